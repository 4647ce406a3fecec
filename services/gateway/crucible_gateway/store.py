"""Job records in Redis and their RQ jobs.

A record is a hash `crucible:job:<id>` (see `crucible_shared.keys`); submission order is a sorted
set. Jobs go to the RQ queue of their kind with the JSON serializer, enqueued by dotted path so
the gateway never imports the trainer.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

from crucible_shared import keys
from redis import Redis
from rq import Queue
from rq.exceptions import NoSuchJobError
from rq.job import Job
from rq.serializers import JSONSerializer

JOB_FUNCTION = "crucible_trainer.jobs.run_job"
_JSON_FIELDS = (
    "metrics",
    "summary",
    "spec",
    "started_at",
    "finished_at",
    "created_at",
    "step",
    "total_steps",
    "attempts",
    "heartbeat_at",
)


def new_job_id(kind: str) -> str:
    return f"{kind}-{uuid.uuid4().hex[:12]}"


class JobStore:
    def __init__(self, redis: Redis, train_timeout: int, eval_timeout: int) -> None:
        self.redis = redis
        self.timeouts = {"train": train_timeout, "eval": eval_timeout}
        self.queues = {
            kind: Queue(kind, connection=redis, serializer=JSONSerializer) for kind in ("train", "eval")
        }

    def ping(self) -> bool:
        return bool(self.redis.ping())

    # -- records ------------------------------------------------------------------------------
    def get(self, job_id: str) -> dict[str, Any] | None:
        raw = self.redis.hgetall(keys.job(job_id))
        if not raw:
            return None
        out: dict[str, Any] = {"id": job_id}
        for k, v in raw.items():
            key, value = k.decode(), v.decode()
            if key in _JSON_FIELDS:
                try:
                    value = json.loads(value)
                except ValueError:
                    pass
            out[key] = value
        return out

    def update(self, job_id: str, **fields: Any) -> None:
        mapping = {k: v if isinstance(v, str) else json.dumps(v, default=str) for k, v in fields.items()}
        self.redis.hset(keys.job(job_id), mapping=mapping)

    def list_ids(self, offset: int, limit: int) -> tuple[list[str], int]:
        total = self.redis.zcard(keys.jobs_index())
        ids = self.redis.zrevrange(keys.jobs_index(), offset, offset + limit - 1)
        return [i.decode() for i in ids], total

    def all_ids(self) -> list[str]:
        return [i.decode() for i in self.redis.zrevrange(keys.jobs_index(), 0, -1)]

    # -- submission ----------------------------------------------------------------------------
    def submit(
        self, kind: str, spec: dict[str, Any], name: str | None, idempotency_key: str | None
    ) -> tuple[str, bool]:
        """Create the record and enqueue; returns (job id, created). A repeated Idempotency-Key returns the first job."""
        job_id = new_job_id(kind)
        if idempotency_key:
            claimed = self.redis.set(keys.idempotency(idempotency_key), job_id, nx=True, ex=24 * 3600)
            if not claimed:
                existing = self.redis.get(keys.idempotency(idempotency_key))
                if existing and self.get(existing.decode()) is not None:
                    return existing.decode(), False
                # The first attempt died between claiming and creating: take the key over.
                self.redis.set(keys.idempotency(idempotency_key), job_id, ex=24 * 3600)
        now = time.time()
        self.update(
            job_id, kind=kind, name=name or "", status="queued", created_at=now, spec=spec, attempts=1
        )
        self.redis.zadd(keys.jobs_index(), {job_id: now})
        self._enqueue(kind, job_id, spec)
        return job_id, True

    def _enqueue(self, kind: str, job_id: str, spec: dict[str, Any]) -> None:
        self.queues[kind].enqueue(
            JOB_FUNCTION,
            job_id,
            spec,
            job_id=job_id,
            job_timeout=self.timeouts[kind],
            result_ttl=7 * 24 * 3600,
            failure_ttl=7 * 24 * 3600,
        )

    def retry(self, job_id: str, record: dict[str, Any]) -> None:
        """Enqueue a failed or cancelled job again under the same id (the trainer resumes from its checkpoint)."""
        self.redis.delete(keys.cancel(job_id))
        try:
            Job.fetch(job_id, connection=self.redis, serializer=JSONSerializer).delete()
        except NoSuchJobError:
            pass
        self.update(
            job_id,
            status="queued",
            error="",
            finished_at="null",
            attempts=int(record.get("attempts") or 1) + 1,
        )
        self._enqueue(record["kind"], job_id, record["spec"])

    # -- cancel ---------------------------------------------------------------------------------
    def request_cancel(self, job_id: str) -> None:
        self.redis.set(keys.cancel(job_id), "1", ex=7 * 24 * 3600)

    def cancel_queued(self, job_id: str) -> bool:
        """Cancel an RQ job that has not started; False if it already started."""
        try:
            job = Job.fetch(job_id, connection=self.redis, serializer=JSONSerializer)
        except NoSuchJobError:
            return False
        if job.get_status(refresh=True) in ("queued", "deferred", "scheduled"):
            job.cancel()
            return True
        return False

    def rq_status(self, job_id: str) -> str | None:
        try:
            return str(
                Job.fetch(job_id, connection=self.redis, serializer=JSONSerializer).get_status(refresh=True)
            )
        except NoSuchJobError:
            return None

    # -- events ---------------------------------------------------------------------------------
    def events_after(self, job_id: str, last_id: str, block_ms: int) -> list[tuple[str, dict[str, Any]]]:
        found = self.redis.xread({keys.events(job_id): last_id}, count=100, block=block_ms)
        out = []
        for _stream, entries in found or []:
            for entry_id, fields in entries:
                data = fields.get(b"data", b"{}").decode()
                try:
                    out.append((entry_id.decode(), json.loads(data)))
                except ValueError:
                    out.append((entry_id.decode(), {"type": "raw", "data": data}))
        return out
