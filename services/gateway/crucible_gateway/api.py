"""HTTP routes of the gateway (thin: the logic lives in `service`).

API keys are checked by middleware before a body is read, and bodies are capped while they are
read. Event streams are served from an asyncio Redis client: an open stream costs a connection,
never a thread, so any number of watchers leave the other routes responsive.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
from contextlib import asynccontextmanager
from typing import Annotated

import redis
import redis.asyncio
from crucible_shared.events import sse_openapi
from crucible_shared.gateway_protocol import AdapterList, ArtifactList, JobCreated, JobList
from crucible_shared.http import (
    ERROR_RESPONSES,
    ApiError,
    BearerAuth,
    BodyLimit,
    error_body,
    install_error_handlers,
)
from crucible_shared.jobs import JobSpec
from crucible_shared.lifecycle import FINAL, JOB_ID_PATTERN, JobKind, JobRecord, JobStatus
from fastapi import Body, FastAPI, Header, Path, Query, Request
from fastapi.responses import FileResponse, JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, Counter, generate_latest
from sse_starlette.sse import EventSourceResponse

from crucible_gateway.openapi import with_event_schemas
from crucible_gateway.service import GatewayService
from crucible_gateway.settings import Settings
from crucible_gateway.store import JobStore

log = logging.getLogger(__name__)
SUBMITTED = Counter("crucible_gateway_jobs_submitted_total", "Jobs accepted, by kind.", ["kind"])
STREAM_ID = re.compile(r"^\d{1,20}-\d{1,20}$")
JobId = Annotated[str, Path(description="A job id.", pattern=JOB_ID_PATTERN, max_length=128)]


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or Settings()
    # A bounded pool: callers wait for a connection rather than fail when all are busy.
    pool = redis.asyncio.BlockingConnectionPool.from_url(
        settings.redis_url,
        max_connections=settings.redis_connections,
        timeout=10,
        socket_timeout=5,
        socket_connect_timeout=3,
    )
    store = JobStore(
        redis.asyncio.Redis(connection_pool=pool),
        redis.Redis.from_url(settings.redis_url, socket_timeout=5, socket_connect_timeout=3),
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
    app.add_middleware(BearerAuth, keys=settings.api_keys)

    @app.exception_handler(redis.exceptions.ConnectionError)
    @app.exception_handler(redis.exceptions.TimeoutError)
    async def _redis_down(request: Request, exc: Exception) -> JSONResponse:
        body = error_body(
            503,
            "the job store (Redis) is unreachable; check REDIS_URL and that Redis is running",
            code="unavailable",
        )
        return JSONResponse(body, status_code=503, headers={"Retry-After": "5"})

    def base(request: Request) -> str:
        return str(request.base_url).rstrip("/")

    @app.post(
        "/v1/jobs",
        status_code=202,
        response_model=JobCreated,
        responses=ERROR_RESPONSES,
        summary="Submit a train or eval job",
    )
    async def submit(
        request: Request,
        spec: Annotated[JobSpec, Body(description="A `train` or `eval` job spec.")],
        idempotency_key: Annotated[str | None, Header(max_length=200)] = None,
    ) -> JSONResponse:
        job_id, created = await service.submit(spec, idempotency_key)
        record = await service.view(job_id, False)
        if created:
            SUBMITTED.labels(spec.kind).inc()
        url = f"{base(request)}/v1/jobs/{job_id}"
        body = JobCreated(id=job_id, status=record.status, location=url, events=f"{url}/events")
        return JSONResponse(
            body.model_dump(mode="json"), status_code=202 if created else 200, headers={"Location": url}
        )

    @app.get("/v1/jobs", response_model=JobList, responses=ERROR_RESPONSES, summary="List jobs, newest first")
    async def list_jobs(
        status: JobStatus | None = None,
        kind: JobKind | None = None,
        offset: Annotated[int, Query(ge=0, le=1_000_000_000)] = 0,
        limit: Annotated[int, Query(ge=1, le=500)] = 50,
    ) -> JobList:
        jobs, total = await service.list_jobs(status, kind, offset, limit)
        return JobList(jobs=jobs, total=total, offset=offset, limit=limit)

    @app.get(
        "/v1/jobs/{job_id}", response_model=JobRecord, responses=ERROR_RESPONSES | {404: ERROR_RESPONSES[422]}
    )
    async def get_job(job_id: JobId) -> JobRecord:
        return await service.view(job_id)

    @app.post("/v1/jobs/{job_id}/cancel", response_model=JobRecord, summary="Ask a job to stop")
    async def cancel(job_id: JobId) -> JobRecord:
        return await service.cancel(job_id)

    @app.post(
        "/v1/jobs/{job_id}/retry",
        response_model=JobRecord,
        summary="Run a failed or cancelled job again (resumes from its checkpoint)",
    )
    async def retry(job_id: JobId) -> JobRecord:
        return await service.retry(job_id)

    @app.get(
        "/v1/jobs/{job_id}/events",
        summary="Server-Sent Events from the job's stream (resumable with Last-Event-ID)",
        responses=sse_openapi(),
        response_class=EventSourceResponse,
    )
    async def events(job_id: JobId, request: Request, last_event_id: Annotated[str | None, Header()] = None):
        if last_event_id is not None and not STREAM_ID.match(last_event_id):
            raise ApiError(
                422,
                "Last-Event-ID must be an event id this stream sent (like 1700000000000-0)",
                field="Last-Event-ID",
            )
        await service.view(job_id, False)

        async def stream_over(last: str) -> bool:
            """The job is over and every event it wrote has gone out (False on a Redis blip)."""
            try:
                record = await store.get(job_id)
                return (record is None or record.status in FINAL) and not await store.events_after(
                    job_id, last
                )
            except redis.exceptions.RedisError:
                return False

        async def stream():
            # Polled without blocking: an idle stream holds no Redis connection and no thread
            # between polls, so thousands of watchers cost the other routes nothing.
            last, idle = last_event_id or "0-0", 0
            while True:
                if await request.is_disconnected():
                    return
                try:
                    found = await store.events_after(job_id, last)
                except redis.exceptions.RedisError as exc:  # a Redis blip must not end the stream
                    log.warning("event stream of %s: %r; retrying", job_id, exc)
                    await asyncio.sleep(1.0)
                    continue
                for entry_id, data in found:
                    last = entry_id
                    yield {
                        "id": entry_id,
                        "event": str(data.get("type", "message")),
                        "data": json.dumps(data),
                    }
                if found:
                    idle = 0
                    continue
                if idle % 8 == 0 and await stream_over(last):  # every 8th idle poll
                    record = await store.get(job_id)
                    status = record.status.value if record else "gone"
                    yield {"event": "end", "data": json.dumps({"status": status})}
                    return
                idle += 1
                # A stream quiet for a while polls four times less often.
                await asyncio.sleep(settings.stream_poll_s * (1 if idle < 8 else 4))

        return EventSourceResponse(stream(), ping=15)

    @app.get(
        "/v1/jobs/{job_id}/artifacts",
        response_model=ArtifactList,
        summary="Reports, metrics and adapters of a job",
    )
    async def artifacts(job_id: JobId, request: Request) -> ArtifactList:
        root = await service.run_dir(job_id)
        found = await asyncio.to_thread(service.artifacts, root, job_id, base(request))
        return ArtifactList(job_id=job_id, artifacts=found)

    @app.get("/v1/jobs/{job_id}/artifacts/{path:path}", summary="Download one artifact")
    async def artifact(job_id: JobId, path: str) -> FileResponse:
        root = await service.run_dir(job_id)
        return FileResponse(await asyncio.to_thread(service.artifact_path, root, job_id, path))

    @app.get("/v1/adapters", response_model=AdapterList, summary="Adapter versions in the store")
    async def adapters() -> AdapterList:
        return AdapterList(adapters=await asyncio.to_thread(service.adapters))

    @app.get("/health", summary="Liveness and Redis reachability")
    async def health() -> JSONResponse:
        try:
            await store.ping()
        except redis.exceptions.RedisError as exc:
            return JSONResponse(
                {"status": "degraded", "redis": False, "error": str(exc)[:200]}, status_code=503
            )
        return JSONResponse({"status": "ok", "redis": True, "auth": bool(settings.api_keys)})

    @app.get("/metrics", response_class=Response, summary="Prometheus metrics")
    async def metrics() -> Response:
        return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)

    return with_event_schemas(app)
