"""The k3-tiny-niah model and a backward-capable forward over k3ray's own K3ForCausalLM modules.

The serving forward writes caches in place and runs inference kernels (out= GEMMs in the chunked
KDA, paged MLA); training walks the same modules over a dense [B, T] batch with the reference
kernels (a parallel-chunk KDA, causal SDPA for MLA, `naive_attn_res_rmsnorm`) and dense bf16-format
experts, so gradients reach every tensor the checkpoint holds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from k3ray.config import L2_NORM_EPS, ModelConfig, k3_tiny_config
from k3ray.kernels.attn_res.naive import naive_attn_res_logits, naive_attn_res_rmsnorm
from k3ray.kernels.kda import kda_gate, l2norm
from k3ray.kernels.moe import situ_glu
from k3ray.models.init import build_model
from k3ray.models.k3 import DecoderLayer, K3ForCausalLM
from k3ray.models.kda import KimiDeltaAttention
from k3ray.models.mla import GatedMLA
from k3ray.models.moe import StableLatentMoE
from k3ray.models.norm import gated_rms_norm

from k3ray_training.kda_train import chunk_kda_train

MODEL_NAME = "k3-tiny-niah"


def niah_config() -> ModelConfig:
    """K3's layer pattern (2 x [KDA, KDA, KDA, MLA] + MLA, AttnRes blocks of 3, 8 experts top-2
    with a shared expert, SiTU) at about 2.5M parameters, byte-level vocabulary."""
    return k3_tiny_config().replace(
        name=MODEL_NAME,
        hidden_size=128,
        intermediate_size=384,
        kda_num_heads=2,
        kda_head_dim=64,
        kda_a_log_size=64,
        mla_num_heads=4,
        q_lora_rank=64,
        kv_lora_rank=64,
        qk_nope_head_dim=32,
        qk_rope_head_dim=16,
        v_head_dim=32,
        num_shared_experts=1,
        moe_intermediate_size=96,
        routed_expert_hidden_size=64,
        vision=None,
    )


def trainable_model(config: ModelConfig, seed: int) -> K3ForCausalLM:
    """fp32 model with dense (bf16-format) experts, initialised for training: AttnRes queries at
    zero (uniform over depth sources), unit norms, a small head."""
    model = build_model(config.replace(expert_format="bf16"), torch.float32, seed=seed).train()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "_res_proj" in name:
                p.zero_()
            elif name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith("lm_head.weight"):
                p.mul_(0.25)
    return model


@dataclass
class KdaCarry:
    """KDA states carried into and out of a batch, as a long context carries them (truncated backprop:
    the initial states are constants). initial: per KDA layer index, [B, H, K, V] (a missing layer starts
    at zeros); valid [B, T]: the real tokens (padding updates no state); final gets each layer's state
    after each row's last real token, detached."""
    valid: torch.Tensor
    initial: dict[int, torch.Tensor] = field(default_factory=dict)
    final: dict[int, torch.Tensor] = field(default_factory=dict)


def _kda(attn: KimiDeltaAttention, x: torch.Tensor, carry: KdaCarry | None = None) -> torch.Tensor:
    B, T, _ = x.shape
    H, K = attn.num_heads, attn.head_dim
    qkv = torch.cat([attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)], -1).transpose(1, 2)  # [B, 3HK, T]
    w = attn.conv_weight()  # [3HK, W]
    qkv = F.silu(F.conv1d(F.pad(qkv, (w.shape[1] - 1, 0)), w[:, None, :], groups=w.shape[0]))
    q, k, v = (t.reshape(B, T, H, K) for t in qkv.transpose(1, 2).split(H * K, -1))
    q, k = l2norm(q, L2_NORM_EPS), l2norm(k, L2_NORM_EPS)
    g = kda_gate(attn.f_b_proj(attn.f_a_proj(x)).view(B, T, H, K), attn.A_log, attn.dt_bias, attn.gate_lower_bound)
    beta = torch.sigmoid(attn.b_proj(x).float())  # [B, T, H]
    if carry is None:
        o = chunk_kda_train(q, k, v, g, beta, K**-0.5)  # [B, T, H, K]
    else:
        real = carry.valid.to(x.device)[..., None]  # [B, T, 1]
        g, beta = g * real[..., None], beta * real
        o, final = chunk_kda_train(q, k, v, g, beta, K**-0.5, carry.initial.get(attn.layer_idx), True)
        carry.final[attn.layer_idx] = final.detach()
    o = gated_rms_norm(o, attn.o_norm.weight, attn.g_proj(x).view(B, T, H, K), attn.norm_eps)
    return attn.o_proj(o.reshape(B, T, H * K))


