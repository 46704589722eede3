"""The MLA math tied to public oracles: k3ray's GatedMLA without its output gate equals
transformers 5.18.0 `KimiLinearAttention` (eager) through the naive form, the prefill dispatcher
and the paged decode dispatcher; and the absorbed form equals the naive one in float64."""

import pytest
import torch
from transformers import KimiLinearConfig
from transformers.models.kimi_linear.modeling_kimi_linear import KimiLinearAttention

from k3ray.kernels.mla import mla_decode
from k3ray.kernels.mla.naive import gather_latent
from k3ray.models.forward_batch import ForwardBatch, ModelCache
from k3ray.models.mla import GatedMLA
from k3ray.testing import assert_close

# odd, unequal dims so a transposed or mis-split weight cannot pass
DIMS = dict(hidden_size=40, num_heads=3, q_lora_rank=24, kv_lora_rank=20, qk_nope_head_dim=12,
            qk_rope_head_dim=7, v_head_dim=10)
# fp32 end to end; both sides round differently (fused vs split matmuls): ~1e-7 observed
TOL_HF = 1e-5
BLOCK = 4


def _ours(dtype=torch.float32, gate=False, seed=0) -> GatedMLA:
    torch.manual_seed(seed)
    layer = GatedMLA(0, DIMS["hidden_size"], DIMS["num_heads"], DIMS["q_lora_rank"], DIMS["kv_lora_rank"],
                     DIMS["qk_nope_head_dim"], DIMS["qk_rope_head_dim"], DIMS["v_head_dim"], gate, dtype)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn_like(p) * (0.3 if p.dim() == 2 else 1.0) + (1.0 if p.dim() == 1 else 0.0))
    return layer


def _hf_from(layer: GatedMLA) -> KimiLinearAttention:
    config = KimiLinearConfig(
        hidden_size=DIMS["hidden_size"], num_attention_heads=DIMS["num_heads"], num_key_value_heads=DIMS["num_heads"],
        q_lora_rank=DIMS["q_lora_rank"], kv_lora_rank=DIMS["kv_lora_rank"], qk_nope_head_dim=DIMS["qk_nope_head_dim"],
        qk_rope_head_dim=DIMS["qk_rope_head_dim"], v_head_dim=DIMS["v_head_dim"], num_hidden_layers=1,
        linear_attn_config={"kda_layers": [], "full_attn_layers": [1], "num_heads": 2, "head_dim": 16,
                            "short_conv_kernel_size": 4},
    )
    config._attn_implementation = "eager"
    hf = KimiLinearAttention(config, layer_idx=0).eval()
    missing, unexpected = hf.load_state_dict(layer.state_dict(), strict=False)
    assert not missing and not unexpected, (missing, unexpected)  # every tensor copied by name
    return hf


def _hf_forward(hf: KimiLinearAttention, x: torch.Tensor) -> torch.Tensor:
    T = x.shape[0]
    mask = torch.full((T, T), float("-inf")).triu(1)[None, None]
    with torch.no_grad():
        return hf(x[None], attention_mask=mask)[0][0]


