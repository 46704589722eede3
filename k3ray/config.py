"""Model configuration, one frozen dataclass per file the checkpoint publishes: `ModelConfig` (with its
`VisionConfig`) built from an HF `config.json`, `MediaConfig` from `preprocessor_config.json`.

K3 publishes a nested `kimi_k3` config (`text_config`, `vision_config`); Kimi-Linear style
checkpoints publish a bare `kimi_linear` text config. Both normalise to `ModelConfig` here, and
the 1-indexed `kda_layers` / `full_attn_layers` lists are converted to 0-indexed `layer_types`
in exactly one place (`_layer_types_from_hf`).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass
from typing import Any, Literal

LayerType = Literal["kda", "mla"]
ExpertFormat = Literal["mxfp4", "bf16"]

MLA_NORM_EPS = 1e-6  # q_a_layernorm / kv_a_layernorm (KimiRMSNorm default), docs/k3-architecture.md §4.2
L2_NORM_EPS = 1e-6  # KDA q/k L2 norm, eps inside the sqrt
MXFP4_GROUP = 32
# The MoonViT3d tower. Every RMSNorm inside it (norm0, norm1, final_layernorm) uses 2^-7: the SGLang port of
# the checkpoint's `modeling_kimi_k3.py` builds `nn.RMSNorm(dim)` with no eps, which means
# `torch.finfo(dtype).eps`, 2^-7 for the published bf16 weights; a second port (mlxcel) pins 2^-7 and says
# the reference writes `2 ** -7`. Both agree for bf16, so the constant is used for every dtype (a float32 run
# then matches the bf16 reference's normalisation rather than finfo(float32)). The projector's post_norm
# uses the config's `projector_ln_eps` (1e-5). See docs/k3-architecture.md §7.3, §12.
VISION_NORM_EPS = 2.0**-7
ROPE_THETA = 10000.0
ROPE_MAX_GRID = 512  # Rope2DPosEmbRepeated's table: 512 x 512 patches
TEMPORAL_THETA = 10000.0


@dataclass(frozen=True)
class VisionConfig:
    """MoonViT-V2 tower + PatchMergerMLPV2 projector (docs/k3-architecture.md §7.1)."""

    patch_size: int = 14
    hidden_size: int = 1024
    num_layers: int = 27
    num_heads: int = 12
    qkv_hidden_size: int = 1536
    intermediate_size: int = 4096
    pos_emb_height: int = 64
    pos_emb_width: int = 64
    pos_emb_time: int = 4
    merge_kernel: tuple[int, int] = (2, 2)
    projector_hidden_size: int = 4096
    text_hidden_size: int = 7168
    projector_ln_eps: float = 1e-5

    def __post_init__(self) -> None:
        _validate_vision(self)

    @property
    def head_dim(self) -> int:
        return self.qkv_hidden_size // self.num_heads

    @property
    def merged_hidden_size(self) -> int:
        """Width of one merged token: a kh x kw block of tower outputs, concatenated."""
        return self.hidden_size * self.merge_kernel[0] * self.merge_kernel[1]


@dataclass(frozen=True)
class MediaConfig:
    """How images and videos become patches (K2.5 / K3 `media_proc_cfg`; defaults are K2.5's as
    published in transformers 5.18.0 `Kimi_K25ImageProcessor` / `Kimi_K25VideoProcessor`).

    Normalisation (x / 255 - 0.5) / 0.5 per channel: K2.5's processors use IMAGENET_STANDARD_MEAN /
    STD = [0.5] * 3, and K3's `preprocessor_config.json` carries `image_mean` / `image_std` in
    `media_proc_cfg` (read by `from_preprocessor_config`)."""

    patch_size: int = 14
    merge_size: int = 2
    max_patches: int = 16384  # in_patch_limit: raw 14x14 patches per image before padding
    max_patches_per_side: int = 512  # patch_limit_on_one_side
    video_max_patches_per_frame: int = 4096  # in_patch_limit_each_frame
    frames_per_chunk: int = 4  # temporal_merge_kernel_size
    video_fps: float = 2.0  # sample_fps
    video_max_frames: int = 64  # frames kept per video after sampling
    image_mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    image_std: tuple[float, float, float] = (0.5, 0.5, 0.5)
    max_input_pixels: int = 89_478_485  # per decoded image or frame (Pillow's decompression-bomb threshold)
    max_input_bytes: int = 64 * 2**20
    max_source_frames: int = 10_000  # frames in a video file (each is decoded to find its timing)
    max_video_source_pixels: int = 1_000_000_000  # frames x width x height of a video file, all decoded
    max_request_pixels: int = 2**28  # decoded pixels of one request, summed over its images and frames

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            val = getattr(self, f.name)
            if f.name in ("image_mean", "image_std"):
                if len(val) != 3 or not all(isinstance(x, (int, float)) for x in val):
                    raise ValueError(f"MediaConfig.{f.name} must be 3 numbers, got {val!r}")
                if f.name == "image_std" and min(val) <= 0:
                    raise ValueError(f"MediaConfig.image_std must be positive, got {val!r}")
            elif f.name == "video_fps":
                if not (isinstance(val, (int, float)) and math.isfinite(val) and val > 0):
                    raise ValueError(f"MediaConfig.video_fps must be a positive number, got {val!r}")
            elif not isinstance(val, int) or isinstance(val, bool) or val <= 0:
                raise ValueError(f"MediaConfig.{f.name} must be a positive int, got {val!r}")
        if self.max_patches_per_side > ROPE_MAX_GRID:
            raise ValueError(
                f"MediaConfig.max_patches_per_side={self.max_patches_per_side} exceeds the tower's "
                f"2D RoPE grid ({ROPE_MAX_GRID} patches per side)"
            )

    @property
    def unit(self) -> int:
        """Pixels per merged token side: both padded sides are multiples of this."""
        return self.patch_size * self.merge_size

    @classmethod
    def for_vision(cls, vision: VisionConfig, **overrides: Any) -> MediaConfig:
        """Settings whose patch size, merge size and chunk length match the tower `vision`."""
        kh, kw = vision.merge_kernel
        if kh != kw:
            raise ValueError(f"preprocessing needs a square merge kernel, got {vision.merge_kernel}")
        base = dict(patch_size=vision.patch_size, merge_size=kh, frames_per_chunk=vision.pos_emb_time)
        return cls(**(base | overrides))

    def to_preprocessor_config(self) -> dict[str, Any]:
        """The `preprocessor_config.json` object `from_preprocessor_config` reads back as this config
        (the `media_proc_cfg` keys; the byte and pixel limits are the server's, not the checkpoint's)."""
        return {"media_proc_cfg": {
            "patch_size": self.patch_size,
            "merge_kernel_size": [self.merge_size, self.merge_size],
            "in_patch_limit": self.max_patches,
            "patch_limit_on_one_side": self.max_patches_per_side,
            "in_patch_limit_each_frame": self.video_max_patches_per_frame,
            "temporal_merge_kernel_size": self.frames_per_chunk,
            "sample_fps": self.video_fps,
            "max_num_frames_each_video": self.video_max_frames,
            "image_mean": list(self.image_mean),
            "image_std": list(self.image_std),
        }}

    @classmethod
    def from_preprocessor_config(cls, data: dict[str, Any], **overrides: Any) -> MediaConfig:
        """From a parsed `preprocessor_config.json` (`media_proc_cfg` nested or flat)."""
        if not isinstance(data, dict):
            raise ValueError(f"preprocessor config must be a JSON object, got {type(data).__name__}")
        cfg = data.get("media_proc_cfg", data)
        keys = {
            "patch_size": "patch_size",
            "merge_kernel_size": "merge_size",
            "in_patch_limit": "max_patches",
            "patch_limit_on_one_side": "max_patches_per_side",
            "in_patch_limit_each_frame": "video_max_patches_per_frame",
            "temporal_merge_kernel_size": "frames_per_chunk",
            "sample_fps": "video_fps",
            "max_num_frames_each_video": "video_max_frames",
            "image_mean": "image_mean",
            "image_std": "image_std",
        }
        values: dict[str, Any] = {}
        for src, dst in keys.items():
            if cfg.get(src) is None:
                continue
            val = cfg[src]
            if src == "merge_kernel_size" and isinstance(val, (list, tuple)):
                if len(set(val)) != 1:
                    raise ValueError(f"media_proc_cfg.merge_kernel_size must be square, got {val!r}")
                val = val[0]
            values[dst] = tuple(val) if dst in ("image_mean", "image_std") else val
        return cls(**(values | overrides))


@dataclass(frozen=True)
class ModelConfig:
    """The K3 text model. Field names follow the HF config where one exists."""

    hidden_size: int
    num_layers: int
    vocab_size: int
    layer_types: tuple[LayerType, ...]
    # dense FFN (layers < first_k_dense_replace)
    intermediate_size: int
    first_k_dense_replace: int = 1
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 1_048_576
    situ_beta: float = 4.0
    situ_linear_beta: float = 25.0
    attn_res_block_size: int = 12
    # KDA
    kda_num_heads: int = 96
    kda_head_dim: int = 128
    kda_a_log_size: int = 128  # A_log is one value per head, zero-padded to this length
    short_conv_kernel_size: int = 4
    gate_lower_bound: float = -5.0
    # gated MLA (NoPE)
    mla_num_heads: int = 96
    q_lora_rank: int = 1536
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    mla_use_output_gate: bool = True
    # Stable LatentMoE
    num_experts: int = 896
    num_experts_per_token: int = 16
    num_shared_experts: int = 2
    moe_intermediate_size: int = 3072
    routed_expert_hidden_size: int = 3584
    latent_moe_use_norm: bool = True
    moe_renormalize: bool = True
    routed_scaling_factor: float = 1.0
    expert_format: ExpertFormat = "mxfp4"
    # special tokens
    bos_token_id: int = 163584
    eos_token_id: int = 163586
    pad_token_id: int = 163839
    media_placeholder_token_id: int = 163605
    vision: VisionConfig | None = None
    name: str = "custom"

    def __post_init__(self) -> None:
        _validate(self)

    # derived dimensions -------------------------------------------------------------------
    @property
    def kda_dim(self) -> int:
        return self.kda_num_heads * self.kda_head_dim

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def mla_latent_dim(self) -> int:
        """Values cached per token per MLA layer: normalised c_kv plus the shared k_r."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def shared_intermediate_size(self) -> int:
        return self.num_shared_experts * self.moe_intermediate_size

    @property
    def kda_layer_ids(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == "kda")

    @property
    def mla_layer_ids(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == "mla")

    def is_moe_layer(self, layer_idx: int) -> bool:
        return layer_idx >= self.first_k_dense_replace

    def is_block_boundary(self, layer_idx: int) -> bool:
        """AttnRes closes a block (pushes the partial sum to the bank) before this layer."""
        return layer_idx % self.attn_res_block_size == 0

    def replace(self, **changes: Any) -> "ModelConfig":
        return dataclasses.replace(self, **changes)

    # HF config.json -----------------------------------------------------------------------
    @classmethod
    def from_hf(cls, hf: dict[str, Any], name: str = "custom") -> "ModelConfig":
        """Build from a parsed `config.json` (`kimi_k3` nested form or bare `kimi_linear`)."""
        if not isinstance(hf, dict):
            raise ValueError(f"config must be a JSON object, got {type(hf).__name__}")
        model_type = hf.get("model_type")
        if model_type == "kimi_k3" or "text_config" in hf:
            text = hf.get("text_config")
            if not isinstance(text, dict):
                raise ValueError("kimi_k3 config needs a `text_config` object")
            vision_hf = hf.get("vision_config")
            quant = hf.get("quantization_config", text.get("quantization_config"))
        elif model_type in ("kimi_linear", None):
            text, vision_hf, quant = hf, None, hf.get("quantization_config")
        else:
            raise ValueError(f"model_type must be 'kimi_k3' or 'kimi_linear', got {model_type!r}")
        config = _text_from_hf(text, vision_hf, quant, name)
        placeholder = hf.get("media_placeholder_token_id", text.get("media_placeholder_token_id"))
        return config if placeholder is None else config.replace(media_placeholder_token_id=placeholder)

    @classmethod
    def from_json_file(cls, path: str | os.PathLike) -> "ModelConfig":
        with open(path) as f:
            try:
                data = json.load(f)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}: not valid JSON ({e})") from e
        return cls.from_hf(data, name=os.path.basename(os.path.dirname(os.path.abspath(path))))

    def to_hf(self) -> dict[str, Any]:
        """The nested `kimi_k3` config.json form (inverse of `from_hf`)."""
        kda_layers = [i + 1 for i, t in enumerate(self.layer_types) if t == "kda"]
        full_layers = [i + 1 for i, t in enumerate(self.layer_types) if t == "mla"]
        text = {
            "model_type": "kimi_linear",
            "architectures": ["KimiLinearForCausalLM"],
            **_fields_to_hf(self, _TEXT_FIELDS),
            "num_key_value_heads": self.mla_num_heads,
            "tie_word_embeddings": False,
            "hidden_act": "situ",
            "moe_layer_freq": 1,
            "mla_use_nope": True,
            "moe_router_activation_func": "sigmoid",
            "use_grouped_topk": True,
            "num_expert_group": 1,
            "topk_group": 1,
            "topk_method": "noaux_tc",
            "num_nextn_predict_layers": 0,
            "media_placeholder_token_id": self.media_placeholder_token_id,
            "linear_attn_config": {
                **_fields_to_hf(self, _KDA_FIELDS),
                "a_log_size": self.kda_a_log_size,
                "use_full_rank_gate": True,
                "kda_layers": kda_layers,
                "full_attn_layers": full_layers,
            },
        }
        out: dict[str, Any] = {
            "model_type": "kimi_k3",
            "architectures": ["KimiK3ForConditionalGeneration"],
            "media_placeholder_token_id": self.media_placeholder_token_id,
            "text_config": text,
        }
        if self.expert_format == "mxfp4":
            out["quantization_config"] = _mxfp4_quantization_config()
        if self.vision is not None:
            out["vision_config"] = _vision_to_hf(self.vision)
        return out


