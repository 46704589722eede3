"""Per-request sampling settings, with vLLM's names and meanings."""

from __future__ import annotations

import enum
import json
import math
import numbers
import re
from dataclasses import dataclass

from k3ray.strict_json import checked_schema

MAX_LOGPROBS = 20
GREEDY_EPS = 1e-5  # temperatures below this sample greedily (vLLM's _SAMPLING_EPS)
MAX_LOGIT_BIAS = 100.0  # OpenAI's bound on a logit_bias value
FUNCTION_NAME_PATTERN = r"^[A-Za-z0-9_-]{1,64}$"  # OpenAI's rule for a function's name


class RequestOutputKind(enum.Enum):
    """What a request's outputs hold (vLLM's names): everything so far, only what is new since the
    previous output, or one output when the request finishes."""

    CUMULATIVE = "cumulative"
    DELTA = "delta"
    FINAL_ONLY = "final_only"


@dataclass(frozen=True)
class ToolCallsFormat:
    """Tool calls the output must be: one call (several with `parallel`) of the named functions,
    each one's arguments strict JSON matching that function's parameters schema. `functions` holds
    (name, parameters schema as a dict or its JSON text, kept as compact JSON text). In K2's format
    `markers` are the ids of its five marker tokens (`k3ray.tokenizer.tool_calls.marker_ids`), each
    call `<call begin>functions.NAME:INDEX<argument begin>{arguments}<call end>` inside the section
    markers; in K3's, `markers` is empty and StructuredOutputsParams.xtml places the calls (its tools
    channel, each call's arguments one `json` block; k3ray.tokenizer.xtml_output reads both forms)."""

    functions: tuple[tuple[str, str | dict], ...]
    markers: tuple[int, ...]  # K2: section begin, call begin, argument begin, call end, section end; K3: ()
    parallel: bool = True

    def __post_init__(self) -> None:
        functions = tuple(self.functions) if isinstance(self.functions, (list, tuple)) else None
        if not functions:
            raise ValueError(f"structured_outputs.tool_calls needs at least one function, got {self.functions!r}")
        checked = []
        for item in functions:
            name, schema = item if isinstance(item, (list, tuple)) and len(item) == 2 else (None, None)
            if not isinstance(name, str):
                raise ValueError(f"structured_outputs.tool_calls functions are (name, parameters schema), got {item!r}")
            if not re.match(FUNCTION_NAME_PATTERN, name):
                raise ValueError(f"structured_outputs.tool_calls: function name {name!r} does not match "
                                 f"{FUNCTION_NAME_PATTERN}")
            if isinstance(schema, dict):
                schema = _json_text(schema, tool_schema_field(name))
            elif not isinstance(schema, str):
                raise ValueError(f"structured_outputs.tool_calls: the parameters of function {name!r} must be a JSON "
                                 f"schema (dict or str), got {schema!r}")
            checked.append((name, schema))
        if len({name for name, _ in checked}) != len(checked):
            raise ValueError("structured_outputs.tool_calls: two functions share one name")
        object.__setattr__(self, "functions", tuple(checked))
        markers = tuple(self.markers)
        if markers and (len(markers) != 5 or len(set(markers)) != 5):
            raise ValueError(f"structured_outputs.tool_calls.markers must be 5 distinct token ids (K2's) or none "
                             f"(K3's, placed by structured_outputs.xtml), got {markers!r}")
        for t in markers:
            _check_int("structured_outputs.tool_calls.markers entry", t, low=0)
        object.__setattr__(self, "markers", markers)


@dataclass(frozen=True)
class XtmlMessage:
    """The rest of K3's assistant message from where the prompt left it: a JSON answer in its response
    channel, or tool calls in its tools channel after an empty response. `markers` are the
    `<|open|>`, `<|close|>`, `<|sep|>` ids; `thinking`: the prompt opened the think channel (free
    reasoning first), else the response channel."""

    markers: tuple[int, int, int]
    thinking: bool = True

    def __post_init__(self) -> None:
        markers = tuple(self.markers)
        if len(markers) != 3 or len(set(markers)) != 3:
            raise ValueError(f"structured_outputs.xtml.markers must be 3 distinct token ids, got {markers!r}")
        for t in markers:
            _check_int("structured_outputs.xtml.markers entry", t, low=0)
        object.__setattr__(self, "markers", markers)


