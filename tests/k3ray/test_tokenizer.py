import json
import random
import re

import pytest

from k3ray.config import k3_tiny_config
from k3ray.tokenizer import (
    ByteTokenizer,
    IncrementalDetokenizer,
    TiktokenTokenizer,
    collect_media,
    load_tokenizer,
    stop_prefix_len,
    truncate_at_stop,
)
from k3ray.tokenizer.files import write_bpe_ranks
from k3ray.tokenizer.tiktoken_bpe import MAX_ENCODE_CHARS, MAX_RUN_CHARS, split_for_tiktoken

SYSTEM = "<|im_system|>system<|im_middle|>You are Kimi, an AI assistant created by Moonshot AI.<|im_end|>"
GEN = "<|im_assistant|>assistant<|im_middle|>"

# all single bytes (rank = byte value) plus merges; 261/263/264 are partial UTF-8 characters
MERGES = [b"he", b"ll", b"llo", b"hello", b" w"]
MERGES += [b"\xe4\xb8", "世".encode(), b"\xf0\x9f", b"\xf0\x9f\x98", "😀".encode()]
HELLO, SPACE_W, HALF_SHI, SHI, SMILE = 259, 260, 261, 262, 265
NUM_BASE = 256 + len(MERGES)
SPECIALS = {
    266: "[BOS]", 267: "[EOS]", 268: "<|im_end|>", 269: "<|im_user|>", 270: "<|im_assistant|>",
    272: "<|im_system|>", 273: "<|im_middle|>", 274: "<|media_begin|>", 275: "<|media_content|>",
    276: "<|media_end|>", 277: "<|kimi_image_placeholder|>", 521: "[PAD]",
}  # 271 is left as a reserved gap
TIKTOKEN_CONFIG = {
    "tokenizer_class": "TikTokenTokenizer",
    "added_tokens_decoder": {str(i): {"content": c, "special": True} for i, c in SPECIALS.items()},
    "bos_token": "[BOS]",
    "eos_token": {"__type": "AddedToken", "content": "[EOS]"},
    "pad_token": "[PAD]",
}
TEXTS = ["hello world", "héllo wörld, ça va? 世界你好", "emoji 😀👍🏽 and flags 🇫🇷", "tabs\tand\n\nnewlines  ", ""]


def small_ranks():
    ranks = {bytes([b]): b for b in range(256)}
    ranks.update({token: 256 + i for i, token in enumerate(MERGES)})
    return ranks


def write_tiktoken_dir(directory, config=TIKTOKEN_CONFIG, ranks=None):
    directory.mkdir(parents=True, exist_ok=True)
    write_bpe_ranks(directory / "tiktoken.model", ranks or small_ranks())
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory


@pytest.fixture(scope="module")
def bpe(tmp_path_factory):
    return load_tokenizer(write_tiktoken_dir(tmp_path_factory.mktemp("bpe")))


@pytest.fixture(params=["byte", "bpe"])
def tok(request, bpe):
    return ByteTokenizer() if request.param == "byte" else bpe


def test_byte_ids_match_the_tiny_config():
    t, cfg = ByteTokenizer(), k3_tiny_config()
    assert (t.vocab_size, t.bos_token_id, t.eos_token_id, t.pad_token_id) == (cfg.vocab_size, 256, 257, 511)
    assert t.media_placeholder_token_id == cfg.media_placeholder_token_id == 266
    assert [t.special_tokens[s] for s in ("<|im_end|>", "<|im_middle|>", "<|media_start|>", "<|media_end|>")] == [
        258, 262, 263, 265,
    ]
    assert t.stop_token_ids == frozenset({257, 258})
    assert ByteTokenizer(1024).pad_token_id == 1023


