"""The tool-call parser on hand-written K3 outputs: one call, parallel calls, text around them, a call
cut by max_tokens, malformed calls, other special tokens, and every output fed in pieces (markers
split across chunks) giving what the whole output gives."""

import pytest

from k3ray.tokenizer import ByteTokenizer
from k3ray.tokenizer import special as sp
from k3ray.tokenizer.tool_calls import MARKERS, SpecialTokens, ToolCall, ToolCallParser, marker_ids

S, B, A, E, Z = (sp.TOOL_CALLS_SECTION_BEGIN, sp.TOOL_CALL_BEGIN, sp.TOOL_CALL_ARGUMENT_BEGIN, sp.TOOL_CALL_END,
                 sp.TOOL_CALLS_SECTION_END)
SPECIALS = SpecialTokens.of(ByteTokenizer(512))
WEATHER = f'{B}functions.get_weather:0{A}{{"city": "Paris"}}{E}'
TIME = f'{B}functions.get_time:1{A}{{"tz": "UTC+1"}}{E}'


def call(index, name, arguments, number=None):
    return ToolCall(index, f"functions.{name}:{index if number is None else number}", name, arguments)


def streamed(text: str, size: int, **kw):
    """Feed text in pieces of `size` characters: (content, calls as the deltas describe them)."""
    parser = ToolCallParser(SPECIALS, **kw)
    deltas = [parser.feed(text[i:i + size]) for i in range(0, len(text), size)] + [parser.finish()]
    content = "".join(d.content for d in deltas)
    calls: dict[int, ToolCall] = {}
    for d in deltas:
        for start in d.started:
            assert start.index not in calls, "a call starts once"
            calls[start.index] = ToolCall(start.index, start.id, start.name)
        for index, fragment in d.arguments.items():
            calls[index].arguments += fragment
    return content, [calls[i] for i in sorted(calls)]


def parse(text: str, **kw):
    out = ToolCallParser.parse(text, SPECIALS, **kw)
    return out.content, out.tool_calls


@pytest.mark.parametrize("text, content, calls", [
    (f"{S}{WEATHER}{Z}", "", [call(0, "get_weather", '{"city": "Paris"}')]),
    (f"Let me look.{S}{WEATHER}{TIME}{Z}", "Let me look.",
     [call(0, "get_weather", '{"city": "Paris"}'), call(1, "get_time", '{"tz": "UTC+1"}')]),
    (f"before {S}{WEATHER}{Z} after", "before  after", [call(0, "get_weather", '{"city": "Paris"}')]),
    (f"{S}{B}functions.f:7{A}{{}}{E}{Z}", "", [ToolCall(0, "functions.f:7", "f", "{}")]),
    (f"{S}{B} functions.f:0 {A}{{}}{E}{Z}", "", [ToolCall(0, "functions.f:0", "f", "{}")]),  # K2 tolerates spaces
    (f"{S}{B}g:3{A}[]{E}{Z}", "", [ToolCall(0, "g:3", "g", "[]")]),  # without the namespace, as vLLM reads it
    ("no calls, a < b and <| not a token |>", "no calls, a < b and <| not a token |>", []),
])
def test_outputs_whole_and_in_every_piece_size(text, content, calls):
    assert parse(text) == (content, calls)
    for size in (1, 2, 3, 5, 8, 13, len(text)):
        assert streamed(text, size) == (content, calls), size


def test_special_tokens_split_across_chunks_never_show_as_content():
    text = f"Hi{S}{WEATHER}{Z}"
    for size in range(1, len(S) + 2):
        parser = ToolCallParser(SPECIALS)
        pieces = [parser.feed(text[i:i + size]) for i in range(0, len(text), size)]
        assert all("<" not in d.content and "|" not in d.content for d in pieces), size
        assert "".join(d.content for d in pieces) == "Hi"


def test_a_call_cut_by_max_tokens_is_content_unless_streamed():
    cut = f"Sure.{S}{WEATHER}{B}functions.get_time:1{A}{{\"tz\": \"UT"
    assert parse(cut) == ('Sure.functions.get_time:1{"tz": "UT', [call(0, "get_weather", '{"city": "Paris"}')])
    # a stream has sent the cut call's fragments: it stays a call
    assert streamed(cut, 4) == ("Sure.", [call(0, "get_weather", '{"city": "Paris"}'),
                                         call(1, "get_time", '{"tz": "UT')])
    kept = ToolCallParser.parse(cut, SPECIALS, keep_specials=True).content
    assert kept == f'Sure.{B}functions.get_time:1{A}{{"tz": "UT'  # as written


