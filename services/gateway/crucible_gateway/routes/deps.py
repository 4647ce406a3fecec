"""What every route module shares: the app's service, the caller's tenant, the job id path
parameter, the base URL."""

from __future__ import annotations

from typing import Annotated

from crucible_shared.lifecycle import JOB_ID_PATTERN
from crucible_shared.tenants import Tenant, current_tenant
from fastapi import Depends, Path, Request

from crucible_gateway.service import GatewayService

JobId = Annotated[str, Path(description="A job id.", pattern=JOB_ID_PATTERN, max_length=128)]


def service(request: Request) -> GatewayService:
    """The one `GatewayService` of the app (`create_app` puts it on `app.state`)."""
    return request.app.state.service


Service = Annotated[GatewayService, Depends(service)]
# The caller's tenant (`TenantAuth` found it from the key before the body was read).
Caller = Annotated[Tenant, Depends(current_tenant)]


def base(request: Request) -> str:
    return str(request.base_url).rstrip("/")