@dataclass(frozen=True)
class StructuredOutputsParams:
    """What the output must parse as (vLLM's names): `json` a JSON schema (a dict or its JSON text,
    kept as compact JSON text in its key order), `json_object` any JSON object, or `tool_calls` a
    tool-call section (ToolCallsFormat). Exactly one is set."""

    json: str | dict | None = None
    json_object: bool = False
    tool_calls: ToolCallsFormat | None = None
    xtml: XtmlMessage | None = None  # the answer or the calls inside K3's assistant message

    def __post_init__(self) -> None:
        if isinstance(self.json, dict):
            object.__setattr__(self, "json", _json_text(self.json))
        elif self.json is not None and not isinstance(self.json, str):
            raise ValueError(f"structured_outputs.json must be a JSON schema (dict or str), got {self.json!r}")
        if self.tool_calls is not None and not isinstance(self.tool_calls, ToolCallsFormat):
            raise ValueError(f"structured_outputs.tool_calls must be a ToolCallsFormat, got {self.tool_calls!r}")
        if (self.json is not None) + bool(self.json_object) + (self.tool_calls is not None) != 1:
            raise ValueError("structured_outputs needs exactly one of json (a schema), json_object=True or tool_calls")
        if self.xtml is not None and not isinstance(self.xtml, XtmlMessage):
            raise ValueError(f"structured_outputs.xtml must be an XtmlMessage, got {self.xtml!r}")
        if self.tool_calls is not None and self.tool_calls.markers and self.xtml is not None:
            raise ValueError("structured_outputs.tool_calls with K2's markers cannot go inside K3's message (xtml)")

    @property
    def free_text(self) -> bool:
        """Whether the output starts with K3's free reasoning (newlines and all) before its constrained part;
        the JSON a grammar writes never holds a raw control character either way."""
        return self.xtml is not None and self.xtml.thinking

    @property
    def field(self) -> str:
        """The field an error about this grammar names."""
        return "structured_outputs.tool_calls" if self.tool_calls is not None else "structured_outputs.json"

    def schemas(self) -> list[tuple[str, str]]:
        """(field an error names, JSON schema text) of each schema in the grammar."""
        if self.json is not None:
            return [("structured_outputs.json", self.json)]
        if self.tool_calls is not None:
            return [(tool_schema_field(name), schema) for name, schema in self.tool_calls.functions]
        return []


def tool_schema_field(name: str) -> str:
    """How errors name the parameters schema of the tool-call function `name`."""
    return f"structured_outputs.tool_calls[{name!r}].parameters"