# --------------------------------------------------------------------------------------------
# (field, its key in the HF config, required there): the fields config.json stores as they are;
# an absent optional key leaves the field's default
_TEXT_FIELDS = (
    ("hidden_size", "hidden_size", True),
    ("num_layers", "num_hidden_layers", True),
    ("vocab_size", "vocab_size", True),
    ("intermediate_size", "intermediate_size", True),
    ("first_k_dense_replace", "first_k_dense_replace", False),
    ("rms_norm_eps", "rms_norm_eps", False),
    ("max_position_embeddings", "max_position_embeddings", False),
    ("situ_beta", "activation_situ_beta", False),
    ("situ_linear_beta", "activation_situ_linear_beta", False),
    ("attn_res_block_size", "attn_res_block_size", True),
    ("mla_num_heads", "num_attention_heads", True),
    ("q_lora_rank", "q_lora_rank", True),
    ("kv_lora_rank", "kv_lora_rank", True),
    ("qk_nope_head_dim", "qk_nope_head_dim", True),
    ("qk_rope_head_dim", "qk_rope_head_dim", True),
    ("v_head_dim", "v_head_dim", True),
    ("mla_use_output_gate", "mla_use_output_gate", False),
    ("num_experts", "num_experts", True),
    ("num_experts_per_token", "num_experts_per_token", True),
    ("num_shared_experts", "num_shared_experts", False),
    ("moe_intermediate_size", "moe_intermediate_size", True),
    ("routed_expert_hidden_size", "routed_expert_hidden_size", True),
    ("latent_moe_use_norm", "latent_moe_use_norm", False),
    ("moe_renormalize", "moe_renormalize", False),
    ("routed_scaling_factor", "routed_scaling_factor", False),
    ("bos_token_id", "bos_token_id", False),
    ("eos_token_id", "eos_token_id", False),
    ("pad_token_id", "pad_token_id", False),
)
# what the published `KimiLinearConfig` (configuration_kimi.py) sets for a key its config.json leaves out;
# the dataclass defaults are K3's values, which only K3-specific keys the class lacks fall back to
_PUBLISHED_CLASS_DEFAULTS = {
    "first_k_dense_replace": 0,
    "rms_norm_eps": 1e-6,
    "num_shared_experts": 0,
    "moe_renormalize": True,
    "routed_scaling_factor": 1.0,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
}
_KDA_FIELDS = (  # in text_config.linear_attn_config
    ("kda_num_heads", "num_heads", True),
    ("kda_head_dim", "head_dim", True),
    ("short_conv_kernel_size", "short_conv_kernel_size", False),
    ("gate_lower_bound", "gate_lower_bound", True),
)
_VISION_FIELDS = (
    ("patch_size", "patch_size", False),
    ("hidden_size", "vt_hidden_size", False),
    ("num_layers", "vt_num_hidden_layers", False),
    ("num_heads", "vt_num_attention_heads", False),
    ("qkv_hidden_size", "qkv_hidden_size", False),
    ("intermediate_size", "vt_intermediate_size", False),
    ("pos_emb_height", "init_pos_emb_height", False),
    ("pos_emb_width", "init_pos_emb_width", False),
    ("pos_emb_time", "init_pos_emb_time", False),
    ("projector_ln_eps", "projector_ln_eps", False),
    ("text_hidden_size", "text_hidden_size", False),
)