# the gathering MLA layer's head that reads a key (head 0 stays free for other reads). What the gather, route,
# gain and match losses do to the lookup, measured run by run, is in docs/multikey-lookup.md
GATHER_HEAD = 1
# with --self-read, the gathering layer's head that reads its own row at each number: the number's digit then
# joins the gathered key in one AttnRes source, so the matching layer's V can read it beside K's key
SELF_HEAD = 2


@dataclass
class CopySupervision:
    """Query rows [A] (flat positions into B * T) whose next token is a copy of the token at targets
    [A] (flat positions, same sequence, earlier): each MLA layer's head 0 is asked to attend there.
    With gather spans, the gathering MLA layer's (gather_layer) GATHER_HEAD is asked instead to attend
    within the key span [start, end) of each gather row (flat positions), and the copy rows are
    supervised in the other MLA layers only: a lookup by a many-byte key in two hops, the key gathered
    onto the value and onto the question, then matched."""
    rows: torch.Tensor
    targets: torch.Tensor
    losses: list[torch.Tensor] = field(default_factory=list)  # per MLA layer: summed -log attention on the target
    gather_rows: torch.Tensor | None = None  # [G]; set (even empty): the gathering MLA layer only gathers
    gather_starts: torch.Tensor | None = None  # [G]
    gather_ends: torch.Tensor | None = None  # [G]
    gather_losses: list[torch.Tensor] = field(default_factory=list)  # the gathering layer's summed KL to uniform
    gather_key_ids: torch.Tensor | None = None  # [G / 2] the key of each (number, question) pair
    contrast_losses: list[torch.Tensor] = field(default_factory=list)  # summed -log p(the question's own key)
    contrast: bool = False  # with gather_key_ids: the gathered keys are contrasted
    match: bool = False  # with gather_key_ids: the next MLA layer's head 0 matches questions to numbers
    match_losses: list[torch.Tensor] = field(default_factory=list)  # summed -log p(own key), the next MLA layer
    gather_layer: int = 1  # the MLA layer (1-based) that gathers; the match is the next one
    route: bool = False  # with gather rows: AttnRes asked to read the gathered key's source at the next MLA layer's
    # input (numbers and questions) and the matching layer's source at the output (questions)
    route_losses: list[torch.Tensor] = field(default_factory=list)  # [input route, output route], each summed
    gathered_source: int = -1  # index among the AttnRes sources (bank, then partial) of the gathering layer's output
    matched_source: int = -1  # the same for the matching layer's output
    self_read: bool = False  # with gather rows: the gathering layer's SELF_HEAD is asked to read each number's own row
    self_losses: list[torch.Tensor] = field(default_factory=list)  # summed -log SELF_HEAD's weight on the row
    readout: bool = False  # with gather rows: the matching head's own share of the answer's logits must pick the digit
    readout_parts: list[torch.Tensor] = field(default_factory=list)  # [Q, D] head 0's term of the matching layer's output
    readout_losses: list[torch.Tensor] = field(default_factory=list)  # summed cross-entropy of that share's logits
    value_readout: bool = False  # with gather rows: the matching head's value at each asked number, read out as above
    value_parts: list[torch.Tensor] = field(default_factory=list)  # [Q, D] head 0's term were it to read only that row
    value_losses: list[torch.Tensor] = field(default_factory=list)  # summed cross-entropy of that term's share
    mla_layers_seen: int = 0


