"""KDA states aged on long haystacks, so short training items see the states of a long context.

Most KDA channels of k3-tiny-niah barely decay (a per-token log decay under 1/262,144 in 112 of 128
channels of its second layer), so their states keep growing with the context: an 8K-token needle
prompt that starts from the states 1M tokens of essay haystack left behind loses digits of its needle,
as the real 1M-token prompts do. A chain is a state that the run ages on haystack text (no gradient),
a little every step; an item that carries starts from a chain's states (truncated backprop: a constant)
and its own MLA attention sees only the item. The states are the current weights' only for the text
aged since they last changed; the older part was written by earlier weights.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from k3ray.models.kda import KimiDeltaAttention

from k3ray_training.model import KdaCarry, train_logits


@dataclass
class Chain:
    states: dict[int, torch.Tensor]  # KDA layer index -> [H, K, V], on the CPU
    age: int  # haystack tokens the states have seen


def kda_layers(model) -> list[KimiDeltaAttention]:
    return [layer.self_attn for layer in model.model.layers.values() if isinstance(layer.self_attn, KimiDeltaAttention)]


class StateBank:
    def __init__(self, chains: int, carry: float) -> None:
        if chains < 1:
            raise ValueError(f"a state bank needs at least one chain, got {chains}")
        if not 0.0 <= carry <= 1.0:
            raise ValueError(f"carry is a probability, got {carry}")
        self.carry = carry
        self.chains: list[Chain | None] = [None] * chains  # None: not aged yet (zero states)

    def draw(self, rng: random.Random) -> Chain | None:
        """The chain an item starts from, or None (zeros) with probability 1 - carry."""
        return self.chains[rng.randrange(len(self.chains))] if rng.random() < self.carry else None

    @torch.no_grad()
    def age(self, model, haystack: list[list[int]]) -> None:
        """Run chain c over the haystack ids haystack[c] (all one length) and keep its final states."""
        assert len(haystack) == len(self.chains) and len({len(h) for h in haystack}) == 1
        attns = kda_layers(model)
        device = next(model.parameters()).device
        ids = torch.tensor(haystack, device=device)  # [C, T]
        carry = KdaCarry(torch.ones_like(ids, dtype=torch.bool), initial_states(self.chains, model))
        train_logits(model, ids, torch.zeros(1, dtype=torch.long, device=device), carry=carry)
        self.chains = [Chain({a.layer_idx: carry.final[a.layer_idx][c].cpu() for a in attns},
                             (0 if old is None else old.age) + ids.shape[1])
                       for c, old in enumerate(self.chains)]

    def age_on_text(self, model, text: str, rng: random.Random, tokens: int, encode) -> None:
        """Age every chain on its own `tokens`-token piece of `text`."""
        self.age(model, [haystack_ids(text, rng, tokens, encode) for _ in self.chains])

    def ages(self) -> list[int]:
        return [0 if c is None else c.age for c in self.chains]

    def state_dict(self) -> dict:
        return {"chains": [None if c is None else {"states": c.states, "age": c.age} for c in self.chains]}

    def load_state_dict(self, state: dict) -> None:
        chains = state["chains"]
        if len(chains) != len(self.chains):
            raise ValueError(f"the saved state bank has {len(chains)} chains, this run asks for {len(self.chains)}")
        self.chains = [None if c is None else Chain(c["states"], c["age"]) for c in chains]


def initial_states(starts: list[Chain | None], model) -> dict[int, torch.Tensor]:
    """Per KDA layer, [B, H, K, V] on the model's device: each row's starting states, zeros where it has none."""
    device = next(model.parameters()).device
    out = {}
    for a in kda_layers(model):
        zeros = torch.zeros(a.num_heads, a.head_dim, a.head_dim)
        out[a.layer_idx] = torch.stack([zeros if c is None else c.states[a.layer_idx] for c in starts]).to(device)
    return out


def haystack_ids(text: str, rng: random.Random, tokens: int, encode) -> list[int]:
    """`tokens` ids of `text` read cyclically from a random character offset."""
    start = rng.randrange(len(text))
    need = tokens * 4  # bytes enough for any byte-level or BPE tokenizer at <= 4 characters a token
    piece = (text * (need // len(text) + 2))[start:start + need]
    ids = encode(piece)
    assert len(ids) >= tokens, "haystack text shorter than asked"
    return ids[:tokens]