def _fields_from_hf(d: dict[str, Any], table: tuple[tuple[str, str, bool], ...], where: str) -> dict[str, Any]:
    fields = {}
    for field, key, required in table:
        if key in d:
            fields[field] = d[key]
        elif required:
            raise ValueError(f"{where}.{key} is required")
    return fields


def _fields_to_hf(config: Any, table: tuple[tuple[str, str, bool], ...]) -> dict[str, Any]:
    return {key: getattr(config, field) for field, key, _ in table}


def _layer_types_from_hf(num_layers: int, lin: dict[str, Any]) -> tuple[LayerType, ...]:
    """The one place the published 1-indexed layer lists become 0-indexed layer types."""
    kda = lin.get("kda_layers")
    full = lin.get("full_attn_layers")
    if kda is None and full is None:
        raise ValueError("linear_attn_config needs `kda_layers` or `full_attn_layers`")
    kda_set = set(kda) if kda is not None else set(range(1, num_layers + 1)) - set(full)
    full_set = set(full) if full is not None else set(range(1, num_layers + 1)) - kda_set
    for fname, s in (("kda_layers", kda_set), ("full_attn_layers", full_set)):
        bad = sorted(i for i in s if not isinstance(i, int) or not 1 <= i <= num_layers)
        if bad:
            raise ValueError(
                f"linear_attn_config.{fname} contains out-of-range layers {bad}; "
                f"expected 1-indexed values in [1, {num_layers}]"
            )
    both = sorted(kda_set & full_set)
    if both:
        raise ValueError(f"layers {both} are listed in both kda_layers and full_attn_layers")
    missing = sorted(set(range(1, num_layers + 1)) - kda_set - full_set)
    if missing:
        raise ValueError(f"layers {missing} are in neither kda_layers nor full_attn_layers")
    return tuple("kda" if (i + 1) in kda_set else "mla" for i in range(num_layers))


