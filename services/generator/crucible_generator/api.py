"""The generator's app: the routes of `routes`, vLLM's status codes and error body, request metrics.

Every error, including request validation, is vLLM's `ErrorResponse`
(`{"error": {"message", "type", "param", "code"}}`); validation failures are 400, as in vLLM.
The handlers are this module's functions (`HANDLERS`), which `create_app` installs.
The model is loaded in the lifespan hook, so `/health` answers only once the server can generate.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from http import HTTPStatus
from typing import Any

from crucible_shared.openai_protocol import ErrorInfo, ErrorResponse
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from .errors import GeneratorError
from .routes import ClientGone, router
from .service import GeneratorService, build_service
from .settings import Settings
from .sizing import BudgetError

log = logging.getLogger(__name__)


def _clean_loc(loc: tuple | list) -> str | None:
    """`("body", "prompt", "list[int]")` -> `"prompt"`: drop pydantic's union-branch markers, as vLLM does."""
    parts = [str(p) for p in loc if str(p) != "body" and not set("[](){}") & set(str(p))]
    return ".".join(parts) or None


def _error(status: int, message: str, type_: str, param: str | None = None) -> JSONResponse:
    body = ErrorResponse(error=ErrorInfo(message=message, type=type_, param=param, code=status))
    return JSONResponse(body.model_dump(), status_code=status)


class RequestMetrics:
    """Counts requests by route and status (a plain ASGI middleware: Starlette's `BaseHTTPMiddleware`
    would hide client disconnects from the routes)."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = {"code": 500}

        async def send_and_record(message: dict) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        started = time.perf_counter()
        try:
            await self.app(scope, receive, send_and_record)
        finally:
            service = getattr(scope["app"].state, "service", None)
            if service is not None:
                route = getattr(scope.get("route"), "path", "unmatched")
                metrics = service.engine.metrics
                metrics.requests.labels(route=route, status=str(status["code"])).inc()
                if route.endswith("completions"):
                    metrics.request_seconds.labels(route=route).observe(time.perf_counter() - started)


async def generator_error(_: Request, exc: GeneratorError) -> JSONResponse:
    return JSONResponse(exc.to_response().model_dump(), status_code=exc.status.value)


async def validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
    errors = exc.errors()
    param = None
    if errors:
        param = _clean_loc(errors[0].get("loc", ()))
    lines = [
        f"  {{'type': {e.get('type')!r}, 'loc': {e.get('loc')!r}, 'msg': {e.get('msg')!r}}}" for e in errors
    ]
    label = "error" if len(errors) == 1 else "errors"
    message = f"{len(errors)} validation {label}:\n" + "\n".join(lines)
    return _error(400, message, HTTPStatus.BAD_REQUEST.phrase, param)


async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
    return _error(exc.status_code, str(exc.detail), HTTPStatus(exc.status_code).phrase)


async def client_gone(_: Request, exc: ClientGone) -> Response:
    return Response(status_code=499)  # nobody reads it; nginx's "client closed request"


async def unexpected_error(_: Request, exc: Exception) -> JSONResponse:
    return _error(500, f"{type(exc).__name__}: {exc}", "InternalServerError")


# Exception class -> handler, in the order `create_app` installs them.
HANDLERS: dict[type[Exception], Callable[..., Awaitable[Response]]] = {
    GeneratorError: generator_error,
    RequestValidationError: validation_error,
    StarletteHTTPException: http_error,
    ClientGone: client_gone,
    Exception: unexpected_error,
}


def create_app(settings: Settings | None = None, service: GeneratorService | None = None) -> FastAPI:
    """The ASGI app; builds (and later stops) a service from `settings` unless one is given."""
    settings = settings or Settings()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        owned = service is None
        try:
            app.state.service = service or build_service(settings)
        except BudgetError as exc:  # one line that says why, before the traceback
            log.error("the generator does not fit in its memory budget: %s", exc)
            raise
        try:
            yield
        finally:
            if owned:
                app.state.service.engine.stop()

    app = FastAPI(title="Crucible generator", version="1", lifespan=lifespan)
    app.add_middleware(RequestMetrics)

    for exc_class, handler in HANDLERS.items():
        app.add_exception_handler(exc_class, handler)
    app.include_router(router)
    return app
