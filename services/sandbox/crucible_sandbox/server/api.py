"""HTTP routes of the sandbox service (thin: the logic lives in `service`)."""

from __future__ import annotations

from contextlib import asynccontextmanager

from crucible_shared.http import (
    ERROR_RESPONSES,
    ApiError,
    BodyLimit,
    check_bearer,
    error_response,
    install_error_handlers,
)
from crucible_shared.sandbox import BatchRequest, BatchResponse, RunRequest, RunResult, SandboxHealth
from fastapi import Depends, FastAPI, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ValidationError
from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from crucible_sandbox.server import fusion
from crucible_sandbox.server.service import SandboxService
from crucible_sandbox.server.settings import Settings


def _key(settings: Settings, header: str | None) -> str | None:
    """The caller's API key (None while auth is off); `ApiError` 401 without a valid one."""
    return check_bearer(settings.api_keys, header)


class SingleRuns:
    """`POST /v1/runs` served in front of the router: the hot path of interactive use.

    FastAPI's routing, dependency solving and body handling cost more server CPU per call than
    everything else this route does. Same checks as the route: pydantic validates the raw body
    against `RunRequest`, the same key check, the same error envelope. A body that does not
    validate, or is not declared JSON, goes on to the router as it was (FastAPI words the 422).
    """

    def __init__(self, app: ASGIApp, service: SandboxService) -> None:
        self.app, self.service = app, service

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST" or scope["path"] != "/v1/runs":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        body = bytearray()
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        try:
            if headers.get("content-type", "").split(";")[0].strip() != "application/json":
                raise ValueError("not declared JSON")
            run = RunRequest.model_validate_json(body)
        except (ValidationError, ValueError):
            replayed = False

            async def replay() -> Message:
                nonlocal replayed
                if replayed:
                    return await receive()
                replayed = True
                return {"type": "http.request", "body": bytes(body), "more_body": False}

            await self.app(scope, replay, send)
            return
        try:
            key = _key(self.service.settings, headers.get("authorization"))
            response = _json(await self.service.run_one(run, key))
        except ApiError as exc:
            response = error_response(exc)
        await response(scope, receive, send)


def _json(model: BaseModel) -> Response:
    """A result, already validated, serialised once by pydantic (FastAPI would check it again
    against `response_model`, which stays for the OpenAPI schema)."""
    return Response(model.model_dump_json(), media_type="application/json")


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
        description="Runs untrusted programs (Python, and C++, Java, JavaScript, Go, Rust, Bash) against tests (asserts, check functions, stdin/stdout) with isolation and rich feedback.",
        lifespan=lifespan,
    )
    app.state.service = service
    install_error_handlers(app)

    app.add_middleware(SingleRuns, service=service)
    # Added last, so outermost: the body limit applies to the fast path too.
    app.add_middleware(BodyLimit, max_bytes=settings.max_body_bytes)

    # async: a plain `def` dependency would be run in a thread for every request.
    async def api_key(request: Request) -> str | None:
        return _key(settings, request.headers.get("authorization"))

    @app.post(
        "/v1/runs",
        response_model=RunResult,
        responses=ERROR_RESPONSES,
        summary="Run one program against its tests",
    )
    async def run(body: RunRequest, key: str | None = Depends(api_key)) -> Response:
        return _json(await service.run_one(body, key))

    @app.post(
        "/v1/runs/batch",
        response_model=BatchResponse,
        responses=ERROR_RESPONSES,
        summary="Run many programs; results in order",
    )
    async def run_batch(body: BatchRequest, key: str | None = Depends(api_key)) -> Response:
        return _json(BatchResponse(results=await service.run_batch(body.runs, key)))

    fusion.register(app, service, api_key)  # SandboxFusion's /run_code and /run_jupyter

    @app.get("/health", response_model=SandboxHealth, summary="Liveness, workers and the isolation in force")
    async def health() -> SandboxHealth:
        return SandboxHealth(
            workers=settings.workers,
            pending=service.pool.pending,
            isolation=service.isolation,
            auth=bool(settings.api_keys),
            languages=service.languages,
        )

    @app.get("/metrics", summary="Prometheus metrics", response_class=Response)
    async def metrics() -> Response:
        return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)

    return app
