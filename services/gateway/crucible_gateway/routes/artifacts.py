"""What jobs leave behind: a job's artifacts (list, download) and the adapter store."""

from __future__ import annotations

import asyncio

from crucible_shared.gateway_protocol import AdapterList, ArtifactList
from fastapi import APIRouter, Request
from fastapi.responses import FileResponse

from crucible_gateway.routes.deps import JobId, Service, base

router = APIRouter()


@router.get(
    "/v1/jobs/{job_id}/artifacts",
    response_model=ArtifactList,
    summary="Reports, metrics and adapters of a job",
)
async def artifacts(job_id: JobId, request: Request, service: Service) -> ArtifactList:
    root = await service.run_dir(job_id)
    found = await asyncio.to_thread(service.artifacts, root, job_id, base(request))
    return ArtifactList(job_id=job_id, artifacts=found)


@router.get("/v1/jobs/{job_id}/artifacts/{path:path}", summary="Download one artifact")
async def artifact(job_id: JobId, path: str, service: Service) -> FileResponse:
    root = await service.run_dir(job_id)
    return FileResponse(await asyncio.to_thread(service.artifact_path, root, job_id, path))


@router.get("/v1/adapters", response_model=AdapterList, summary="Adapter versions in the store")
async def adapters(service: Service) -> AdapterList:
    return AdapterList(adapters=await asyncio.to_thread(service.adapters))