def _batch(q_lens, context_lens, cache) -> ForwardBatch:
    n = len(q_lens)
    blocks = -(-max(context_lens) // BLOCK)
    table = (torch.arange(n * blocks, dtype=torch.int32).view(n, blocks).flip(0))  # non-identity block layout
    return ForwardBatch(torch.tensor([0] + q_lens).cumsum(0), torch.tensor(context_lens),
                        torch.zeros(n, dtype=torch.long), table, cache)


def _cache(n_seqs, max_len) -> ModelCache:
    width = DIMS["kv_lora_rank"] + DIMS["qk_rope_head_dim"]
    blocks = n_seqs * -(-max_len // BLOCK)
    return ModelCache({}, {}, {0: torch.full((blocks * BLOCK, width), 1e30)}, BLOCK)


def test_naive_form_matches_transformers():
    layer = _ours()
    hf = _hf_from(layer)
    x = torch.randn(11, DIMS["hidden_size"])
    with torch.no_grad():
        ours = layer.o_proj(layer.attend_naive(layer.project_q(x), layer.project_latent(x)).reshape(11, -1))
    assert_close("naive vs transformers", _hf_forward(hf, x), ours, TOL_HF)


def test_prefill_then_decode_match_transformers_per_sequence():
    """Several sequences of different lengths packed in one prefill, then one decode step each,
    through the model layer and so through the mla_prefill / mla_decode dispatchers."""
    layer = _ours()
    hf = _hf_from(layer)
    lens = [5, 1, 9]
    xs = [torch.randn(n + 1, DIMS["hidden_size"]) for n in lens]
    cache = _cache(len(lens), max(lens) + 1)
    with torch.no_grad():
        pre = layer(torch.cat([x[:-1] for x in xs]), _batch(lens, lens, cache))
        dec = layer(torch.stack([x[-1] for x in xs]), _batch([1] * len(lens), [n + 1 for n in lens], cache))
    refs = [_hf_forward(hf, x) for x in xs]
    assert_close("prefill vs transformers", torch.cat([r[:-1] for r in refs]), pre, TOL_HF)
    assert_close("decode vs transformers", torch.stack([r[-1] for r in refs]), dec, TOL_HF)


def test_gate_is_sigmoid_of_g_proj_on_the_input():
    """The K3 gate, added outside the oracle: out = o_proj(attn * sigmoid(g_proj(x)))."""
    layer = _ours(gate=True)
    x = torch.randn(6, DIMS["hidden_size"])
    with torch.no_grad():
        attn = layer.attend_naive(layer.project_q(x), layer.project_latent(x)).reshape(6, -1)
        expected = layer.o_proj(attn * torch.sigmoid(layer.g_proj(x)))
        got = layer(x, _batch([6], [6], _cache(1, 6)))
    assert_close("gated output", expected, got, TOL_HF)


@pytest.mark.parametrize("tq,tk", [(1, 13), (5, 5), (4, 17)], ids=["decode", "prefill", "chunked_prefill"])
def test_absorbed_equals_naive_float64(tq, tk):
    layer = _ours(torch.float64)
    x = torch.randn(tk, DIMS["hidden_size"], dtype=torch.float64)
    with torch.no_grad():
        latent = layer.project_latent(x)
        q = layer.project_q(x[tk - tq :])
        naive, absorbed = layer.attend_naive(q, latent), layer.attend_absorbed(q, latent)
    assert (naive - absorbed).abs().max().item() <= 1e-10


def test_paged_decode_dispatch_equals_naive_float64():
    """The paged CPU decode path over the latent cache equals the naive (expanded K/V) form in fp64."""
    layer = _ours(torch.float64)
    lens = [3, 8, 1]
    cache = _cache(len(lens), max(lens))
    cache.mla_latent[0] = cache.mla_latent[0].double()
    batch = _batch([1] * len(lens), lens, cache)
    xs = [torch.randn(n, DIMS["hidden_size"], dtype=torch.float64) for n in lens]
    with torch.no_grad():
        for i, x in enumerate(xs):
            pos = torch.arange(lens[i])
            slots = batch.block_tables[i, pos // BLOCK].long() * BLOCK + pos % BLOCK
            cache.mla_latent[0][slots] = layer.project_latent(x)
        q = layer.project_q(torch.stack([x[-1] for x in xs]))
        o_lat = mla_decode(layer.absorb_q(q), cache.mla_latent[0], batch.block_tables, batch.context_lens,
                           BLOCK, DIMS["kv_lora_rank"], layer.scale)
        got = layer.unabsorb_o(o_lat)
        for i in range(len(lens)):
            lat = gather_latent(cache.mla_latent[0], batch.block_tables[i], lens[i], BLOCK)
            ref = layer.attend_naive(q[i : i + 1], lat)[0]
            assert (ref - got[i]).abs().max().item() <= 1e-10
