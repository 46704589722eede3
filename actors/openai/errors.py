"""OpenAI-style error bodies, {"error": {"message", "type", "param", "code"}}, for every failure.

Bad input of any kind (malformed JSON, wrong types, FastAPI's 422) answers 400; a model that
cannot run now (a dead pipeline actor or engine process, being replaced) answers 503 with
Retry-After, logged once with a count however many requests it fails (k3ray/repeat_log.py); only another
fault of the server itself answers 500, with its traceback logged.
"""

from __future__ import annotations

import logging
import re

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from k3ray.engine.process.errors import ModelUnavailableError
from k3ray.repeat_log import RepeatLog

logger = logging.getLogger(__name__)
# what makes the model unavailable; a handler per class answers without Starlette's catch-all,
# which re-raises after answering (and Serve then logs a traceback per request)
UNAVAILABLE = (ModelUnavailableError,)  # an engine process or pipeline actor gone (the runner turns Ray's errors into it)
unavailable_log = RepeatLog(logger)

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "internal_error",
    503: "service_unavailable",
}


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorBody(BaseModel):
    """The body of every error answer (the OpenAPI document's error schema)."""

    error: ErrorDetail


ERROR_RESPONSES: dict[int | str, dict] = {
    status: {"model": ErrorBody, "description": what} for status, what in (
        (400, "invalid request: malformed JSON, a wrong type or value, a context too long, bad media"),
        (401, "a missing or wrong API key"), (404, "an unknown model or route"), (405, "a wrong method"),
        (413, "a request body over the limit"), (429, "the server is full: retry after Retry-After seconds"),
        (500, "a fault of the server"),
        (503, "the model cannot run now (starting, or a dead actor being replaced): retry after Retry-After seconds"),
    )
}


class APIError(Exception):
    """An error the client sees as `status` with an OpenAI error body."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.headers = status, message, param, code, headers

    def body(self) -> dict:
        kind = ERROR_TYPES.get(self.status, "invalid_request_error" if self.status < 500 else "internal_error")
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param, code)


def from_value_error(e: ValueError, params: tuple[str, ...] = ()) -> APIError:
    """A ValueError from validation -> 400, naming the request field when its message starts with one."""
    message = str(e)
    first = re.match(r"[A-Za-z_]+", message)
    param = first.group() if first and first.group() in params else None
    return bad_request(message, param)


def unavailable(retry_after_s: float, message: str) -> APIError:
    return APIError(503, message, None, "model_unavailable", {"Retry-After": retry_after_header(retry_after_s)})


def retry_after_header(seconds: float) -> str:
    return str(max(1, round(seconds)))  # whole seconds (RFC 9110), never 0: that invites a hot retry loop


def as_api_error(exc: BaseException, retry_after_s: float = 1.0) -> APIError:
    """The answer to an exception out of a route: its own APIError, a 503 for a model that cannot run
    now (a dead pipeline actor or engine process), else a 500."""
    if isinstance(exc, APIError):
        return exc
    if _is_unavailable(exc):
        return unavailable(retry_after_s, f"the model is unavailable, retry shortly: {type(exc).__name__}: {exc}")
    return APIError(500, f"internal server error: {type(exc).__name__}: {exc}")


def _is_unavailable(exc: BaseException) -> bool:
    return isinstance(exc, UNAVAILABLE)


def log_failure(exc: BaseException) -> None:
    """A request failed with exc after its answer began (a stream) or as its answer: the model being
    unavailable is logged once with a count, anything else with its traceback."""
    if _is_unavailable(exc):
        unavailable_log.failure(f"requests answered 503: {type(exc).__name__}: {exc}")
    elif not isinstance(exc, (APIError, ValueError)):
        logger.error("request failed", exc_info=exc)


def install_error_handlers(app: FastAPI, retry_after_s: float = 1.0) -> None:
    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        return validation_error(exc).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
        return APIError(exc.status_code, message, headers=getattr(exc, "headers", None)).response()

    async def _unavailable(_: Request, exc: Exception) -> JSONResponse:
        log_failure(exc)
        return as_api_error(exc, retry_after_s).response()

    for kind in UNAVAILABLE:
        app.add_exception_handler(kind, _unavailable)

    @app.exception_handler(Exception)
    async def _internal_error(_: Request, exc: Exception) -> JSONResponse:
        logger.exception("request failed")
        return as_api_error(exc, retry_after_s).response()


def validation_error(exc: RequestValidationError) -> APIError:
    """Pydantic's error list -> one readable message; param is the first failing field's path."""
    errors = exc.errors()
    if not errors:
        return bad_request("the request body is invalid")
    parts, param = [], None
    for err in errors[:5]:
        where = _field_path(err.get("loc", ()))
        if err.get("type") == "json_invalid":
            parts.append(f"the body is not valid JSON ({err.get('msg')})")
            where = "body"
        else:
            parts.append(f"{where}: {err.get('msg')}")
        param = param or (where if where != "body" else None)
    more = f" (and {len(errors) - 5} more)" if len(errors) > 5 else ""
    return bad_request("; ".join(parts) + more, param)


def _field_path(loc) -> str:
    """("body", "messages", 0, "content", "str") -> "messages[0].content"; union member tags and dict keys
    are dropped (("body", "logit_bias", "1") and ("body", "logit_bias", "x", "[key]") name logit_bias)."""
    parts: list = []
    for part in loc:
        if part == "[key]":
            parts.pop()
            break
        if _UNION_TAG.match(str(part)) or (isinstance(part, str) and not part.isidentifier()):
            break  # a union member's tag, or a dict key such as a token id: the field is named
        if not (part == "body" and not parts):
            parts.append(part)
    out = ""
    for part in parts:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "body"


_UNION_TAG = re.compile(r"^(str|int|float|bool|none|.*\[.*\]|function-.*|constrained-.*)$")
