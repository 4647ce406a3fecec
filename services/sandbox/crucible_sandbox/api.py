"""HTTP routes of the sandbox service (thin: the logic lives in `service`)."""

from __future__ import annotations

import hmac
from contextlib import asynccontextmanager

from crucible_shared.http import ERROR_RESPONSES, ApiError, error_body, install_error_handlers
from crucible_shared.sandbox import BatchRequest, BatchResponse, RunRequest, RunResult
from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.datastructures import Headers
from starlette.types import ASGIApp, Receive, Scope, Send

from crucible_sandbox.service import SandboxService
from crucible_sandbox.settings import Settings


class BodyLimit:
    """413 for a declared body over `max_bytes`, before it is read.

    A plain ASGI middleware: Starlette's `BaseHTTPMiddleware` costs a task group per request.
    """

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            length = Headers(scope=scope).get("content-length")
            if length and length.isdigit() and int(length) > self.max_bytes:
                body = error_body(413, f"request body is larger than {self.max_bytes} bytes", field="body")
                await JSONResponse(body, status_code=413)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or Settings()
    service = SandboxService(settings)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await service.start()
        yield
        await service.stop()

    app = FastAPI(
        title="Crucible sandbox",
        version="1",
        description="Runs untrusted Python against tests (asserts, check functions, stdin/stdout) with isolation and rich feedback.",
        lifespan=lifespan,
    )
    app.state.service = service
    install_error_handlers(app)

    app.add_middleware(BodyLimit, max_bytes=settings.max_body_bytes)

    # async: a plain `def` dependency would be run in a thread for every request.
    async def api_key(request: Request) -> str | None:
        if not settings.api_keys:
            return None
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not token:
            raise ApiError(
                401,
                "missing API key: send `Authorization: Bearer <key>`",
                headers={"WWW-Authenticate": "Bearer"},
            )
        for key in settings.api_keys:
            if hmac.compare_digest(key.encode(), token.encode()):
                return key
        raise ApiError(401, "invalid API key", headers={"WWW-Authenticate": "Bearer"})

    @app.post(
        "/v1/runs",
        response_model=RunResult,
        responses=ERROR_RESPONSES,
        summary="Run one program against its tests",
    )
    async def run(body: RunRequest, key: str | None = Depends(api_key)) -> RunResult:
        return await service.run_one(body, key)

    @app.post(
        "/v1/runs/batch",
        response_model=BatchResponse,
        responses=ERROR_RESPONSES,
        summary="Run many programs; results in order",
    )
    async def run_batch(body: BatchRequest, key: str | None = Depends(api_key)) -> BatchResponse:
        return BatchResponse(results=await service.run_batch(body.runs, key))

    @app.get("/health", summary="Liveness, workers and the isolation mode in force")
    async def health() -> dict:
        info = service.pool.isolation
        return {
            "status": "ok",
            "workers": settings.workers,
            "pending": service.pool.pending,
            "isolation": {"mode": info.get("mode"), **info.get("caps", {})},
            "auth": bool(settings.api_keys),
        }

    @app.get("/metrics", summary="Prometheus metrics", response_class=Response)
    async def metrics() -> Response:
        return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)

    return app