def _req(d: dict[str, Any], key: str, where: str = "text_config") -> Any:
    if key not in d:
        raise ValueError(f"{where}.{key} is required")
    return d[key]


def _text_from_hf(
    t: dict[str, Any], v: dict[str, Any] | None, quant: dict[str, Any] | None, name: str
) -> ModelConfig:
    lin = _req(t, "linear_attn_config")
    if not isinstance(lin, dict):
        raise ValueError("text_config.linear_attn_config must be an object")
    num_layers = _req(t, "num_hidden_layers")
    if not isinstance(num_layers, int) or num_layers <= 0:
        raise ValueError(f"text_config.num_hidden_layers must be a positive int, got {num_layers!r}")
    if t.get("tie_word_embeddings", False):
        raise ValueError("text_config.tie_word_embeddings=True is not K3 (its head is untied)")
    if t.get("mla_use_nope") is False:
        raise ValueError("text_config.mla_use_nope=False (rotary MLA) is not supported; K3 is NoPE")
    if t.get("q_lora_rank") is None:
        raise ValueError("text_config.q_lora_rank=None (plain q_proj MLA) is not supported; K3 uses q-LoRA")
    if lin.get("use_full_rank_gate") is False:
        raise ValueError("linear_attn_config.use_full_rank_gate=False is not supported; K3 uses a full-rank gate")
    if lin.get("gate_lower_bound") is None:
        raise ValueError("linear_attn_config.gate_lower_bound is required (K3's safe gate, -5.0)")
    if t.get("moe_router_activation_func", "sigmoid") != "sigmoid":
        raise ValueError(
            f"text_config.moe_router_activation_func must be 'sigmoid', got {t['moe_router_activation_func']!r}"
        )
    if t.get("num_expert_group", 1) != 1 or t.get("topk_group", 1) != 1:
        raise ValueError("text_config.num_expert_group/topk_group must be 1 (K3 has no group limit)")
    if t.get("moe_layer_freq", 1) != 1:
        raise ValueError(f"text_config.moe_layer_freq must be 1, got {t['moe_layer_freq']!r}")
    fields = _fields_from_hf(t, _TEXT_FIELDS, "text_config") | _fields_from_hf(lin, _KDA_FIELDS, "linear_attn_config")
    fields = _PUBLISHED_CLASS_DEFAULTS | fields
    kwargs: dict[str, Any] = dict(
        fields,
        layer_types=_layer_types_from_hf(num_layers, lin),
        kda_a_log_size=lin.get("a_log_size", max(fields["kda_num_heads"], fields["kda_head_dim"])),
        gate_lower_bound=float(fields["gate_lower_bound"]),
        routed_scaling_factor=float(fields.get("routed_scaling_factor", 1.0)),
        expert_format="mxfp4" if _is_mxfp4(quant) else "bf16",
        vision=_vision_from_hf(v) if v else None,
        name=name,
    )
    return ModelConfig(**kwargs)


