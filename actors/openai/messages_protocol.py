"""Request bodies of POST /v1/messages and /v1/messages/count_tokens: Anthropic's Messages API as
vLLM serves it, checked as strictly as the OpenAI bodies (openai/protocol.py; unknown fields such as
`cache_control` are ignored).

A user message holds text, image and tool_result blocks, an assistant message text, thinking,
redacted_thinking and tool_use blocks; the rules between fields that JSON Schema states (a forcing
tool_choice needs tools) are in the schema, the rest in its description and checked in messages.py.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field, WithJsonSchema

from k3ray.actors.openai.protocol import (
    IN_CONTEXT,
    MAX_SEED,
    MEDIA,
    SERVED_MODEL,
    NonEmptyText,
    OpenAIModel,
    _schema,
    integer,
)
from k3ray.sampling_params import FUNCTION_NAME_PATTERN

IMAGE_MEDIA_TYPES = ("image/jpeg", "image/png", "image/gif", "image/webp")


class TextBlock(OpenAIModel):
    type: Literal["text"]
    text: str


class Base64Source(OpenAIModel):
    type: Literal["base64"]
    media_type: Literal[IMAGE_MEDIA_TYPES]  # type: ignore[valid-type]
    data: str


class URLSource(OpenAIModel):
    type: Literal["url"]
    url: str


class ImageBlock(OpenAIModel):
    type: Literal["image"]
    source: Annotated[Base64Source | URLSource, Field(discriminator="type")]


# inline (no $ref) so that the document of a model without a vision tower drops it (schema.fill_in_limits)
_IMAGE_SCHEMA = {
    "type": "object", "required": ["type", "source"], **MEDIA, "description": "data that must decode as an image",
    "properties": {"type": {"const": "image"}, "source": {"oneOf": [
        {"type": "object", "required": ["type", "media_type", "data"], "properties": {
            "type": {"const": "base64"}, "media_type": {"enum": list(IMAGE_MEDIA_TYPES)},
            "data": {"type": "string", "description": "base64"}}},
        {"type": "object", "required": ["type", "url"], "properties": {
            "type": {"const": "url"}, "url": {"type": "string", "description": "http(s) where the server allows "
                                                                                "remote media"}}}]}}}
Image = Annotated[ImageBlock, WithJsonSchema(_IMAGE_SCHEMA)]


class ToolResultBlock(OpenAIModel):
    type: Literal["tool_result"]
    tool_use_id: NonEmptyText = Field(description="the id of a tool_use block of the last assistant message "
                                                  "before it")
    content: str | list[TextBlock | Image] | None = None
    is_error: bool | None = None


class ToolUseBlock(OpenAIModel):
    type: Literal["tool_use"]
    id: NonEmptyText
    name: NonEmptyText
    input: dict[str, Any]


class ThinkingBlock(OpenAIModel):
    type: Literal["thinking"]
    thinking: str
    signature: str | None = Field(None, description="accepted and not checked")


class RedactedThinkingBlock(OpenAIModel):
    type: Literal["redacted_thinking"]
    data: str | None = Field(None, description="ignored: nothing the model can read")


UserBlock = TextBlock | Image | ToolResultBlock
AssistantBlock = Annotated[TextBlock | ThinkingBlock | RedactedThinkingBlock | ToolUseBlock,
                           Field(discriminator="type")]


class UserMessage(OpenAIModel):
    role: Literal["user"]
    content: str | Annotated[list[UserBlock], Field(min_length=1)]


class AssistantMessage(OpenAIModel):
    role: Literal["assistant"]
    content: str | Annotated[list[AssistantBlock], Field(min_length=1)]


Message = Annotated[UserMessage | AssistantMessage, Field(discriminator="role")]


class ToolDefinition(OpenAIModel):
    name: Annotated[str, Field(pattern=FUNCTION_NAME_PATTERN)]
    description: str | None = None
    input_schema: dict[str, Any] = Field(
        description="a JSON Schema of the input (one the grammar engine can compile, else a 400)")
    type: Literal["custom"] | None = None


class ToolChoiceAuto(OpenAIModel):
    type: Literal["auto"]
    disable_parallel_tool_use: bool | None = None


class ToolChoiceAny(OpenAIModel):
    type: Literal["any"]
    disable_parallel_tool_use: bool | None = None


class ToolChoiceTool(OpenAIModel):
    type: Literal["tool"]
    name: str = Field(description="one of tools")
    disable_parallel_tool_use: bool | None = None


class ToolChoiceNone(OpenAIModel):
    type: Literal["none"]


ToolChoice = Annotated[ToolChoiceAuto | ToolChoiceAny | ToolChoiceTool | ToolChoiceNone, Field(discriminator="type")]


class ThinkingEnabled(OpenAIModel):
    type: Literal["enabled"]
    budget_tokens: integer(ge=1) = Field(description="accepted; K3 thinks until it is done (within max_tokens)")


class ThinkingDisabled(OpenAIModel):
    type: Literal["disabled"]


class ThinkingAdaptive(OpenAIModel):
    type: Literal["adaptive"]


Thinking = Annotated[ThinkingEnabled | ThinkingDisabled | ThinkingAdaptive, Field(discriminator="type")]


class Metadata(OpenAIModel):
    user_id: str | None = None


# any and tool constrain decoding to a call of one of tools
_TOOL_CHOICE_RULE = {"anyOf": [
    {"required": ["tools"], "properties": {"tools": {"type": "array", "minItems": 1}}},
    {"properties": {"tool_choice": {"anyOf": [{"type": "null"}, {"type": "object", "properties": {
        "type": {"enum": ["auto", "none"]}}}]}}}]}
_RULES = ("a tool_result's tool_use_id names a tool_use of the last assistant message before it; a tool_choice of type "
          "tool names one of tools; tool names are unique and each input_schema compiles as a grammar")


class PromptFields(OpenAIModel):
    """What the prompt is rendered from (count_tokens takes these alone)."""

    model: str = Field(json_schema_extra=SERVED_MODEL)
    messages: Annotated[list[Message], Field(min_length=1)]
    system: str | list[TextBlock] | None = None
    tools: list[ToolDefinition] | None = None
    tool_choice: ToolChoice | None = Field(
        None, description="auto (the default with tools): the model may call them; any: it calls one or more; tool: "
                          "it calls the one named; none: it does not. any and tool constrain the output to the call")
    thinking: Thinking | None = Field(None, description="absent or adaptive: the model's default (thinking on)")


class CountTokensRequest(PromptFields):
    model_config = ConfigDict(json_schema_extra=_schema(
        f"The rendered conversation's tokens must be fewer than the context (max_model_len); {_RULES}.",
        _TOOL_CHOICE_RULE))


class MessagesRequest(PromptFields):
    model_config = ConfigDict(json_schema_extra=_schema(
        f"The rendered conversation's tokens plus max_tokens must fit the context (max_model_len); {_RULES}; a final "
        "assistant message without tool_use blocks is continued (a prefill).", _TOOL_CHOICE_RULE))

    max_tokens: integer(ge=1, json_schema_extra=IN_CONTEXT)
    stop_sequences: list[NonEmptyText] | None = None
    stream: bool = False
    temperature: float | None = Field(None, ge=0.0, le=1.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: integer(ge=1) | None = None
    metadata: Metadata | None = None
    seed: integer(ge=0, le=MAX_SEED) | None = Field(None, description="k3ray's extension, as on chat completions")
