"""Redis key names shared by the gateway and the trainer (one place, so they never drift).

Each kind of key has its own prefix, so no job id can name another kind's key: the record of
job `x` is `crucible:job:x`, its events `crucible:events:x`, its cancel flag `crucible:cancel:x`.
Job ids are validated (`crucible_shared.lifecycle.JOB_ID_PATTERN`) before they reach a key.
"""

from __future__ import annotations

PREFIX = "crucible"


def job(job_id: str) -> str:
    """Hash: the job record (see `crucible_shared.lifecycle.JobRecord`)."""
    return f"{PREFIX}:job:{job_id}"


def events(job_id: str) -> str:
    """Stream: the job's events (progress, metrics, swaps, evaluations, logs)."""
    return f"{PREFIX}:events:{job_id}"


def cancel(job_id: str) -> str:
    """String: present when a cancel was requested; the job loop polls it."""
    return f"{PREFIX}:cancel:{job_id}"


def jobs_index() -> str:
    """Sorted set of every job id by submission time."""
    return f"{PREFIX}:jobs"


def status_index(status: str) -> str:
    """Sorted set of the ids of jobs in one status, by submission time (filtered listings)."""
    return f"{PREFIX}:jobs:status:{status}"


def idempotency(key: str, tenant: str = "") -> str:
    """String: `<job id> <spec digest>` of the job an `Idempotency-Key` created, per tenant
    (tenant names hold no `:`, so one tenant's keys never name another's)."""
    return f"{PREFIX}:idempotency:{tenant}:{key}" if tenant else f"{PREFIX}:idempotency:{key}"


def tenant_jobs(tenant: str) -> str:
    """Sorted set of the ids of one tenant's jobs by submission time."""
    return f"{PREFIX}:tenant:{tenant}:jobs"


def tenant_lock(tenant: str) -> str:
    """String: held (a random token, with an expiry) by the gateway replica checking a submission
    of the tenant against its `active_jobs` quota, until the job is created."""
    return f"{PREFIX}:tenant:{tenant}:lock"


def tenant_streams(tenant: str) -> str:
    """Sorted set of the tenant's open event streams (a lease id each, scored by when the lease
    lapses unless its gateway renews it), shared by every gateway replica."""
    return f"{PREFIX}:tenant:{tenant}:streams"


def worker_models() -> str:
    """Hash: worker name -> JSON {"installed": [...], "missing": [...]}, the installable models
    (`crucible models install`) the worker has or lacks, for the gateway's check of `model.base`."""
    return f"{PREFIX}:workers:models"


def worker_served() -> str:
    """Hash: worker name -> JSON {"at": Redis time, "models": [{"id", "root"}, ...] or null}, the
    base models the worker's generators served when it last asked them (`crucible_shared.served`),
    for the gateway's check of an eval job's `model.base`; null: no generator answered."""
    return f"{PREFIX}:workers:served"


def worker_ranks() -> str:
    """Hash: worker name -> how many ranks it may launch for one job (crucible_shared.distributed)."""
    return f"{PREFIX}:workers:ranks"


def heartbeat_timeout() -> str:
    """String: the gateway reaper's heartbeat timeout in seconds, which a running job's lease must
    lapse before (the trainer holds it for at most half of it)."""
    return f"{PREFIX}:settings:heartbeat_timeout_s"
