"""XtmlOutputParser (k3ray/tokenizer/xtml_output.py) on hand-written K3 XTML outputs.

The output shapes follow docs/k3-conversation.md ("The output": the release encoder's element forms, and vLLM's
KimiK3ReasoningParser / KimiK3ToolParser behaviour: only fully closed calls are emitted, attribute escapes undone,
"string" arguments raw and other types JSON-decoded with the raw text kept when it does not decode)."""

import json

import pytest

from k3ray.tokenizer import ByteTokenizer
from k3ray.tokenizer.tool_calls import ParsedDelta, SpecialTokens
from k3ray.tokenizer.xtml_output import XtmlOutputParser

REASONING = "Let me work out 6 × 7 — that's 42 🙂."
TWO_CALLS = (
    'I should call two tools.<|close|>think<|sep|>'
    '<|open|>response<|sep|>Checking both.<|close|>response<|sep|>'
    '<|open|>tools<|sep|>'
    '<|open|>call tool="get_weather" index="1"<|sep|>'
    '<|open|>argument key="city" type="string"<|sep|>São Paulo<|close|>argument<|sep|>'
    '<|open|>argument key="days" type="number"<|sep|>3<|close|>argument<|sep|>'
    '<|close|>call<|sep|>'
    '<|open|>call tool="calculate" index="2"<|sep|>'
    '<|open|>argument key="options" type="object"<|sep|>{"exact": true, "digits": [1, 2]}<|close|>argument<|sep|>'
    '<|open|>argument key="expression" type="string"<|sep|>6 * 7<|close|>argument<|sep|>'
    '<|close|>call<|sep|>'
    '<|close|>tools<|sep|><|close|>message<|sep|>'
)
MARKUP = ("<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>", "think<|", "response<|", "call<|", "tools<|")


def calls_of(parser):
    return [(call.index, call.name, json.loads(call.arguments)) for call in parser.calls]


def assert_no_markup(delta):
    for text in (delta.content, delta.reasoning):
        assert not any(marker in text for marker in MARKUP), text


def whole(text, **kwargs):
    parser = XtmlOutputParser(**kwargs)
    delta = parser.feed(text).joined(parser.finish())
    return delta, parser


def streamed(pieces, **kwargs):
    parser = XtmlOutputParser(**kwargs)
    delta = ParsedDelta()
    for piece in pieces:
        step = parser.feed(piece)
        assert_no_markup(step)
        delta = delta.joined(step)
    return delta.joined(parser.finish()), parser


def test_reasoning_only_unclosed_think_at_max_tokens():
    delta, parser = whole(REASONING)
    assert delta.reasoning == REASONING
    assert delta.content == "" and not delta.started and parser.calls == []


def test_reasoning_then_response():
    text = REASONING + "<|close|>think<|sep|><|open|>response<|sep|>42<|close|>response<|sep|><|close|>message<|sep|>"
    delta = XtmlOutputParser.parse(text)
    assert (delta.reasoning, delta.content, delta.started, delta.arguments) == (REASONING, "42", [], {})


def test_end_of_msg_after_the_message_is_dropped():
    text = "r<|close|>think<|sep|><|open|>response<|sep|>ok<|close|>response<|sep|><|close|>message<|sep|><|end_of_msg|>"
    delta = XtmlOutputParser.parse(text, specials=SpecialTokens.of(ByteTokenizer(512, "kimi_k3_xtml")))
    assert (delta.reasoning, delta.content) == ("r", "ok")


def test_response_and_two_parallel_calls():
    delta, parser = whole(TWO_CALLS)
    assert delta.reasoning == "I should call two tools."
    assert delta.content == "Checking both."
    assert [(s.index, s.name) for s in delta.started] == [(0, "get_weather"), (1, "calculate")]
    assert [s.id for s in delta.started] == [c.id for c in parser.calls]
    assert len({c.id for c in parser.calls}) == 2
    assert calls_of(parser) == [
        (0, "get_weather", {"city": "São Paulo", "days": 3}),
        (1, "calculate", {"options": {"exact": True, "digits": [1, 2]}, "expression": "6 * 7"}),
    ]
    assert {i: json.loads(a) for i, a in delta.arguments.items()} == {c[0]: c[2] for c in calls_of(parser)}
    assert_no_markup(delta)


