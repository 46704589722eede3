"""The documented Python entry point: load any K3-shaped checkpoint directory and score or
generate in this process.

    from k3ray.api import K3
    k3 = K3.load("path/to/checkpoint")        # its own config.json: any widths and layer counts
    k3 = K3.load("path", device="cuda:0")     # default "auto": CUDA when available
    logits = k3.logits([1, 2, 3])              # [3, vocab] fp32 full-sequence logits
    lp, greedy = k3.loglikelihood(ctx_ids, continuation_ids)
    ids = k3.generate(prompt_ids, max_new_tokens=32)   # through the engine (LLM), as serving runs

Scoring runs the model over the whole sequence here; generation goes through the engine that
serving runs (one LLM over this model, sized for the longest request so far).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence

import torch

from k3ray.default_model import checkpoint_dir
from k3ray.device import DeviceLike, resolve_device, to_device
from k3ray.engine.llm import LLM
from k3ray.models.forward_batch import ForwardBatch, ModelCache
from k3ray.models.k3 import K3ForCausalLM
from k3ray.sampling_params import SamplingParams
from k3ray.tokenizer.load import tokenizer_for
from k3ray.weights.loader import load_model

BLOCK_SIZE = 64


@dataclass
class K3:
    model: K3ForCausalLM
    tokenizer: object | None = None
    name: str = "k3"
    prefill_chunk: int = 4096  # tokens per forward: bounds activation memory on long inputs
    _engine: LLM | None = field(default=None, init=False, repr=False, compare=False)
    _engine_blocks: int = field(default=0, init=False, repr=False, compare=False)

    @classmethod
    def load(cls, path: str | None = None, dtype: torch.dtype = torch.float32, device: DeviceLike = "auto",
             tokenizer: str | None = None) -> "K3":
        """Load a checkpoint directory (config.json + safetensors, tokenizer files if present) or a
        shipped checkpoint by name ("k3-tiny-niah") onto `device` ("auto": CUDA when available,
        "cpu", "cuda", "cuda:N"); with no path, the deterministic tiny K3 checkpoint (made on first
        use). `tokenizer`: a directory holding the tokenizer when the checkpoint has none of its own."""
        path = checkpoint_dir(path)
        model = load_model(path, dtype=dtype, device=resolve_device(device))
        return cls(model.eval(), tokenizer_for(path, tokenizer), name=model.config.name)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def vocab_size(self) -> int:
        return self.model.config.vocab_size

    def _check_ids(self, ids: Sequence[int]) -> torch.Tensor:
        t = torch.as_tensor(list(ids), dtype=torch.long)
        if t.dim() != 1 or t.numel() == 0:
            raise ValueError("token_ids must be a non-empty 1-D sequence of ints")
        bad = t[(t < 0) | (t >= self.vocab_size)]
        if bad.numel():
            raise ValueError(f"token id {int(bad[0])} is outside the vocabulary [0, {self.vocab_size})")
        limit = self.model.config.max_position_embeddings
        if t.numel() > limit:
            raise ValueError(f"{t.numel()} tokens exceed the model's context of {limit}")
        return t

    def _session(self, total_len: int) -> ModelCache:
        blocks = max(1, math.ceil(total_len / BLOCK_SIZE))
        return ModelCache.allocate(self.model.config, 1, blocks, BLOCK_SIZE, dtype=self.model.dtype,
                                   device=self.device)

    def _step(self, cache: ModelCache, ids: torch.Tensor, prior: int, all_logits: bool) -> torch.Tensor:
        """ids [n] on the host -> fp32 logits on the model's device (every row, or the last)."""
        n = ids.numel()
        table = torch.arange(_blocks(cache))[None]
        batch = ForwardBatch(torch.tensor([0, n]), torch.tensor([prior + n]), torch.tensor([0]), table, cache)
        idx = None if all_logits else torch.tensor([n - 1])
        moved = to_device([ids] if idx is None else [ids, idx], self.device)
        return self.model(moved[0], batch, logits_indices=None if idx is None else moved[1]).float()

    @torch.no_grad()
    def logits(self, token_ids: Sequence[int]) -> torch.Tensor:
        """Full-sequence logits [T, vocab] (fp32, on the model's device): row t scores the token after position t."""
        ids = self._check_ids(token_ids)
        cache = self._session(ids.numel())
        out = [self._step(cache, ids[s : s + self.prefill_chunk], s, True) for s in range(0, ids.numel(), self.prefill_chunk)]
        return torch.cat(out)

    @torch.no_grad()
    def loglikelihood(self, context: Sequence[int], continuation: Sequence[int]) -> tuple[float, bool]:
        """log P(continuation | context) and whether it is the greedy continuation (lm-eval's pair)."""
        if not continuation:
            raise ValueError("continuation must contain at least one token")
        ids = list(context) + list(continuation)
        logp = torch.log_softmax(self.logits(ids), -1)
        rows = logp[len(context) - 1 : len(ids) - 1]  # predictions for the continuation tokens
        target = torch.tensor(list(continuation)).to(rows.device)
        lp, greedy = torch.stack([rows.gather(-1, target[:, None]).sum().double(),
                                  (rows.argmax(-1) == target).all().double()]).tolist()  # one copy back
        return lp, bool(greedy)

    def generate(
        self,
        prompt_ids: Sequence[int],
        max_new_tokens: int = 32,
        temperature: float = 0.0,
        top_k: int = 0,
        seed: int | None = None,
        stop_token_ids: Sequence[int] | None = None,
    ) -> list[int]:
        """Greedy (temperature 0) or sampled continuation from the engine, ending with (and
        including) the model's EOS or a stop id, or after max_new_tokens."""
        if max_new_tokens <= 0:
            raise ValueError(f"max_new_tokens must be > 0, got {max_new_tokens}")
        if temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {temperature}")
        ids = self._check_ids(prompt_ids).tolist()
        params = SamplingParams(temperature=temperature, top_k=top_k if top_k > 0 else -1,
                                seed=0 if seed is None else seed, max_tokens=max_new_tokens,
                                stop_token_ids=tuple(stop_token_ids or ()))
        (out,) = self._llm(len(ids) + max_new_tokens).generate([ids], params)
        return out.outputs[0].token_ids

    def _llm(self, total_len: int) -> LLM:
        """The engine over this model, its cache holding total_len tokens of one sequence (built
        anew, twice as large, when a longer request comes). No tokenizer: the model's EOS and the
        caller's stop ids end a generation, as they always have here."""
        blocks = max(1, math.ceil(total_len / BLOCK_SIZE))
        if self._engine is None or self._engine_blocks < blocks:
            blocks = max(blocks, 2 * self._engine_blocks)
            self._engine = None  # its caches go before the larger ones come
            self._engine = LLM(self.model, max_num_seqs=1, block_size=BLOCK_SIZE, num_blocks=blocks,
                               max_num_batched_tokens=self.prefill_chunk, enable_prefix_caching=False,
                               long_context_reserve=0)
            self._engine_blocks = blocks
        return self._engine


def _blocks(cache: ModelCache) -> int:
    lat = next(iter(cache.mla_latent.values()), None)
    return 1 if lat is None else lat.shape[0] // cache.block_size