def _is_mxfp4(quant: dict[str, Any] | None) -> bool:
    if not quant:
        return False
    fmt = quant.get("format")
    if fmt != "mxfp4-pack-quantized":
        raise ValueError(
            f"quantization_config.format {fmt!r} is not supported; expected 'mxfp4-pack-quantized' or none"
        )
    return True


def _mxfp4_quantization_config() -> dict[str, Any]:
    return {
        "quant_method": "compressed-tensors",
        "format": "mxfp4-pack-quantized",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {
                    "num_bits": 4,
                    "type": "float",
                    "group_size": MXFP4_GROUP,
                    "strategy": "group",
                    "symmetric": True,
                    "scale_dtype": "torch.uint8",
                },
                "input_activations": None,
            }
        },
        "ignore": [
            "re:.*self_attn.*",
            "re:.*shared_experts.*",
            r"re:.*mlp\.(gate|up|gate_up|down)_proj.*",
            "re:.*lm_head.*",
            "re:.*vision_tower.*",
            "re:.*mm_projector.*",
        ],
    }


def _vision_from_hf(v: dict[str, Any]) -> VisionConfig:
    mk = v.get("merge_kernel_size", [2, 2])
    return VisionConfig(
        **_fields_from_hf(v, _VISION_FIELDS, "vision_config"),
        merge_kernel=(int(mk[0]), int(mk[1])),
        projector_hidden_size=v.get("mm_hidden_size", 1024) * int(mk[0]) * int(mk[1]),
    )


