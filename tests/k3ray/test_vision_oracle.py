"""The K3 vision tower and projector against transformers 5.18.0 `models/kimi_k25` (MoonViT3d of
K2.5), the closest public oracle (docs/k3-architecture.md §7.3). Shared parts (2D RoPE, the divided_fixed position
term with its temporal sin/cos, chunk-restricted attention, the temporal-pool merger) are compared
directly; K3's documented differences are checked explicitly: the oracle is configured to K3's
choices where it allows (RMSNorm modules swapped in, biases zeroed, bilinear interpolation, the
projector's pre-norm removed and a post-RMSNorm added) and the K2.5 choice is shown to differ."""

import math
from types import SimpleNamespace

import pytest
import torch
from torch import nn
from transformers.models.kimi_k25 import modeling_kimi_k25 as hf
from transformers.models.kimi_k25.configuration_kimi_k25 import Kimi_K25VisionConfig
from transformers.vision_utils import get_vision_position_ids

from k3ray.config import VISION_NORM_EPS, k3_config, k3_tiny_config
from k3ray.testing import assert_close, rel_rmse
from k3ray.vision.merger import tpool_patch_merger
from k3ray.vision.model import build_vision_model
from k3ray.vision.norm import VisionRMSNorm
from k3ray.vision.rope2d import apply_rope2d, rope2d_angles

FP32 = 2e-6  # float32, same math in another op order (gathered interpolation, rotate-half RoPE): rounding only
VISION = k3_tiny_config().vision
GRIDS = {  # HF's merge index needs one frame count per batch
    "images": [[1, 8, 8], [1, 4, 6]],  # native 8x8 pos grid (used as-is) and a resampled one
    "videos": [[3, 6, 4], [3, 2, 2]],
    "upsampled": [[4, 10, 12]],  # beyond the 8x8 learned grid
}


def _hf_config(hidden: int, heads: int, layers: int = 1, intermediate: int = 8, side: int = 8, frames: int = 4):
    config = Kimi_K25VisionConfig(
        hidden_size=hidden, num_attention_heads=heads, num_hidden_layers=layers, intermediate_size=intermediate,
        pos_emb_height=side, pos_emb_width=side, pos_emb_time=frames,
        rope_parameters={"rope_type": "axial", "rope_theta": 10000.0},
    )
    config._attn_implementation = "eager"
    return config