def _row_attention(q: torch.Tensor, k: torch.Tensor, scale: float, rows: torch.Tensor, head: int,
                   v: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """q, k [B, H, T, d], rows [N] flat positions into B * T -> head's causal log-attention [N, T] of each
    row over its own sequence, and with v [B, H, T, dv] the head's output [N, dv], both in rows' order."""
    T = q.shape[2]
    b, t = rows // T, rows % T
    positions = torch.arange(T, device=q.device)[None, :]
    log_attention = q.new_empty(len(rows), T)
    outputs = None if v is None else q.new_empty(len(rows), v.shape[-1])
    for item in b.unique().tolist():
        sel = b == item
        scores = q[item, head, t[sel]] @ k[item, head].T * scale  # [N_b, T]
        log_attention[sel] = scores.masked_fill(positions > t[sel, None], float("-inf")).log_softmax(-1)
        if v is not None:
            outputs[sel] = log_attention[sel].exp() @ v[item, head]
    return log_attention, outputs


def _copy_attention_loss(q: torch.Tensor, k: torch.Tensor, scale: float, sup: CopySupervision) -> torch.Tensor:
    """q, k [B, H, T, d] -> sum over the rows of -log(head 0's causal attention weight on the target)."""
    log_attention, _ = _row_attention(q, k, scale, sup.rows, 0)
    return -log_attention.gather(1, (sup.targets % q.shape[2])[:, None]).sum()


def _gather_attention_loss(log_attention: torch.Tensor, sup: CopySupervision) -> torch.Tensor:
    """GATHER_HEAD's log-attention [G, T] at the gather rows -> sum of KL(uniform on the span || attention):
    every byte of the key read alike, so a key gathered at the value and at the question gives one
    fingerprint (a loss on the span's mass alone left the two sites reading different bytes)."""
    T = log_attention.shape[1]
    positions = torch.arange(T, device=log_attention.device)[None, :]
    inside = (positions >= (sup.gather_starts % T)[:, None]) & (positions < (sup.gather_ends % T)[:, None])  # [G, T]
    width = inside.sum(-1)  # [G]
    return -(log_attention.masked_fill(~inside, 0.0).sum(-1) / width + width.log()).sum()


CONTRAST_TEMPERATURE = 0.1


def _fingerprint_contrast_loss(outputs: torch.Tensor, sup: CopySupervision) -> torch.Tensor:
    """GATHER_HEAD's outputs [G, dv] at the gather rows -> sum over the questions of -log p(a number of
    the same key) among all gathered numbers of the batch, p a softmax of the outputs' cosines: the
    gathered key must name its key (training the gather alone let the values forget the bytes: measured,
    a uniform read of the keys picked the right needle 4 in 4 from the shipped weights, 1 in 4 after)."""
    fingerprints = F.normalize(outputs, dim=-1)  # numbers and questions alternate
    return _own_key_loss(fingerprints[1::2] @ fingerprints[0::2].T / CONTRAST_TEMPERATURE, sup.gather_key_ids)


def _own_key_loss(scores: torch.Tensor, key_ids: torch.Tensor) -> torch.Tensor:
    """scores [Q, N] of each question against each number -> sum of -log p(a number of the question's key)."""
    same = key_ids[:, None] == key_ids[None, :]
    return -scores.log_softmax(-1).masked_fill(~same, float("-inf")).logsumexp(-1).sum()


def _match_loss(q: torch.Tensor, k: torch.Tensor, scale: float, sup: CopySupervision) -> torch.Tensor:
    """q, k [B, H, T, d] -> sum over the questions of -log p(a number of the same key) under head 0's
    attention scores restricted to the batch's gathered numbers: hop 2's match without the haystack."""
    T = q.shape[2]
    b, t = sup.gather_rows // T, sup.gather_rows % T
    numbers = k[b[0::2], 0, t[0::2]]  # [G/2, d]
    questions = q[b[1::2], 0, t[1::2]]  # [G/2, d]
    return _own_key_loss(questions @ numbers.T * scale, sup.gather_key_ids)


@torch.no_grad()
def amplify_mla_head(model: K3ForCausalLM, mla_layer: int, gain: float, head: int) -> None:
    """Scale the `head` columns of the mla_layer-th (1-based) MLA layer's o_proj by gain: a head whose output is
    small beside the MoE outputs in its AttnRes source (measured for the gathering head, from --route-partial
    weights: x4 lifted the key's probe read at the matching layer's input from 0.25 to 0.60, 4 needles)."""
    mla = [layer.self_attn for layer in model.model.layers.values()
           if not isinstance(layer.self_attn, KimiDeltaAttention)]
    attn = mla[mla_layer - 1]
    attn.o_proj.weight[:, head * attn.v_dim:(head + 1) * attn.v_dim] *= gain


# the route keeps the weight within a band: a number's row feeds its key to K and its digit to V. Routing
# all of it to the gathered source (measured: weight 0.997, a saturated softmax) left the digit out: the
# matching head put 0.86 of its attention on the asked number (0.91 of picks) and the lead digit stayed at chance
ROUTE_BAND = (0.5, 0.9)


def _route_loss(sources: torch.Tensor, proj: torch.Tensor, norm: torch.Tensor, eps: float, source: int) -> torch.Tensor:
    """sources [G, S, D] at G rows -> sum of max(0, log 0.5 - log w) + max(0, log 0.1 - log(1 - w)), w the AttnRes
    weight (query proj * norm) on sources[:, source], so w stays in ROUTE_BAND. At the matching layer's mixer
    input, the source holding the gathered key (measured with --gather-layer 2: the partial sum read 0.48 at
    layer 8, its AttnRes gave it 0.03-0.04 at these rows, the mixed input read 0.27); at the output, the
    source holding the matching layer's output (measured: 0.009 of the weight at the answer rows, where the
    first KDA block had 0.78, so the matching head's read of the asked digit, 0.85 held-out, went unused)."""
    assert 0 <= source < sources.shape[1], "the source is written before it is read"
    log_p = naive_attn_res_logits(sources, proj, norm, eps).log_softmax(-1)  # [G, S]
    log_rest = torch.cat([log_p[:, :source], log_p[:, source + 1:]], -1).logsumexp(-1)  # log(1 - w), stably
    low, high = ROUTE_BAND
    return ((math.log(low) - log_p[:, source]).clamp(min=0) + (math.log(1 - high) - log_rest).clamp(min=0)).sum()


def _gate_and_project_head(attn: GatedMLA, flat: torch.Tensor, out: torch.Tensor, rows: torch.Tensor,
                           head: int) -> torch.Tensor:
    """out [N, dv] a head output at rows [N] (flat) -> its term [N, D]: gated by the rows' gate, through the
    head's columns of o_proj (gate_and_project restricted to the head)."""
    cols = slice(head * attn.v_dim, (head + 1) * attn.v_dim)
    if attn.g_proj is not None:
        out = out * torch.sigmoid(attn.g_proj(flat[rows]).float())[:, cols]
    return out @ attn.o_proj.weight[:, cols].T


def _head_term(attn: GatedMLA, flat: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               rows: torch.Tensor, head: int) -> torch.Tensor:
    """One head's term [N, D] of the layer's output at rows [N] (flat): its attention output, gated, through
    its columns of o_proj (the layer's output is the sum of these)."""
    _, out = _row_attention(q, k, attn.scale, rows, head, v)  # [N, dv]
    return _gate_and_project_head(attn, flat, out, rows, head)


def _value_term(attn: GatedMLA, flat: torch.Tensor, v: torch.Tensor, sources: torch.Tensor, rows: torch.Tensor,
                head: int) -> torch.Tensor:
    """The term [N, D] head would add at rows [N] if it attended only to sources [N] (flat, same sequences): the
    sources' values, gated by the rows' gate, through its o_proj columns; _head_term is the attention-weighted
    sum of these over a row's positions."""
    B, H, T, dv = v.shape
    values = v.transpose(1, 2).reshape(B * T, H, dv)[sources, head]  # [N, dv]
    return _gate_and_project_head(attn, flat, values, rows, head)


def readout_logits(model: K3ForCausalLM, sources: torch.Tensor, term: torch.Tensor, source: int) -> torch.Tensor:
    """sources [Q, S, D] (the output AttnRes sources at Q rows), term [Q, D] a part of sources[:, source] ->
    that part's direct share of the logits [Q, V]: its AttnRes weight, the final norm's weight over the
    aggregate's RMS (held fixed), the LM head. Summed over every source's whole term, the shares are the logits."""
    m = model.model
    eps = model.config.rms_norm_eps
    weights = naive_attn_res_logits(sources, m.output_attn_res_proj.weight, m.output_attn_res_norm.weight,
                                    eps).softmax(-1)  # [Q, S]
    aggregate = (weights[..., None] * sources).sum(1)  # [Q, D]
    inv_rms = torch.rsqrt(aggregate.pow(2).mean(-1, keepdim=True) + eps).detach()
    return model.lm_head(weights[:, source, None] * term * inv_rms * m.norm.weight)


def _readout_loss(model: K3ForCausalLM, sources: torch.Tensor, term: torch.Tensor, source: int,
                  labels: torch.Tensor) -> torch.Tensor:
    """Summed cross-entropy of the matching head's share of the logits at the answer rows against their lead
    digits [Q]: the head alone must name the digit (measured: its output held the asked digit 0.66-0.85
    held-out while the answer's first digit stayed at chance; docs/multikey-lookup.md)."""
    return F.cross_entropy(readout_logits(model, sources, term, source), labels, reduction="sum")


def _mla(attn: GatedMLA, x: torch.Tensor, copy: CopySupervision | None = None) -> torch.Tensor:
    B, T, D = x.shape
    flat = x.reshape(B * T, D)
    q = attn.project_q(flat).view(B, T, attn.num_heads, -1).transpose(1, 2)  # [B, H, T, nope + rope]
    k, v = attn.expand_kv(attn.project_latent(flat))
    k = k.view(B, T, attn.num_heads, -1).transpose(1, 2)
    v = v.view(B, T, attn.num_heads, -1).transpose(1, 2)  # [B, H, T, v]
    if copy is not None:
        copy.mla_layers_seen += 1
        if copy.mla_layers_seen == copy.gather_layer and copy.gather_rows is not None:
            if len(copy.gather_rows):
                contrast = copy.contrast and copy.gather_key_ids is not None
                log_attention, outputs = _row_attention(q, k, attn.scale, copy.gather_rows, GATHER_HEAD,
                                                        v if contrast else None)
                copy.gather_losses.append(_gather_attention_loss(log_attention, copy))
                if contrast:
                    copy.contrast_losses.append(_fingerprint_contrast_loss(outputs, copy))
                if copy.self_read:
                    numbers = copy.gather_rows[0::2]
                    log_self, _ = _row_attention(q, k, attn.scale, numbers, SELF_HEAD)  # [G / 2, T]
                    copy.self_losses.append(-log_self[torch.arange(len(numbers), device=log_self.device), numbers % T].sum())
        else:
            if len(copy.rows):
                copy.losses.append(_copy_attention_loss(q, k, attn.scale, copy))
            if copy.match and copy.mla_layers_seen == copy.gather_layer + 1 and copy.gather_key_ids is not None and len(copy.gather_rows):
                copy.match_losses.append(_match_loss(q, k, attn.scale, copy))
            matching = copy.mla_layers_seen == copy.gather_layer + 1 and copy.gather_rows is not None and len(copy.gather_rows)
            if copy.readout and matching:
                copy.readout_parts.append(_head_term(attn, flat, q, k, v, copy.gather_rows[1::2], head=0))
            if copy.value_readout and matching:
                copy.value_parts.append(_value_term(attn, flat, v, copy.gather_rows[0::2], copy.gather_rows[1::2], head=0))
    # V zero-padded to q's head dim: SDPA then takes its fused CPU flash path (5.6x faster, forward
    # and backward, at T=2249 here) instead of the math path that materialises [B, H, T, T]
    width = v.shape[-1]
    v = F.pad(v, (0, max(0, q.shape[-1] - width)))
    o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=attn.scale)[..., :width]
    return attn.gate_and_project(flat, o.transpose(1, 2).reshape(B * T, -1)).view(B, T, D)


