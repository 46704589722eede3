"""Strict JSON from structured outputs: patterns written as EBNF over the JSON text (quotes,
backslashes and control characters only escaped), the control-byte mask, and hypothesis-generated
schemas over the random default model, whose every output that stops parses with `json.loads` and
validates against its schema with `jsonschema`."""

import json

import jsonschema
import pytest
import torch
import xgrammar as xgr
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from k3ray.engine import LLM, SamplingParams, StructuredOutputsParams
from k3ray.engine.structured.structured_output import StructuredOutputs, encoded_vocab
from k3ray.strict_json import checked_schema
from k3ray.tokenizer import ByteTokenizer

EXAMPLES = 8  # x 4 schemas x 2 samples, about 30 s on 2 shared cores
MAX_TOKENS = 200


@pytest.fixture(scope="module")
def outputs():
    tok = ByteTokenizer(512)
    return StructuredOutputs(encoded_vocab(tok, 512), tok.stop_token_ids)


@pytest.fixture(scope="module")
def tiny_llm(tiny_checkpoint):
    return LLM(tiny_checkpoint)


def accepts(outputs: StructuredOutputs, compiled, text: str) -> bool:
    """Whether the grammar takes text, byte token by byte token, and then ends."""
    state = outputs.new_state(compiled)
    for byte in text.encode():
        if not state.matcher.accept_token(byte):
            return False
    return state.matcher.accept_token(outputs.stop_token_ids[0]) and state.terminated


def string_schema(**kw) -> StructuredOutputsParams:
    return StructuredOutputsParams(json={"type": "string", **kw})


@pytest.mark.parametrize("pattern, value", [
    ('^a"b$', 'a"b'), (r"^\\$", "\\"), (r"^\n\t$", "\n\t"), (r"^[\x00-\x1f]{2}$", "\x00\x1f"), ("^.$", "é"),
    (r"^\s$", "\u3000"), (r"^\s$", "\t"), (r"^\d{3}$", "123"), (r'^(?:ab|\\|")+$', 'ab\\"'), (r"^[^a]$", '"'),
    ("^[é-ê]😀$", "ê😀"), (r"^\w+@\w+\.com$", "k3@ray.com"), ("x", "x"), (r"\Aq\Z", "q"), (r"^\x7f$", "\x7f"),
])
def test_a_pattern_takes_its_strings_json_escaped_and_never_raw(outputs, pattern, value):
    compiled = outputs.compile(string_schema(pattern=pattern))
    escaped, raw = json.dumps(value, ensure_ascii=False), f'"{value}"'
    assert accepts(outputs, compiled, escaped), escaped
    try:
        json.loads(raw)
    except json.JSONDecodeError:  # the value written raw is no (strict) JSON: refused
        assert not accepts(outputs, compiled, raw)


def test_latin_1_characters_before_hex_digits_stay_themselves(outputs):
    """xgrammar prints é as \\xe9, which its own parser reads on into "\\xe9a" = U+0E9A (found by the
    hypothesis test below: const "éa" gave "ບ")."""
    compiled = outputs.compile(StructuredOutputsParams(json={"enum": ["éa", "ÿf0", "kÀ"]}))
    for value in ("éa", "ÿf0", "kÀ"):
        assert accepts(outputs, compiled, json.dumps(value, ensure_ascii=False))
    assert not accepts(outputs, compiled, '"ບ"')


@pytest.mark.parametrize("params, prefix", [
    (string_schema(maxLength=1), b'"'), (string_schema(), b'"'), (string_schema(pattern="^[^a]$"), b'"'),
    (StructuredOutputsParams(json_object=True), b'{"'),
    (StructuredOutputsParams(json={"type": "object", "additionalProperties": {"type": "string"}}), b'{"k": "'),
])
def test_strings_take_no_surrogate_bytes(outputs, params, prefix):
    """A surrogate's UTF-8-like bytes (ED A0-BF ..) are no UTF-8: xgrammar's negated classes took
    them (found by the hypothesis test below: maxLength 1 gave three U+FFFD)."""
    state = outputs.new_state(outputs.compile(params))
    for byte in prefix + b"\xed":
        assert state.matcher.accept_token(byte)
    logits = torch.zeros(1, 512)
    outputs.mask(logits, [state])
    assert torch.isfinite(logits[0]).nonzero().flatten().tolist() == list(range(0x80, 0xA0))


def test_bounded_strings_take_no_raw_control_character(outputs):
    compiled = outputs.compile(string_schema(minLength=1, maxLength=3))
    assert accepts(outputs, compiled, '"é😀x"') and not accepts(outputs, compiled, '"é😀xy"')
    for raw in ("\t", "\x00", "\x1f"):
        assert not accepts(outputs, compiled, f'"{raw}"')


@pytest.mark.parametrize("schema, match", [
    ({"type": "string", "pattern": "(?=a)a"}, "lookaround"), ({"type": "string", "pattern": r"(a)\1"}, "backreference"),
    ({"type": "string", "pattern": "(?i)a"}, "case-insensitive"), ({"type": "string", "pattern": r"a\b"}, "anchor"),
    ({"type": "string", "pattern": "a^b"}, "anchor"), ({"type": "string", "pattern": "[^\\s\\S]"}, "matches nothing"),
    ({"type": "string", "pattern": "(unclosed"}, "not a regular expression"),
    ({"type": "string", "pattern": "^a+$", "maxLength": 3}, "minLength / maxLength"),
    ({"properties": {"p": {"type": "string", "pattern": "^a{2}$", "minLength": 3}}}, "minLength / maxLength"),
    ([1], "an object or a boolean"),
])
def test_patterns_a_grammar_cannot_enforce_are_refused_without_xgrammar(schema, match):
    with pytest.raises(ValueError, match=match):
        checked_schema(json.dumps(schema))