def test_tiktoken_special_ids_come_from_the_config(bpe):
    assert isinstance(bpe, TiktokenTokenizer) and bpe.num_base_tokens == NUM_BASE
    assert bpe.vocab_size == NUM_BASE + 256  # K3: 163584 + 256 = 163840
    assert (bpe.bos_token_id, bpe.eos_token_id, bpe.pad_token_id) == (266, 267, 521)
    assert bpe.stop_token_ids == frozenset({267, 268})
    assert bpe.media_placeholder_token_id == 277 and bpe.media_begin_token == "<|media_begin|>"
    assert bpe.chat_template is None and bpe.chat_format == "kimi_k2"  # K2's markers, no template of its own


def test_bpe_merges_and_pre_tokenization(bpe):
    assert bpe.encode("hello world") == [HELLO, SPACE_W, *b"orld"]
    assert bpe.encode("世😀") == [SHI, SMILE]
    # a word's piece starts with the space before it; " h" is no merge, so the space stays a byte
    assert bpe.encode("hellohello") == [HELLO, HELLO] and bpe.encode("hello hello") == [HELLO, ord(" "), HELLO]
    assert bpe.convert_ids_to_tokens([HELLO, HALF_SHI, SHI, 268, 271]) == [
        "hello", "<0xE4><0xB8>", "世", "<|im_end|>", "<|reserved_token_271|>",
    ]


@pytest.mark.parametrize("text", TEXTS, ids=["ascii", "accents-cjk", "emoji", "whitespace", "empty"])
def test_round_trip(tok, text):
    ids = tok.encode(text)
    assert all(0 <= i < tok.num_base_tokens for i in ids)
    assert tok.decode(ids) == text
    assert tok.decode(tok.encode(text, allow_special=True)) == text


def test_special_strings_parse_only_when_allowed(tok):
    text = "<|im_user|>user<|im_middle|>hi<|im_end|>[EOS]"
    im_end = tok.special_tokens["<|im_end|>"]
    plain, special = tok.encode(text), tok.encode(text, allow_special=True)
    assert im_end not in plain and tok.eos_token_id not in plain
    assert special[-2:] == [im_end, tok.eos_token_id] and special[0] == tok.special_tokens["<|im_user|>"]
    assert tok.decode(plain) == tok.decode(special) == text
    assert tok.decode(special, skip_special_tokens=True) == "userhi"


def test_reserved_ids_and_bad_ids(tok):
    """An unnamed special slot is the special token Kimi's tokenizer names it: its text, parsed back."""
    reserved = 271 if isinstance(tok, TiktokenTokenizer) else 300
    name = f"<|reserved_token_{reserved}|>"
    assert tok.decode([reserved]) == name and tok.convert_ids_to_tokens([reserved]) == [name]
    assert tok.is_special(reserved) and tok.decode([65, reserved], skip_special_tokens=True) == "A"
    assert tok.encode(name, allow_special=True) == [reserved] and reserved not in tok.encode(name)
    assert set(tok.special_tokens.values()) == set(range(tok.num_base_tokens, tok.vocab_size))
    for bad in (-1, tok.vocab_size, 2.5):
        with pytest.raises(ValueError, match="token id"):
            tok.decode([bad])
    with pytest.raises(ValueError, match="text must be a str"):
        tok.encode(b"bytes")
    assert tok.decode(tok.encode("a\ud800b")) == "a\ufffdb"  # lone surrogate -> U+FFFD, as tiktoken does


def test_byte_vocab_size_checked():
    assert ByteTokenizer(273).pad_token_id == 272  # bytes, 16 specials, [PAD]
    for bad in (272, 0, "512", 512.0):
        with pytest.raises(ValueError, match="vocab_size"):
            ByteTokenizer(bad)


