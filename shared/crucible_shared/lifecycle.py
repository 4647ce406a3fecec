"""The job lifecycle contract between the gateway and the trainer.

A job is a record in Redis (a hash, `keys.job(id)`), an RQ job on the queue of its kind, an
event stream and a cancel flag. Two pieces of code write them: the gateway's store (create,
cancel, retry, reap) and the trainer's `JobChannel` (start, progress, heartbeat, events,
finish). Both encode the record through `JobRecord` and change its status only through
`transition`, an atomic check-and-set that also keeps the per-status indexes in step, so a
record is never half-written and two writers never undo each other's transition.

Statuses move like this (anything else is refused):

    queued  -> running (a worker took it) | cancelled (before it started) | failed (it never started)
    running -> finished | failed | cancelled | queued (worker lost or stopping: it resumes elsewhere)
    failed, cancelled -> queued (retry)

Each start of a job gives the run a lease: its fencing token, the record's `fence` counter
incremented by the start (`start_command`), so every run of a job holds a larger token than the
runs before it. The run's writes (heartbeat, progress, events, finish, release, the checkpoint
pointer) are fenced by it: once the reaper re-queued the job, or another run started it, the old
run's writes are refused and it stops (`crucible_trainer.runtime.outbox`). What a run writes outside
Redis (run dir, adapter store, generators) is fenced too; docs/jobs.md ("Fencing") has the model. The reaper counts a job as silent only from when Redis time says
its heartbeat is older than the timeout *and* Redis was reachable all that while
(`crucible_gateway.service`), so an outage of Redis itself never re-queues a live job.
"""

from __future__ import annotations

import json
import re
from enum import StrEnum
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from crucible_shared import keys


class JobStatus(StrEnum):
    queued = "queued"
    running = "running"
    finished = "finished"
    failed = "failed"
    cancelled = "cancelled"


FINAL = frozenset({JobStatus.finished, JobStatus.failed, JobStatus.cancelled})


class JobKind(StrEnum):
    """What a job is; its spec's `kind` (`crucible_shared.jobs`), its RQ queue and its timeout."""

    train = "train"
    eval = "eval"
    pipeline = "pipeline"


# Job ids name Redis keys and run directories: letters, digits, `_ . -`, no separators.
JOB_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$"
_JOB_ID = re.compile(JOB_ID_PATTERN)

# The RQ queue of each job kind, and the job function (enqueued by dotted path, so the gateway
# never imports the trainer).
QUEUES: dict[JobKind, str] = {JobKind.train: "train", JobKind.eval: "eval", JobKind.pipeline: "train"}
JOB_FUNCTION = "crucible_trainer.runtime.entry.run_job"


def valid_job_id(job_id: str) -> bool:
    """Whether `job_id` may name a job.

    >>> valid_job_id("train-0123456789ab"), valid_job_id("x:events"), valid_job_id("../etc")
    (True, False, False)
    """
    return bool(_JOB_ID.match(job_id))


class JobSummary(BaseModel):
    """What a finished (or cancelled) job hands back: where its results are and its headline
    figures. The fields below are those every runner and the CLI share; a runner adds its own
    (a method's report, a pipeline's stages) as extra fields."""

    model_config = ConfigDict(extra="allow")

    job_id: str | None = None  # every runner sets it; a record without it must still read
    run_dir: str | None = None
    status: JobStatus | None = Field(None, description="finished or cancelled.")
    method: str | None = None
    steps: int | None = Field(None, description="Training steps run.")
    adapter: str | None = Field(None, description="The trained adapter's folder.")
    model_name: str | None = Field(None, description="The name the generator serves it under.")
    report: str | None = Field(None, description="An eval job's report folder.")
    before_after: str | None = Field(None, description="The before/after comparison's folder.")
    learning_curve: str | None = None
    games_report: str | None = None
    merged: str | None = Field(None, description="A pipeline's merged model.")
    eval: dict[str, Any] | None = Field(None, description="Headline figures per evaluation (by label).")
    settings: dict[str, Any] | None = Field(None, description="What the job chose for the machine.")
    stages: dict[str, dict[str, Any]] | None = Field(None, description="A pipeline's stages: ran or skipped.")


class JobRecord(BaseModel):
    """A job as stored in Redis and shown by the API."""

    id: str
    kind: JobKind
    name: str | None = None
    status: JobStatus
    created_at: float
    started_at: float | None = None
    finished_at: float | None = None
    queued_at: float | None = Field(None, description="When it last went (back) to the queue.")
    heartbeat_at: float | None = Field(None, description="Last sign of life of the worker running it.")
    step: int | None = Field(None, description="Last finished training step.")
    total_steps: int | None = None
    policy_version: str | None = Field(None, description="Adapter version the generator serves for this job.")
    metrics: dict[str, Any] | None = Field(None, description="Latest step's metrics.")
    error: str | None = None
    summary: JobSummary | None = None
    spec: dict[str, Any] | None = None
    attempts: int = Field(1, description="Runs of this job so far (retries included).")
    max_attempts: int = Field(1, description="Runs allowed when a worker is lost (automatic retries).")
    worker: str | None = Field(None, description="The worker running it (host:pid).")
    tenant: str | None = Field(None, description="The tenant that submitted it (its owner).")

    @classmethod
    def from_redis(cls, job_id: str, raw: dict[Any, Any]) -> JobRecord:
        fields = {_text(k): decode(_text(k), _text(v)) for k, v in raw.items()}
        fields.pop("id", None)
        return cls.model_validate({k: v for k, v in fields.items() if k in cls.model_fields} | {"id": job_id})


