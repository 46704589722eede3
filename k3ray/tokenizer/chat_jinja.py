"""The chat format of k3ray.tokenizer.chat as a Jinja template, for Hugging Face's `apply_chat_template`.

Written into `tokenizer_config.json` and served by `/tokenizer_info`, so clients that render chats
themselves (lm-eval's `huggingface` tokenizer backend, vLLM's benchmark) get the prompt k3ray renders.
"""

from __future__ import annotations

from k3ray.tokenizer import special as sp
from k3ray.tokenizer.chat import DEFAULT_SYSTEM_PROMPT

# One string without newlines between tags, so trim/lstrip settings change nothing.
_TEMPLATE = "".join((
    "{%- if tools -%}",
    "IM_SYSTEMtool_declareIM_MIDDLE{{ tools | tojson(separators=(',', ':'), sort_keys=True) }}IM_END",
    "{%- endif -%}",
    "{%- if messages[0]['role'] not in ('system', 'developer') -%}IM_SYSTEMsystemIM_MIDDLESYSTEM_PROMPTIM_END{%- endif -%}",
    "{%- for message in messages -%}",
    "{%- set role = 'system' if message['role'] == 'developer' else message['role'] -%}",
    "{%- if role == 'user' -%}IM_USER{%- elif role == 'assistant' -%}IM_ASSISTANT{%- else -%}IM_SYSTEM{%- endif -%}",
    "{{- message.get('name') or role -}}IM_MIDDLE",
    "{%- if role == 'tool' -%}{{- '## Return of ' ~ message['tool_call_id'] ~ '\\n' -}}{%- endif -%}",
    "{%- if message['content'] is string -%}{{- message['content'] -}}",
    "{%- elif message['content'] is not none -%}{%- for part in message['content'] -%}",
    "{%- if part['type'] == 'text' -%}{{- part['text'] -}}",
    "{%- else -%}MEDIA_BEGIN{{- 'image' if part['type'] == 'image_url' else 'video' -}}",
    "MEDIA_CONTENTMEDIA_PLACEHOLDERMEDIA_END{{- '\\n' -}}{%- endif -%}",
    "{%- endfor -%}{%- endif -%}",
    "{%- if role == 'assistant' and message.get('tool_calls') -%}TOOL_CALLS_SECTION_BEGIN",
    "{%- for call in message['tool_calls'] -%}TOOL_CALL_BEGIN",
    "{{- call.get('id') or 'functions.' ~ call['function']['name'] ~ ':' ~ loop.index0 -}}TOOL_CALL_ARGUMENT_BEGIN",
    "{%- set arguments = call['function'].get('arguments', {}) -%}",
    "{{- arguments if arguments is string else arguments | tojson -}}TOOL_CALL_END",
    "{%- endfor -%}TOOL_CALLS_SECTION_END{%- endif -%}",
    "{%- if not (continue_final_message and loop.last) -%}IM_END{%- endif -%}",
    "{%- endfor -%}",
    "{%- if add_generation_prompt and not continue_final_message -%}IM_ASSISTANTassistantIM_MIDDLE{%- endif -%}",
))
_TOKENS = {
    "IM_SYSTEM": sp.IM_SYSTEM,
    "IM_USER": sp.IM_USER,
    "IM_ASSISTANT": sp.IM_ASSISTANT,
    "IM_MIDDLE": sp.IM_MIDDLE,
    "IM_END": sp.IM_END,
    "MEDIA_CONTENT": sp.MEDIA_CONTENT,
    "MEDIA_END": sp.MEDIA_END,
    "TOOL_CALLS_SECTION_BEGIN": sp.TOOL_CALLS_SECTION_BEGIN,
    "TOOL_CALLS_SECTION_END": sp.TOOL_CALLS_SECTION_END,
    "TOOL_CALL_BEGIN": sp.TOOL_CALL_BEGIN,
    "TOOL_CALL_ARGUMENT_BEGIN": sp.TOOL_CALL_ARGUMENT_BEGIN,
    "TOOL_CALL_END": sp.TOOL_CALL_END,
    "SYSTEM_PROMPT": DEFAULT_SYSTEM_PROMPT,
}


def chat_template(media_begin: str = sp.MEDIA_START, media_placeholder: str = sp.KIMI_IMAGE_PLACEHOLDER) -> str:
    """The Jinja template rendering what `render_chat` renders with these media tokens."""
    template = _TEMPLATE.replace("MEDIA_BEGIN", media_begin).replace("MEDIA_PLACEHOLDER", media_placeholder)
    # longest names first, so IM_SYSTEM never eats part of a longer name
    for name in sorted(_TOKENS, key=len, reverse=True):
        template = template.replace(name, _TOKENS[name])
    return template
