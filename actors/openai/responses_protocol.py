"""The request body of POST /v1/responses (OpenAI's Responses API, stateless).

Unknown fields are ignored; what this server cannot honour (stored responses: `store` true,
`previous_response_id`, `conversation`, `background`; tools other than functions) is declared so that
it answers a 400 saying so instead of being served differently.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field, WithJsonSchema, field_validator, model_validator

from k3ray.actors.openai.protocol import (
    IN_CONTEXT,
    LIMIT,
    MAX_SEED,
    MEDIA,
    SERVED_MODEL,
    OpenAIModel,
    ReasoningEffort,
    _schema,
    integer,
)
from k3ray.sampling_params import FUNCTION_NAME_PATTERN

STATELESS = "this server keeps no responses (it is stateless): send the whole conversation in `input`"


class TextPart(OpenAIModel):
    type: Literal["input_text", "output_text"]
    text: str


class ImagePart(OpenAIModel):
    model_config = ConfigDict(json_schema_extra=MEDIA)  # dropped from the document of a text-only model

    type: Literal["input_image"]
    image_url: str = Field(description="a data: URL (http(s) where the server allows remote media)",
                           json_schema_extra={LIMIT: "media_url"})
    detail: Literal["low", "high", "auto", "original"] | None = None


Content = str | list[TextPart | ImagePart]


class MessageItem(OpenAIModel):
    type: Literal["message"] | None = None
    role: Literal["user", "assistant", "system", "developer"]
    content: Content


class FunctionCallItem(OpenAIModel):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str = Field(description="JSON text")


class FunctionCallOutputItem(OpenAIModel):
    type: Literal["function_call_output"]
    call_id: str = Field(description="the call_id of an earlier function_call item")
    output: str | list[TextPart]


class ReasoningText(OpenAIModel):
    type: Literal["reasoning_text", "summary_text"]
    text: str


class ReasoningItem(OpenAIModel):
    """The model's thinking, rendered as that of the next assistant message (dropped if none follows)."""

    type: Literal["reasoning"]
    summary: list[ReasoningText] = []
    content: list[ReasoningText] | None = None


InputItem = MessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningItem


class FunctionTool(OpenAIModel):
    type: Literal["function"]
    name: Annotated[str, Field(pattern=FUNCTION_NAME_PATTERN)]
    description: str | None = None
    parameters: dict[str, Any] | None = Field(
        None, description="a JSON Schema of the arguments (one the grammar engine can compile, else a 400)")
    strict: bool | None = Field(None, description="accepted; constrained calls are always strict")

    @model_validator(mode="before")
    @classmethod
    def _only_functions(cls, value: Any) -> Any:
        kind = value.get("type") if isinstance(value, dict) else None
        if isinstance(kind, str) and kind != "function":
            raise ValueError(f"tool type {kind!r} is not supported: this server runs function tools only")
        return value


class NamedFunction(OpenAIModel):
    type: Literal["function"]
    name: str


class TextFormat(OpenAIModel):
    type: Literal["text", "json_object"]


class JsonSchemaTextFormat(OpenAIModel):
    type: Literal["json_schema"]
    name: str | None = None
    description: str | None = None
    json_schema: dict[str, Any] = Field(alias="schema", description="a JSON Schema the output follows (one the "
                                                                    "grammar engine can compile, else a 400)")
    strict: bool | None = None


class TextConfig(OpenAIModel):
    format: TextFormat | JsonSchemaTextFormat | None = None


class ReasoningConfig(OpenAIModel):
    effort: ReasoningEffort | None = Field(None, description="none turns thinking off; absent: thinking on")


_ABSENT = {"type": "null"}
_NOT_STORED = {"anyOf": [{"const": False}, {"type": "null"}]}
_NO_TOOL_GRAMMAR = {"properties": {"tool_choice": {"enum": ["none", "auto", None]}}}
_TOOL_CHOICE_RULE = {"anyOf": [  # required or a named function needs tools
    {"required": ["tools"], "properties": {"tools": {"type": "array", "minItems": 1}}}, _NO_TOOL_GRAMMAR]}
_PLAIN_TEXT = {"properties": {"text": {"anyOf": [{"type": "null"}, {"type": "object", "properties": {"format": {
    "anyOf": [{"type": "null"}, {"type": "object", "properties": {"type": {"const": "text"}}}]}}}]}}}
_TOOL_GRAMMAR_RULE = {"anyOf": [_PLAIN_TEXT, _NO_TOOL_GRAMMAR]}  # a forced call is a grammar: no JSON format too


class ResponsesRequest(OpenAIModel):
    model_config = ConfigDict(json_schema_extra=_schema(
        "Stateless: the conversation is `input` (store true and previous_response_id answer 400). The rendered "
        "input's tokens plus max_output_tokens must fit the context (max_model_len); a function_call_output "
        "answers the call_id of an earlier function_call item; a text.format schema, and each tool's parameters, "
        "must compile as a grammar; function names are unique and a named tool_choice names one of tools.",
        _TOOL_CHOICE_RULE, _TOOL_GRAMMAR_RULE))

    model: str | None = Field(None, json_schema_extra=SERVED_MODEL)
    input: str | Annotated[list[InputItem], Field(min_length=1)]
    instructions: str | None = Field(None, description="a system message before the input")
    max_output_tokens: integer(ge=1, json_schema_extra=IN_CONTEXT) | None = None
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    seed: integer(ge=0, le=MAX_SEED) | None = Field(None, description="not OpenAI's (vLLM's, through extra_body): "
                                                                      "reproducible sampling")
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = None
    parallel_tool_calls: bool | None = Field(None, description="false: at most one call (default true)")
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    stream: bool = False
    metadata: dict[str, str] | None = None
    user: str | None = None
    store: Annotated[bool | None, WithJsonSchema(_NOT_STORED)] = Field(
        None, description="false or absent: " + STATELESS)
    previous_response_id: Annotated[Any, WithJsonSchema(_ABSENT)] = None
    conversation: Annotated[Any, WithJsonSchema(_ABSENT)] = None
    background: Annotated[bool | None, WithJsonSchema(_NOT_STORED)] = None

    @field_validator("store", "previous_response_id", "conversation", mode="before")
    @classmethod
    def _stateless(cls, value: Any, info) -> Any:
        if value is not None and value is not False:
            raise ValueError(f"{info.field_name} is not supported: {STATELESS}")
        return value

    @field_validator("background", mode="before")
    @classmethod
    def _foreground(cls, value: Any) -> Any:
        if value is not None and value is not False:
            raise ValueError("background responses are not supported: the answer comes on this request")
        return value
