"""A byte-level vocabulary as Hugging Face fast-tokenizer files (`tokenizer.json`, `tokenizer_config.json`).

Base ids are bytes (a ByteLevel-mapped vocabulary of 256 symbols and no merges), the named specials
are added tokens, so `transformers.AutoTokenizer.from_pretrained(dir)` encodes as
`Tokenizer.encode(text, allow_special=True)` does and renders chats with the same template.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import AddedToken, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as FastTokenizer
from tokenizers.pre_tokenizers import ByteLevel

from k3ray.tokenizer.base import Tokenizer

HF_TOKENIZER_CLASS = "PreTrainedTokenizerFast"
TOKENIZER_FILE = "tokenizer.json"


def fast_tokenizer(tokenizer: Tokenizer) -> FastTokenizer:
    """A `tokenizers` tokenizer whose ids match `tokenizer` (a byte vocabulary: 256 base ids)."""
    assert tokenizer.num_base_tokens == 256, tokenizer.num_base_tokens
    symbols = ByteLevel.alphabet()
    byte_symbol = _byte_symbols()
    vocab = {byte_symbol[b]: b for b in range(256)}
    assert set(vocab) == set(symbols)
    # specials sit in the model's vocabulary too: an added token takes the id it has there, so ids
    # with gaps (reserved ids, [PAD] last) come out as k3ray numbers them
    vocab.update(tokenizer.special_tokens)
    fast = FastTokenizer(models.BPE(vocab=vocab, merges=[], ignore_merges=True))
    fast.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    fast.decoder = decoders.ByteLevel()
    specials = sorted(tokenizer.special_tokens, key=tokenizer.special_tokens.get)
    fast.add_special_tokens([AddedToken(token, special=True, normalized=False) for token in specials])
    assert all(fast.token_to_id(token) == tokenizer.special_tokens[token] for token in specials)
    return fast


def save_hf_files(tokenizer: Tokenizer, directory: Path, extra_config: dict) -> None:
    """Write tokenizer.json and tokenizer_config.json (with the chat template and `extra_config`)."""
    fast_tokenizer(tokenizer).save(str(directory / TOKENIZER_FILE))
    special_by_id = sorted(tokenizer.special_tokens.items(), key=lambda kv: kv[1])
    config = {
        "tokenizer_class": HF_TOKENIZER_CLASS,
        **extra_config,
        "bos_token": tokenizer.convert_ids_to_tokens([tokenizer.bos_token_id])[0],
        "eos_token": tokenizer.convert_ids_to_tokens([tokenizer.eos_token_id])[0],
        "pad_token": tokenizer.convert_ids_to_tokens([tokenizer.pad_token_id])[0],
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 1 << 20,
        "chat_template": tokenizer.chat_template,
        "added_tokens_decoder": {
            str(token_id): {"content": token, "lstrip": False, "normalized": False, "rstrip": False,
                            "single_word": False, "special": True}
            for token, token_id in special_by_id
        },
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")


def _byte_symbols() -> list[str]:
    """GPT-2's byte -> printable character map, which the ByteLevel pre-tokenizer applies."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    symbols = {b: chr(b) for b in printable}
    shift = 0
    for b in range(256):
        if b not in symbols:
            symbols[b] = chr(256 + shift)
            shift += 1
    return [symbols[b] for b in range(256)]
