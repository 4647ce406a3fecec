"""HTTP routes of the gateway (thin: the logic lives in `service`)."""

from __future__ import annotations

import asyncio
import hmac
import json
from contextlib import asynccontextmanager
from typing import Annotated

import redis
from crucible_shared.http import ERROR_RESPONSES, ApiError, error_body, install_error_handlers
from crucible_shared.jobs import JobSpec
from fastapi import Body, Depends, FastAPI, Header, Query, Request
from fastapi.responses import FileResponse, JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, Counter, generate_latest
from sse_starlette.sse import EventSourceResponse

from crucible_gateway.protocol import (
    FINAL,
    AdapterList,
    ArtifactList,
    JobCreated,
    JobList,
    JobStatus,
    JobView,
)
from crucible_gateway.service import GatewayService
from crucible_gateway.settings import Settings
from crucible_gateway.store import JobStore

SUBMITTED = Counter("crucible_gateway_jobs_submitted_total", "Jobs accepted, by kind.", ["kind"])


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or Settings()
    client = redis.Redis.from_url(settings.redis_url, socket_timeout=5, socket_connect_timeout=3)
    store = JobStore(client, settings.train_job_timeout_s, settings.eval_job_timeout_s)
    service = GatewayService(settings, store)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        client.close()

    app = FastAPI(
        title="Crucible gateway",
        version="1",
        description="Submit, watch and cancel training and evaluation jobs; download their reports and adapters.",
        lifespan=lifespan,
    )
    app.state.service = service
    install_error_handlers(app)

    @app.exception_handler(redis.exceptions.ConnectionError)
    @app.exception_handler(redis.exceptions.TimeoutError)
    async def _redis_down(request: Request, exc: Exception) -> JSONResponse:
        body = error_body(
            503,
            "the job store (Redis) is unreachable; check REDIS_URL and that Redis is running",
            code="unavailable",
        )
        return JSONResponse(body, status_code=503, headers={"Retry-After": "5"})

    def api_key(request: Request) -> None:
        if not settings.api_keys:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not token:
            raise ApiError(
                401,
                "missing API key: send `Authorization: Bearer <key>`",
                headers={"WWW-Authenticate": "Bearer"},
            )
        if not any(hmac.compare_digest(k.encode(), token.encode()) for k in settings.api_keys):
            raise ApiError(401, "invalid API key", headers={"WWW-Authenticate": "Bearer"})

    auth = [Depends(api_key)]

    def base(request: Request) -> str:
        return str(request.base_url).rstrip("/")

    @app.post(
        "/v1/jobs",
        status_code=202,
        response_model=JobCreated,
        responses=ERROR_RESPONSES,
        dependencies=auth,
        summary="Submit a train or eval job",
    )
    async def submit(
        request: Request,
        spec: Annotated[JobSpec, Body(description="A `train` or `eval` job spec.")],
        idempotency_key: Annotated[str | None, Header(max_length=200)] = None,
    ) -> JSONResponse:
        job_id, created = await asyncio.to_thread(service.submit, spec, idempotency_key)
        view = await asyncio.to_thread(service.view, job_id, False)
        if created:
            SUBMITTED.labels(spec.kind).inc()
        url = f"{base(request)}/v1/jobs/{job_id}"
        body = JobCreated(id=job_id, status=view.status, location=url, events=f"{url}/events")
        return JSONResponse(
            body.model_dump(mode="json"), status_code=202 if created else 200, headers={"Location": url}
        )

    @app.get(
        "/v1/jobs",
        response_model=JobList,
        responses=ERROR_RESPONSES,
        dependencies=auth,
        summary="List jobs, newest first",
    )
    async def list_jobs(
        status: JobStatus | None = None,
        kind: Annotated[str | None, Query(pattern="^(train|eval)$")] = None,
        offset: Annotated[int, Query(ge=0, le=1_000_000_000)] = 0,
        limit: Annotated[int, Query(ge=1, le=500)] = 50,
    ) -> JobList:
        jobs, total = await asyncio.to_thread(service.list, status, kind, offset, limit)
        return JobList(jobs=jobs, total=total, offset=offset, limit=limit)

    @app.get(
        "/v1/jobs/{job_id}",
        response_model=JobView,
        responses={404: ERROR_RESPONSES[422] | {"description": "unknown job"}},
        dependencies=auth,
    )
    async def get_job(job_id: str) -> JobView:
        return await asyncio.to_thread(service.view, job_id)

    @app.post(
        "/v1/jobs/{job_id}/cancel", response_model=JobView, dependencies=auth, summary="Ask a job to stop"
    )
    async def cancel(job_id: str) -> JobView:
        return await asyncio.to_thread(service.cancel, job_id)

    @app.post(
        "/v1/jobs/{job_id}/retry",
        response_model=JobView,
        dependencies=auth,
        summary="Run a failed or cancelled job again (resumes from its checkpoint)",
    )
    async def retry(job_id: str) -> JobView:
        return await asyncio.to_thread(service.retry, job_id)

    @app.get(
        "/v1/jobs/{job_id}/events",
        dependencies=auth,
        summary="Server-Sent Events from the job's stream (resumable with Last-Event-ID)",
    )
    async def events(job_id: str, request: Request, last_event_id: Annotated[str | None, Header()] = None):
        await asyncio.to_thread(service.view, job_id, False)

        async def stream():
            last = last_event_id or "0-0"
            while True:
                if await request.is_disconnected():
                    return
                found = await asyncio.to_thread(store.events_after, job_id, last, 1000)
                for entry_id, data in found:
                    last = entry_id
                    yield {
                        "id": entry_id,
                        "event": str(data.get("type", "message")),
                        "data": json.dumps(data),
                    }
                if not found:
                    view = await asyncio.to_thread(service.view, job_id, False)
                    if view.status in FINAL:
                        yield {"event": "end", "data": json.dumps({"status": view.status.value})}
                        return

        return EventSourceResponse(stream(), ping=15)

    @app.get(
        "/v1/jobs/{job_id}/artifacts",
        response_model=ArtifactList,
        dependencies=auth,
        summary="Reports, metrics and adapters of a job",
    )
    async def artifacts(job_id: str, request: Request) -> ArtifactList:
        return ArtifactList(
            job_id=job_id, artifacts=await asyncio.to_thread(service.artifacts, job_id, base(request))
        )

    @app.get("/v1/jobs/{job_id}/artifacts/{path:path}", dependencies=auth, summary="Download one artifact")
    async def artifact(job_id: str, path: str) -> FileResponse:
        return FileResponse(await asyncio.to_thread(service.artifact_path, job_id, path))

    @app.get(
        "/v1/adapters", response_model=AdapterList, dependencies=auth, summary="Adapter versions in the store"
    )
    async def adapters() -> AdapterList:
        return AdapterList(adapters=await asyncio.to_thread(service.adapters))

    @app.get("/health", summary="Liveness and Redis reachability")
    async def health() -> JSONResponse:
        try:
            await asyncio.to_thread(store.ping)
        except redis.exceptions.RedisError as exc:
            return JSONResponse(
                {"status": "degraded", "redis": False, "error": str(exc)[:200]}, status_code=503
            )
        return JSONResponse({"status": "ok", "redis": True, "auth": bool(settings.api_keys)})

    @app.get("/metrics", response_class=Response, summary="Prometheus metrics")
    async def metrics() -> Response:
        return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)

    return app
