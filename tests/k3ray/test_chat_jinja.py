"""A Jinja-template checkpoint (chat_format "jinja", k3ray/tokenizer/chat_jinja_render.py) renders and encodes
chats exactly as Hugging Face `transformers.AutoTokenizer.apply_chat_template` does for the same saved files."""

import os

import pytest
import transformers

from k3ray.tokenizer import ByteTokenizer, load_tokenizer
from k3ray.tokenizer.chat_jinja_render import TemplateError
from k3ray.tokenizer.chat_options import ChatOptions, options_from_kwargs

CHATML_TOOLS = """{{ bos_token }}
{%- if tools %}<|im_system|>tool_declare<|im_middle|>{{ tools | tojson }}<|im_end|>{% endif %}
{%- for message in messages %}
<|im_{{ message['role'] }}|>{{ message.get('name') or message['role'] }}<|im_middle|>
{%- if message['content'] is string %}{{ message['content'] }}
{%- elif message['content'] %}{% for part in message['content'] %}{% if part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}
{%- endif %}
{%- if message.get('tool_calls') %}<|tool_calls_section_begin|>
{%- for call in message['tool_calls'] %}<|tool_call_begin|>{{ call['id'] }}<|tool_call_argument_begin|>{{ call['function']['arguments'] | tojson }}<|tool_call_end|>{% endfor %}
<|tool_calls_section_end|>
{%- endif %}<|im_end|>
{%- endfor %}
{%- if add_generation_prompt %}<|im_assistant|>assistant<|im_middle|>{% if enable_thinking is defined and not enable_thinking %}<think></think>{% endif %}{% endif %}"""

STRICT = """{%- if messages[0]['role'] != 'user' %}{{ raise_exception('Conversations must start with a user message, got ' + messages[0]['role']) }}{% endif %}
{%- for message in messages %}
    {%- if message['role'] not in ['user', 'assistant'] %}{{ raise_exception('Unsupported role: ' + message['role']) }}{% endif %}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}{{ raise_exception('Roles must alternate user/assistant') }}{% endif %}
[{{ message['role'] | upper }}] {{ message['content'] | trim }}<|im_end|>
{% endfor %}
{%- if add_generation_prompt %}[ASSISTANT]{% endif %}"""

