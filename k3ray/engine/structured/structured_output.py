"""Grammar-constrained sampling with xgrammar (what vLLM, SGLang and TensorRT-LLM use).

`StructuredOutputs` holds the vocabulary as xgrammar sees it: the grammar worker compiles
grammars with it (grammar_compiler.py runs that off the engine's step), the engine turns each
compiled grammar into one `GrammarState` per constrained sequence (a matcher over the tokens it
has accepted). Each step the rows of constrained sequences get their grammar's token mask
(forbidden tokens to -inf) before sampling. A finished grammar allows only the stop tokens, so
the output ends with "stop"; max_tokens reached first ends it with "length", as in vLLM.

Every output is strict JSON (RFC 8259): `build_grammar` writes patterns and bounded strings
itself (strict_json.py), and the mask never allows a token holding a control byte (U+0000-U+001F),
which compact JSON has nowhere (outside strings there is no whitespace but " ", inside them a
control character is escaped), whatever the grammar engine would allow.

JSON is generated without free whitespace between tokens (xgrammar's `any_whitespace=False`):
models otherwise can emit whitespace until max_tokens. Special and reserved tokens match no text:
xgrammar sees each as a piece starting with a NUL byte, which no strict-JSON text holds, so one is
allowed only where a grammar names its id (`Token(id)`: the markers of a tool-call section) or as a
stop token at the grammar's end.

A tool-call grammar (StructuredOutputsParams.tool_calls) is an xgrammar structural tag: K2's
section markers around one call (or several) of the given functions, or K3's XTML message from
where the prompt left it (reasoning, then the tools channel); each call's arguments are the
strict-JSON grammar of that function's parameters.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence

import torch
import xgrammar as xgr
from xgrammar import structural_tag as tag

from k3ray.sampling_params import StructuredOutputsParams, ToolCallsFormat, XtmlMessage, tool_schema_field
from k3ray.strict_json import FIELD, checked_schema, schema_with_placeholders, splice

ANY_OBJECT = '{"type": "object"}'
CALL_INDEX = "0|[1-9][0-9]{0,3}"  # the INDEX of functions.NAME:INDEX
XTML_CALL_INDEX = "[1-9][0-9]{0,3}"  # K3 numbers calls from 1
FREE_TEXT = "[^\\x00]*"  # reasoning: any text, no special token (xgrammar sees those as NUL-led pieces)
SPECIAL_PREFIX = b"\x00k3ray-special-"  # + the id: what xgrammar sees for a special id


def build_grammar(params: StructuredOutputsParams, max_schema_bytes: int | None = None) -> xgr.Grammar:
    """The strict-JSON grammar of params (no vocabulary needed); ValueError if there is none."""
    if params.tool_calls is not None:
        return _tool_calls_grammar(params, max_schema_bytes)
    if params.json_object:  # any object (strict_mode=False: a bare {"type": "object"} would otherwise allow only {})
        ebnf = _json_ebnf(ANY_OBJECT, [], False, FIELD)
    else:
        schema, patterns = schema_with_placeholders(checked_schema(params.json, max_schema_bytes))
        ebnf = _json_ebnf(json.dumps(schema), patterns, True, FIELD)
    try:
        if params.xtml is not None:
            answer = [tag.GrammarFormat(grammar=ebnf), *_xtml_element(params.xtml, CLOSE, "response")]
            return xgr.Grammar.from_structural_tag(tag.StructuralTag(format=_xtml_message(params.xtml, answer)))
        return xgr.Grammar.from_ebnf(ebnf)
    except RuntimeError as e:
        raise ValueError(f"{FIELD} is not a usable JSON schema: {_first_line(e)}") from None


def _json_ebnf(schema: str, patterns: list[str], strict: bool, field: str) -> str:
    """The EBNF of a schema's JSON text (with schema_with_placeholders's patterns put back)."""
    try:
        converted = xgr.Grammar.from_json_schema(schema, any_whitespace=False, strict_mode=strict)
    except RuntimeError as e:
        raise ValueError(f"{field} is not a usable JSON schema: {_first_line(e)}") from None
    return splice(str(converted), patterns)


def _tool_calls_grammar(params: StructuredOutputsParams, max_schema_bytes: int | None) -> xgr.Grammar:
    tool_calls = params.tool_calls
    if not tool_calls.markers and params.xtml is None:
        raise ValueError("structured_outputs.tool_calls without K2's markers needs structured_outputs.xtml: where in "
                         "K3's message the calls go")
    arguments = {}
    for name, text in tool_calls.functions:
        field = tool_schema_field(name)
        schema, patterns = schema_with_placeholders(checked_schema(text, max_schema_bytes, field))
        arguments[name] = tag.GrammarFormat(grammar=_json_ebnf(json.dumps(schema), patterns, True, field))
    section = _k2_section(tool_calls, arguments) if params.xtml is None else \
        _xtml_message(params.xtml, _xtml_tools(params.xtml, tool_calls, arguments))
    try:
        return xgr.Grammar.from_structural_tag(tag.StructuralTag(format=section))
    except RuntimeError as e:
        raise ValueError(f"structured_outputs.tool_calls: no grammar for the section: {_first_line(e)}") from None


def _k2_section(tool_calls: ToolCallsFormat, arguments: dict) -> tag.Format:
    section_begin, call_begin, argument_begin, call_end, section_end = tool_calls.markers
    calls = [tag.SequenceFormat(elements=[
        tag.TokenFormat(token=call_begin), tag.ConstStringFormat(value=f"functions.{name}:"),
        tag.RegexFormat(pattern=CALL_INDEX), tag.TokenFormat(token=argument_begin), grammar,
        tag.TokenFormat(token=call_end)]) for name, grammar in arguments.items()]
    call = calls[0] if len(calls) == 1 else tag.OrFormat(elements=calls)
    return tag.SequenceFormat(elements=[
        tag.TokenFormat(token=section_begin), tag.PlusFormat(content=call) if tool_calls.parallel else call,
        tag.TokenFormat(token=section_end)])


OPEN, CLOSE, SEP = range(3)  # K3's markers, by their place in XtmlMessage.markers


def _xtml_element(message: XtmlMessage, marker: int, header: str) -> list[tag.Format]:
    """`<|open|>header<|sep|>` or `<|close|>header<|sep|>` as structural-tag pieces."""
    return [tag.TokenFormat(token=message.markers[marker]), tag.ConstStringFormat(value=header),
            tag.TokenFormat(token=message.markers[SEP])]


def _xtml_message(message: XtmlMessage, body: list[tag.Format]) -> tag.Format:
    """The rest of K3's assistant message: [free reasoning, think closed, response opened], `body`
    (which closes the response channel), the message closed."""
    head = [tag.RegexFormat(pattern=FREE_TEXT), *_xtml_element(message, CLOSE, "think"),
            *_xtml_element(message, OPEN, "response")] if message.thinking else []
    return tag.SequenceFormat(elements=[*head, *body, *_xtml_element(message, CLOSE, "message")])


def _xtml_tools(message: XtmlMessage, tool_calls: ToolCallsFormat, arguments: dict) -> list[tag.Format]:
    """An empty response closed, then the tools channel of calls with a json block each."""
    def element(marker: int, header: str) -> list[tag.Format]:
        return _xtml_element(message, marker, header)

    calls = [tag.SequenceFormat(elements=[
        tag.TokenFormat(token=message.markers[OPEN]), tag.ConstStringFormat(value=f'call tool="{name}" index="'),
        tag.RegexFormat(pattern=XTML_CALL_INDEX), tag.ConstStringFormat(value='"'),
        tag.TokenFormat(token=message.markers[SEP]), *element(OPEN, 'json type="object"'), grammar,
        *element(CLOSE, "json"), *element(CLOSE, "call")]) for name, grammar in arguments.items()]
    call = calls[0] if len(calls) == 1 else tag.OrFormat(elements=calls)
    return [*element(CLOSE, "response"), *element(OPEN, "tools"),
            tag.PlusFormat(content=call) if tool_calls.parallel else call, *element(CLOSE, "tools")]


def check_grammar(params: StructuredOutputsParams, max_schema_bytes: int | None = None) -> None:
    """Raise ValueError if the schema cannot be turned into a grammar (no vocabulary needed)."""
    build_grammar(params, max_schema_bytes)


def encoded_vocab(tokenizer, vocab_size: int) -> list[bytes]:
    """Each id's bytes; SPECIAL_PREFIX + id for special and reserved ids (and ids past the tokenizer's
    vocabulary): never part of the text a grammar matches, only of its Token(id)s."""
    vocab = [SPECIAL_PREFIX + str(token_id).encode() for token_id in range(vocab_size)]
    for token_id in range(min(vocab_size, tokenizer.vocab_size)):
        piece = tokenizer.token_piece(token_id)
        if isinstance(piece, bytes):
            vocab[token_id] = piece
    return vocab


class GrammarState:
    """One sequence's matcher: which tokens may come next, advanced by each accepted token."""

    def __init__(self, matcher: xgr.GrammarMatcher, strict: bool = True) -> None:
        """strict: no token holding a control byte, whatever the grammar allows (off for K3's free reasoning)."""
        self.matcher = matcher
        self.strict = strict

    def accept(self, token: int) -> None:
        accepted = self.matcher.accept_token(token)
        assert accepted, f"token {token} was sampled outside the grammar's mask"

    @property
    def terminated(self) -> bool:
        return self.matcher.is_terminated()


