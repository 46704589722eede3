"""Request bodies of the OpenAI-compatible routes (OpenAI's names plus vLLM's extra fields).

Unknown fields are ignored, as OpenAI-compatible servers do; fields k3ray cannot honour (suffix,
tools on /v1/completions) are declared so that a request using them fails with a 400 instead of
being silently served differently. Every bound a single field has is declared here, so validation and the OpenAPI
document (openai/schema.py) state the same thing; bounds that are the server's own (its model name,
vocabulary, context) are marked for the document and checked in OpenAIServing; rules between
fields are checked there and SamplingParams.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, WithJsonSchema, model_validator

from k3ray.sampling_params import FUNCTION_NAME_PATTERN, MAX_LOGIT_BIAS, MAX_LOGPROBS

# the largest int64 a double holds exactly: clients that read JSON numbers as doubles (schemathesis
# did: it sent 2**63 + 192 as "<= 2**63 - 1") agree with the server on the bound
MAX_SEED = 2**63 - 1024
MAX_N = 128  # samples per prompt; bounds the sequences one request can create
MAX_SEQUENCES_PER_REQUEST = 1024  # prompts x n

# where the OpenAPI document writes this server's own limits (openai_schema.fill_in_limits)
LIMIT = "x-k3ray-limit"
SERVED_MODEL = {LIMIT: "served_model"}  # the one model name accepted (another answers 404)
IN_VOCAB = {LIMIT: "vocab"}  # a token id below the vocabulary size
IN_CONTEXT = {LIMIT: "context"}  # a token count below max_model_len
VOCAB_KEYS = {LIMIT: "vocab_keys"}  # an object keyed by token ids
MEDIA = {LIMIT: "media"}  # a content part only a model with a vision tower takes


def _integral(value: Any) -> Any:
    """2.0 is the integer 2 in JSON Schema (one number); 2.5, `true` and `"2"` stay no integer."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


def integer(**bounds: Any) -> Any:
    """An int field type with pydantic Field bounds (a JSON integer; strict otherwise)."""
    return Annotated[int, Field(**bounds), BeforeValidator(_integral)]


TokenId = integer(ge=0, json_schema_extra=IN_VOCAB)
TokenIds = list[TokenId]
NonEmptyText = Annotated[str, Field(min_length=1)]
PromptInput = (NonEmptyText | Annotated[list[NonEmptyText], Field(min_length=1)]
               | Annotated[TokenIds, Field(min_length=1)]
               | Annotated[list[Annotated[TokenIds, Field(min_length=1)]], Field(min_length=1)])
StopInput = NonEmptyText | list[NonEmptyText] | None
LogprobCount = integer(ge=0, le=MAX_LOGPROBS)
Penalty = Annotated[float, Field(ge=-2.0, le=2.0)]
TokenIdKey = Annotated[str, Field(pattern=r"^[0-9]+$")]  # JSON keys are strings
LogitBias = Annotated[dict[TokenIdKey, Annotated[float, Field(ge=-MAX_LOGIT_BIAS, le=MAX_LOGIT_BIAS)]],
                      Field(json_schema_extra=VOCAB_KEYS)]


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


_RESPONSE_FORMAT_SCHEMA = {  # `json_schema` with its `schema` is needed by that type only
    "oneOf": [
        {"type": "object", "required": ["type"], "properties": {"type": {"enum": ["text", "json_object"]}}},
        {"type": "object", "required": ["type", "json_schema"], "properties": {
            "type": {"const": "json_schema"},
            "json_schema": {"type": "object", "required": ["schema"], "properties": {
                "name": {"type": ["string", "null"]}, "description": {"type": ["string", "null"]},
                "schema": {"type": "object", "description": "a JSON Schema the output follows (one the "
                           "grammar engine can compile, else a 400)"},
                "strict": {"type": ["boolean", "null"]}}}}},
    ],
}


class ResponseFormat(OpenAIModel):
    model_config = ConfigDict(json_schema_extra=lambda schema: schema.update(_RESPONSE_FORMAT_SCHEMA))

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _json_schema_has_schema(self) -> ResponseFormat:
        if self.type == "json_schema" and (self.json_schema is None or self.json_schema.json_schema is None):
            raise ValueError("type json_schema needs json_schema.schema")
        return self


