"""FastAPI wiring every Crucible service shares: the one error envelope, on every error path.

FastAPI is imported lazily so `crucible_shared` installs without it (`crucible-shared[server]`).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

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


# Responses to declare on routes so OpenAPI documents the envelope.
ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorEnvelope, "description": name.replace("_", " ")}
    for code, name in _CODES.items()
    if code in (400, 401, 413, 422, 429, 503)
}


def install_error_handlers(app: FastAPI) -> None:
    """Route validation errors, HTTP errors, `ApiError` and crashes into the envelope."""
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse
    from starlette.exceptions import HTTPException as StarletteHTTPException

    @app.exception_handler(ApiError)
    async def _api_error(request, exc: ApiError):  # type: ignore[no-untyped-def]
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation(request, exc: RequestValidationError):  # type: ignore[no-untyped-def]
        errors = exc.errors()
        details = [
            {"field": field_path(e.get("loc", ())), "message": e.get("msg", ""), "type": e.get("type", "")}
            for e in errors
        ]
        first = details[0] if details else {"field": "body", "message": "invalid request"}
        if first.get("type") == "json_invalid":
            first["field"] = "body"
            message = f"malformed JSON: {first['message']}"
        else:
            message = f"{first['field']}: {first['message']}"
        return JSONResponse(error_body(422, message, field=first["field"], details=details), status_code=422)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request, exc: StarletteHTTPException):  # type: ignore[no-untyped-def]
        return JSONResponse(
            error_body(exc.status_code, str(exc.detail)), status_code=exc.status_code, headers=exc.headers
        )

    @app.exception_handler(Exception)
    async def _crash(request, exc: Exception):  # type: ignore[no-untyped-def]
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return JSONResponse(
            error_body(500, "internal error; see the service log", code="internal"), status_code=500
        )
