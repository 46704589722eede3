"""The sigmoid + bias top-k expert selection (reference, CPU dispatch and the Triton kernel under the
CPU interpreter) against transformers 5.18.0 `DeepseekV3TopkRouter` and `KimiLinearTopkRouter`
with one expert group (n_group = topk_group = 1, as K3 configures them)."""

import pytest
import torch
from transformers import DeepseekV3Config, KimiLinearConfig
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter
from transformers.models.kimi_linear.modeling_kimi_linear import KimiLinearTopkRouter

from k3ray.kernels.moe import select_experts
from k3ray.kernels.moe.naive import naive_select_experts
from k3ray.kernels.moe.select_experts_triton import select_experts_triton
from k3ray.testing import assert_close

HIDDEN, EXPERTS, TOP_K = 24, 37, 5


def _deepseek(renormalize: bool, scaling: float) -> DeepseekV3TopkRouter:
    return DeepseekV3TopkRouter(DeepseekV3Config(
        hidden_size=HIDDEN, n_routed_experts=EXPERTS, num_experts_per_tok=TOP_K, n_group=1, topk_group=1,
        norm_topk_prob=renormalize, routed_scaling_factor=scaling,
    ))


def _kimi(renormalize: bool, scaling: float) -> KimiLinearTopkRouter:
    return KimiLinearTopkRouter(KimiLinearConfig(
        hidden_size=HIDDEN, num_hidden_layers=1, num_local_experts=EXPERTS, num_experts_per_tok=TOP_K, n_group=1,
        topk_group=1, norm_topk_prob=renormalize, routed_scaling_factor=scaling,
        linear_attn_config={"kda_layers": [], "full_attn_layers": [1]},
    ))


ORACLES = {"deepseek_v3": _deepseek, "kimi_linear": _kimi}
IMPLS = {"naive": naive_select_experts, "dispatch": select_experts, "triton": select_experts_triton}


def _by_id(weights: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The oracle returns its top-k unsorted: compare (ids, weights) sorted by expert id."""
    order = ids.argsort(-1)
    return ids.gather(-1, order), weights.gather(-1, order)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("oracle", ORACLES)
@pytest.mark.parametrize("renormalize,scaling", [(True, 1.0), (False, 2.5)], ids=["renorm", "raw_scaled"])
def test_router_matches_transformers(oracle, impl, renormalize, scaling):
    g = torch.Generator().manual_seed(0)
    router = ORACLES[oracle](renormalize, scaling)
    x = torch.randn(9, HIDDEN, generator=g).bfloat16()  # the model feeds bf16 activations
    with torch.no_grad():
        router.weight.copy_(torch.randn(EXPERTS, HIDDEN, generator=g).bfloat16().float())
        # a bias large enough to change the selection, so selection-only use is checked
        router.e_score_correction_bias.copy_(torch.randn(EXPERTS, generator=g) * 0.3)
        _, their_w, their_ids = router(x)
    logits = x.float() @ router.weight.float().T  # the fp32 gate GEMM of k3ray's ExpertGate
    w, ids = IMPLS[impl](logits, router.e_score_correction_bias, TOP_K, renormalize, scaling)
    ours_ids, ours_w = _by_id(w, ids)
    ref_ids, ref_w = _by_id(their_w, their_ids)
    assert torch.equal(ours_ids, ref_ids)
    assert_close("router weights", ref_w, ours_w, 1e-6)  # fp32 sigmoid and one division


def test_bias_changes_selection_not_weights():
    """With a bias the chosen experts change, but each chosen weight is still its plain sigmoid."""
    logits = torch.randn(6, EXPERTS)
    bias = torch.zeros(EXPERTS)
    bias[:TOP_K] = 10.0  # forces experts 0..k-1
    w, ids = naive_select_experts(logits, bias, TOP_K, renormalize=False)
    assert torch.equal(ids.sort(-1).values, torch.arange(TOP_K).expand(6, -1))
    assert torch.equal(w, torch.sigmoid(logits).gather(-1, ids))