class SamplingFields(OpenAIModel):
    """Fields shared by completions and chat completions."""

    model: str | None = Field(None, json_schema_extra=SERVED_MODEL)
    n: integer(ge=1, le=MAX_N) = 1
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    seed: integer(ge=0, le=MAX_SEED) | None = None
    stop: StopInput = None
    stream: bool = False
    stream_options: StreamOptions | None = Field(None, description="only with stream=true")
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    logit_bias: LogitBias | None = None
    response_format: ResponseFormat | None = Field(None, description="a grammar: not with ignore_eos=true")
    user: str | None = None
    # vLLM extras (the OpenAI client sends them through extra_body)
    top_k: Literal[-1] | integer(ge=1) | None = Field(None, description="-1 keeps every token")
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    ignore_eos: bool = False
    stop_token_ids: TokenIds | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    repetition_penalty: float | None = Field(None, gt=0.0, le=2.0)


_EMPTY_STRING = {"type": "string", "maxLength": 0}

# rules between fields that JSON Schema states, so that a request the document calls valid is served
_STREAM_OPTIONS_RULE = {"anyOf": [  # stream_options only with stream=true
    {"required": ["stream"], "properties": {"stream": {"const": True}}},
    {"properties": {"stream_options": {"type": "null"}}}]}
_GRAMMAR_RULE = {"anyOf": [  # a grammar ends with EOS: not with ignore_eos=true
    {"properties": {"ignore_eos": {"const": False}}},
    {"properties": {"response_format": {"anyOf": [
        {"type": "null"}, {"type": "object", "properties": {"type": {"const": "text"}}}]}}}]}
_TOP_LOGPROBS_RULE = {"anyOf": [  # top_logprobs above 0 only with logprobs=true
    {"required": ["logprobs"], "properties": {"logprobs": {"const": True}}},
    {"properties": {"top_logprobs": {"enum": [0, None]}}}]}
_NO_TOOL_GRAMMAR = {"properties": {"tool_choice": {"enum": ["none", "auto", None]}}}  # no grammar from tools
_TOOL_CHOICE_RULE = {"anyOf": [  # required or a named function needs tools
    {"required": ["tools"], "properties": {"tools": {"type": "array", "minItems": 1}}}, _NO_TOOL_GRAMMAR]}
_TOOL_GRAMMAR_RULE = {"anyOf": [  # a tool_choice grammar: not with ignore_eos=true, nor another grammar
    {"properties": {"ignore_eos": {"const": False},
                    "response_format": {"anyOf": [
                        {"type": "null"}, {"type": "object", "properties": {"type": {"const": "text"}}}]}}},
    _NO_TOOL_GRAMMAR]}
_ONE_TOKENIZE_INPUT = {"oneOf": [  # exactly one of prompt or messages
    {"required": ["prompt"], "properties": {"prompt": {"type": "string"}, "messages": {"type": "null"}}},
    {"required": ["messages"], "properties": {"messages": {"type": "array"}, "prompt": {"type": "null"}}}]}


def _schema(description: str, *rules: dict):
    """A model's json_schema_extra: its description (the rules JSON Schema cannot state) and `rules`."""
    def extra(schema: dict) -> None:
        schema["description"] = description
        if rules:
            schema["allOf"] = list(rules)
    return extra


_ABSENT = {"type": "null"}


class CompletionRequest(SamplingFields):
    model_config = ConfigDict(json_schema_extra=_schema(
        "The prompt's tokens plus max_tokens must fit the context (max_model_len); best_of >= n, and "
        f"best_of > n is not streamed; prompts x (best_of or n) <= {MAX_SEQUENCES_PER_REQUEST}; a "
        "response_format schema must compile as a grammar. max_tokens 0 generates nothing: the text is the "
        "echoed prompt (echo=true) or empty.", _STREAM_OPTIONS_RULE, _GRAMMAR_RULE))

    prompt: PromptInput
    max_tokens: integer(ge=0, json_schema_extra=IN_CONTEXT) | None = 16
    echo: bool = False
    logprobs: LogprobCount | None = None
    best_of: integer(ge=1, le=MAX_N) | None = None
    # a non-empty suffix answers 400 (K3 does no fill-in-the-middle): OpenAIServing says why
    suffix: Annotated[str, WithJsonSchema(_EMPTY_STRING)] | None = None
    prompt_logprobs: LogprobCount | None = None
    add_special_tokens: bool = Field(
        True, description="accepted for vLLM compatibility; K3's tokenizers add no BOS/EOS to a prompt"
    )
    # tool calling is chat's: these answer 400 here (OpenAIServing says why)
    tools: Annotated[Any, WithJsonSchema(_ABSENT)] = None
    tool_choice: Annotated[Any, WithJsonSchema(_ABSENT)] = None