@pytest.mark.parametrize("kind, value, decoded", [
    ("string", "42", "42"),  # raw: a string stays a string even when it looks like JSON
    ("string", '{"a": 1}', '{"a": 1}'),
    ("string", "", ""),
    ("string", "  padded\n", "  padded\n"),
    ("number", "42", 42),
    ("number", "1.5", 1.5),
    ("number", "-3e2", -300.0),
    ("integer", "7", 7),  # not emitted by the release encoder; seen in third-party parser tests
    ("boolean", "true", True),
    ("boolean", "false", False),
    ("null", "null", None),
    ("object", '{"k": [1, {"n": null}]}', {"k": [1, {"n": None}]}),
    ("array", '[1, "two", false]', [1, "two", False]),
    ("number", "not json", "not json"),  # does not decode: kept as the string
])
def test_argument_types_decoded(kind, value, decoded):
    text = ('r<|close|>think<|sep|><|open|>tools<|sep|><|open|>call tool="f" index="1"<|sep|>'
            f'<|open|>argument key="x" type="{kind}"<|sep|>{value}<|close|>argument<|sep|>'
            '<|close|>call<|sep|><|close|>tools<|sep|>')
    _, parser = whole(text)
    assert calls_of(parser) == [(0, "f", {"x": decoded})]


def test_argument_without_type_is_a_string():
    text = ('r<|close|>think<|sep|><|open|>tools<|sep|><|open|>call tool="f"<|sep|>'
            '<|open|>argument key="n"<|sep|>5<|close|>argument<|sep|><|close|>call<|sep|>')
    _, parser = whole(text)
    assert calls_of(parser) == [(0, "f", {"n": "5"})]


def test_json_block_arguments():
    text = ('r<|close|>think<|sep|><|open|>tools<|sep|>'
            '<|open|>call tool="f" index="1"<|sep|><|open|>json type="object"<|sep|>{"a": 1, "b": ["x"]}'
            '<|close|>json<|sep|><|close|>call<|sep|>'
            '<|open|>call tool="g" index="2"<|sep|><|open|>json type="object"<|sep|>{"a": 1'
            '<|close|>json<|sep|><|close|>call<|sep|><|close|>tools<|sep|>')
    delta, parser = whole(text)
    assert [(c.name, c.arguments) for c in parser.calls][1] == ("g", '{"a": 1')  # no JSON: passed on as written
    assert json.loads(parser.calls[0].arguments) == {"a": 1, "b": ["x"]}
    assert delta.content == "" and delta.reasoning == "r"


def test_escaped_attributes_are_unescaped():
    text = ('r<|close|>think<|sep|><|open|>tools<|sep|><|open|>call tool="a&amp;b" index="1"<|sep|>'
            '<|open|>argument key="say &quot;hi&quot;" type="string"<|sep|>x &amp; y<|close|>argument<|sep|>'
            '<|open|>argument key="lit &amp;quot;" type="string"<|sep|>z<|close|>argument<|sep|>'
            '<|close|>call<|sep|><|close|>tools<|sep|>')
    delta, parser = whole(text)
    assert [s.name for s in delta.started] == ["a&b"]
    # attribute values are unescaped (`&amp;quot;` is the text `&quot;`); argument bodies are raw
    assert calls_of(parser) == [(0, "a&b", {'say "hi"': "x &amp; y", "lit &quot;": "z"})]


