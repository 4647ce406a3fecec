"""Operations routes: liveness with Redis reachability, Prometheus metrics."""

from __future__ import annotations

import redis
from fastapi import APIRouter
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from crucible_gateway.routes.deps import Service

router = APIRouter()


@router.get("/health", summary="Liveness and Redis reachability")
async def health(service: Service) -> JSONResponse:
    try:
        await service.store.ping()
    except redis.exceptions.RedisError as exc:
        return JSONResponse({"status": "degraded", "redis": False, "error": str(exc)[:200]}, status_code=503)
    return JSONResponse({"status": "ok", "redis": True, "auth": service.tenants.auth})


@router.get("/metrics", response_class=Response, summary="Prometheus metrics")
async def metrics() -> Response:
    return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)