def _content_schema(parts: list[dict]) -> dict:
    return {"anyOf": [{"type": "string"}, {"type": "array", "items": {"oneOf": parts}}]}


_TEXT_PART = {"type": "object", "required": ["type", "text"],
              "properties": {"type": {"const": "text"}, "text": {"type": "string"}}}


def _media_part(kind: str, url: dict) -> dict:
    """An image_url / video_url part: the URL, or {"url": URL}; a data: URL (http(s) where the server
    allows remote media) that must decode as the media."""
    source = {"anyOf": [url, {"type": "object", "required": ["url"], "properties": {"url": url}}]}
    return {"type": "object", "required": ["type", kind], **MEDIA,
            "properties": {"type": {"const": kind}, kind: source}}


_URL = {"type": "string", LIMIT: "media_url"}  # a URL of a scheme this server reads
_FRAMES = {"type": "array", "items": _URL, "minItems": 1}  # a video as the URLs of its frames
_MEDIA_PARTS = [_media_part("image_url", _URL), _media_part("video_url", {"anyOf": [_URL, _FRAMES]})]
_CONTENT = _content_schema([_TEXT_PART, *_MEDIA_PARTS])
_NAME = {"type": ["string", "null"]}
_TOOL_CALL = {"type": "object", "required": ["function"], "properties": {
    "id": {"type": ["string", "null"]},
    "function": {"type": "object", "required": ["name"], "properties": {"name": {"type": "string"}}}}}
_TOOL_CALLS = {"anyOf": [{"type": "array", "items": _TOOL_CALL}, {"type": "null"}]}
_MESSAGE_SCHEMA = {  # what K3's chat template takes, by role (k3ray.tokenizer.chat)
    "oneOf": [
        {"type": "object", "required": ["role", "content"], "properties": {
            "role": {"enum": ["system", "developer", "user"]}, "content": _CONTENT, "name": _NAME,
            "tool_calls": _TOOL_CALLS}},
        {"type": "object", "required": ["role"], "properties": {
            "role": {"const": "assistant"}, "content": {"anyOf": [_CONTENT, {"type": "null"}]}, "name": _NAME,
            "tool_calls": _TOOL_CALLS},
         "anyOf": [{"required": ["content"], "properties": {"content": _CONTENT}},
                   {"required": ["tool_calls"], "properties": {"tool_calls": {"type": "array", "minItems": 1}}}]},
        {"type": "object", "required": ["role", "content", "tool_call_id"], "properties": {
            "role": {"const": "tool"}, "content": _CONTENT, "tool_call_id": {"type": "string"}, "name": _NAME,
            "tool_calls": _TOOL_CALLS}},
    ],
}


class ContentPart(OpenAIModel):
    model_config = ConfigDict(extra="allow")  # the part's `text`, `image_url`, ... by its type

    type: str


class FunctionCall(OpenAIModel):
    model_config = ConfigDict(extra="allow")

    name: str
    arguments: Any = None  # JSON text, or any JSON value (rendered as JSON)


class MessageToolCall(OpenAIModel):
    """A call in an assistant message the client sends back (the model's own, parsed from its output, is
    k3ray.tokenizer.tool_calls.ToolCall)."""

    model_config = ConfigDict(extra="allow")

    id: str | None = None
    function: FunctionCall


class ChatMessage(OpenAIModel):
    """Its types are checked here, what the template needs by role where it renders (a 400 either way)."""

    model_config = ConfigDict(extra="allow", json_schema_extra=lambda schema: schema.update(_MESSAGE_SCHEMA))

    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None
    tool_call_id: str | None = None