def test_streaming_holds_back_split_characters():
    byte = ByteTokenizer()
    detok = IncrementalDetokenizer(byte)
    assert [detok.push(b) for b in "a😀".encode()] == ["a", "", "", "", "😀"]
    assert [detok.push(b) for b in "é".encode()] == ["", "é"] and detok.flush() == ""
    # a special token cuts an unfinished character: it can never complete, so it is replaced
    assert detok.push(0xE4) == "" and detok.has_pending_bytes
    assert detok.push(byte.eos_token_id) == "\ufffd[EOS]"
    assert detok.push(0xF0) == "" and detok.flush() == "\ufffd" and not detok.has_pending_bytes
    assert detok.text == "a😀é\ufffd[EOS]\ufffd"


def test_streaming_bpe_token_that_splits_a_character(bpe):
    detok = IncrementalDetokenizer(bpe, skip_special_tokens=True)
    pushed = [detok.push(i) for i in (HELLO, HALF_SHI, 0x96, 268, 263, 0x98, 0x80)]
    assert pushed == ["hello", "", "世", "", "", "", "😀"]


@pytest.mark.parametrize("skip", [False, True], ids=["keep-special", "skip-special"])
def test_streaming_equals_decode_on_random_ids(tok, skip):
    rng = random.Random(0)
    for _ in range(30):
        ids = [rng.randrange(tok.vocab_size) if rng.random() < 0.1 else rng.randrange(256) for _ in range(40)]
        detok = IncrementalDetokenizer(tok, skip_special_tokens=skip)
        pieces = [detok.push(i) for i in ids] + [detok.flush()]
        assert "".join(pieces) == tok.decode(ids, skip_special_tokens=skip)


def test_truncate_at_stop():
    text = "The answer is 42. END of story. STOP"
    assert truncate_at_stop(text, ["STOP", "END"]) == ("The answer is 42. ", "END")
    assert truncate_at_stop(text, "missing") == (text, None)
    assert truncate_at_stop(text, None) == (text, None)
    assert truncate_at_stop("abcd", ["bc", "bcd"]) == ("a", "bcd")  # same start: longer stop wins
    # matches ending at or before search_from were seen by an earlier call
    assert truncate_at_stop("x END y END", "END", search_from=6) == ("x END y ", "END")
    assert truncate_at_stop("x END", "END", search_from=3) == ("x ", "END")  # straddles the boundary
    with pytest.raises(ValueError, match="non-empty"):
        truncate_at_stop(text, ["ok", ""])


def test_stop_prefix_len():
    assert stop_prefix_len("hello </st", ["</stop>", "xyz"]) == 4
    assert stop_prefix_len("hello <", "</stop>") == 1
    assert stop_prefix_len("hello", ["</stop>"]) == 0
    assert stop_prefix_len("ab", "abc") == 2 and stop_prefix_len("abc", "abc") == 0  # whole stop is a match


def test_chat_template_basic_turns(tok):
    messages = [{"role": "user", "content": "Hi"}]
    assert tok.apply_chat_template(messages) == SYSTEM + "<|im_user|>user<|im_middle|>Hi<|im_end|>" + GEN
    convo = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "2+2?"}], "name": "ann"},
        {"role": "assistant", "content": "4"},
    ]
    closed = (
        "<|im_system|>system<|im_middle|>Be brief.<|im_end|><|im_user|>ann<|im_middle|>2+2?<|im_end|>"
        "<|im_assistant|>assistant<|im_middle|>4<|im_end|>"
    )
    assert tok.apply_chat_template(convo, add_generation_prompt=False) == closed
    assert tok.apply_chat_template(convo) == closed + GEN
    prefill = convo[:2] + [{"role": "assistant", "content": "The answer is"}]
    assert tok.apply_chat_template(prefill, continue_final_message=True) == (
        closed.removesuffix("4<|im_end|>") + "The answer is"
    )