@pytest.mark.parametrize("cut", [
    '<|open|>call tool="calculate" index="2"<|sep|>',
    '<|open|>call tool="calculate" index="2"<|sep|><|open|>argument key="options" type="object"<|sep|>{"exa',
    '<|open|>call tool="calculate" index="2"<|sep|><|open|>argument key="options" type="object"<|sep|>{"exact": '
    'true, "digits": [1, 2]}<|close|>argument<|sep|>',
    '<|open|>call tool="calculate" index="2"<|sep|><|open|>argument key="options" type="object"<|sep|>{"exact": '
    'true, "digits": [1, 2]}<|close|>argument<|sep|><|open|>argument key="expression" type="string"<|sep|>6 * 7'
    '<|close|>argument<|sep|><|close|>ca',
    '<|open|>call tool="calc',
    '<|op',
])
def test_call_cut_by_max_tokens_is_dropped(cut):
    head = TWO_CALLS[:TWO_CALLS.index('<|open|>call tool="calculate"')]
    delta, parser = whole(head + cut)
    assert [c.name for c in parser.calls] == ["get_weather"]
    assert delta.content == "Checking both."
    assert_no_markup(delta)
    assert "calc" not in delta.content and "6 * 7" not in delta.content


def test_call_reported_only_when_closed():
    parser = XtmlOutputParser()
    end = TWO_CALLS.index("<|close|>call<|sep|>")
    first = parser.feed(TWO_CALLS[:end])
    assert not first.started and parser.calls == []
    second = parser.feed("<|close|>call<|sep|>")
    assert [s.name for s in second.started] == ["get_weather"]
    assert json.loads(second.arguments[0]) == {"city": "São Paulo", "days": 3}


SAMPLES = {
    "two_calls": (TWO_CALLS, {}),
    "reasoning_response": ("a<b>c ||| <|x|> <|close|>think<|sep|><|open|>response<|sep|>é 🙂 "
                           "<|close|>response<|sep|><|close|>message<|sep|>", {}),
    "thinking_off_call": ('Sure.<|close|>response<|sep|><|open|>tools<|sep|><|open|>call tool="f" index="1"<|sep|>'
                          '<|open|>json type="object"<|sep|>{"q": "<|"}<|close|>json<|sep|><|close|>call<|sep|>'
                          '<|close|>tools<|sep|><|close|>message<|sep|>', {"thinking": False}),
    "cut_call": (TWO_CALLS[:TWO_CALLS.index("<|close|>call<|sep|><|close|>tools")], {}),
    "reopened_think": ("<|open|>think<|sep|>hmm<|close|>think<|sep|><|open|>response<|sep|>ok", {}),
}


@pytest.mark.parametrize("name", SAMPLES)
def test_split_at_every_position_matches_whole(name):
    text, kwargs = SAMPLES[name]
    expected, parser = whole(text, **kwargs)
    expected_calls = parser.calls
    for at in range(len(text) + 1):
        got, split = streamed([text[:at], text[at:]], **kwargs)
        assert (got, split.calls) == (expected, expected_calls), at


@pytest.mark.parametrize("name", SAMPLES)
def test_char_by_char_streaming_matches_whole(name):
    text, kwargs = SAMPLES[name]
    expected, parser = whole(text, **kwargs)
    got, streaming = streamed(list(text), **kwargs)
    assert got == expected and streaming.calls == parser.calls
    assert got == XtmlOutputParser.parse(text, **kwargs)


def test_reasoning_streams_before_think_closes():
    parser = XtmlOutputParser()
    assert parser.feed("Let me").reasoning == "Let me"
    assert parser.feed(" see<|clo").reasoning == " see"  # the partial marker is held back
    step = parser.feed("se|>think<|sep|><|open|>response<|sep|>Hi")
    assert (step.reasoning, step.content) == ("", "Hi")


def test_thinking_off_starts_in_response():
    text = ('Sunny.<|close|>response<|sep|><|open|>tools<|sep|><|open|>call tool="f" index="1"<|sep|>'
            '<|open|>argument key="b" type="boolean"<|sep|>true<|close|>argument<|sep|><|close|>call<|sep|>'
            '<|close|>tools<|sep|><|close|>message<|sep|>')
    delta, parser = whole(text, thinking=False)
    assert (delta.reasoning, delta.content) == ("", "Sunny.")
    assert calls_of(parser) == [(0, "f", {"b": True})]
    assert XtmlOutputParser.parse("<|open|>response<|sep|>Hi<|close|>response<|sep|>", thinking=False).content == "Hi"


