"""The sandbox's own routes, thin: each hands its request to `SandboxService` and answers with the
protocol's models (`crucible_shared.sandbox`). SandboxFusion's routes are in `fusion`.

`create_app` (in `api`) includes `runs`, then `fusion.router`, then `ops`: that order is the order
of the OpenAPI document's paths. A route finds the app's one service through the dependency
`Service` and the caller's tenant, which `TenantAuth` found from the key before the body was
read, through `Caller`.
"""

from __future__ import annotations

from typing import Annotated

from crucible_shared.http import ERROR_RESPONSES
from crucible_shared.sandbox import BatchRequest, BatchResponse, RunRequest, RunResult, SandboxHealth
from crucible_shared.tenants import Tenant, current_tenant
from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel

from crucible_sandbox.server.service import SandboxService


def service(request: Request) -> SandboxService:
    """The one `SandboxService` of the app (`create_app` puts it on `app.state`)."""
    return request.app.state.service


Service = Annotated[SandboxService, Depends(service)]
# The caller's tenant (`TenantAuth` checked its key before the body was read): `tenant: Caller`.
Caller = Annotated[Tenant, Depends(current_tenant)]

runs = APIRouter()
ops = APIRouter()


def as_json(model: BaseModel) -> Response:
    """A result, already validated, serialised once by pydantic (FastAPI would check it again
    against `response_model`, which stays for the OpenAPI schema)."""
    return Response(model.model_dump_json(), media_type="application/json")


@runs.post(
    "/v1/runs",
    response_model=RunResult,
    responses=ERROR_RESPONSES,
    summary="Run one program against its tests",
)
async def run(body: RunRequest, tenant: Caller, service: Service) -> Response:
    return as_json(await service.run_one(body, tenant))


@runs.post(
    "/v1/runs/batch",
    response_model=BatchResponse,
    responses=ERROR_RESPONSES,
    summary="Run many programs; results in order",
)
async def run_batch(body: BatchRequest, tenant: Caller, service: Service) -> Response:
    return as_json(BatchResponse(results=await service.run_batch(body.runs, tenant)))


@ops.get("/health", response_model=SandboxHealth, summary="Liveness, workers and the isolation in force")
async def health(request: Request, service: Service) -> SandboxHealth:
    return SandboxHealth(
        workers=service.settings.workers,
        pending=service.pool.pending,
        isolation=service.isolation,
        auth=request.app.state.tenants.auth,
        languages=service.languages,
    )


@ops.get("/metrics", summary="Prometheus metrics", response_class=Response)
async def metrics() -> Response:
    return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)