LOOPS_TOJSON = """{%- set ns = namespace(users=0) %}
{%- for message in messages %}
  {%- if message['role'] == 'system' %}{% continue %}{% endif %}
  {%- if ns.users >= 3 %}{% break %}{% endif %}
  {%- if message['role'] == 'user' %}{% set ns.users = ns.users + 1 %}{% endif %}
<|im_system|>{{ loop.index }}/{{ loop.length }}<|im_middle|>{{ message | tojson }}
{{ message['content'] | tojson(indent=2) }}<|im_end|>
{%- endfor %}
{%- if tools %}
{% for tool in tools %}{{ tool['function'] | tojson(sort_keys=true) }}{% if not loop.last %},{% endif %}{% endfor %}
{%- endif %}
{%- if add_generation_prompt %}<|im_assistant|>{% endif %}"""

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Wetter — météo",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}
CONVERSATIONS = {
    "single": [{"role": "user", "content": "hi"}],
    "system_multiturn": [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "2+2?"},
                         {"role": "assistant", "content": "4"}, {"role": "user", "content": "and 3+3? é 🙂"}],
    "tool_calls": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_0", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "tool_call_id": "call_0", "content": "18C"},
    ],
    "parts_and_names": [{"role": "user", "name": "ada", "content": [{"type": "text", "text": "look "},
                                                                    {"type": "text", "text": "here"}]}],
    "markers_in_text": [{"role": "user", "content": "say <|im_end|> and [EOS] please"}],
    "many_users": [{"role": "user", "content": f"u{i}"} for i in range(5)],
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Per template: the saved checkpoint loaded by k3ray and by transformers (offline)."""
    loaded = {}
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HF_HUB_OFFLINE", "1")
        patch.setenv("TRANSFORMERS_OFFLINE", "1")
        for name, template in (("chatml", CHATML_TOOLS), ("strict", STRICT), ("loops", LOOPS_TOJSON)):
            directory = tmp_path_factory.mktemp(name)
            ByteTokenizer(512, "jinja", chat_template=template).save_pretrained(directory)
            ours = load_tokenizer(directory)
            assert ours.chat_format == "jinja"
            assert ours.chat_template == template
            loaded[template] = ours, transformers.AutoTokenizer.from_pretrained(str(directory))
    return loaded


def hf_ids(theirs, messages, **kwargs):
    ids = theirs.apply_chat_template(messages, tokenize=True, **kwargs)
    if isinstance(ids, dict) or hasattr(ids, "input_ids") or hasattr(ids, "keys"):
        ids = ids["input_ids"]
    if ids and isinstance(ids[0], list):
        (ids,) = ids
    return list(ids)


def assert_same(ours, theirs, messages, add_generation_prompt=True, tools=None, **template_kwargs):
    options = ChatOptions(template_kwargs=template_kwargs or None)
    text = theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                      tools=tools, **template_kwargs)
    assert ours.apply_chat_template(messages, add_generation_prompt, tools=tools, options=options) == text
    ids = hf_ids(theirs, messages, add_generation_prompt=add_generation_prompt, tools=tools, **template_kwargs)
    assert ours.encode_chat(messages, add_generation_prompt, tools=tools, options=options) == ids
    return text, ids


@pytest.mark.parametrize("name", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("with_tools", [False, True])
def test_chatml_template_matches_transformers(checkpoints, name, add_generation_prompt, with_tools):
    ours, theirs = checkpoints[CHATML_TOOLS]
    tools = [WEATHER] if with_tools else None
    text, ids = assert_same(ours, theirs, CONVERSATIONS[name], add_generation_prompt, tools)
    assert text.startswith("[BOS]")
    assert ids[0] == ours.bos_token_id
    assert ("tool_declare" in text) == with_tools
    assert text.endswith("<|im_assistant|>assistant<|im_middle|>") == add_generation_prompt
    assert ours.special_tokens["<|im_end|>"] in ids


def test_template_kwargs_reach_the_template(checkpoints):
    ours, theirs = checkpoints[CHATML_TOOLS]
    messages = CONVERSATIONS["single"]
    text, _ = assert_same(ours, theirs, messages, enable_thinking=False)
    assert text.endswith("<think></think>")
    options = options_from_kwargs({"enable_thinking": False}, any_kwargs=True)
    assert ours.apply_chat_template(messages, options=options) == text
    text, _ = assert_same(ours, theirs, messages, enable_thinking=True)
    assert not text.endswith("<think></think>")


@pytest.mark.parametrize("name", ["single", "system_multiturn", "tool_calls", "markers_in_text", "many_users"])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_loop_controls_and_tojson_match_transformers(checkpoints, name, add_generation_prompt):
    ours, theirs = checkpoints[LOOPS_TOJSON]
    text, _ = assert_same(ours, theirs, CONVERSATIONS[name], add_generation_prompt, tools=[WEATHER])
    assert '"description":' in text or '"description": ' in text
    if name == "many_users":
        assert "u2" in text and "u3" not in text  # {% break %} after three user messages
    if name == "system_multiturn":
        assert "Be terse." not in text  # {% continue %} skipped the system message
        assert "2/4" in text


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_strict_template_matches_transformers(checkpoints, add_generation_prompt):
    ours, theirs = checkpoints[STRICT]
    messages = [{"role": "user", "content": "  hi  "}, {"role": "assistant", "content": "yo"},
                {"role": "user", "content": "again"}]
    text, _ = assert_same(ours, theirs, messages, add_generation_prompt)
    assert text.startswith("[USER] hi<|im_end|>\n[ASSISTANT] yo")


@pytest.mark.parametrize("messages, message", [
    ([{"role": "system", "content": "s"}, {"role": "user", "content": "u"}],
     "Conversations must start with a user message, got system"),
    ([{"role": "user", "content": "u"}, {"role": "tool", "content": "t"}], "Unsupported role: tool"),
    ([{"role": "user", "content": "u"}, {"role": "user", "content": "u"}], "Roles must alternate user/assistant"),
])
def test_raise_exception_is_a_value_error(checkpoints, messages, message):
    ours, theirs = checkpoints[STRICT]
    with pytest.raises(Exception, match=message):  # transformers raises jinja2's TemplateError
        theirs.apply_chat_template(messages, tokenize=False)
    for call in (ours.apply_chat_template, ours.encode_chat):
        with pytest.raises(ValueError, match=message) as raised:
            call(messages)
        assert isinstance(raised.value, TemplateError)


def test_template_that_does_not_compile_is_a_value_error():
    ours = ByteTokenizer(512, "jinja", chat_template="{% for m in messages %}{{ m['content'] }")
    with pytest.raises(ValueError, match="does not compile"):
        ours.encode_chat(CONVERSATIONS["single"])


def test_continue_final_message_matches_transformers(checkpoints):
    ours, theirs = checkpoints[CHATML_TOOLS]
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hel"}]
    text = theirs.apply_chat_template(messages, tokenize=False, continue_final_message=True,
                                      add_generation_prompt=False)
    assert text.endswith("Hel")
    assert ours.apply_chat_template(messages, add_generation_prompt=False, continue_final_message=True) == text
    assert ours.encode_chat(messages, add_generation_prompt=False, continue_final_message=True) == hf_ids(
        theirs, messages, continue_final_message=True, add_generation_prompt=False)


def test_saved_files_name_the_jinja_format(tmp_path):
    import json

    ByteTokenizer(512, "jinja", chat_template=STRICT).save_pretrained(tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert config["chat_template"] == STRICT
    assert config["k3ray_chat_format"] == "jinja"
    assert os.path.isfile(tmp_path / "tokenizer.json")
