"""What jobs leave behind: a job's artifacts (list, download) and the adapter store.

A download is served from the descriptor the containment check opened (`open_file_inside`), so a
file swapped for a link after the check is never what is sent.
"""

from __future__ import annotations

import asyncio
import mimetypes
import os
from collections.abc import AsyncIterator

from crucible_shared.gateway_protocol import AdapterList, ArtifactList
from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse
from starlette.background import BackgroundTask

from crucible_gateway.routes.deps import Caller, JobId, Service, base

router = APIRouter()
CHUNK = 256 * 1024


@router.get(
    "/v1/jobs/{job_id}/artifacts",
    response_model=ArtifactList,
    summary="Reports, metrics and adapters of a job",
)
async def artifacts(job_id: JobId, request: Request, service: Service, tenant: Caller) -> ArtifactList:
    await service.check_run_dir(job_id, tenant)
    found = await asyncio.to_thread(service.artifacts, job_id, base(request))
    return ArtifactList(job_id=job_id, artifacts=found)


@router.get("/v1/jobs/{job_id}/artifacts/{path:path}", summary="Download one artifact")
async def artifact(job_id: JobId, path: str, service: Service, tenant: Caller) -> StreamingResponse:
    await service.check_run_dir(job_id, tenant)
    fd = await asyncio.to_thread(service.open_artifact, job_id, path)
    file = os.fdopen(fd, "rb")
    size = os.fstat(fd).st_size
    media = mimetypes.guess_type(path)[0] or "application/octet-stream"
    return StreamingResponse(
        _chunks(file, size),
        media_type=media,
        headers={"Content-Length": str(size)},
        background=BackgroundTask(file.close),
    )


async def _chunks(file, size: int) -> AsyncIterator[bytes]:
    """The file's first `size` bytes (its size when checked: a file still growing is cut there, so
    the body matches Content-Length), read in a thread, chunk by chunk."""
    left = size
    try:
        while left > 0:
            chunk = await asyncio.to_thread(file.read, min(CHUNK, left))
            if not chunk:
                break
            left -= len(chunk)
            yield chunk
    finally:
        file.close()


@router.get("/v1/adapters", response_model=AdapterList, summary="Adapter versions in the store")
async def adapters(service: Service, tenant: Caller) -> AdapterList:
    return AdapterList(adapters=await service.adapters(tenant))