@dataclass(frozen=True)
class SamplingParams:
    """How to turn logits into tokens and when to stop.

    temperature 0 is greedy (top_k / top_p / min_p are then ignored); top_k -1 keeps every token;
    max_tokens None generates until the context limit; logprobs n returns the top-n log-probabilities
    (of the raw model distribution) for each generated token, prompt_logprobs n the same for every
    prompt token after the first; seed makes sampling reproducible whatever else is in the batch.

    The logits controls act before temperature, as in vLLM: logit_bias (token id -> value added to its
    logit), repetition_penalty over the prompt and output tokens (a positive logit divided by it, a
    negative one multiplied), frequency_penalty x the token's count in the output and presence_penalty
    once it is there (both subtracted). best_of samples that many sequences and returns the n with
    the highest cumulative log-probability; structured_outputs masks every token outside a grammar.
    output_kind: whether the engine's outputs for the request are cumulative, per-step deltas (what
    a stream sends on), or the final one only.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    best_of: int | None = None
    structured_outputs: StructuredOutputsParams | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE

    def __post_init__(self) -> None:
        stop = self.stop
        if stop is None:
            stop = ()
        elif isinstance(stop, str):
            stop = (stop,)
        object.__setattr__(self, "stop", tuple(stop))
        ids = () if self.stop_token_ids is None else self.stop_token_ids
        object.__setattr__(self, "stop_token_ids", tuple(ids))
        if self.logit_bias is not None:
            object.__setattr__(self, "logit_bias", _int_keys(self.logit_bias))
        self._check_values()

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_EPS

    @property
    def num_sequences(self) -> int:
        """Sequences the request samples: best_of, else n."""
        return self.n if self.best_of is None else self.best_of

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    @property
    def processes_logits(self) -> bool:
        """Whether the logits are changed before sampling (the penalties, logit_bias or a grammar)."""
        return self.has_penalties or bool(self.logit_bias) or self.structured_outputs is not None

    def validate(self, vocab_size: int, max_model_len: int, max_schema_bytes: int | None = None, *,
                 schemas: bool = True) -> None:
        """Raise ValueError if these settings cannot run on a model with this vocabulary and context.
        A JSON schema gets the checks that need no grammar engine (its size, JSON, its patterns); the
        engine's grammar worker finds the rest. schemas=False leaves the schemas to a caller that
        builds their grammar itself (check_grammar checks them as it does)."""
        self._check_values()
        bad = [t for t in self.stop_token_ids if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"stop_token_ids {bad} are outside the vocabulary [0, {vocab_size})")
        bad = [t for t in self.logit_bias or {} if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"logit_bias token ids {bad} are outside the vocabulary [0, {vocab_size})")
        if self.structured_outputs is not None:
            for field, schema in self.structured_outputs.schemas() if schemas else ():
                checked_schema(schema, max_schema_bytes, field)
            tool_calls = self.structured_outputs.tool_calls
            bad = [t for t in tool_calls.markers if t >= vocab_size] if tool_calls is not None else []
            if bad:
                raise ValueError(f"structured_outputs.tool_calls.markers {bad} are outside the vocabulary "
                                 f"[0, {vocab_size})")
        if self.max_tokens is not None and self.max_tokens >= max_model_len:
            raise ValueError(
                f"max_tokens={self.max_tokens} can never be reached: at most max_model_len - 1 = "
                f"{max_model_len - 1} tokens fit after a one-token prompt"
            )

    def _check_values(self) -> None:
        if not isinstance(self.output_kind, RequestOutputKind):
            raise ValueError(f"output_kind must be a RequestOutputKind, got {self.output_kind!r}")
        _check_int("n", self.n, low=1)
        if self.max_tokens is not None:
            _check_int("max_tokens", self.max_tokens, low=1)
        _check_real("temperature", self.temperature)
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        _check_real("top_p", self.top_p)
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        _check_int("top_k", self.top_k, low=-1)
        if self.top_k == 0:
            raise ValueError("top_k must be -1 (disabled) or >= 1, got 0")
        _check_real("min_p", self.min_p)
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.seed is not None:
            _check_int("seed", self.seed, low=0)
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None:
                _check_int(name, value, low=0)
                if value > MAX_LOGPROBS:
                    raise ValueError(f"{name} must be at most {MAX_LOGPROBS}, got {value}")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop strings must be non-empty strings, got {s!r}")
        for t in self.stop_token_ids:
            _check_int("stop_token_ids entry", t, low=0)
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check_real(name, value)
            if not -2.0 <= value <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {value}")
        _check_real("repetition_penalty", self.repetition_penalty)
        if not 0.0 < self.repetition_penalty <= 2.0:
            raise ValueError(f"repetition_penalty must be in (0, 2], got {self.repetition_penalty}")
        for token, bias in (self.logit_bias or {}).items():
            _check_real(f"logit_bias[{token}]", bias)
            if not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
                raise ValueError(f"logit_bias values must be in [-100, 100], got {bias} for token {token}")
        if self.best_of is not None:
            _check_int("best_of", self.best_of, low=1)
            if self.best_of < self.n:
                raise ValueError(f"best_of must be >= n, got best_of={self.best_of} and n={self.n}")
        if self.structured_outputs is not None:
            if not isinstance(self.structured_outputs, StructuredOutputsParams):
                raise ValueError("structured_outputs must be StructuredOutputsParams, got "
                                 f"{type(self.structured_outputs).__name__}")
            if self.ignore_eos:
                raise ValueError("structured_outputs cannot be combined with ignore_eos: the grammar ends the "
                                 "output with an end-of-sequence token")


def _check_int(name: str, value: object, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name} must be an int, got {value!r}")
    if value < low:
        raise ValueError(f"{name} must be >= {low}, got {value}")


def _int_keys(logit_bias: object) -> dict[int, float]:
    """Token ids as ints: the OpenAI API sends them as JSON object keys, i.e. strings."""
    if not isinstance(logit_bias, dict):
        raise ValueError(f"logit_bias must be a dict of token id -> bias, got {logit_bias!r}")
    out = {}
    for key, bias in logit_bias.items():
        try:
            token = int(key) if isinstance(key, str) else key
        except ValueError:
            raise ValueError(f"logit_bias keys must be token ids, got {key!r}") from None
        _check_int("logit_bias key", token, low=0)
        out[token] = bias
    return out


def _json_text(schema: dict, what: str = "structured_outputs.json") -> str:
    try:
        return json.dumps(schema, separators=(",", ":"))
    except (TypeError, ValueError) as e:
        raise ValueError(f"{what} is not JSON-serialisable: {e}") from None


def _check_real(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
