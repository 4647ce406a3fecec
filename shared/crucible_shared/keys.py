"""Redis key names shared by the gateway and the trainer (one place, so they never drift)."""

from __future__ import annotations

PREFIX = "crucible"
TRAIN_QUEUE = "train"
EVAL_QUEUE = "eval"


def job(job_id: str) -> str:
    """Hash: the job record (spec, status, progress, latest metrics, timestamps, error)."""
    return f"{PREFIX}:job:{job_id}"


def events(job_id: str) -> str:
    """Stream: the job's events (progress, metrics, swaps, evaluations, logs)."""
    return f"{PREFIX}:job:{job_id}:events"


def cancel(job_id: str) -> str:
    """String: present when a cancel was requested; the job loop polls it."""
    return f"{PREFIX}:job:{job_id}:cancel"


def jobs_index() -> str:
    """Sorted set of job ids by submission time."""
    return f"{PREFIX}:jobs"


def idempotency(key: str) -> str:
    return f"{PREFIX}:idempotency:{key}"
