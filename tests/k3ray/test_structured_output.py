"""Structured outputs (xgrammar): the vocabulary k3ray hands xgrammar, the token mask, and the
random micro model, whose unconstrained output is never JSON, producing output that parses and
matches the schema (n > 1, streaming, speculative decoding on), or stopping with "length"."""

import asyncio
import json

import jsonschema
import pytest
import torch

from k3ray.engine import LLM, AsyncEngine, EngineConfig, LLMEngine, LocalExecutor, SamplingParams
from k3ray.engine.config import SpeculativeConfig
from k3ray.engine.structured.structured_output import StructuredOutputs, encoded_vocab
from k3ray.sampling_params import StructuredOutputsParams
from k3ray.tokenizer import ByteTokenizer

SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0, "maximum": 99},
                   "tag": {"enum": ["red", "green"]}},
    "required": ["ok", "n", "tag"],
    "additionalProperties": False,
}


def schema_params(**kw) -> SamplingParams:
    return SamplingParams(structured_outputs=StructuredOutputsParams(json=SCHEMA), **kw)


def test_vocab_is_the_tokenizers_bytes_with_specials_as_no_text():
    tok = ByteTokenizer(512)
    vocab = encoded_vocab(tok, 520)
    assert vocab[:256] == [bytes([b]) for b in range(256)]
    # specials, reserved ids and ids past the tokenizer: a NUL byte no strict JSON holds, then the id
    assert vocab[256:] == [b"\x00k3ray-special-%d" % i for i in range(256, 520)]


def test_the_mask_allows_exactly_the_grammars_next_tokens():
    tok = ByteTokenizer(512)
    grammars = StructuredOutputs(encoded_vocab(tok, 512), tok.stop_token_ids)
    state = grammars.new_state(grammars.compile(StructuredOutputsParams(json={"type": "boolean"})))
    logits = torch.zeros(2, 512)
    grammars.mask(logits, [None, state])
    assert torch.isfinite(logits[1]).nonzero().flatten().tolist() == [ord("f"), ord("t")]
    assert torch.equal(logits[0], torch.zeros(512))  # an unconstrained row is untouched
    for token in b"true":
        state.accept(token)
    logits = torch.zeros(1, 512)
    grammars.mask(logits, [state])
    assert torch.isfinite(logits[0]).nonzero().flatten().tolist() == sorted(tok.stop_token_ids)


def test_unconstrained_output_is_not_json(micro_llm):
    out = micro_llm.generate(["{"], SamplingParams(seed=0, n=3, max_tokens=40))[0]
    for c in out.outputs:
        with pytest.raises(json.JSONDecodeError):
            json.loads(c.text)


def test_json_schema_outputs_parse_and_validate(micro_llm):
    out = micro_llm.generate(["Answer:"], schema_params(n=3, seed=5, max_tokens=60, temperature=1.0))[0]
    for c in out.outputs:
        assert c.finish_reason == "stop", c.text
        jsonschema.validate(json.loads(c.text), SCHEMA)
    greedy = micro_llm.generate(["Answer:"], schema_params(temperature=0, max_tokens=60))[0].outputs[0]
    jsonschema.validate(json.loads(greedy.text), SCHEMA)


def test_json_object_outputs_parse(micro_llm):
    params = SamplingParams(n=2, seed=2, max_tokens=250, structured_outputs=StructuredOutputsParams(json_object=True))
    objects = [json.loads(c.text) for c in micro_llm.generate(["Hi"], params)[0].outputs]
    assert all(isinstance(o, dict) for o in objects) and all(objects)  # two non-empty objects


def test_max_tokens_before_the_json_closes_is_length(micro_llm):
    c = micro_llm.generate(["Answer:"], schema_params(seed=5, max_tokens=4))[0].outputs[0]
    assert c.finish_reason == "length" and len(c.token_ids) == 4 and c.text.startswith('{"')


def test_speculative_decoding_leaves_constrained_sequences_alone(micro_model):
    spec = LLM(micro_model, ByteTokenizer(512), num_blocks=64, block_size=8, speculative=SpeculativeConfig("ngram", 3))
    for c in spec.generate(["Answer:"], schema_params(n=2, seed=5, max_tokens=60))[0].outputs:
        jsonschema.validate(json.loads(c.text), SCHEMA)
    assert spec.get_stats().spec_draft_tokens == 0


def test_streamed_constrained_output_grows_into_valid_json(micro_model):
    engine = AsyncEngine(LLMEngine(LocalExecutor(micro_model), EngineConfig(num_blocks=64, block_size=8),
                                   ByteTokenizer(512)))

    async def run() -> list[str]:
        texts = []
        async for out in engine.generate("Answer:", schema_params(seed=5, max_tokens=60), "r0"):
            texts.append(out.outputs[0].text)
        await engine.shutdown()
        return texts

    texts = asyncio.run(run())
    assert len(texts) > 1 and all(b.startswith(a) for a, b in zip(texts, texts[1:]))
    jsonschema.validate(json.loads(texts[-1]), SCHEMA)


@pytest.mark.parametrize("kwargs, match", [
    ({"structured_outputs": StructuredOutputsParams(json={"type": "objectx"})}, "not a usable JSON schema"),
    ({"structured_outputs": StructuredOutputsParams(json="{not json")}, "not a usable JSON schema"),
    ({"structured_outputs": StructuredOutputsParams(json_object=True), "ignore_eos": True}, "ignore_eos"),
])
def test_bad_structured_outputs_are_refused(micro_llm, kwargs, match):
    with pytest.raises(ValueError, match=match):
        micro_llm.generate(["x"], SamplingParams(**kwargs))


def test_structured_outputs_params_need_exactly_one_kind():
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams()
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams(json=SCHEMA, json_object=True)


def test_k3s_free_reasoning_may_hold_newlines_but_its_json_never_a_control_character():
    """A grammar that starts in K3's think channel (StructuredOutputsParams.free_text) lets the reasoning
    write newlines; the JSON answer after it is still strict (its grammar allows no raw control byte)."""
    from k3ray.sampling_params import XtmlMessage
    from k3ray.tokenizer.xtml_output import xtml_marker_ids

    tok = ByteTokenizer(512, "kimi_k3_xtml")
    outputs = StructuredOutputs(encoded_vocab(tok, 512), tok.stop_token_ids)
    for thinking in (True, False):
        params = StructuredOutputsParams(json={"type": "object", "properties": {"a": {"type": "string"}}},
                                         xtml=XtmlMessage(xtml_marker_ids(tok), thinking))
        assert params.free_text == thinking
        state = outputs.new_state(outputs.compile(params), strict=not params.free_text)
        logits = torch.zeros(1, 512)
        outputs.mask(logits, [state])
        assert (logits[0, ord("\n")] == 0) == thinking  # the reasoning may start a new line
        prefix = 'a\nb<|close|>think<|sep|><|open|>response<|sep|>' if thinking else ""
        for i in tok.encode(prefix + '{"a": "x', allow_special=True):
            state.accept(i)
        logits = torch.zeros(1, 512)
        outputs.mask(logits, [state])
        assert logits[0, ord("\n")] == float("-inf") and logits[0, ord("y")] == 0  # inside the JSON string
    strict = outputs.new_state(outputs.compile(StructuredOutputsParams(json_object=True)))
    logits = torch.zeros(1, 512)
    outputs.mask(logits, [strict])
    assert logits[0, ord("\n")] == float("-inf")
