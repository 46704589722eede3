"""Engine logprobs -> the two OpenAI shapes: the legacy completions block {tokens, token_logprobs,
top_logprobs, text_offset} (what lm-eval's loglikelihood reads) and the chat `content` list. Tokens
are named by their text (`token_text`), as OpenAI and vLLM name them."""

from __future__ import annotations

import math
from collections.abc import Sequence

from k3ray.engine.outputs import PositionLogprobs
from k3ray.tokenizer import IncrementalDetokenizer

LOGPROB_FLOOR = -9999.0  # JSON has no -inf


def token_text(tokenizer, token_id: int) -> str:
    """A token as OpenAI's logprobs name it (vLLM's rule too): its text; a special token's name; for
    bytes that are no whole UTF-8 text (part of a character), `bytes:` and each byte as `\\xNN`."""
    piece = tokenizer.token_piece(token_id)
    if isinstance(piece, str):
        return piece
    try:
        return piece.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in piece)


def clean(logprob: float) -> float:
    return LOGPROB_FLOOR if math.isnan(logprob) else max(logprob, LOGPROB_FLOOR)


class CompletionLogprobs:
    """Accumulates one choice's legacy logprobs block; `add` returns only the new part, so one
    instance serves a whole response or every chunk of a stream. text_offset counts characters of
    the choice's text (the echoed prompt first, when echoed)."""

    def __init__(self, tokenizer, skip_special_tokens: bool) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._detok = IncrementalDetokenizer(tokenizer, skip_special_tokens)
        self._offset = 0

    def add_prompt(self, ids: Sequence[int], entries: Sequence[PositionLogprobs | None]) -> dict:
        """Echoed prompt tokens: their text is never skipped (it is the prompt as given)."""
        detok = IncrementalDetokenizer(self.tokenizer, skip_special_tokens=False)
        block = self._block(ids, entries, detok)
        self._offset += len(detok.flush())
        return block

    def add(self, ids: Sequence[int], entries: Sequence[PositionLogprobs | None]) -> dict:
        return self._block(ids, entries, self._detok)

    def _block(self, ids: Sequence[int], entries: Sequence[PositionLogprobs | None], detok) -> dict:
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for token_id, entry in zip(ids, entries):
            out["tokens"].append(token_text(self.tokenizer, token_id))
            # a character split over tokens counts at the token that completes it
            out["text_offset"].append(self._offset)
            self._offset += len(detok.push(token_id))
            if entry is None:
                out["token_logprobs"].append(None)
                out["top_logprobs"].append(None)
                continue
            out["token_logprobs"].append(clean(entry[token_id].logprob))
            top = sorted(entry.items(), key=lambda kv: kv[1].rank)
            out["top_logprobs"].append({token_text(self.tokenizer, t): clean(lp.logprob) for t, lp in top})
        return out


def merge_blocks(a: dict | None, b: dict) -> dict:
    if a is None:
        return b
    return {key: a[key] + b[key] for key in a}


def chat_logprobs(tokenizer, ids: Sequence[int], entries: Sequence[PositionLogprobs], top_n: int) -> list[dict]:
    """The chat `logprobs.content` list: one item per generated token with its top_n alternatives."""
    content = []
    for token_id, entry in zip(ids, entries):
        ranked = [(t, lp) for t, lp in sorted(entry.items(), key=lambda kv: kv[1].rank) if lp.rank <= top_n]
        content.append({**_chat_token(tokenizer, token_id, entry[token_id].logprob),
                        "top_logprobs": [_chat_token(tokenizer, t, lp.logprob) for t, lp in ranked[:top_n]]})
    return content


def _chat_token(tokenizer, token_id: int, logprob: float) -> dict:
    piece = tokenizer.token_piece(token_id)
    raw = piece if isinstance(piece, bytes) else piece.encode()
    return {"token": token_text(tokenizer, token_id), "logprob": clean(logprob), "bytes": list(raw)}


def prompt_logprobs_field(tokenizer, ids: Sequence[int], entries: Sequence[PositionLogprobs | None]) -> list:
    """vLLM's `prompt_logprobs`: per prompt position None or {token id: {logprob, rank, decoded_token}}."""
    out: list = []
    for entry in entries:
        if entry is None:
            out.append(None)
            continue
        out.append({str(t): {"logprob": clean(lp.logprob), "rank": lp.rank, "decoded_token": token_text(tokenizer, t)}
                    for t, lp in entry.items()})
    return out
