"""Thin FastAPI routes of the generator, with vLLM's paths, status codes and error body.

Every error, including request validation, is vLLM's `ErrorResponse`
(`{"error": {"message", "type", "param", "code"}}`); validation failures are 400, as in vLLM.
The model is loaded in the lifespan hook, so `/health` answers only once the server can generate.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from http import HTTPStatus
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from .errors import GeneratorError
from .protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    ErrorInfo,
    ErrorResponse,
    LoadLoRAAdapterRequest,
    ModelList,
    UnloadLoRAAdapterRequest,
)
from .service import GeneratorService, build_service
from .settings import Settings
from .sizing import BudgetError

log = logging.getLogger(__name__)

T = TypeVar("T")

ERRORS: dict[int | str, dict[str, Any]] = {status: {"model": ErrorResponse} for status in (400, 404, 500)}


def _clean_loc(loc: tuple | list) -> str | None:
    """`("body", "prompt", "list[int]")` -> `"prompt"`: drop pydantic's union-branch markers, as vLLM does."""
    parts = [str(p) for p in loc if str(p) != "body" and not set("[](){}") & set(str(p))]
    return ".".join(parts) or None


def _error(status: int, message: str, type_: str, param: str | None = None) -> JSONResponse:
    body = ErrorResponse(error=ErrorInfo(message=message, type=type_, param=param, code=status))
    return JSONResponse(body.model_dump(), status_code=status)


class ClientGone(Exception):
    """The client hung up before its completion was ready."""


async def until_disconnect(request: Request, work: Awaitable[T], poll_s: float = 0.5) -> T:
    """Await `work`, cancelling it if the client disconnects first (its sequences leave the batch)."""
    task = asyncio.ensure_future(work)
    while True:
        done, _ = await asyncio.wait({task}, timeout=poll_s)
        if done:
            return task.result()
        if await request.is_disconnected():
            task.cancel()
            raise ClientGone


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

    def svc(request: Request) -> GeneratorService:
        return request.app.state.service

    @app.exception_handler(GeneratorError)
    async def generator_error(_: Request, exc: GeneratorError) -> JSONResponse:
        return JSONResponse(exc.to_response().model_dump(), status_code=exc.status.value)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        param = None
        if errors:
            param = _clean_loc(errors[0].get("loc", ()))
        lines = [
            f"  {{'type': {e.get('type')!r}, 'loc': {e.get('loc')!r}, 'msg': {e.get('msg')!r}}}"
            for e in errors
        ]
        label = "error" if len(errors) == 1 else "errors"
        message = f"{len(errors)} validation {label}:\n" + "\n".join(lines)
        return _error(400, message, HTTPStatus.BAD_REQUEST.phrase, param)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return _error(exc.status_code, str(exc.detail), HTTPStatus(exc.status_code).phrase)

    @app.exception_handler(ClientGone)
    async def client_gone(_: Request, exc: ClientGone) -> Response:
        return Response(status_code=499)  # nobody reads it; nginx's "client closed request"

    @app.exception_handler(Exception)
    async def unexpected_error(_: Request, exc: Exception) -> JSONResponse:
        return _error(500, f"{type(exc).__name__}: {exc}", "InternalServerError")

    @app.get("/health", responses=ERRORS)
    async def health() -> Response:
        return Response(status_code=200)

    @app.get("/metrics", responses=ERRORS)
    async def metrics(request: Request) -> Response:
        service = svc(request)
        return Response(service.engine.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models", response_model=ModelList, responses=ERRORS)
    async def models(request: Request) -> ModelList:
        return svc(request).list_models()

    @app.post("/v1/completions", response_model=CompletionResponse, responses=ERRORS)
    async def completions(body: CompletionRequest, request: Request) -> JSONResponse:
        result = await until_disconnect(request, svc(request).complete(body))
        return JSONResponse(result.model_dump())

    @app.post("/v1/chat/completions", response_model=ChatCompletionResponse, responses=ERRORS)
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> JSONResponse:
        result = await until_disconnect(request, svc(request).chat(body))
        return JSONResponse(result.model_dump())

    @app.post("/v1/load_lora_adapter", response_class=PlainTextResponse, responses=ERRORS)
    async def load_lora_adapter(body: LoadLoRAAdapterRequest, request: Request) -> PlainTextResponse:
        return PlainTextResponse(await svc(request).load_adapter(body))

    @app.post("/v1/unload_lora_adapter", response_class=PlainTextResponse, responses=ERRORS)
    async def unload_lora_adapter(body: UnloadLoRAAdapterRequest, request: Request) -> PlainTextResponse:
        return PlainTextResponse(await svc(request).unload_adapter(body))

    return app
