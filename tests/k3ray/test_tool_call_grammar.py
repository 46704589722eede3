"""Tool-call grammars (StructuredOutputsParams.tool_calls) in the engine: the mask allows the marker
tokens exactly where the section has them and nowhere inside JSON, and the random micro model's
constrained outputs are call sections whose arguments match the called function's schema."""

import json

import jsonschema
import pytest
import torch

from k3ray.engine import SamplingParams
from k3ray.engine.structured.structured_output import StructuredOutputs, encoded_vocab
from k3ray.sampling_params import StructuredOutputsParams, ToolCallsFormat
from k3ray.tokenizer import ByteTokenizer
from k3ray.tokenizer.tool_calls import SpecialTokens, ToolCallParser, marker_ids

TOK = ByteTokenizer(512)
MARKERS = marker_ids(TOK)
SECTION_BEGIN, CALL_BEGIN, ARGUMENT_BEGIN, CALL_END, SECTION_END = MARKERS
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 4},
                                            "unit": {"enum": ["c", "f"]}}, "required": ["city", "unit"]}
COUNT = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["n"]}
SCHEMAS = {"get_weather": WEATHER, "count": COUNT}


def tool_params(parallel: bool = True, **kw) -> SamplingParams:
    fmt = ToolCallsFormat(tuple(SCHEMAS.items()), MARKERS, parallel)
    return SamplingParams(structured_outputs=StructuredOutputsParams(tool_calls=fmt), skip_special_tokens=False, **kw)


def allowed(grammars: StructuredOutputs, state) -> list[int]:
    logits = torch.zeros(1, 512)
    grammars.mask(logits, [state])
    return torch.isfinite(logits[0]).nonzero().flatten().tolist()


def test_the_mask_allows_marker_tokens_only_where_the_section_has_them():
    grammars = StructuredOutputs(encoded_vocab(TOK, 512), TOK.stop_token_ids)
    state = grammars.new_state(grammars.compile(tool_params(parallel=True).structured_outputs))
    assert allowed(grammars, state) == [SECTION_BEGIN]
    state.accept(SECTION_BEGIN)
    assert allowed(grammars, state) == [CALL_BEGIN]
    for token in [CALL_BEGIN, *b"functions.count:1"]:
        state.accept(token)
    assert allowed(grammars, state) == [*b"0123456789", ARGUMENT_BEGIN]  # more index digits, or the arguments
    for token in [ARGUMENT_BEGIN, *b'{"n": ']:
        state.accept(token)
    assert allowed(grammars, state) == list(b"0123456789")
    state.accept(ord("7"))
    assert allowed(grammars, state) == [ord("}")]
    state.accept(ord("}"))
    assert allowed(grammars, state) == [CALL_END]
    state.accept(CALL_END)
    assert allowed(grammars, state) == [SECTION_END, CALL_BEGIN]  # parallel: another call, or the end
    state.accept(SECTION_END)
    assert allowed(grammars, state) == sorted(TOK.stop_token_ids)


def test_no_special_token_is_allowed_inside_a_string_argument():
    grammars = StructuredOutputs(encoded_vocab(TOK, 512), TOK.stop_token_ids)
    state = grammars.new_state(grammars.compile(tool_params().structured_outputs))
    for token in [SECTION_BEGIN, CALL_BEGIN, *b"functions.get_weather:0", ARGUMENT_BEGIN, *b'{"city": "']:
        state.accept(token)
    inside = allowed(grammars, state)
    assert ord("a") in inside and ord('"') in inside and all(t < 256 for t in inside)


@pytest.mark.parametrize("parallel", [True, False])
def test_constrained_outputs_are_call_sections_with_valid_arguments(micro_llm, parallel):
    """The random model may go on calling until max_tokens (then the calls it finished count)."""
    outputs = micro_llm.generate(["Call a tool:"], tool_params(parallel, n=3, seed=11, max_tokens=250))[0].outputs
    for c in outputs:
        assert c.finish_reason == "stop" or (parallel and c.finish_reason == "length"), c.text
        assert c.text.startswith(TOK.decode([SECTION_BEGIN]))
        assert c.text.endswith(TOK.decode([SECTION_END])) == (c.finish_reason == "stop")
        parsed = ToolCallParser.parse(c.text, SpecialTokens.of(TOK))
        assert len(parsed.tool_calls) >= 1
        assert parallel or len(parsed.tool_calls) == 1
        assert parsed.content == "" or c.finish_reason == "length"  # the unfinished call
        for call in parsed.tool_calls:
            jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])


def test_a_functions_bad_schema_is_refused_naming_the_function(micro_llm):
    fmt = ToolCallsFormat((("ok", COUNT), ("broken", {"type": "objectx"})), MARKERS)
    with pytest.raises(ValueError, match=r"structured_outputs.tool_calls\['broken'\].parameters is not a usable"):
        micro_llm.generate(["x"], SamplingParams(structured_outputs=StructuredOutputsParams(tool_calls=fmt)))


@pytest.mark.parametrize("functions, markers, match", [
    ((), MARKERS, "at least one function"),
    ((("a b", COUNT),), MARKERS, "does not match"),
    ((("f", COUNT), ("f", WEATHER)), MARKERS, "share one name"),
    ((("f", COUNT),), MARKERS[:4], "5 distinct token ids"),
    ((("f", 3),), MARKERS, "must be a JSON schema"),
])
def test_bad_tool_call_formats_are_refused(functions, markers, match):
    with pytest.raises(ValueError, match=match):
        ToolCallsFormat(functions, markers)


def test_markers_outside_the_vocabulary_are_refused():
    params = tool_params()
    with pytest.raises(ValueError, match="outside the vocabulary"):
        params.validate(vocab_size=260, max_model_len=512)
