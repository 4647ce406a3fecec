"""Job records in Redis and their RQ jobs: the gateway's half of `crucible_shared.lifecycle`.

Records, indexes, cancel flags and event streams go through an asyncio Redis client, so open
event streams never hold a thread. RQ is synchronous: enqueueing and RQ's own job state use a
plain client, from a thread. Jobs are enqueued by dotted path with the JSON serializer, so the
gateway never imports the trainer.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from crucible_shared import events, keys, served
from crucible_shared.lifecycle import (
    JOB_FUNCTION,
    QUEUES,
    JobKind,
    JobRecord,
    JobStatus,
    decode,
    encode_fields,
    transition_command,
    transition_result,
)
from redis import Redis
from redis.asyncio import Redis as AsyncRedis
from rq import Queue
from rq.exceptions import NoSuchJobError
from rq.job import Job
from rq.serializers import JSONSerializer

_TTL_S = 7 * 24 * 3600

# Leases of open event streams, on Redis's clock (every replica reads the same one): drop the
# lapsed, count, and take a slot only below the cap, in one step so that two replicas cannot both
# take the last one. Returns [taken (0/1), streams open before].
_TAKE_LEASE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1e6
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
local open = redis.call('ZCARD', KEYS[1])
if open >= tonumber(ARGV[1]) then return {0, open} end
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[3]), ARGV[2])
redis.call('EXPIRE', KEYS[1], math.ceil(tonumber(ARGV[3])) + 1)
return {1, open}
"""
_UNLOCK = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""
# A stream still open keeps (or, after a Redis blip let its lease lapse, takes back) its slot.
_RENEW_LEASE = """
local t = redis.call('TIME')
redis.call('ZADD', KEYS[1], tonumber(t[1]) + tonumber(t[2]) / 1e6 + tonumber(ARGV[2]), ARGV[1])
redis.call('EXPIRE', KEYS[1], math.ceil(tonumber(ARGV[2])) + 1)
return 1
"""


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class IdempotencyConflict(Exception):
    """An `Idempotency-Key` already created job `job_id` from a different spec."""

    def __init__(self, job_id: str) -> None:
        super().__init__(job_id)
        self.job_id = job_id


def new_job_id(kind: str) -> str:
    return f"{kind}-{uuid.uuid4().hex[:12]}"