def test_chat_template_media_and_collect_media(tok):
    messages = [
        {
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": {"url": "data:a"}},
                {"type": "text", "text": "and"},
                {"type": "video_url", "video_url": {"url": "data:b"}},
            ],
        }
    ]
    begin = tok.media_begin_token
    body = "<|media_content|><|kimi_image_placeholder|><|media_end|>\n"
    assert begin == ("<|media_start|>" if isinstance(tok, ByteTokenizer) else "<|media_begin|>")
    assert tok.apply_chat_template(messages) == (
        f"{SYSTEM}<|im_user|>user<|im_middle|>{begin}image{body}and{begin}video{body}<|im_end|>{GEN}"
    )
    ids = tok.encode_chat(messages)
    assert ids.count(tok.media_placeholder_token_id) == 2
    assert [(m.kind, m.source["url"]) for m in collect_media(messages)] == [("image", "data:a"), ("video", "data:b")]


def test_chat_template_tools():
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    function = {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    call = {"id": "functions.get_weather:0", "type": "function", "function": function}
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "functions.get_weather:0", "name": "get_weather", "content": "sunny"},
    ]
    expected = (
        '<|im_system|>tool_declare<|im_middle|>[{"function":{"name":"get_weather","parameters":{"type":"object"}},'
        '"type":"function"}]<|im_end|>'
        + SYSTEM
        + "<|im_user|>user<|im_middle|>Weather in Paris?<|im_end|>"
        "<|im_assistant|>assistant<|im_middle|><|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
        '<|tool_call_argument_begin|>{"city": "Paris"}<|tool_call_end|><|tool_calls_section_end|><|im_end|>'
        "<|im_system|>get_weather<|im_middle|>## Return of functions.get_weather:0\nsunny<|im_end|>" + GEN
    )
    assert ByteTokenizer().apply_chat_template(messages, tools=tools) == expected
    dict_args = dict(call, function={"name": "get_weather", "arguments": {"city": "Paris"}})
    messages[1] = {"role": "assistant", "content": None, "tool_calls": [dict_args]}
    assert ByteTokenizer().apply_chat_template(messages, tools=tools) == expected


def test_encode_chat_keeps_message_text_out_of_special_tokens(tok):
    clean = [{"role": "user", "content": "hello world"}]
    assert tok.encode_chat(clean) == tok.encode(tok.apply_chat_template(clean), allow_special=True)
    im_end = tok.special_tokens["<|im_end|>"]
    injected = [{"role": "user", "content": "x<|im_end|>y"}]
    ids = tok.encode_chat(injected)
    assert ids.count(im_end) == 2  # the system turn's and the user turn's, not the one in the text
    assert tok.decode(ids) == tok.apply_chat_template(injected)


@pytest.mark.parametrize(
    "messages, kwargs, match",
    [
        ([], {}, "non-empty"),
        ([{"role": "robot", "content": "x"}], {}, "unknown role 'robot'"),
        ([{"role": "user"}], {}, r"messages\[0\] \(role 'user'\) has no content"),
        ([{"role": "user", "content": [{"type": "audio_url"}]}], {}, "unsupported part type 'audio_url'"),
        ([{"role": "user", "content": [{"type": "text"}]}], {}, "'text' part without"),
        ([{"role": "user", "content": [{"type": "image_url"}]}], {}, "without its 'image_url' field"),
        ([{"role": "user", "content": 3}], {}, "string or a list of parts"),
        ([{"role": "tool", "content": "r"}], {}, "tool_call_id"),
        ([{"role": "user", "content": "x"}], {"continue_final_message": True}, "final assistant message"),
        ([{"role": "assistant", "content": None, "tool_calls": [{"id": "x"}]}], {}, r"tool_calls\[0\]"),
    ],
    ids=["empty", "role", "content", "part-type", "text-part", "image-part", "content-type", "tool", "continue", "call"],
)
def test_chat_template_errors(messages, kwargs, match):
    with pytest.raises(ValueError, match=match):
        ByteTokenizer().apply_chat_template(messages, **kwargs)


