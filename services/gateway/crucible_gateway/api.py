"""The gateway's app: Redis clients, the service, the reaper, middleware and error handlers.

The routes live in `crucible_gateway.routes`, one module per concern, and stay thin: the logic is
in `service`. Middleware wraps every route: `TenantAuth` maps the API key to its tenant before a
body is read (401 otherwise; routes take it as `deps.Caller`), and `BodyLimit` caps bodies while
they are read, before anything parses them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from contextlib import asynccontextmanager

import redis
import redis.asyncio
from crucible_shared.http import BodyLimit, error_body, install_error_handlers
from crucible_shared.lifecycle import JobKind
from crucible_shared.tenants import TenantAuth
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from redis.asyncio.retry import Retry as AsyncRetry
from redis.backoff import NoBackoff
from redis.retry import Retry

from crucible_gateway.openapi import with_event_schemas
from crucible_gateway.routes import ROUTERS
from crucible_gateway.service import GatewayService
from crucible_gateway.settings import Settings
from crucible_gateway.store import JobStore

log = logging.getLogger(__name__)


async def redis_down(request: Request, exc: Exception) -> JSONResponse:
    """Any route that finds Redis unreachable answers 503 with the one error envelope."""
    body = error_body(
        503,
        "the job store (Redis) is unreachable; check REDIS_URL and that Redis is running",
        code="unavailable",
    )
    return JSONResponse(body, status_code=503, headers={"Retry-After": "5"})


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or Settings()
    # A bounded pool: callers wait for a connection rather than fail when all are busy. A pooled
    # connection that a Redis restart closed fails its next command: redis-py's retry reconnects
    # and sends it once more (only on a connection error: a timeout may have run the command).
    dead = (redis.exceptions.ConnectionError,)
    pool = redis.asyncio.BlockingConnectionPool.from_url(
        settings.redis_url,
        max_connections=settings.redis_connections,
        timeout=10,
        socket_timeout=5,
        socket_connect_timeout=3,
        retry=AsyncRetry(NoBackoff(), 1, supported_errors=dead),
    )
    store = JobStore(
        redis.asyncio.Redis(connection_pool=pool),
        redis.Redis.from_url(
            settings.redis_url,
            socket_timeout=5,
            socket_connect_timeout=3,
            retry=Retry(NoBackoff(), 1, supported_errors=dead),
        ),
        {kind: settings.job_timeout_s(kind) for kind in JobKind},
    )
    service = GatewayService(settings, store)

    async def reaper() -> None:
        while True:
            await asyncio.sleep(settings.reap_interval_s)
            try:
                for job_id, status in await service.reap():
                    log.warning("job %s moved on by the reaper: now %s", job_id, status.value)
            except Exception as exc:  # a Redis blip must not stop the reaper
                service.redis_lost()
                log.warning("reaping failed: %r", exc)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        task = asyncio.create_task(reaper())
        yield
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await store.close()

    app = FastAPI(
        title="Crucible gateway",
        version="1",
        description="Submit, watch and cancel training and evaluation jobs; download their reports and adapters.",
        lifespan=lifespan,
    )
    app.state.service = service
    install_error_handlers(app)
    # Outermost first: authenticate, then cap the body.
    app.add_middleware(BodyLimit, max_bytes=settings.max_body_bytes)
    app.add_middleware(TenantAuth, table=service.tenants)

    app.add_exception_handler(redis.exceptions.ConnectionError, redis_down)
    app.add_exception_handler(redis.exceptions.TimeoutError, redis_down)
    for router in ROUTERS:
        app.include_router(router)
    return with_event_schemas(app)
