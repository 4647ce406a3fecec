"""Job routes: submit, list, view, cancel, retry; each on the caller's own jobs (an admin: all)."""

from __future__ import annotations

from typing import Annotated

from crucible_shared.gateway_protocol import JobCreated, JobList
from crucible_shared.http import ERROR_RESPONSES
from crucible_shared.jobs import JobSpec
from crucible_shared.lifecycle import JobKind, JobRecord, JobStatus
from fastapi import APIRouter, Body, Header, Query, Request
from fastapi.responses import JSONResponse
from prometheus_client import Counter

from crucible_gateway.routes.deps import Caller, JobId, Service, base

SUBMITTED = Counter("crucible_gateway_jobs_submitted_total", "Jobs accepted, by kind.", ["kind"])
TENANT_SUBMITTED = Counter(
    "crucible_gateway_tenant_jobs_submitted_total", "Jobs accepted, by tenant and kind.", ["tenant", "kind"]
)
router = APIRouter()


@router.post(
    "/v1/jobs",
    status_code=202,
    response_model=JobCreated,
    responses=ERROR_RESPONSES,
    summary="Submit a train or eval job",
)
async def submit(
    request: Request,
    service: Service,
    tenant: Caller,
    spec: Annotated[JobSpec, Body(description="A `train` or `eval` job spec.")],
    idempotency_key: Annotated[str | None, Header(max_length=200)] = None,
) -> JSONResponse:
    job_id, created = await service.submit(spec, idempotency_key, tenant)
    record = await service.view(job_id, False, tenant)
    if created:
        SUBMITTED.labels(spec.kind).inc()
        TENANT_SUBMITTED.labels(tenant.name, spec.kind).inc()
    url = f"{base(request)}/v1/jobs/{job_id}"
    body = JobCreated(id=job_id, status=record.status, location=url, events=f"{url}/events")
    return JSONResponse(
        body.model_dump(mode="json"), status_code=202 if created else 200, headers={"Location": url}
    )


@router.get("/v1/jobs", response_model=JobList, responses=ERROR_RESPONSES, summary="List jobs, newest first")
async def list_jobs(
    service: Service,
    tenant: Caller,
    status: JobStatus | None = None,
    kind: JobKind | None = None,
    offset: Annotated[int, Query(ge=0, le=1_000_000_000)] = 0,
    limit: Annotated[int, Query(ge=1, le=500)] = 50,
) -> JobList:
    jobs, total = await service.list_jobs(status, kind, offset, limit, tenant)
    return JobList(jobs=jobs, total=total, offset=offset, limit=limit)


@router.get(
    "/v1/jobs/{job_id}", response_model=JobRecord, responses=ERROR_RESPONSES | {404: ERROR_RESPONSES[422]}
)
async def get_job(job_id: JobId, service: Service, tenant: Caller) -> JobRecord:
    return await service.view(job_id, tenant=tenant)


@router.post("/v1/jobs/{job_id}/cancel", response_model=JobRecord, summary="Ask a job to stop")
async def cancel(job_id: JobId, service: Service, tenant: Caller) -> JobRecord:
    return await service.cancel(job_id, tenant)


@router.post(
    "/v1/jobs/{job_id}/retry",
    response_model=JobRecord,
    summary="Run a failed or cancelled job again (resumes from its checkpoint)",
)
async def retry(job_id: JobId, service: Service, tenant: Caller) -> JobRecord:
    return await service.retry(job_id, tenant)
