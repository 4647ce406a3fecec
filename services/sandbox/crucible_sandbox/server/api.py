"""The sandbox's app: the service, its middleware and error handlers, and the routes of `routes`
and `fusion` (thin: the logic lives in `service`).

Middleware, outermost first, wraps every route (those added later too): `TenantAuth` maps the key
to its tenant before a byte of the body is read (401 otherwise) and leaves it on
`request.state.tenant` (the dependency `Caller`); `BodyLimit` cuts the body off at
`max_body_bytes` while it streams in, before anything parses it.
"""

from __future__ import annotations

from contextlib import asynccontextmanager

from crucible_shared.http import ApiError, BodyLimit, error_response, install_error_handlers
from crucible_shared.sandbox import RunRequest
from crucible_shared.tenants import TenantAuth
from fastapi import FastAPI
from pydantic import ValidationError
from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from crucible_sandbox.server import fusion, routes
from crucible_sandbox.server.routes import as_json
from crucible_sandbox.server.service import SandboxService
from crucible_sandbox.server.settings import Settings


class SingleRuns:
    """`POST /v1/runs` served in front of the router: the hot path of interactive use.

    FastAPI's routing, dependency solving and body handling cost more server CPU per call than
    everything else this route does. Same checks as the route: pydantic validates the raw body
    against `RunRequest`, the tenant `TenantAuth` found, the same error envelope. A body that does not
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
            tenant = scope["state"]["tenant"]  # set by TenantAuth, which runs first
            response = as_json(await self.service.run_one(run, tenant))
        except ApiError as exc:
            response = error_response(exc)
        await response(scope, receive, send)


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
    app.state.tenants = settings.tenant_table()
    install_error_handlers(app)

    app.add_middleware(SingleRuns, service=service)
    # Added last, so outermost: the key is checked, then the body capped, before any route reads it.
    app.add_middleware(BodyLimit, max_bytes=settings.max_body_bytes)
    app.add_middleware(TenantAuth, table=app.state.tenants)

    for router in (routes.runs, fusion.router, routes.ops):  # the OpenAPI document's order
        app.include_router(router)
    return app
