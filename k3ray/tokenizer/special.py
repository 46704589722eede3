"""Spellings of the Kimi special tokens k3ray's chat template and tokenizers use.

The names follow Kimi K2's `tokenizer_config.json` (`added_tokens_decoder`); the media tokens
follow Kimi-VL (`<|media_start|>`) and Kimi K2.5 / K3 (`<|media_begin|>`), see chat.py.
"""

BOS = "[BOS]"
EOS = "[EOS]"
PAD = "[PAD]"

IM_END = "<|im_end|>"
IM_USER = "<|im_user|>"
IM_ASSISTANT = "<|im_assistant|>"
IM_SYSTEM = "<|im_system|>"
IM_MIDDLE = "<|im_middle|>"

MEDIA_START = "<|media_start|>"  # Kimi-VL spelling
MEDIA_BEGIN = "<|media_begin|>"  # Kimi K2.5 / K3 spelling
MEDIA_CONTENT = "<|media_content|>"
MEDIA_END = "<|media_end|>"
MEDIA_PAD = "<|media_pad|>"
KIMI_IMAGE_PLACEHOLDER = "<|kimi_image_placeholder|>"

TOOL_CALLS_SECTION_BEGIN = "<|tool_calls_section_begin|>"
TOOL_CALLS_SECTION_END = "<|tool_calls_section_end|>"
TOOL_CALL_BEGIN = "<|tool_call_begin|>"
TOOL_CALL_ARGUMENT_BEGIN = "<|tool_call_argument_begin|>"
TOOL_CALL_END = "<|tool_call_end|>"

# K3's XTML chat encoding: an element is <|open|>NAME ATTRS<|sep|>BODY<|close|>NAME<|sep|>, and every
# top-level message is followed by <|end_of_msg|> (k3ray.tokenizer.chat_xtml)
END_OF_MSG = "<|end_of_msg|>"
OPEN = "<|open|>"
CLOSE = "<|close|>"
SEP = "<|sep|>"
XTML_MARKERS = (OPEN, CLOSE, SEP)

# ends an assistant turn besides EOS, whichever of them a vocabulary has
END_OF_TURN_TOKENS = (IM_END, END_OF_MSG)


def reserved_token(token_id: int) -> str:
    """The special token of a slot the vocabulary leaves unnamed (Kimi's `tokenization_kimi.py` spelling)."""
    return f"<|reserved_token_{token_id}|>"