def _vision_to_hf(v: VisionConfig) -> dict[str, Any]:
    return {
        **_fields_to_hf(v, _VISION_FIELDS),
        "activation_func": "gelu_pytorch_tanh",
        "norm_type": "rmsnorm",
        "attn_bias": False,
        "linear_bias": False,
        "patch_embed_proj_bias": False,
        "pos_emb_type": "divided_fixed",
        "pos_emb_interpolation_mode": "bilinear",
        "merge_type": "sd2_tpool",
        "merge_kernel_size": list(v.merge_kernel),
        "mm_projector_type": "patchmergerv2",
        "mm_hidden_size": v.hidden_size,
        "projector_hidden_act": "gelu",
    }


def _check_positive_ints(config: Any, names: tuple[str, ...], where: str = "") -> None:
    for fname in names:
        val = getattr(config, fname)
        if not isinstance(val, int) or isinstance(val, bool) or val <= 0:
            raise ValueError(f"{where}{fname} must be a positive int, got {val!r}")


def _validate_vision(v: VisionConfig) -> None:
    _check_positive_ints(v, (
        "patch_size", "hidden_size", "num_layers", "num_heads", "qkv_hidden_size", "intermediate_size",
        "pos_emb_height", "pos_emb_width", "pos_emb_time", "projector_hidden_size", "text_hidden_size",
    ), "vision_config.")
    if v.qkv_hidden_size % v.num_heads or v.head_dim % 4:
        raise ValueError(
            f"vision_config.qkv_hidden_size={v.qkv_hidden_size} must split into {v.num_heads} heads whose "
            "size is a multiple of 4 (2D RoPE gives each head alternating x / y complex pairs)"
        )
    if len(v.merge_kernel) != 2 or min(v.merge_kernel) <= 0:
        raise ValueError(f"vision_config.merge_kernel_size must be two positive ints, got {v.merge_kernel!r}")
    if v.projector_hidden_size != v.merged_hidden_size:
        raise ValueError(
            f"vision projector input {v.projector_hidden_size} != hidden_size x merge kernel area "
            f"({v.hidden_size} x {v.merge_kernel[0] * v.merge_kernel[1]})"
        )
    if not 0 < v.projector_ln_eps < 1:
        raise ValueError(f"vision_config.projector_ln_eps must be in (0, 1), got {v.projector_ln_eps}")