class JobStore:
    def __init__(self, redis: AsyncRedis, rq_redis: Redis, timeouts: dict[JobKind, int]) -> None:
        self.redis, self.rq_redis, self.timeouts = redis, rq_redis, timeouts
        self.queues = {
            name: Queue(name, connection=rq_redis, serializer=JSONSerializer) for name in set(QUEUES.values())
        }

    async def ping(self) -> bool:
        return bool(await self.redis.ping())

    async def clock(self) -> tuple[float, float]:
        """(Redis's time, seconds since the Redis server started): the clock the trainer stamps
        heartbeats with, and how long Redis has been up."""
        pipe = self.redis.pipeline(transaction=False)
        pipe.time()
        pipe.info("server")
        (seconds, micros), info = await pipe.execute()
        return seconds + micros / 1e6, float(info.get("uptime_in_seconds", 0))

    async def close(self) -> None:
        await self.redis.aclose()
        self.rq_redis.close()

    # -- records ------------------------------------------------------------------------------
    async def get(self, job_id: str) -> JobRecord | None:
        raw = await self.redis.hgetall(keys.job(job_id))
        return JobRecord.from_redis(job_id, raw) if raw else None

    async def get_many(self, ids: list[str]) -> list[JobRecord]:
        pipe = self.redis.pipeline(transaction=False)
        for job_id in ids:
            pipe.hgetall(keys.job(job_id))
        raws = await pipe.execute()
        return [JobRecord.from_redis(i, raw) for i, raw in zip(ids, raws, strict=True) if raw]

    async def page(self, status: JobStatus | None, offset: int, limit: int) -> tuple[list[str], int]:
        """Ids newest first, of all jobs or of one status (from the status index: no scan)."""
        index = keys.status_index(status.value) if status else keys.jobs_index()
        total = await self.redis.zcard(index)
        ids = await self.redis.zrevrange(index, offset, offset + limit - 1)
        return [_text(i) for i in ids], total

    async def ids(self, status: JobStatus | None, tenant: str | None = None) -> list[str]:
        """Ids newest first, of all jobs or of one status, of every tenant or of one."""
        index = keys.status_index(status.value) if status else keys.jobs_index()
        if tenant is None:
            return [_text(i) for i in await self.redis.zrevrange(index, 0, -1)]
        pipe = self.redis.pipeline(transaction=False)
        pipe.zrevrange(keys.tenant_jobs(tenant), 0, -1)
        if status:
            pipe.zrange(index, 0, -1)
        found = await pipe.execute()
        own = [_text(i) for i in found[0]]
        if not status:
            return own
        wanted = {_text(i) for i in found[1]}
        return [i for i in own if i in wanted]

    async def fields(self, ids: list[str], names: tuple[str, ...]) -> list[dict[str, Any]]:
        """Only the fields `names` of each job (decoded; missing jobs left out): what the reaper,
        quotas and filtered listings need, without reading and parsing whole specs."""
        pipe = self.redis.pipeline(transaction=False)
        for job_id in ids:
            pipe.hmget(keys.job(job_id), list(names))
        out = []
        for job_id, values in zip(ids, await pipe.execute(), strict=True):
            if values[0] is None and all(v is None for v in values):
                continue
            row: dict[str, Any] = {"id": job_id}
            for name, value in zip(names, values, strict=True):
                row[name] = None if value is None else decode(name, _text(value))
            out.append(row)
        return out

    async def transition(
        self,
        job_id: str,
        status: JobStatus,
        *,
        allowed_from: set[JobStatus] | frozenset[JobStatus] | None = None,
        stale_before: float | None = None,
        **fields: Any,
    ) -> tuple[bool, JobStatus | None]:
        """Atomic check-and-set (see `crucible_shared.lifecycle`); (changed, status if refused)."""
        reply = await self.redis.eval(
            *transition_command(
                job_id, status, allowed_from=allowed_from, stale_before=stale_before, **fields
            )
        )
        return transition_result(reply)

    # -- submission ----------------------------------------------------------------------------
    async def create(
        self,
        kind: JobKind,
        spec: dict[str, Any],
        name: str | None,
        idempotency_key: str | None,
        max_attempts: int,
        tenant: str | None = None,
    ) -> tuple[str, bool]:
        """Write the record and its indexes; returns (job id, created). A repeated
        Idempotency-Key of the same tenant with the same spec returns the first job; with another
        spec it is an `IdempotencyConflict`. The caller enqueues the job."""
        job_id = new_job_id(kind)
        if idempotency_key:
            digest = hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()
            key = keys.idempotency(idempotency_key, tenant or "")
            claimed = await self.redis.set(key, f"{job_id} {digest}", nx=True, ex=24 * 3600)
            if not claimed:
                existing = _text(await self.redis.get(key) or b"")
                first, _, first_digest = existing.partition(" ")
                if first and await self.redis.exists(keys.job(first)):
                    if first_digest != digest:
                        raise IdempotencyConflict(first)
                    return first, False
                # The first attempt died between claiming and creating: take the key over.
                await self.redis.set(key, f"{job_id} {digest}", ex=24 * 3600)
        now = time.time()
        record = JobRecord(
            id=job_id,
            kind=kind,
            name=name,
            status=JobStatus.queued,
            created_at=now,
            queued_at=now,
            spec=spec,
            max_attempts=max_attempts,
            tenant=tenant,
        )
        pipe = self.redis.pipeline(transaction=True)
        mapping: dict[Any, Any] = encode_fields(record.model_dump(exclude={"id"}))
        pipe.hset(keys.job(job_id), mapping=mapping)
        pipe.zadd(keys.jobs_index(), {job_id: now})
        pipe.zadd(keys.status_index(JobStatus.queued.value), {job_id: now})
        if tenant:
            pipe.zadd(keys.tenant_jobs(tenant), {job_id: now})
        await pipe.execute()
        return job_id, True

    def worker_ranks(self) -> list[int]:
        """How many ranks each live trainer worker can launch for one job (RQ's registry says
        which workers are alive: a worker that died keeps its field until one starts again)."""
        from rq import Worker

        live = {w.name for w in Worker.all(connection=self.rq_redis)}
        reported = self.rq_redis.hgetall(keys.worker_ranks())
        return [int(v) for k, v in reported.items() if _text(k) in live]

    def worker_models(self) -> tuple[set[str], set[str]]:
        """The installable models live trainer workers have, and those some of them lack."""
        from rq import Worker

        live = {w.name for w in Worker.all(connection=self.rq_redis)}
        installed: set[str] = set()
        missing: set[str] = set()
        for name, value in self.rq_redis.hgetall(keys.worker_models()).items():
            if _text(name) in live:
                report = json.loads(_text(value))
                installed.update(report.get("installed", []))
                missing.update(report.get("missing", []))
        return installed, missing

    def worker_served(self) -> list[list[dict[str, Any]]]:
        """The base models each live trainer worker's generators served at its last reading, of
        the readings at most `served.FRESH_S` old on Redis's clock (a worker whose generators did
        not answer reports nothing)."""
        from rq import Worker

        live = {w.name for w in Worker.all(connection=self.rq_redis)}
        seconds, micros = self.rq_redis.time()
        fresh_after = seconds + micros / 1e6 - served.FRESH_S
        out = []
        for name, value in self.rq_redis.hgetall(keys.worker_served()).items():
            report = json.loads(_text(value))
            if _text(name) in live and report.get("models") is not None and report["at"] >= fresh_after:
                out.append(report["models"])
        return out

    def enqueue(self, kind: JobKind, job_id: str, spec: dict[str, Any]) -> None:
        """Put the job on its RQ queue (again: an earlier RQ job of the same id is replaced)."""
        try:
            Job.fetch(job_id, connection=self.rq_redis, serializer=JSONSerializer).delete()
        except NoSuchJobError:
            pass
        self.queues[QUEUES[kind]].enqueue(
            JOB_FUNCTION,
            job_id,
            spec,
            job_id=job_id,
            job_timeout=self.timeouts[kind],
            result_ttl=_TTL_S,
            failure_ttl=_TTL_S,
        )

    # -- cancel ---------------------------------------------------------------------------------
    async def request_cancel(self, job_id: str) -> None:
        await self.redis.set(keys.cancel(job_id), "1", ex=_TTL_S)

    async def clear_cancel(self, job_id: str) -> None:
        await self.redis.delete(keys.cancel(job_id))

    def cancel_queued(self, job_id: str) -> bool:
        """Take an RQ job that has not started off its queue; False if it already started."""
        try:
            job = Job.fetch(job_id, connection=self.rq_redis, serializer=JSONSerializer)
        except NoSuchJobError:
            return False
        if job.get_status(refresh=True) in ("queued", "deferred", "scheduled"):
            job.cancel()
            return True
        return False

    def rq_statuses(self, ids: list[str]) -> dict[str, str | None]:
        """RQ's status of each job (None: no RQ job), in one round trip (run it in a thread).
        Read from RQ's job hash (`Job.key_for`), the field `Job.get_status` reads."""
        pipe = self.rq_redis.pipeline(transaction=False)
        for job_id in ids:
            pipe.hget(Job.key_for(job_id), "status")
        return {
            i: _text(raw) or None if raw is not None else None
            for i, raw in zip(ids, pipe.execute(), strict=True)
        }

    # -- per-tenant lock (the active_jobs quota, across replicas) --------------------------------
    @asynccontextmanager
    async def tenant_lock(
        self, tenant: str, wait_s: float = 10.0, hold_s: float = 30.0
    ) -> AsyncIterator[bool]:
        """Hold the tenant's submission lock (one replica at a time checks and creates its jobs);
        yields False if it could not be had within `wait_s`. It lapses after `hold_s` should the
        holder die."""
        key, token = keys.tenant_lock(tenant), uuid.uuid4().hex
        deadline = time.monotonic() + wait_s
        held = False
        while not (held := bool(await self.redis.set(key, token, nx=True, px=int(hold_s * 1000)))):
            if time.monotonic() > deadline:
                break
            await asyncio.sleep(0.01)
        try:
            yield held
        finally:
            if held:
                await self.redis.eval(_UNLOCK, 1, key, token)

    # -- event stream leases (the event_streams quota, across replicas) --------------------------
    async def take_lease(self, tenant: str, lease: str, cap: int, ttl_s: float) -> tuple[bool, int]:
        """(taken, streams the tenant had open): a slot of `cap` for `ttl_s` unless renewed."""
        taken, open_ = await self.redis.eval(_TAKE_LEASE, 1, keys.tenant_streams(tenant), cap, lease, ttl_s)
        return bool(taken), int(open_)

    async def renew_lease(self, tenant: str, lease: str, ttl_s: float) -> None:
        """Keep the slot `ttl_s` longer."""
        await self.redis.eval(_RENEW_LEASE, 1, keys.tenant_streams(tenant), lease, ttl_s)

    async def drop_lease(self, tenant: str, lease: str) -> None:
        await self.redis.zrem(keys.tenant_streams(tenant), lease)

    # -- events ---------------------------------------------------------------------------------
    async def emit(self, job_id: str, kind: str, **data: Any) -> None:
        record = events.record(kind, **data)  # validated: one of crucible_shared.events
        await self.redis.xadd(keys.events(job_id), {"data": json.dumps(record, default=str)}, maxlen=10_000)

    async def events_after(self, job_id: str, last_id: str) -> list[tuple[str, dict[str, Any]]]:
        """Events after `last_id` (up to 100), without blocking."""
        found: Any = await self.redis.xread({keys.events(job_id): last_id}, count=100)
        out = []
        for _stream, entries in found or []:
            for entry_id, fields in entries:
                data = _text(fields.get(b"data", b"{}"))
                try:
                    out.append((_text(entry_id), json.loads(data)))
                except ValueError:
                    out.append((_text(entry_id), {"type": "raw", "data": data}))
        return out