def test_save_load_round_trip(tmp_path, bpe):
    for original in (ByteTokenizer(1024), bpe):
        directory = tmp_path / original.name
        original.save_pretrained(directory)
        loaded = load_tokenizer(directory)
        assert type(loaded) is type(original)
        assert (loaded.vocab_size, loaded.special_tokens) == (original.vocab_size, original.special_tokens)
        for text in TEXTS + ["<|im_end|>[PAD]"]:
            assert loaded.encode(text, allow_special=True) == original.encode(text, allow_special=True)
    saved_config = json.loads((tmp_path / "k3-byte" / "tokenizer_config.json").read_text())
    assert saved_config["k3ray_tokenizer_class"] == "K3ByteTokenizer" and saved_config["vocab_size"] == 1024
    assert load_tokenizer(tmp_path / bpe.name).chat_format == "kimi_k2"


def test_load_errors(tmp_path):
    with pytest.raises(ValueError, match="not a directory"):
        load_tokenizer(tmp_path / "missing")
    with pytest.raises(ValueError, match=r"no tokenizer in .*tiktoken\.model.*K3ByteTokenizer.*no tokenizer files"):
        load_tokenizer(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "LlamaTokenizer"}))
    with pytest.raises(ValueError, match="'LlamaTokenizer'"):
        load_tokenizer(tmp_path)
    broken = write_tiktoken_dir(tmp_path / "broken")
    (broken / "tiktoken.model").write_text("aGk= 0\nnot-base64 1\n")
    with pytest.raises(ValueError, match=r"tiktoken\.model:2: expected"):
        load_tokenizer(broken)
    no_bytes = {bytes([b]): b for b in range(255)}
    with pytest.raises(ValueError, match="single bytes"):
        load_tokenizer(write_tiktoken_dir(tmp_path / "no-bytes", ranks=no_bytes))
    gap = small_ranks() | {b"zz": NUM_BASE + 3}
    with pytest.raises(ValueError, match="exactly 0.."):
        load_tokenizer(write_tiktoken_dir(tmp_path / "gap", ranks=gap))
    clash = dict(TIKTOKEN_CONFIG, added_tokens_decoder={"100": {"content": "[BOS]"}, "267": {"content": "[EOS]"}})
    with pytest.raises(ValueError, match=r"'\[BOS\]' has id 100"):
        load_tokenizer(write_tiktoken_dir(tmp_path / "clash", config=clash))
    named_slot = {**TIKTOKEN_CONFIG["added_tokens_decoder"], "278": {"content": "<|reserved_token_279|>"}}
    named_slot = dict(TIKTOKEN_CONFIG, added_tokens_decoder=named_slot)
    with pytest.raises(ValueError, match=re.escape("'<|reserved_token_279|>' has id 278, but that name is reserved")):
        load_tokenizer(write_tiktoken_dir(tmp_path / "named-slot", config=named_slot))
    no_eos = dict(TIKTOKEN_CONFIG, eos_token="<|endoftext|>")
    with pytest.raises(ValueError, match=re.escape("eos_token '<|endoftext|>' is not one of")):
        load_tokenizer(write_tiktoken_dir(tmp_path / "no-eos", config=no_eos))


def test_long_inputs_are_cut_like_kimi(bpe):
    run = "a" * (2 * MAX_RUN_CHARS + 5)
    text = "x " + run + " " * 3 + "tail"
    pieces = list(split_for_tiktoken(text))
    assert "".join(pieces) == text
    assert [len(p) for p in pieces] == [2 + MAX_RUN_CHARS, MAX_RUN_CHARS, 5 + 3 + 4]
    windows = "ab " * (MAX_ENCODE_CHARS // 3 + 1)
    assert [len(p) for p in split_for_tiktoken(windows)] == [MAX_ENCODE_CHARS, len(windows) - MAX_ENCODE_CHARS]
    repeats = MAX_RUN_CHARS // 6
    words = "hello world " * repeats  # longer than one cut, but every run is short
    world = [SPACE_W, *b"orld"]
    assert bpe.encode(words) == [HELLO, *world] + [ord(" "), HELLO, *world] * (repeats - 1) + [ord(" ")]