def _validate(c: ModelConfig) -> None:
    _check_positive_ints(c, (
        "hidden_size", "num_layers", "vocab_size", "intermediate_size", "attn_res_block_size",
        "kda_num_heads", "kda_head_dim", "kda_a_log_size", "short_conv_kernel_size", "mla_num_heads",
        "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "v_head_dim", "num_experts",
        "num_experts_per_token", "moe_intermediate_size", "routed_expert_hidden_size",
        "max_position_embeddings",
    ))
    if not isinstance(c.qk_rope_head_dim, int) or c.qk_rope_head_dim < 0:
        raise ValueError(f"qk_rope_head_dim must be a non-negative int, got {c.qk_rope_head_dim!r}")
    if len(c.layer_types) != c.num_layers:
        raise ValueError(f"layer_types has {len(c.layer_types)} entries, expected num_layers={c.num_layers}")
    bad = [t for t in c.layer_types if t not in ("kda", "mla")]
    if bad:
        raise ValueError(f"layer_types must be 'kda' or 'mla', got {bad[:3]}")
    if not 0 <= c.first_k_dense_replace <= c.num_layers:
        raise ValueError(f"first_k_dense_replace must be in [0, {c.num_layers}], got {c.first_k_dense_replace}")
    if c.num_experts_per_token > c.num_experts:
        raise ValueError(
            f"num_experts_per_token={c.num_experts_per_token} exceeds num_experts={c.num_experts}"
        )
    if c.num_shared_experts < 0:
        raise ValueError(f"num_shared_experts must be >= 0, got {c.num_shared_experts}")
    if c.kda_a_log_size < c.kda_num_heads:
        raise ValueError(
            f"kda_a_log_size={c.kda_a_log_size} must be >= kda_num_heads={c.kda_num_heads} (one A_log per head)"
        )
    if not c.gate_lower_bound < 0:
        raise ValueError(f"gate_lower_bound must be negative, got {c.gate_lower_bound}")
    if not 0 < c.rms_norm_eps < 1:
        raise ValueError(f"rms_norm_eps must be in (0, 1), got {c.rms_norm_eps}")
    if c.expert_format not in ("mxfp4", "bf16"):
        raise ValueError(f"expert_format must be 'mxfp4' or 'bf16', got {c.expert_format!r}")
    if c.expert_format == "mxfp4":
        for fname in ("routed_expert_hidden_size", "moe_intermediate_size"):
            if getattr(c, fname) % MXFP4_GROUP:
                raise ValueError(
                    f"{fname}={getattr(c, fname)} must be a multiple of {MXFP4_GROUP} for MXFP4 experts"
                )
    for fname in ("bos_token_id", "eos_token_id", "pad_token_id"):
        tid = getattr(c, fname)
        if not 0 <= tid < c.vocab_size:
            raise ValueError(f"{fname}={tid} is outside the vocabulary [0, {c.vocab_size})")