def test_a_schema_may_hold_the_placeholder_text(outputs):
    compiled = outputs.compile(StructuredOutputsParams(json={"enum": ["^k3raypattern0$", "k3raypattern"]}))
    assert accepts(outputs, compiled, '"^k3raypattern0$"')


def test_length_bounds_a_pattern_implies_are_kept():
    checked_schema(json.dumps({"type": "string", "pattern": "^[a-z]{2,3}$", "minLength": 1, "maxLength": 3}))
    # a property named "pattern" is no pattern
    checked_schema(json.dumps({"properties": {"pattern": {"type": "string", "maxLength": 2}}}))


def test_the_mask_never_allows_a_control_byte(outputs):
    ascii_grammar = xgr.GrammarCompiler(outputs.info).compile_grammar(r"root ::= [\x00-\x7f]")
    logits = torch.zeros(1, 512)
    outputs.mask(logits, [outputs.new_state(ascii_grammar)])
    assert torch.isfinite(logits[0]).nonzero().flatten().tolist() == list(range(0x20, 0x80))
    # a grammar that can only go on with one keeps it rather than leave a row with no token
    newline = xgr.GrammarCompiler(outputs.info).compile_grammar(r'root ::= "\n"')
    logits = torch.zeros(1, 512)
    outputs.mask(logits, [outputs.new_state(newline)])
    assert torch.isfinite(logits[0]).nonzero().flatten().tolist() == [0x0A]


# hypothesis: generated schemas over the random model ------------------------------------------
TEXT = st.text(st.sampled_from(["a", "Z", "é", '"', "\\", "\n", "\t", "\x00", "\x1f", "😀", " ", "/"]), max_size=4)
ATOMS = ["a", "é", '"', r"\\", r"\n", r"\t", r"\x00", "[a-c]", "[^a]", r"\d", r"\w", r"\s", ".", r"[\x00-\x1f]",
         r'[\\"]', "[é-ê]", "😀", r"\.", "/"]
PIECES = st.tuples(st.sampled_from(ATOMS), st.sampled_from(["", "", "?", "{2}", "{0,2}", "{1,3}"])).map("".join)
SEQUENCES = st.lists(PIECES, min_size=1, max_size=3).map("".join)
PATTERNS = st.lists(st.one_of(PIECES, st.lists(SEQUENCES, min_size=2, max_size=3).map(lambda alts: f"(?:{'|'.join(alts)})")),
                    min_size=1, max_size=4).map(lambda parts: "^" + "".join(parts) + "$")


def _bounded_string(low: int, extra: int) -> dict:
    return {"type": "string", "minLength": low, "maxLength": low + extra}


def _object(properties: dict, required: list) -> dict:
    return {"type": "object", "properties": properties, "required": required, "additionalProperties": False}


LEAVES = st.one_of(
    st.builds(_bounded_string, st.integers(0, 3), st.integers(0, 5)),
    PATTERNS.map(lambda p: {"type": "string", "pattern": p}),
    st.lists(st.one_of(TEXT, st.integers(-5, 5), st.booleans(), st.none()), min_size=1, max_size=4,
             unique_by=json.dumps).map(lambda values: {"enum": values}),
    TEXT.map(lambda v: {"const": v}),
    st.builds(lambda low, span: {"type": "integer", "minimum": low, "maximum": low + span},
              st.integers(-300, 300), st.integers(0, 400)),
    st.builds(lambda low, span: {"type": "number", "minimum": low / 4, "maximum": (low + span) / 4},
              st.integers(-40, 40), st.integers(1, 40)),
    st.just({"type": "boolean"}), st.just({"type": "null"}),
)
KEYS = st.text(st.sampled_from(["k", "é", '"', "\\", "\n", "\x01", " "]), min_size=1, max_size=3)


def _nested(children):
    objects = st.dictionaries(KEYS, children, min_size=1, max_size=3).flatmap(
        lambda props: st.lists(st.sampled_from(sorted(props)), unique=True).map(lambda req: _object(props, req)))
    arrays = st.builds(lambda items, low, extra: {"type": "array", "items": items, "minItems": low,
                                                  "maxItems": low + extra},
                       children, st.integers(0, 2), st.integers(0, 2))
    return st.one_of(objects, arrays)


SCHEMAS = st.recursive(LEAVES, _nested, max_leaves=5)
STOPPED: list[int] = []


@settings(max_examples=EXAMPLES, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(schemas=st.lists(SCHEMAS, min_size=4, max_size=4), seed=st.integers(0, 2**16))
def test_generated_schemas_give_strict_json_that_validates(tiny_llm, schemas, seed):
    params = [SamplingParams(n=2, seed=seed + i, max_tokens=MAX_TOKENS,
                             structured_outputs=StructuredOutputsParams(json=schema)) for i, schema in enumerate(schemas)]
    for schema, out in zip(schemas, tiny_llm.generate(["{"] * len(schemas), params)):
        for c in out.outputs:
            assert not any(ch < " " for ch in c.text), (schema, c.text)  # raw control characters, even in a cut one
            if c.finish_reason == "stop":
                jsonschema.validate(json.loads(c.text), schema)  # json.loads is strict: no raw control characters
                STOPPED.append(1)
            else:
                assert c.finish_reason == "length", c.finish_reason


def test_most_generated_outputs_finished():
    """The property above held over outputs that stopped, not only over cut ones."""
    if not STOPPED:
        pytest.skip("run with test_generated_schemas_give_strict_json_that_validates")
    assert len(STOPPED) >= EXAMPLES * 4 * 2 // 2, len(STOPPED)
