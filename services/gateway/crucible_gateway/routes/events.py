"""The job's event stream as Server-Sent Events, resumable with Last-Event-ID.

Served from the asyncio Redis client and polled without blocking: an open stream costs a
connection only while it polls, never a thread, so any number of watchers leave the other routes
responsive.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
from typing import Annotated

import anyio
import redis
from crucible_shared.events import sse_openapi
from crucible_shared.http import ApiError
from crucible_shared.lifecycle import FINAL
from fastapi import APIRouter, Header, Request
from sse_starlette.sse import EventSourceResponse

from crucible_gateway.routes.deps import Caller, JobId, Service
from crucible_gateway.service import GatewayService, StreamLease

log = logging.getLogger(__name__)
STREAM_ID = re.compile(r"^\d{1,20}-\d{1,20}$")
router = APIRouter()


@router.get(
    "/v1/jobs/{job_id}/events",
    summary="Server-Sent Events from the job's stream (resumable with Last-Event-ID)",
    responses=sse_openapi(),
    response_class=EventSourceResponse,
)
async def events(
    job_id: JobId,
    request: Request,
    service: Service,
    tenant: Caller,
    last_event_id: Annotated[str | None, Header()] = None,
):
    if last_event_id is not None and not STREAM_ID.match(last_event_id):
        raise ApiError(
            422,
            "Last-Event-ID must be an event id this stream sent (like 1700000000000-0)",
            field="Last-Event-ID",
        )
    await service.view(job_id, False, tenant)
    lease = await service.open_stream(tenant)  # 429 at the tenant's event_streams quota
    return EventSourceResponse(_stream(service, job_id, request, last_event_id or "0-0", lease), ping=15)


async def _stream_over(service: GatewayService, job_id: str, last: str) -> bool:
    """The job is over and every event it wrote has gone out (False on a Redis blip)."""
    store = service.store
    try:
        record = await store.get(job_id)
        return (record is None or record.status in FINAL) and not await store.events_after(job_id, last)
    except redis.exceptions.RedisError:
        return False


async def _stream(service: GatewayService, job_id: str, request: Request, last: str, lease: StreamLease):
    try:
        async for event in _events(service, job_id, request, last, lease):
            yield event
    finally:
        # The stream no longer counts against the tenant's quota; shielded, since a client that
        # went away cancels the stream's task and every await in it would be cancelled too.
        with anyio.CancelScope(shield=True):
            await lease.release()


async def _events(service: GatewayService, job_id: str, request: Request, last: str, lease: StreamLease):
    # Polled without blocking: an idle stream holds no Redis connection and no thread
    # between polls, so thousands of watchers cost the other routes nothing.
    store, idle = service.store, 0
    while True:
        if await request.is_disconnected():
            return
        try:
            await lease.keep()
            found = await store.events_after(job_id, last)
        except redis.exceptions.RedisError as exc:  # a Redis blip must not end the stream
            log.warning("event stream of %s: %r; retrying", job_id, exc)
            await asyncio.sleep(1.0)
            continue
        for entry_id, data in found:
            last = entry_id
            yield {"id": entry_id, "event": str(data.get("type", "message")), "data": json.dumps(data)}
        if found:
            idle = 0
            continue
        if idle % 8 == 0 and await _stream_over(service, job_id, last):  # every 8th idle poll
            record = await store.get(job_id)
            status = record.status.value if record else "gone"
            yield {"event": "end", "data": json.dumps({"status": status})}
            return
        idle += 1
        # A stream quiet for a while polls four times less often.
        await asyncio.sleep(service.settings.stream_poll_s * (1 if idle < 8 else 4))
