"""OpenAI-format errors for every epd HTTP server.

Invariants:
- Every error a client sees is `{"error": {"message", "type", "param", "code"}}` with a
  4xx/5xx status; `param` names the offending request field in OpenAI style
  (`messages[0].content[1].image_url`, `temperature`), never pydantic's raw location.
- Unexpected exceptions become a 500 with type `internal_error`; the traceback is logged,
  never sent.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

logger = logging.getLogger(__name__)

# Pydantic error types that we raise on purpose (epd/protocol/) and surface as `code`.
_PASSTHROUGH_CODES = frozenset({"unsupported_parameter", "unsupported_value"})
_MSG_PREFIXES = ("Value error, ", "Assertion failed, ")
# Locations that are not request fields: the body itself, and query/path/header sources.
_SOURCES = frozenset({"body", "query", "path", "header", "cookie"})
_UNION_LABELS = frozenset({"str", "int", "float", "bool", "list", "dict", "none", "tuple"})


class EPDError(Exception):
    """An error with everything needed to render it as an OpenAI error response."""

    def __init__(
        self,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        status: int = 400,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.status_code = status
        self.headers = headers

    @property
    def status(self) -> int:
        return self.status_code

    def __repr__(self) -> str:
        return (
            f"EPDError({self.message!r}, type={self.type!r}, param={self.param!r}, "
            f"code={self.code!r}, status={self.status_code})"
        )


def invalid_request(message: str, param: str | None = None, code: str | None = None) -> EPDError:
    return EPDError(message, param=param, code=code, status=400)


def not_found(message: str, param: str | None = "model", code: str = "model_not_found") -> EPDError:
    return EPDError(message, param=param, code=code, status=404)


def service_unavailable(message: str, retry_after_s: float | None = None) -> EPDError:
    headers = None
    if retry_after_s is not None:
        # Retry-After takes whole seconds; round up so clients never retry too early.
        headers = {"Retry-After": str(max(1, int(-(-retry_after_s // 1))))}
    return EPDError(
        message,
        type="service_unavailable",
        code="service_unavailable",
        status=503,
        headers=headers,
    )


def upstream_error(message: str, stage: str) -> EPDError:
    """A failure in another epd process; `stage` becomes the code, e.g. `epd_migration_failed`."""
    return EPDError(message, type="upstream_error", code=stage, status=502)


def internal_error(
    message: str = "The server had an error while processing your request.",
) -> EPDError:
    return EPDError(message, type="internal_error", status=500)


def error_body(err: EPDError) -> dict[str, Any]:
    return {
        "error": {
            "message": err.message,
            "type": err.type,
            "param": err.param,
            "code": err.code,
        }
    }


def error_response(err: EPDError) -> JSONResponse:
    return JSONResponse(error_body(err), status_code=err.status_code, headers=err.headers)


def format_loc(loc: Sequence[Any]) -> str | None:
    """Pydantic location -> OpenAI param: ("body", "messages", 0, "content") -> messages[0].content.

    Union branch labels that pydantic inserts ("str", "list[...]", tags like "ImagePart")
    are dropped: epd/protocol/ names its union tags in CamelCase for this reason.
    """
    parts: list[str] = []
    for i, item in enumerate(loc):
        if isinstance(item, int):
            parts.append(f"[{item}]")
            continue
        item = str(item)
        if i == 0 and item in _SOURCES:
            continue
        if not item.isidentifier() or item[:1].isupper() or item in _UNION_LABELS:
            continue
        parts.append(("." if parts else "") + item)
    return "".join(parts) or None


def _root_field(error: dict[str, Any]) -> Any:
    loc = tuple(error.get("loc", ()))
    if loc and loc[0] in _SOURCES:
        loc = loc[1:]
    return loc[0] if loc else None


def from_validation_errors(errors: Sequence[dict[str, Any]]) -> EPDError:
    """Turn pydantic/FastAPI validation errors into one 400 naming the first bad parameter."""
    if not errors:
        return invalid_request("Invalid request.")
    # A union reports one error per branch for the same field: report the deepest of those
    # (e.g. `stop[1]` rather than "stop is not a string").
    root = _root_field(errors[0])
    same_field = [e for e in errors if _root_field(e) == root]
    first = max(same_field, key=lambda e: len(e.get("loc", ())))
    others = len({format_loc(tuple(e.get("loc", ()))) for e in errors if e not in same_field})
    etype = str(first.get("type", ""))
    loc = tuple(first.get("loc", ()))
    if etype in ("json_invalid", "json_type"):
        detail = (first.get("ctx") or {}).get("error")
        suffix = f" ({detail})" if detail else ""
        return invalid_request(f"The request body is not valid JSON{suffix}.", None)
    param = format_loc(loc)
    msg = str(first.get("msg", "invalid value"))
    for prefix in _MSG_PREFIXES:
        if msg.startswith(prefix):
            msg = msg[len(prefix) :]
    code = etype if etype in _PASSTHROUGH_CODES else None
    if etype == "missing":
        message = (
            f"Missing required parameter: '{param}'." if param else "The request body is missing."
        )
        code = "missing_required_parameter"
    elif param is None and etype in ("model_attributes_type", "model_type", "dict_type"):
        message = "The request body must be a JSON object"
    elif param is None:
        message = f"Invalid request body: {msg}"
    else:
        message = f"Invalid value for '{param}': {msg}"
    if not message.endswith("."):
        message += "."
    if others:
        message += f" ({others} more invalid parameter{'s' if others > 1 else ''})"
    return invalid_request(message, param, code)


def install_error_handlers(app: FastAPI) -> None:
    """Render EPDError, validation errors, HTTP errors and crashes as OpenAI JSON."""

    async def on_epd_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, EPDError)
        return error_response(exc)

    async def on_validation_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError)
        return error_response(from_validation_errors(list(exc.errors())))

    async def on_http_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, StarletteHTTPException)
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        err = EPDError(str(exc.detail), code=code, status=exc.status_code, headers=exc.headers)
        if exc.status_code >= 500:
            err.type = "internal_error"
        return error_response(err)

    async def on_unhandled(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error in %s %s", request.method, request.url.path, exc_info=exc)
        return error_response(internal_error())

    app.add_exception_handler(EPDError, on_epd_error)
    app.add_exception_handler(RequestValidationError, on_validation_error)
    app.add_exception_handler(StarletteHTTPException, on_http_error)
    app.add_exception_handler(Exception, on_unhandled)
