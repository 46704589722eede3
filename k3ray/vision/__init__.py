"""K3's vision side: the MoonViT3d tower, the PatchMergerMLPV2 projector, media preprocessing
(images and videos) and placeholder handling. Pure PyTorch + Pillow; no Ray."""

from k3ray.config import VISION_NORM_EPS, MediaConfig
from k3ray.vision.media import data_url_bytes, pack_media, preprocess_media
from k3ray.vision.model import K3VisionModel, build_vision_model, checked_grid, encode_media
from k3ray.vision.placeholders import ExpandedPrompt, expand_placeholders, media_token_count, splice_media_embeddings
from k3ray.vision.preprocess import ProcessedMedia, preprocess_image
from k3ray.vision.video import preprocess_video
from k3ray.vision.weights import has_vision_weights, load_vision, load_vision_checkpoint

__all__ = [
    "VISION_NORM_EPS",
    "ExpandedPrompt",
    "K3VisionModel",
    "MediaConfig",
    "ProcessedMedia",
    "build_vision_model",
    "checked_grid",
    "data_url_bytes",
    "encode_media",
    "expand_placeholders",
    "has_vision_weights",
    "load_vision",
    "load_vision_checkpoint",
    "media_token_count",
    "pack_media",
    "preprocess_image",
    "preprocess_media",
    "preprocess_video",
    "splice_media_embeddings",
]
