"""Request bodies of the OpenAI-compatible routes (OpenAI's names plus vLLM's extra fields).

Unknown fields are ignored, as OpenAI-compatible servers do; fields k3ray cannot honour (suffix,
tools) are declared so that a request using them fails with a 400 instead of being silently
served differently. Value checks beyond types live in SamplingParams.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
MAX_N = 128  # samples per prompt; bounds the sequences one request can create

TokenIds = list[int]
PromptInput = str | list[str] | TokenIds | list[TokenIds]
StopInput = str | list[str] | None


class OpenAIModel(BaseModel):
    # strict: `true` is no token id and `"3"` no max_tokens (a 400 naming the field, not a coercion)
    model_config = ConfigDict(extra="ignore", strict=True)


class StreamOptions(OpenAIModel):
    include_usage: bool = False


class JsonSchemaFormat(OpenAIModel):
    name: str | None = None
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(None, alias="schema")  # `schema` would shadow BaseModel's
    strict: bool | None = None


class ResponseFormat(OpenAIModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class SamplingFields(OpenAIModel):
    """Fields shared by completions and chat completions."""

    model: str | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    stop: StopInput = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    response_format: ResponseFormat | None = None
    user: str | None = None
    # vLLM extras (the OpenAI client sends them through extra_body)
    top_k: int | None = None
    min_p: float | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    repetition_penalty: float | None = None


class CompletionRequest(SamplingFields):
    prompt: PromptInput
    max_tokens: int | None = 16
    echo: bool = False
    logprobs: int | None = None
    best_of: int | None = Field(None, ge=1, le=MAX_N)
    suffix: str | None = None
    prompt_logprobs: int | None = None
    add_special_tokens: bool = Field(
        True, description="accepted for vLLM compatibility; K3's tokenizers add no BOS/EOS to a prompt"
    )


class ChatMessage(OpenAIModel):
    model_config = ConfigDict(extra="allow")

    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    # vLLM chat-template extras
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None


class TokenizeRequest(OpenAIModel):
    """vLLM's /tokenize: a `prompt` or a chat `messages` list."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    return_token_strs: bool = False


class DetokenizeRequest(OpenAIModel):
    model: str | None = None
    tokens: TokenIds