def _to_half_layout(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Rows of a q/k projection from interleaved (re, im) pairs to HF's rotate-half layout
    (transformers' PermuteForRope, as applied when it loads the published `wqkv`)."""
    head = w.shape[0] // heads
    return w.view(heads, head // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _rms(weight: torch.Tensor, eps: float) -> nn.RMSNorm:
    norm = nn.RMSNorm(weight.shape[0], eps=eps)
    norm.weight.data.copy_(weight)
    return norm


def _oracle_tower(ours, rms_norms: bool = True, bilinear: bool = True):
    """HF K2.5 tower holding our weights, configured to K3's choices (RMSNorm, no bias, bilinear)."""
    c = ours.config
    model = hf.Kimi_K25VisionModel(
        _hf_config(c.hidden_size, c.num_heads, c.num_layers, c.intermediate_size, c.pos_emb_height, c.pos_emb_time)
    ).eval()
    tower = ours.vision_tower
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.zero_()
        model.patch_embed.proj.weight.copy_(tower.patch_embed.proj.weight)
        model.patch_embed.pos_emb.position_embeddings.copy_(tower.patch_embed.pos_emb.weight)
        if bilinear:
            model.patch_embed.pos_emb.interpolation_mode = "bilinear"
        for layer, block in zip(model.layers, tower.encoder.blocks):
            q, k, v = block.wqkv.weight.chunk(3)
            layer.attn.q_proj.weight.copy_(_to_half_layout(q, c.num_heads))
            layer.attn.k_proj.weight.copy_(_to_half_layout(k, c.num_heads))
            layer.attn.v_proj.weight.copy_(v)
            layer.attn.proj.weight.copy_(block.wo.weight)
            layer.mlp.fc1.weight.copy_(block.mlp.fc0.weight)
            layer.mlp.fc2.weight.copy_(block.mlp.fc1.weight)
            if rms_norms:
                layer.norm1 = _rms(block.norm0.weight, VISION_NORM_EPS)
                layer.norm2 = _rms(block.norm1.weight, VISION_NORM_EPS)
            else:
                layer.norm1.weight.copy_(block.norm0.weight)
                layer.norm2.weight.copy_(block.norm1.weight)
        if rms_norms:
            model.final_layernorm = _rms(tower.encoder.final_layernorm.weight, VISION_NORM_EPS)
        else:
            model.final_layernorm.weight.copy_(tower.encoder.final_layernorm.weight)
    return model


@pytest.fixture(scope="module")
def ours():
    return build_vision_model(VISION, torch.float32, seed=5)


def _pixels(grid, seed=0):
    n = sum(t * h * w for t, h, w in grid)
    return torch.randn(n, 3, VISION.patch_size, VISION.patch_size, generator=torch.Generator().manual_seed(seed))


# shared parts ---------------------------------------------------------------------------------
@pytest.mark.parametrize("grid", [[[1, 3, 5]], [[2, 4, 4], [4, 2, 6]]])
def test_rope2d_matches_k25_axial_rope_at_k3_head_dim(grid):
    heads, head_dim = 3, k3_config().vision.head_dim  # 128: 32 x- and 32 y-frequencies
    rotary = hf.Kimi_K25VisionRotaryEmbedding(_hf_config(heads * head_dim, heads))
    grid_t = torch.tensor(grid)
    n = int(grid_t.prod(-1).sum())
    q = torch.randn(n, heads, head_dim, generator=torch.Generator().manual_seed(1))
    cos_hf, sin_hf = rotary(q, get_vision_position_ids(grid_t, spatial_merge_size=1))
    q_half = q.view(n, heads, head_dim // 2, 2).transpose(-1, -2).reshape(n, heads, head_dim)
    expected_half, _ = hf.apply_rotary_pos_emb_vision(q_half[None], q_half[None], cos_hf, sin_hf)
    expected = expected_half[0].view(n, heads, 2, head_dim // 2).transpose(-1, -2).reshape(n, heads, head_dim)
    angles = rope2d_angles([tuple(g) for g in grid], head_dim)
    assert_close("rope2d", expected, apply_rope2d(q, angles.cos(), angles.sin()), FP32)


def test_rope2d_pairs_interleave_column_and_row_frequencies():
    angles = rope2d_angles([(2, 3, 5)], 16)  # [30, 8]: pairs (x0, y0, x1, y1, ...)
    freqs = 1.0 / 10000 ** (torch.arange(0, 16, 4).float() / 16)
    row, col = 2, 3
    patch = row * 5 + col
    assert torch.equal(angles[patch, 0::2], col * freqs) and torch.equal(angles[patch, 1::2], row * freqs)
    assert torch.equal(angles[15 + patch], angles[patch])  # repeated for the second frame


@pytest.mark.parametrize("name", GRIDS)
def test_position_term_matches_k25_when_bilinear(ours, name):
    grid = GRIDS[name]
    pos_hf = hf.Kimi_K25VisionPositionEmbeddings(_hf_config(VISION.hidden_size, VISION.num_heads))
    pos_ours = ours.vision_tower.patch_embed.pos_emb
    pos_hf.position_embeddings.data.copy_(pos_ours.weight)
    pos_hf.interpolation_mode = "bilinear"  # K3's pos_emb_interpolation_mode
    zeros = torch.zeros(sum(t * h * w for t, h, w in grid), VISION.hidden_size)
    expected = pos_hf(zeros, torch.tensor(grid))
    assert_close(f"pos emb {name}", expected, pos_ours(zeros, [tuple(g) for g in grid]), FP32)


def test_bicubic_k25_position_term_differs_except_on_the_native_grid(ours):
    pos_hf = hf.Kimi_K25VisionPositionEmbeddings(_hf_config(VISION.hidden_size, VISION.num_heads))
    pos_ours = ours.vision_tower.patch_embed.pos_emb
    pos_hf.position_embeddings.data.copy_(pos_ours.weight)
    assert pos_hf.interpolation_mode == "bicubic"
    native, resampled = [[1, 8, 8]], [[1, 4, 6]]
    for grid, same in ((native, True), (resampled, False)):
        zeros = torch.zeros(sum(t * h * w for t, h, w in grid), VISION.hidden_size)
        err = rel_rmse(pos_hf(zeros, torch.tensor(grid)), pos_ours(zeros, [tuple(g) for g in grid]))
        assert (err <= FP32) == same, (grid, err)


def test_temporal_term_only_for_multi_frame_chunks(ours):
    pos, dim = ours.vision_tower.patch_embed.pos_emb, VISION.hidden_size
    zeros = torch.zeros(3 * 16, dim)
    spatial = pos.spatial(4, 4)
    assert torch.equal(pos(zeros[:16], [(1, 4, 4)]), spatial)  # an image gets no temporal term
    video = pos(zeros, [(3, 4, 4)]).view(3, 16, dim) - spatial
    omega = 10000 ** -(torch.arange(dim // 2).double() / (dim // 2))
    for frame in range(3):  # frame 0 too: [sin 0 | cos 0] = [0 | 1]
        expected = torch.cat([(frame * omega).sin(), (frame * omega).cos()]).float()
        assert torch.allclose(video[frame], expected.expand(16, dim), atol=1e-6)  # one fp32 add


@pytest.mark.parametrize("name", GRIDS)
def test_temporal_pool_merger_matches_k25(name):
    grid = GRIDS[name]
    n = sum(t * h * w for t, h, w in grid)
    x = torch.randn(n, 16, generator=torch.Generator().manual_seed(2))
    index = hf.get_vision_temporal_merge_index(torch.tensor(grid), 2, 2)
    expected = x[index].mean(dim=1).flatten(1)  # [M, 4 * 16]
    assert_close(f"merger {name}", expected, tpool_patch_merger(x, [tuple(g) for g in grid], (2, 2)), FP32)


# the whole tower, oracle configured to K3 --------------------------------------------------------
@pytest.mark.parametrize("name", GRIDS)
def test_tower_matches_k25_configured_to_k3(ours, name):
    grid = GRIDS[name]
    pixels = _pixels(grid)
    oracle = _oracle_tower(ours)
    with torch.no_grad():
        expected = oracle(pixels, torch.tensor(grid))
        hidden = ours.vision_tower(pixels, [tuple(g) for g in grid])
        merged = tpool_patch_merger(hidden, [tuple(g) for g in grid], VISION.merge_kernel)
    assert expected.last_hidden_state.std() > 0.5
    assert_close(f"tower {name}", expected.last_hidden_state, hidden, 1e-5)  # fp32 through 2 blocks
    assert_close(f"merged {name}", expected.pooler_output.flatten(1), merged, 1e-5)


def test_k25_layernorm_tower_differs(ours):
    grid = GRIDS["images"]
    pixels = _pixels(grid)
    with torch.no_grad():
        layernorm = _oracle_tower(ours, rms_norms=False)(pixels, torch.tensor(grid)).last_hidden_state
        hidden = ours.vision_tower(pixels, [tuple(g) for g in grid])
    assert rel_rmse(layernorm, hidden) > 1e-2


def test_k3_tower_has_no_biases_and_a_decoupled_qkv_width():
    with torch.device("meta"):
        model = build_vision_model(k3_config().vision, torch.bfloat16, seed=None)
    shapes = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    assert not any("bias" in name for name in shapes)
    block = "vision_tower.encoder.blocks.26."
    assert shapes[block + "wqkv.weight"] == (3 * 1536, 1024) and shapes[block + "wo.weight"] == (1024, 1536)
    assert model.vision_tower.encoder.blocks[0].head_dim == 128  # 1536 / 12, not 1024 / 12
    assert "vision_tower.encoder.blocks.27.wqkv.weight" not in shapes
    assert not any(isinstance(m, nn.LayerNorm) for m in model.modules())
    norms = [m for m in model.modules() if isinstance(m, VisionRMSNorm)]
    assert len(norms) == 2 * 27 + 2  # norm0/norm1 per block, final_layernorm, the projector's post_norm


# projector ----------------------------------------------------------------------------------------
def _oracle_projector(ours, pre_norm: bool):
    c = ours.config
    config = SimpleNamespace(
        vision_config=SimpleNamespace(hidden_size=c.hidden_size, merge_kernel_size=c.merge_kernel),
        projection_hidden_size=c.hidden_size, projection_layer_norm_eps=c.projector_ln_eps,
        text_config=SimpleNamespace(hidden_size=c.text_hidden_size),
    )
    projection = hf.Kimi_K25MultimodalProjection(config).eval()
    with torch.no_grad():
        projection.in_proj.weight.copy_(ours.mm_projector.proj[0].weight)
        projection.out_proj.weight.copy_(ours.mm_projector.proj[2].weight)
        projection.in_proj.bias.zero_()
        projection.out_proj.bias.zero_()
    if not pre_norm:
        projection.pre_norm = nn.Identity()
    return projection


def test_projector_is_k25_without_pre_norm_plus_post_rmsnorm(ours):
    c = ours.config
    merged = torch.randn(10, 4, c.hidden_size, generator=torch.Generator().manual_seed(3)) * 3 + 1
    post = _rms(ours.mm_projector.post_norm.weight, 1e-5)
    with torch.no_grad():
        expected = post(_oracle_projector(ours, pre_norm=False)(merged).squeeze(1))
        k25 = _oracle_projector(ours, pre_norm=True)(merged).squeeze(1)
        out = ours.mm_projector(merged.flatten(1))
    assert_close("projector", expected, out, FP32)
    assert rel_rmse(k25, out) > 0.1  # K2.5 normalises the input instead of the output
    assert not isinstance(ours.mm_projector.proj[1], nn.Identity) and ours.mm_projector.proj[1].approximate == "none"
    ones = ours.mm_projector.post_norm.weight.detach().clone()
    with torch.no_grad():
        ours.mm_projector.post_norm.weight.fill_(1.0)
        rms = ours.mm_projector(merged.flatten(1)).pow(2).mean(-1).sqrt()
        ours.mm_projector.post_norm.weight.copy_(ones)
    assert torch.allclose(rms, torch.ones_like(rms), atol=1e-4)  # eps 1e-5 against O(1) activations


def test_norm_eps_is_two_to_minus_seven():
    assert VISION_NORM_EPS == 2.0**-7 == torch.finfo(torch.bfloat16).eps
    model = build_vision_model(VISION, torch.float32, seed=0)
    eps = {m.eps for name, m in model.named_modules() if name.startswith("vision_tower") and hasattr(m, "eps")}
    assert eps == {VISION_NORM_EPS}
    assert model.mm_projector.post_norm.eps == 1e-5
    assert math.isclose(model.config.projector_ln_eps, 1e-5)