def test_thinking_off_plain_text_is_content():
    assert XtmlOutputParser.parse("just text", thinking=False) == ParsedDelta(content="just text")


def test_repeated_open_think_accepted():
    delta = XtmlOutputParser.parse("<|open|>think<|sep|>hmm<|close|>think<|sep|><|open|>response<|sep|>ok"
                                   "<|close|>response<|sep|>")
    assert (delta.reasoning, delta.content) == ("hmm", "ok")


def test_think_ended_by_the_next_channel():
    delta = XtmlOutputParser.parse("r<|open|>response<|sep|>c<|close|>response<|sep|>")
    assert (delta.reasoning, delta.content) == ("r", "c")
    delta, parser = whole('r<|open|>tools<|sep|><|open|>call tool="f"<|sep|><|close|>call<|sep|>')
    assert (delta.reasoning, delta.content, [c.name for c in parser.calls]) == ("r", "", ["f"])


def test_text_outside_channels_is_content():
    delta = XtmlOutputParser.parse("r<|close|>think<|sep|>stray<|open|>response<|sep|>c<|close|>response<|sep|>tail")
    assert (delta.reasoning, delta.content) == ("r", "strayctail")
    # whitespace between channels is no content
    assert XtmlOutputParser.parse("r<|close|>think<|sep|>\n<|open|>response<|sep|>c<|close|>response<|sep|>\n"
                                  ).content == "c"


def test_no_markup_leaks():
    for text, kwargs in SAMPLES.values():
        delta = XtmlOutputParser.parse(text, **kwargs)
        assert_no_markup(delta)
    # text that only looks like a marker is kept as written
    assert XtmlOutputParser.parse(SAMPLES["reasoning_response"][0]).reasoning == "a<b>c ||| <|x|> "
    stray = XtmlOutputParser.parse("r<|open|>bogus x=\"1\"<|sep|>s<|close|>think<|sep|><|open|>response<|sep|>a"
                                   "<|close|>bogus<|sep|>b<|sep|>c<|close|>response<|sep|>")
    assert_no_markup(stray)
    assert (stray.reasoning, stray.content) == ("rs", "abc")


def test_other_specials_dropped_unless_kept():
    specials = SpecialTokens.of(ByteTokenizer(512, "kimi_k3_xtml"))
    text = "r<|close|>think<|sep|><|open|>response<|sep|>a[EOS]b<|close|>response<|sep|>"
    assert XtmlOutputParser.parse(text, specials=specials).content == "ab"
    assert XtmlOutputParser.parse(text, specials=specials, keep_specials=True).content == "a[EOS]b"


def test_max_calls():
    delta, parser = whole(TWO_CALLS, max_calls=1)
    assert [c.name for c in parser.calls] == ["get_weather"]
    assert [s.name for s in delta.started] == ["get_weather"] and list(delta.arguments) == [0]
    assert delta.content == "Checking both."
    _, none = whole(TWO_CALLS, max_calls=0)
    assert none.calls == []


def test_call_without_tool_name_dropped():
    text = ('r<|close|>think<|sep|><|open|>tools<|sep|>'
            '<|open|>call index="1"<|sep|><|open|>argument key="a" type="string"<|sep|>x<|close|>argument<|sep|>'
            '<|close|>call<|sep|>'
            '<|open|>call tool="" index="2"<|sep|><|close|>call<|sep|>'
            '<|open|>call tool="g" index="3"<|sep|><|close|>call<|sep|><|close|>tools<|sep|>')
    delta, parser = whole(text)
    assert calls_of(parser) == [(0, "g", {})]
    assert [s.index for s in delta.started] == [0]
    assert delta.content == "" and "x" not in delta.reasoning