def _moe(moe: StableLatentMoE, x: torch.Tensor, expert_load: torch.Tensor | None) -> torch.Tensor:
    """x [N, D]; the routed experts as a loop over the 8 experts' selected rows."""
    weights, ids = moe.gate(x)  # [N, k] fp32, [N, k]
    h = moe.routed_expert_down_proj(x)  # [N, Dl]
    ex = moe.experts
    y = torch.zeros_like(h)
    for e in range(ex.count):
        rows, slot = (ids == e + ex.start).nonzero(as_tuple=True)
        if rows.numel() == 0:
            continue
        he = h[rows]
        out = situ_glu(he @ ex.w1[e].T, he @ ex.w3[e].T, ex.beta, ex.linear_beta) @ ex.w2[e].T
        y = y.index_add(0, rows, out * weights[rows, slot, None])
        if expert_load is not None:
            expert_load[e] += rows.numel()
    if moe.routed_expert_norm is not None:
        y = moe.routed_expert_norm(y)
    out = moe.routed_expert_up_proj(y)
    return out if moe.shared_experts is None else out + moe.shared_experts(x)


def _layer(layer: DecoderLayer, prefix: torch.Tensor, bank: list[torch.Tensor],
           loads: dict[int, torch.Tensor] | None,
           copy: CopySupervision | None = None,
           trace: dict[str, torch.Tensor] | None = None,
           carry: KdaCarry | None = None) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """DecoderLayer.forward over [B, T, D] (same AttnRes block logic); trace gets the mixer's input and
    output as "{layer}.{kda|mla}.in" / ".out", each [B, T, D]."""
    B, T, D = prefix.shape

    def stack(sources: list[torch.Tensor]) -> torch.Tensor:
        return torch.stack(sources, 2).reshape(B * T, len(sources), D)  # [B * T, S, D]

    def mix(stacked: torch.Tensor, proj, res_norm, out_norm) -> torch.Tensor:
        return naive_attn_res_rmsnorm(stacked, proj.weight, res_norm.weight, out_norm.weight, layer.eps)[1].view(B, T, D)

    if bank:
        sources = stack(bank + [prefix])
        a = mix(sources, layer.self_attention_res_proj, layer.self_attention_res_norm, layer.input_layernorm)
        if copy is not None and copy.route and not isinstance(layer.self_attn, KimiDeltaAttention):
            if copy.mla_layers_seen == copy.gather_layer and len(copy.gather_rows):
                copy.route_losses.append(_route_loss(sources[copy.gather_rows], layer.self_attention_res_proj.weight,
                                                     layer.self_attention_res_norm.weight, layer.eps,
                                                     copy.gathered_source))
    else:
        a = layer.input_layernorm(prefix)
    partial: torch.Tensor | None = prefix
    if layer.closes_block:
        bank, partial = bank + [prefix], None
    is_kda = isinstance(layer.self_attn, KimiDeltaAttention)
    if copy is not None and not is_kda and copy.mla_layers_seen + 1 == copy.gather_layer:
        copy.gathered_source = len(bank)  # y joins the partial sum, which later closes into bank[len(bank)]
    if copy is not None and not is_kda and copy.mla_layers_seen == copy.gather_layer:
        copy.matched_source = len(bank)
    y = _kda(layer.self_attn, a, carry) if is_kda else _mla(layer.self_attn, a, copy)
    if trace is not None:
        site = f"{layer.layer_idx}.{'kda' if is_kda else 'mla'}"
        trace[f"{site}.in"], trace[f"{site}.out"] = a.detach(), y.detach()
    partial = y if partial is None else partial + y
    m = mix(stack(bank + [partial]), layer.mlp_res_proj, layer.mlp_res_norm, layer.post_attention_layernorm)
    if hasattr(layer, "block_sparse_moe"):
        load = None if loads is None else loads.setdefault(layer.layer_idx, torch.zeros(layer.block_sparse_moe.experts.count))
        f = _moe(layer.block_sparse_moe, m.reshape(B * T, D), load).view(B, T, D)
    else:
        f = layer.mlp(m)
    return partial + f, bank