_STRING_FIELDS = frozenset(
    {"kind", "name", "status", "policy_version", "error", "worker", "lease", "checkpoint", "tenant"}
)


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def encode(field: str, value: Any) -> str:
    """One field as stored: strings as they are ("" for none), everything else as JSON.

    >>> encode("status", JobStatus.running), encode("error", None), encode("step", 3)
    ('running', '', '3')
    """
    if field in _STRING_FIELDS:
        return "" if value is None else str(value)
    return json.dumps(value, default=str)


def decode(field: str, text: str) -> Any:
    """Inverse of `encode` (text that isn't JSON is kept as it is)."""
    if field in _STRING_FIELDS:
        return text or None
    try:
        return json.loads(text)
    except ValueError:
        return text


def encode_fields(fields: dict[str, Any]) -> dict[str, str]:
    return {k: encode(k, v) for k, v in fields.items()}


# Check-and-set of the status, the given fields and the status indexes, atomically.
# KEYS[1] the record. ARGV: job id, new status, allowed current statuses ("a,b"; "*" any),
# stale_before ("" or a time: only when the last heartbeat is older), index key prefix, fence
# ("" or the lease token the run holding the job was given at its start: only while it still holds it),
# then field/value pairs. Returns "ok", or the current status when refused (nil: no such job).
_TRANSITION = """
local cur = redis.call('HGET', KEYS[1], 'status')
if not cur then return false end
if ARGV[3] ~= '*' then
  local ok = false
  for s in string.gmatch(ARGV[3], '[^,]+') do if s == cur then ok = true end end
  if not ok then return cur end
end
if ARGV[4] ~= '' then
  local beat = tonumber(redis.call('HGET', KEYS[1], 'heartbeat_at') or '')
  if beat == nil then beat = tonumber(redis.call('HGET', KEYS[1], 'started_at') or '') end
  if beat ~= nil and beat >= tonumber(ARGV[4]) then return cur end
end
if ARGV[6] ~= '' and redis.call('HGET', KEYS[1], 'lease') ~= ARGV[6] then return cur end
redis.call('HSET', KEYS[1], 'status', ARGV[2])
for i = 7, #ARGV, 2 do redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1]) end
local created = tonumber(redis.call('HGET', KEYS[1], 'created_at') or '0') or 0
redis.call('ZREM', ARGV[5] .. cur, ARGV[1])
redis.call('ZADD', ARGV[5] .. ARGV[2], created, ARGV[1])
return 'ok'
"""


def transition_command(
    job_id: str,
    status: JobStatus,
    *,
    allowed_from: frozenset[JobStatus] | set[JobStatus] | None = None,
    stale_before: float | None = None,
    fence: str | None = None,
    **fields: Any,
) -> tuple[Any, ...]:
    """Arguments of `redis.eval(...)` for a transition (works with sync and asyncio clients).

    `fence` (a run's lease) fences a run's own transitions (finish, release): refused once the
    job was taken from it (re-queued by the reaper, started by another run), whatever its status.
    """
    allowed = ",".join(sorted(allowed_from)) if allowed_from else "*"
    pairs = [x for k, v in encode_fields(fields).items() for x in (k, v)]
    prefix = keys.status_index("")
    stale = "" if stale_before is None else repr(float(stale_before))
    return (
        _TRANSITION,
        1,
        keys.job(job_id),
        job_id,
        status.value,
        allowed,
        stale,
        prefix,
        fence or "",
        *pairs,
    )


# Starting a run: queued -> running with the next fencing token (the record's `fence` + 1), which
# becomes the run's lease. KEYS[1] the record. ARGV: job id, index key prefix, then field/value
# pairs. Returns the token, or the current status when the job is not queued (nil: no such job).
_START = """
local cur = redis.call('HGET', KEYS[1], 'status')
if not cur then return false end
if cur ~= 'queued' then return cur end
local token = redis.call('HINCRBY', KEYS[1], 'fence', 1)
redis.call('HSET', KEYS[1], 'status', 'running', 'lease', tostring(token))
for i = 3, #ARGV, 2 do redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1]) end
local created = tonumber(redis.call('HGET', KEYS[1], 'created_at') or '0') or 0
redis.call('ZREM', ARGV[2] .. cur, ARGV[1])
redis.call('ZADD', ARGV[2] .. 'running', created, ARGV[1])
return token
"""


def start_command(job_id: str, **fields: Any) -> tuple[Any, ...]:
    """Arguments of `redis.eval(...)` that start a run of a queued job (see `start_result`)."""
    pairs = [x for k, v in encode_fields(fields).items() for x in (k, v)]
    return (_START, 1, keys.job(job_id), job_id, keys.status_index(""), *pairs)


def start_result(reply: Any) -> tuple[int | None, JobStatus | None]:
    """(the run's fencing token, None) when it started; (None, the job's status) when not."""
    if reply is None:
        return None, None
    if isinstance(reply, int):
        return reply, None
    return None, JobStatus(_text(reply))


def transition_result(reply: Any) -> tuple[bool, JobStatus | None]:
    """(changed, status before the refused change) from the script's reply."""
    if reply is None:
        return False, None
    text = _text(reply)
    if text == "ok":
        return True, None
    return False, JobStatus(text)
