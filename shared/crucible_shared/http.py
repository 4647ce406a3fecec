"""FastAPI wiring every Crucible service shares: the one error envelope, on every error path.

FastAPI is imported lazily so `crucible_shared` installs without it (`crucible-shared[server]`).
"""

from __future__ import annotations

import hmac
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, cast

from crucible_shared.errors import ErrorDetail, ErrorEnvelope

if TYPE_CHECKING:
    from fastapi import FastAPI

log = logging.getLogger(__name__)

_CODES = {
    400: "bad_request",
    401: "unauthorized",
    403: "forbidden",
    404: "not_found",
    405: "method_not_allowed",
    409: "conflict",
    413: "payload_too_large",
    415: "unsupported_media_type",
    422: "invalid_request",
    429: "too_many_requests",
    503: "unavailable",
}


class ApiError(Exception):
    """Raise from service code to answer with the error envelope."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        field: str | None = None,
        code: str | None = None,
        headers: dict | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.field = status, message, field
        self.code = code or _CODES.get(status, "error")
        self.headers = headers or {}


def error_body(
    status: int, message: str, *, field: str | None = None, code: str | None = None, details=None
) -> dict:
    detail = ErrorDetail(
        code=code or _CODES.get(status, "error"), message=message, status=status, field=field, details=details
    )
    return ErrorEnvelope(error=detail).model_dump(mode="json", exclude_none=True)


def error_response(exc: ApiError):  # -> starlette JSONResponse (imported lazily)
    """The envelope response for an `ApiError`, for handlers and for plain ASGI code alike."""
    from starlette.responses import JSONResponse

    body = error_body(exc.status, exc.message, field=exc.field, code=exc.code)
    return JSONResponse(body, status_code=exc.status, headers=exc.headers)


def field_path(loc: tuple | list) -> str:
    """`("body", "runs", 0, "code")` -> `runs.0.code`."""
    parts = [str(p) for p in loc if p not in ("body", "query", "path", "header")]
    return ".".join(parts) or "body"


def error_field(error: dict) -> str:
    """The dotted field of one pydantic error; cross-field errors that name a field deeper than
    where they were raised (`crucible_shared.jobs.unused`) carry it in their context."""
    where = field_path(error.get("loc", ()))
    deeper = (error.get("ctx") or {}).get("field")
    if deeper:
        return deeper if where == "body" else f"{where}.{deeper}"
    return where


# Responses to declare on routes so OpenAPI documents the envelope.
ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorEnvelope, "description": name.replace("_", " ")}
    for code, name in _CODES.items()
    if code in (400, 401, 413, 422, 429, 503)
}


async def api_error(request, exc: Exception):
    """`ApiError` -> the envelope."""
    return error_response(cast(ApiError, exc))


async def validation_error(request, exc):
    """FastAPI's `RequestValidationError` -> a 422 envelope naming the first field, all in `details`."""
    from fastapi.responses import JSONResponse

    errors = exc.errors()
    details = [
        {"field": error_field(e), "message": e.get("msg", ""), "type": e.get("type", "")} for e in errors
    ]
    first = details[0] if details else {"field": "body", "message": "invalid request"}
    if first.get("type") == "json_invalid":
        first["field"] = "body"
        message = f"malformed JSON: {first['message']}"
    else:
        message = f"{first['field']}: {first['message']}"
    return JSONResponse(error_body(422, message, field=first["field"], details=details), status_code=422)


async def http_error(request, exc):
    """Starlette's `HTTPException` (404 for an unknown path, 405, ...) -> the envelope."""
    from fastapi.responses import JSONResponse

    if exc.status_code == 400 and exc.detail == "There was an error parsing the body":
        # FastAPI's answer when the body is not UTF-8, or Python's JSON parser gives up (an
        # integer over 4,300 digits, nesting deeper than its recursion limit): malformed JSON
        # as any other, in the same words and with the field.
        message = (
            "malformed JSON: the body could not be parsed (it must be UTF-8, its integers under "
            "4,300 digits and its nesting within the parser's depth limit)"
        )
        return JSONResponse(error_body(422, message, field="body"), status_code=422)
    return JSONResponse(
        error_body(exc.status_code, str(exc.detail)), status_code=exc.status_code, headers=exc.headers
    )


async def crash(request, exc: Exception):
    """Anything else -> a logged 500 envelope that shows nothing of the error."""
    from fastapi.responses import JSONResponse

    log.exception("unhandled error on %s %s", request.method, request.url.path)
    return JSONResponse(
        error_body(500, "internal error; see the service log", code="internal"), status_code=500
    )


def install_error_handlers(app: FastAPI) -> None:
    """Route validation errors, HTTP errors, `ApiError` and crashes into the envelope (the
    handlers above)."""
    from fastapi.exceptions import RequestValidationError
    from starlette.exceptions import HTTPException as StarletteHTTPException

    app.add_exception_handler(ApiError, api_error)
    app.add_exception_handler(RequestValidationError, validation_error)
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(Exception, crash)


async def send_error(
    send: Any, status: int, message: str, field: str | None, headers: dict | None = None
) -> None:
    """Send a whole error-envelope response on a raw ASGI `send`."""
    import json

    body = json.dumps(error_body(status, message, field=field)).encode()
    raw = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    raw += [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": body})


class BodyLimit:
    """ASGI middleware: 413 for a request body over `max_bytes`, declared or not.

    A declared `Content-Length` over the limit is refused before anything is read; a chunked
    body is counted as it arrives and cut off at the limit (the application sees the client
    disconnect and its answer is replaced by the 413), so nothing past the limit is buffered.
    A plain ASGI middleware: Starlette's `BaseHTTPMiddleware` costs a task group per request.
    """

    def __init__(self, app: Any, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        message = f"request body is larger than {self.max_bytes} bytes"
        length = dict(scope.get("headers") or []).get(b"content-length", b"")
        if length.isdigit() and int(length) > self.max_bytes:
            await send_error(send, 413, message, "body")
            return
        state = {"received": 0, "too_large": False, "answered": False}

        async def limited_receive() -> Any:
            if state["too_large"]:
                return {"type": "http.disconnect"}
            event = await receive()
            if event["type"] == "http.request":
                state["received"] += len(event.get("body", b""))
                if state["received"] > self.max_bytes:
                    state["too_large"] = True
                    return {"type": "http.disconnect"}
            return event

        async def guarded_send(event: Any) -> None:
            if not state["too_large"]:
                await send(event)
            elif not state["answered"]:
                state["answered"] = True
                await send_error(send, 413, message, "body")

        try:
            await self.app(scope, limited_receive, guarded_send)
        except Exception:
            if not state["too_large"]:
                raise
        if state["too_large"] and not state["answered"]:
            state["answered"] = True
            await send_error(send, 413, message, "body")


def check_bearer(keys: Sequence[str], header: str | None) -> str | None:
    """The caller's key from an `Authorization: Bearer` header (None while `keys` is empty);
    `ApiError` 401 without a valid one. Keys are compared in constant time."""
    if not keys:
        return None
    scheme, _, token = (header or "").partition(" ")
    if scheme.lower() != "bearer" or not token:
        raise ApiError(
            401, "missing API key: send `Authorization: Bearer <key>`", headers={"WWW-Authenticate": "Bearer"}
        )
    for key in keys:
        if hmac.compare_digest(key.encode(), token.encode()):
            return key
    raise ApiError(401, "invalid API key", headers={"WWW-Authenticate": "Bearer"})