# presets ------------------------------------------------------------------------------------
def _k3_layer_types(num_layers: int, period: int = 4) -> tuple[LayerType, ...]:
    """Groups of (period-1) KDA + 1 MLA, then a final MLA layer."""
    body = ["mla" if (i + 1) % period == 0 else "kda" for i in range(num_layers - 1)]
    return tuple(body + ["mla"])  # type: ignore[return-value]


def k3_config() -> ModelConfig:
    """The published Kimi K3 numbers (docs/k3-architecture.md §1.1)."""
    return ModelConfig(
        name="k3",
        hidden_size=7168,
        num_layers=93,
        vocab_size=163840,
        layer_types=_k3_layer_types(93),
        intermediate_size=33792,
        vision=VisionConfig(),
    )


def k3_tiny_config() -> ModelConfig:
    """K3's structure at small widths: 2 x [KDA, KDA, KDA, MLA] + a final MLA, dense first FFN,
    AttnRes blocks of 3 layers, an 8-expert top-2 latent MoE with shared expert, MXFP4 experts, and a
    2-block MoonViT3d tower (qkv width = hidden, head_dim 32, an 8x8 position grid)."""
    return ModelConfig(
        name="k3-tiny",
        hidden_size=64,
        num_layers=9,
        vocab_size=512,
        layer_types=_k3_layer_types(9),
        intermediate_size=128,
        attn_res_block_size=3,
        kda_num_heads=2,
        kda_head_dim=32,
        kda_a_log_size=32,
        mla_num_heads=2,
        q_lora_rank=24,
        kv_lora_rank=16,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        num_experts=8,
        num_experts_per_token=2,
        num_shared_experts=2,
        moe_intermediate_size=32,
        routed_expert_hidden_size=32,
        max_position_embeddings=1_048_576,
        bos_token_id=256,
        eos_token_id=257,
        pad_token_id=511,
        media_placeholder_token_id=266,
        vision=VisionConfig(
            hidden_size=64,
            num_layers=2,
            num_heads=2,
            qkv_hidden_size=64,
            intermediate_size=128,
            pos_emb_height=8,
            pos_emb_width=8,
            pos_emb_time=4,
            projector_hidden_size=256,
            text_hidden_size=64,
        ),
    )


def k3_micro_config() -> ModelConfig:
    """The smallest K3-shaped model for fast engine tests: KDA x 3 + MLA, dense FFNs, one MoE layer."""
    return k3_tiny_config().replace(
        name="k3-micro", num_layers=4, layer_types=("kda", "kda", "kda", "mla"), first_k_dense_replace=3
    )


PRESETS = {"k3": k3_config, "k3-tiny": k3_tiny_config, "k3-micro": k3_micro_config}


def preset(name: str) -> ModelConfig:
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
    return PRESETS[name]()