def test_a_call_max_tokens_cut_is_dropped_when_the_output_is_known_truncated():
    """finish_reason "length": the cut call (or header) is neither a call nor content."""
    for cut in (f"Sure.{S}{WEATHER}{B}functions.get_time:1{A}{{\"tz\": \"UT", f"Sure.{S}{WEATHER}{B}functions.get_ti"):
        parser = ToolCallParser(SPECIALS)
        content = parser.feed(cut).content + parser.finish(streamed=False, truncated=True).content
        assert (content, parser.calls) == ("Sure.", [call(0, "get_weather", '{"city": "Paris"}')])


@pytest.mark.parametrize("size", [1, 4, 100])
def test_a_call_cut_inside_its_header_is_content_streamed_or_not(size):
    cut = f"{S}{B}functions.get_wea"
    assert parse(cut) == ("functions.get_wea", [])
    assert streamed(cut, size) == ("functions.get_wea", [])


def test_a_malformed_header_is_content():
    text = f"x{S}{B}not a call{A}{{}}{E}{WEATHER}{Z}"
    assert parse(text) == ("xnot a call{}", [call(0, "get_weather", '{"city": "Paris"}')])
    assert streamed(text, 3) == parse(text)
    assert parse(text, keep_specials=True)[0] == f"x{B}not a call{A}{{}}{E}"


def test_other_special_tokens_are_dropped_unless_kept():
    text = f"a<|im_end|>b<|reserved_token_300|>{S}{B}functions.f:0{A}{{<|im_user|>}}{E}{Z}c"
    assert parse(text) == ("abc", [call(0, "f", "{}")])
    assert parse(text, keep_specials=True) == ("a<|im_end|>b<|reserved_token_300|>c", [call(0, "f", "{<|im_user|>}")])
    assert streamed(text, 2, keep_specials=True) == parse(text, keep_specials=True)


def test_markers_out_of_place_are_other_special_tokens():
    text = f"{E}a{A}{Z}{S}{B}functions.f:0{A}{{}}{E}{S}{Z}"
    assert parse(text) == ("a", [call(0, "f", "{}")])
    assert parse(text, keep_specials=True) == (f"{E}a{A}{Z}", [call(0, "f", "{}")])


def test_max_calls_leaves_out_later_calls():
    text = f"{S}{WEATHER}{TIME}{Z}"
    assert parse(text, max_calls=1) == ("", [call(0, "get_weather", '{"city": "Paris"}')])
    assert streamed(text, 3, max_calls=1) == parse(text, max_calls=1)


def test_text_between_calls_is_dropped():
    assert parse(f"{S}\n{WEATHER}\n{Z}") == ("", [call(0, "get_weather", '{"city": "Paris"}')])


def test_what_the_chat_template_renders_parses_back():
    tok = ByteTokenizer(512)
    calls = [{"id": "functions.get_weather:0", "type": "function",
              "function": {"name": "get_weather", "arguments": '{"city": "Zürich"}'}},
             {"type": "function", "function": {"name": "now", "arguments": {}}}]
    ids = tok.encode_chat([{"role": "user", "content": "hi"},
                           {"role": "assistant", "content": "Checking.", "tool_calls": calls}],
                          add_generation_prompt=False)
    rendered = tok.decode(ids)
    answer = rendered[rendered.rindex(sp.IM_MIDDLE) + len(sp.IM_MIDDLE):rendered.rindex(sp.IM_END)]
    assert parse(answer) == ("Checking.", [call(0, "get_weather", '{"city": "Zürich"}'), call(1, "now", "{}")])


def test_marker_ids_are_special_ids_of_the_tiny_vocabulary():
    tok = ByteTokenizer(512)
    ids = marker_ids(tok)
    assert ids == (267, 269, 270, 271, 268) and all(tok.is_special(i) for i in ids)
    assert [tok.decode([i]) for i in ids] == list(MARKERS)
    assert all(tok.encode(m, allow_special=True) == [i] for m, i in zip(MARKERS, ids))


def test_a_vocabulary_without_the_markers_has_no_tool_calls():
    class NoTools:
        name, special_tokens = "plain", {sp.EOS: 1}

    with pytest.raises(ValueError, match="no tool-call tokens"):
        marker_ids(NoTools())
