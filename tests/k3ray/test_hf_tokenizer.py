"""The byte tokenizer's Hugging Face files: AutoTokenizer encodes, decodes and renders chats as k3ray does."""

import json
import random

import pytest
from transformers import AutoTokenizer

from k3ray.default_model import checkpoint_dir
from k3ray.tokenizer import ByteTokenizer, load_tokenizer
from k3ray.tokenizer import special as sp

TEXTS = [
    "hello world", "héllo wörld, ça va? 世界你好", "emoji 😀👍🏽 and flags 🇫🇷", "tabs\tand\n\nnewlines  ", "",
    " leading and trailing spaces ", "\x00\x01\x7f control bytes", "<|im_end|>[PAD] specials [BOS]mid[EOS]",
    "<|im_user|>user<|im_middle|>hi<|im_end|><|media_start|>", "a <|reserved_300|> stays text", "[PAD", "<|im_",
    "<|reserved_token_300|> is a special token",
]
CHATS = [
    ([{"role": "user", "content": "hi"}], {}),
    ([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "q", "name": "ann"}], {}),
    ([{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "q"}], {}),
    ([{"role": "user", "content": [{"type": "text", "text": "look: "}, {"type": "image_url", "image_url": {"url": "x"}},
                                   {"type": "video_url", "video_url": {"url": "y"}}]}], {}),
    ([{"role": "user", "content": "weather?"},
      {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "get", "arguments": {"city": "Zürich"}}},
                                                          {"id": "c9", "function": {"name": "f", "arguments": "{}"}}]},
      {"role": "tool", "tool_call_id": "c9", "content": "sunny"}],
     {"tools": [{"type": "function", "function": {"name": "get", "parameters": {"z": 1, "a": {"y": "ü", "b": 2}}}}]}),
    ([{"role": "user", "content": "q"}, {"role": "assistant", "content": "I think"}],
     {"continue_final_message": True, "add_generation_prompt": False}),
    ([{"role": "user", "content": "q"}, {"role": "assistant", "content": "done"}], {"add_generation_prompt": False}),
]


@pytest.fixture(scope="module", params=[512, 300, 1024])
def pair(request, tmp_path_factory):
    ours = ByteTokenizer(request.param)
    directory = tmp_path_factory.mktemp(f"byte{request.param}")
    ours.save_pretrained(directory)
    return ours, AutoTokenizer.from_pretrained(directory), directory


def test_same_ids_and_text(pair):
    ours, hf, directory = pair
    rng = random.Random(0)
    randoms = ["".join(rng.choice("ab é世😀\n<|>[]") for _ in range(40)) for _ in range(20)]
    for text in TEXTS + randoms:
        ids = ours.encode(text, allow_special=True)
        assert hf.encode(text, add_special_tokens=False) == ids, text
        assert hf.decode(ids) == ours.decode(ids)
    invalid_utf8 = [0xC3, 97, 0xE4, 0xB8, ours.eos_token_id, 0xFF]
    assert hf.decode(invalid_utf8) == ours.decode(invalid_utf8)
    specials = (hf.bos_token_id, hf.eos_token_id, hf.pad_token_id)
    assert specials == (ours.bos_token_id, ours.eos_token_id, ours.pad_token_id) == (256, 257, ours.vocab_size - 1)
    assert load_tokenizer(directory).special_tokens == ours.special_tokens


@pytest.mark.parametrize("messages,kwargs", CHATS, ids=["user", "named", "developer", "media", "tools", "continue",
                                                        "closed"])
def test_same_chat_template(pair, messages, kwargs):
    ours, hf, _ = pair
    kwargs = {"add_generation_prompt": True, **kwargs}
    ours_messages = [dict(m, role="system") if m["role"] == "developer" else m for m in messages]
    text = ours.apply_chat_template(ours_messages, **kwargs)
    assert hf.apply_chat_template(messages, tokenize=False, **kwargs) == text
    assert hf.encode(text, add_special_tokens=False) == ours.encode_chat(ours_messages, **kwargs)


def test_config_carries_the_template(pair):
    ours, _, directory = pair
    config = json.loads((directory / "tokenizer_config.json").read_text())
    assert config["chat_template"] == ours.chat_template and sp.IM_ASSISTANT in ours.chat_template
    assert config["tokenizer_class"] == "PreTrainedTokenizerFast"


@pytest.fixture(scope="module", params=[None, "k3-tiny-niah"], ids=["default", "k3-tiny-niah"])
def checkpoint_pair(request):
    """The tokenizer k3ray serves a checkpoint with, and the one `AutoTokenizer` loads from its files."""
    path = checkpoint_dir(request.param)
    return load_tokenizer(path), AutoTokenizer.from_pretrained(path)


def test_every_id_decodes_alike(checkpoint_pair):
    """Every id of the vocabulary, reserved ones included, exists in the HF files and decodes there as
    the server decodes it (as vLLM would serve these files)."""
    ours, hf = checkpoint_pair
    assert len(hf) == ours.vocab_size
    everything = list(range(ours.vocab_size))
    for skip in (False, True):
        for token_id in everything:
            assert hf.decode([token_id], skip_special_tokens=skip) == ours.decode([token_id], skip), (token_id, skip)
        assert hf.decode(everything, skip_special_tokens=skip) == ours.decode(everything, skip)
    assert hf.convert_tokens_to_ids([ours.decode([i]) for i in everything[256:]]) == everything[256:]


def test_checkpoint_text_encodes_alike(checkpoint_pair):
    ours, hf = checkpoint_pair
    for text in TEXTS + [ours.decode([ours.vocab_size - 2]) + " after a reserved token"]:
        assert hf.encode(text, add_special_tokens=False) == ours.encode(text, allow_special=True), text