class StructuredOutputs:
    def __init__(self, vocab: list[bytes], stop_token_ids: Iterable[int]) -> None:
        """vocab: encoded_vocab(tokenizer, vocab_size)."""
        self.vocab_size = len(vocab)
        self.stop_token_ids = sorted(stop_token_ids)
        self.info = xgr.TokenizerInfo(vocab, xgr.VocabType.RAW, vocab_size=self.vocab_size,
                                      stop_token_ids=self.stop_token_ids)
        self.strict_tokens = _bitmask([_is_special(piece) or not any(b < 0x20 for b in piece)
                                       for piece in vocab])  # [ceil(V / 32)] int32
        self._compiler: xgr.GrammarCompiler | None = None

    def compile(self, params: StructuredOutputsParams) -> xgr.CompiledGrammar:
        """Compile here and now (the grammar worker's job; seconds to minutes for a large schema)."""
        if self._compiler is None:
            self._compiler = xgr.GrammarCompiler(self.info, max_threads=1, cache_enabled=False)
        grammar = build_grammar(params)
        try:
            return self._compiler.compile_grammar(grammar)
        except RuntimeError as e:
            raise ValueError(f"{params.field} could not be compiled: {_first_line(e)}") from None

    def deserialize(self, text: str) -> xgr.CompiledGrammar:
        """A grammar the worker compiled (CompiledGrammar.serialize_json) over this vocabulary."""
        return xgr.CompiledGrammar.deserialize_json(text, self.info)

    def new_state(self, compiled: xgr.CompiledGrammar, extra_stop_token_ids: Sequence[int] = (),
                  strict: bool = True) -> GrammarState:
        """A fresh matcher; the grammar may end with the engine's stop tokens or the request's.
        strict=False lets control bytes through where the grammar does (StructuredOutputsParams.free_text)."""
        stops = sorted(set(self.stop_token_ids) | set(extra_stop_token_ids))
        return GrammarState(xgr.GrammarMatcher(compiled, override_stop_tokens=stops), strict)

    def mask(self, logits: torch.Tensor, states: Sequence[GrammarState | None]) -> None:
        """logits [M, V] fp32, in place: each constrained row's forbidden tokens to -inf, and in a
        strict row every token holding a control byte (a row that would have no token left keeps its
        grammar's mask, so no step fails on it; build_grammar's grammars never get there)."""
        rows = [i for i, s in enumerate(states) if s is not None]
        if not rows:
            return
        bitmask = xgr.allocate_token_bitmask(len(states), self.vocab_size)  # [M, ceil(V / 32)] int32
        for i in rows:
            states[i].matcher.fill_next_token_bitmask(bitmask, i)
        grammar = bitmask[rows]  # [R, W]
        strict_rows = torch.tensor([states[i].strict for i in rows]).unsqueeze(1)  # [R, 1]
        strict = torch.where(strict_rows, grammar & self.strict_tokens, grammar)
        stuck = (strict == 0).all(dim=1, keepdim=True)  # [R, 1]
        bitmask[rows] = torch.where(stuck, grammar, strict)
        xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device), vocab_size=self.vocab_size, indices=rows)


def _is_special(piece: bytes) -> bool:
    return piece.startswith(SPECIAL_PREFIX)


def _bitmask(allowed: list[bool]) -> torch.Tensor:
    """[V] bools -> xgrammar's packed token bitmask [ceil(V / 32)] int32 (token 32 w + b is bit b of word w)."""
    words = (len(allowed) + 31) // 32
    bits = torch.zeros(words * 32, dtype=torch.int64)
    bits[: len(allowed)] = torch.tensor(allowed, dtype=torch.int64)
    packed = (bits.view(words, 32) << torch.arange(32)).sum(dim=1)  # [W] in [0, 2^32)
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)


def _first_line(e: BaseException) -> str:
    """xgrammar's message without its C++ source location."""
    text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return text.split(": ", 1)[1] if text.startswith("[") and ": " in text else text
