"""Grammar-constrained sampling with xgrammar (what vLLM, SGLang and TensorRT-LLM use).

One `StructuredOutputs` per engine holds the tokenizer's vocabulary as xgrammar sees it and one
compiled-grammar cache; each constrained sequence carries its own `GrammarState` (a matcher over
the tokens it has accepted). Each step the rows of constrained sequences get their grammar's token
mask (forbidden tokens to -inf) before sampling. A finished grammar allows only the stop tokens,
so the output ends with "stop"; max_tokens reached first ends it with "length", as in vLLM.

JSON is generated without free whitespace between tokens (xgrammar's `any_whitespace=False`):
models otherwise can emit whitespace until max_tokens. Special and reserved tokens are never
allowed inside the grammar, only as stop tokens at its end.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
import xgrammar as xgr

from k3ray.sampling_params import StructuredOutputsParams


def check_grammar(params: StructuredOutputsParams) -> None:
    """Raise ValueError if the schema cannot be turned into a grammar (no vocabulary needed)."""
    try:
        if params.json is not None:
            xgr.Grammar.from_json_schema(params.json, any_whitespace=False)
    except RuntimeError as e:
        raise ValueError(f"structured_outputs.json is not a usable JSON schema: {_first_line(e)}") from None


def encoded_vocab(tokenizer, vocab_size: int) -> list[bytes]:
    """Each id's bytes; b"" for special and reserved ids (and ids past the tokenizer's vocabulary),
    which xgrammar treats as special: never part of the text a grammar matches."""
    vocab = [b""] * vocab_size
    for token_id in range(min(vocab_size, tokenizer.vocab_size)):
        piece = tokenizer.token_piece(token_id)
        if isinstance(piece, bytes):
            vocab[token_id] = piece
    return vocab


class GrammarState:
    """One sequence's matcher: which tokens may come next, advanced by each accepted token."""

    def __init__(self, matcher: xgr.GrammarMatcher) -> None:
        self.matcher = matcher

    def accept(self, token: int) -> None:
        accepted = self.matcher.accept_token(token)
        assert accepted, f"token {token} was sampled outside the grammar's mask"

    @property
    def terminated(self) -> bool:
        return self.matcher.is_terminated()


class StructuredOutputs:
    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: Iterable[int]) -> None:
        if tokenizer is None:
            raise ValueError("structured outputs need the engine's tokenizer")
        self.vocab_size = vocab_size
        self.stop_token_ids = sorted(stop_token_ids)
        info = xgr.TokenizerInfo(encoded_vocab(tokenizer, vocab_size), xgr.VocabType.RAW, vocab_size=vocab_size,
                                 stop_token_ids=self.stop_token_ids)
        self.compiler = xgr.GrammarCompiler(info, max_threads=1)  # caches each compiled grammar

    def new_state(self, params: StructuredOutputsParams, extra_stop_token_ids: Sequence[int] = ()) -> GrammarState:
        """A fresh matcher; the grammar may end with the engine's stop tokens or the request's."""
        try:
            if params.json_object:
                # any object (strict_mode=False: a bare {"type": "object"} would otherwise allow only {})
                compiled = self.compiler.compile_json_schema('{"type": "object"}', any_whitespace=False,
                                                             strict_mode=False)
            else:
                compiled = self.compiler.compile_json_schema(params.json, any_whitespace=False)
        except RuntimeError as e:
            raise ValueError(f"structured_outputs.json is not a usable JSON schema: {_first_line(e)}") from None
        stops = sorted(set(self.stop_token_ids) | set(extra_stop_token_ids))
        return GrammarState(xgr.GrammarMatcher(compiled, override_stop_tokens=stops))

    def mask(self, logits: torch.Tensor, states: Sequence[GrammarState | None]) -> None:
        """logits [M, V] fp32, in place: each constrained row's forbidden tokens to -inf."""
        rows = [i for i, s in enumerate(states) if s is not None]
        if not rows:
            return
        bitmask = xgr.allocate_token_bitmask(len(states), self.vocab_size)  # [M, ceil(V / 32)] int32
        for i in rows:
            states[i].matcher.fill_next_token_bitmask(bitmask, i)
        xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device), vocab_size=self.vocab_size, indices=rows)


def _first_line(e: BaseException) -> str:
    """xgrammar's message without its C++ source location."""
    text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return text.split(": ", 1)[1] if text.startswith("[") and ": " in text else text