def train_logits(model: K3ForCausalLM, input_ids: torch.Tensor, rows: torch.Tensor,
                 loads: dict[int, torch.Tensor] | None = None, copy: CopySupervision | None = None,
                 trace: dict[str, torch.Tensor] | None = None, carry: KdaCarry | None = None) -> torch.Tensor:
    """input_ids [B, T] -> logits [R, V] at the flat positions rows [R] (indices into B * T);
    carry starts the KDA layers from given states and collects their final ones;
    loads collects each MoE layer's per-expert token counts, copy each MLA layer's copy-attention loss,
    trace each token mixer's input and output (see _layer) and the output AttnRes weights as
    "output.weights" [B, T, S] (S: the embedding, each closed block, the last block's partial sum)."""
    B, T = input_ids.shape
    hidden = model.embed(input_ids)
    bank: list[torch.Tensor] = []
    for layer in model.model.layers.values():
        hidden, bank = _layer(layer, hidden, bank, loads, copy, trace, carry)
    D = hidden.shape[-1]
    sources = torch.stack(bank + [hidden], 2).reshape(B * T, len(bank) + 1, D)  # [B * T, S, D]
    m = model.model
    if copy is not None and copy.route and copy.matched_source >= 0 and len(copy.gather_rows):
        copy.route_losses.append(_route_loss(sources[copy.gather_rows[1::2]], m.output_attn_res_proj.weight,
                                             m.output_attn_res_norm.weight, model.config.rms_norm_eps,
                                             copy.matched_source))
    if copy is not None and (copy.readout_parts or copy.value_parts) and copy.matched_source >= 0:
        answers, digits = copy.gather_rows[1::2], input_ids.flatten()[copy.gather_rows[0::2]]
        for parts, losses in ((copy.readout_parts, copy.readout_losses), (copy.value_parts, copy.value_losses)):
            if parts:
                losses.append(_readout_loss(model, sources[answers], parts[0], copy.matched_source, digits))
    if trace is not None:
        trace["output.weights"] = naive_attn_res_logits(sources, m.output_attn_res_proj.weight,
                                                        m.output_attn_res_norm.weight,
                                                        model.config.rms_norm_eps).softmax(-1).view(B, T, -1)
    sources = sources[rows]  # [R, S, D]
    _, h = naive_attn_res_rmsnorm(sources, m.output_attn_res_proj.weight, m.output_attn_res_norm.weight,
                                  m.norm.weight, model.config.rms_norm_eps)
    return model.lm_head(h)


@torch.no_grad()
def balance_experts(model: K3ForCausalLM, loads: dict[int, torch.Tensor], rate: float) -> None:
    """K3's auxiliary-loss-free balancing: raise the selection bias of under-loaded experts."""
    for idx, load in loads.items():
        bias = model.model.layers[str(idx)].block_sparse_moe.gate.e_score_correction_bias
        bias += rate * torch.sign(load.mean() - load).to(bias.device)


def parameter_count(model: K3ForCausalLM) -> int:
    return sum(p.numel() for p in model.parameters())


def cosine_lr(step: int, total: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))
