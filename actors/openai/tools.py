"""Tool calling on /v1/chat/completions: a request's tools and tool_choice -> what the chat template
declares and how decoding runs (`ToolPlan`); choice_output.py reads the calls back.

tool_choice `auto` (the default with tools) leaves the model free and parses what it writes;
`required` and a named function constrain decoding to a call section (a grammar over the marker
tokens and each function's strict-JSON parameters, StructuredOutputsParams.tool_calls: K2's section,
or K3's tools channel after its reasoning); `none` declares the tools but stops the output where a
section would start (K3's prompt also says so). Outputs are parsed from text decoded with its special
tokens; the other special tokens are then dropped from content unless the request keeps them
(skip_special_tokens=false).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from k3ray.actors.openai.errors import bad_request
from k3ray.actors.openai.protocol import ChatCompletionRequest, NamedToolChoice
from k3ray.engine.structured.structured_output import check_grammar
from k3ray.sampling_params import StructuredOutputsParams, ToolCallsFormat
from k3ray.strict_json import renamed
from k3ray.tokenizer import special as sp
from k3ray.tokenizer.chat_format import output_reasons
from k3ray.tokenizer.tool_calls import marker_ids

TOOLS_OPEN = sp.OPEN + "tools" + sp.SEP  # tool_choice none stops K3's output where its tools channel would open
NO_PARAMETERS = {"type": "object", "properties": {}}  # a function without `parameters` takes none
_TOOL_SCHEMA_FIELD = re.compile(r"structured_outputs\.tool_calls\['([A-Za-z0-9_-]+)'\]\.parameters")


@dataclass(frozen=True)
class ToolPlan:
    """How one chat request uses its tools."""

    tools: list[dict] | None  # declared in the prompt
    parse: bool  # whether the output is read for calls (the text then keeps its special tokens)
    structured_outputs: StructuredOutputsParams | None  # required / a named function
    stop_token_ids: tuple[int, ...]  # none, K2: the section's first marker
    max_calls: int | None
    stop: tuple[str, ...] = ()  # none, K3: the tools channel's open


def tool_plan(req: ChatCompletionRequest, tokenizer, max_schema_bytes: int | None) -> ToolPlan | None:
    """The plan of req (None without tools and tool_choice); an APIError (400) naming the field; in
    K3's format the grammar's calls are placed in its message by OpenAIServing.sampling_params."""
    tools = req.tools or []
    choice = req.tool_choice if req.tool_choice is not None else ("auto" if tools else "none")
    if not tools:
        if choice not in ("none", "auto"):
            raise bad_request("tool_choice other than none or auto needs tools", "tool_choice")
        return None
    names = [t.function.name for t in tools]
    duplicate = next((n for i, n in enumerate(names) if n in names[:i]), None)
    if duplicate is not None:
        raise bad_request(f"two tools are named {duplicate!r}: function names must be unique", "tools")
    xtml = output_reasons(tokenizer)
    try:
        markers = () if xtml else marker_ids(tokenizer)  # K3's vocabulary has its markers by definition
    except ValueError as e:
        raise bad_request(f"tools are not supported by this model: {e}", "tools", "unsupported_parameter") from e
    functions = [(t.function.name, _parameters_text(t.function.parameters)) for t in tools]
    declared = [t.model_dump(exclude_none=True) for t in tools]
    parallel = req.parallel_tool_calls is not False
    # each schema is checked once: here when it is only declared, else with the call grammar it is part of
    compiled = set() if choice in ("none", "auto") else \
        {choice.function.name} if isinstance(choice, NamedToolChoice) else set(names)
    _check_declared([(i, text) for i, (name, text) in enumerate(functions) if name not in compiled],
                    max_schema_bytes)
    if choice == "none":
        if xtml:
            return ToolPlan(declared, False, None, (), 0, (TOOLS_OPEN,))
        return ToolPlan(declared, False, None, (markers[0],), None)
    if choice == "auto":
        return ToolPlan(declared, True, None, (), None if parallel else 1)
    if req.response_format is not None and req.response_format.type != "text":
        raise bad_request(f"response_format {req.response_format.type} cannot be combined with a tool_choice that "
                          "constrains the output to a tool call", "response_format")
    if req.ignore_eos:
        raise bad_request("ignore_eos cannot be combined with a tool_choice that constrains the output to a tool "
                          "call: the call section ends with an end-of-sequence token", "tool_choice")
    if isinstance(choice, NamedToolChoice):
        if choice.function.name not in names:
            raise bad_request(f"tool_choice names the function {choice.function.name!r}, which is not one of "
                              f"tools ({', '.join(names)})", "tool_choice")
        functions, parallel = [f for f in functions if f[0] == choice.function.name], False
    grammar = StructuredOutputsParams(tool_calls=ToolCallsFormat(tuple(functions), markers, parallel))
    return ToolPlan(declared, True, grammar, (), None if parallel else 1)


def _parameters_text(parameters: dict | None) -> str:
    """A function's parameters schema as JSON text."""
    return json.dumps(NO_PARAMETERS if parameters is None else parameters, separators=(",", ":"))


def _check_declared(schemas: list[tuple[int, str]], max_schema_bytes: int | None) -> None:
    """The grammar engine's checks of (tool index, parameters schema) that no call grammar is built
    from (400 naming it)."""
    for index, text in schemas:
        try:
            check_grammar(StructuredOutputsParams(json=text), max_schema_bytes)
        except ValueError as e:
            raise bad_request(str(renamed(e, f"tools[{index}].function.parameters")), "tools") from e


def tool_calls_error_message(message: str) -> str:
    """A message about structured_outputs.tool_calls as one about the client's tools."""
    message = _TOOL_SCHEMA_FIELD.sub(lambda m: f"the parameters of tool {m.group(1)!r}", message)
    return message.replace("structured_outputs.tool_calls", "tools")