Messages = Annotated[list[ChatMessage], Field(min_length=1)]


class FunctionDefinition(OpenAIModel):
    name: Annotated[str, Field(pattern=FUNCTION_NAME_PATTERN)]
    description: str | None = None
    parameters: dict[str, Any] | None = Field(
        None, description="a JSON Schema of the arguments (one the grammar engine can compile, else a 400); "
                          "none: no arguments")
    strict: bool | None = Field(None, description="accepted; constrained calls are always strict")


class Tool(OpenAIModel):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(OpenAIModel):
    name: str


class NamedToolChoice(OpenAIModel):
    type: Literal["function"]
    function: FunctionName


Tools = Annotated[list[Tool], Field(description="function names are unique")]
ReasoningEffort = Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"]
_TEMPLATE_KWARGS = {  # what K3's and K2's formats take; a Jinja checkpoint's template takes any key
    "type": "object", "additionalProperties": False, "properties": {
        "thinking": {"type": ["boolean", "null"], "description": "false turns K3's thinking off"},
        "enable_thinking": {"type": ["boolean", "null"], "description": "thinking's other name (used if it is absent)"},
        "thinking_effort": {"enum": ["low", "high", "max", None], "description": "default max; null: none stated"}}}
ChatTemplateKwargs = Annotated[dict[str, Any], WithJsonSchema(_TEMPLATE_KWARGS)]
ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class ChatCompletionRequest(SamplingFields):
    model_config = ConfigDict(json_schema_extra=_schema(
        "The rendered conversation's tokens plus max_tokens must fit the context (max_model_len); "
        "continue_final_message needs a final assistant message; a response_format schema, and each tool's "
        "parameters, must compile as a grammar; a named tool_choice names one of tools.",
        _STREAM_OPTIONS_RULE, _GRAMMAR_RULE, _TOP_LOGPROBS_RULE, _TOOL_CHOICE_RULE, _TOOL_GRAMMAR_RULE))

    messages: Messages
    max_tokens: integer(ge=1, json_schema_extra=IN_CONTEXT) | None = None
    max_completion_tokens: integer(ge=1, json_schema_extra=IN_CONTEXT) | None = None
    logprobs: bool = False
    top_logprobs: LogprobCount | None = None
    tools: Tools | None = None
    tool_choice: ToolChoice | None = Field(
        None, description="auto (the default with tools): the model may call them; none: it does not; required: "
                          "it calls one or more (one with parallel_tool_calls=false); a named function: it calls "
                          "that one. required and a named function constrain the output to the call")
    parallel_tool_calls: bool | None = Field(None, description="false: at most one call (default true)")
    # OpenAI's deprecated forms of tools / tool_choice: a 400 saying so, never silently ignored
    functions: Annotated[Any, WithJsonSchema(_ABSENT)] = None
    function_call: Annotated[Any, WithJsonSchema(_ABSENT)] = None
    reasoning_effort: ReasoningEffort | None = Field(
        None, description="none turns thinking off; K3 thinks at low (minimal, low), high (medium, high) or max "
                          "(xhigh, max)")
    # vLLM chat-template extras
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: ChatTemplateKwargs | None = None


class TokenizeRequest(OpenAIModel):
    """vLLM's /tokenize: a `prompt` or a chat `messages` list."""

    model_config = ConfigDict(json_schema_extra=_schema(
        "exactly one of prompt or messages; continue_final_message needs a final assistant message",
        _ONE_TOKENIZE_INPUT))

    model: str | None = Field(None, json_schema_extra=SERVED_MODEL)
    prompt: str | None = None
    messages: Messages | None = None
    tools: Tools | None = None
    tool_choice: ToolChoice | None = Field(None, description="what K3's prompt states of it (required, none)")
    response_format: ResponseFormat | None = None
    reasoning_effort: ReasoningEffort | None = None
    chat_template_kwargs: ChatTemplateKwargs | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    return_token_strs: bool = False


class DetokenizeRequest(OpenAIModel):
    model: str | None = Field(None, json_schema_extra=SERVED_MODEL)
    tokens: TokenIds
