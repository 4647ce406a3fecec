"""RQ job functions (the payloads are JSON: a job id and a spec dict), each run by the `JobRun`
the runner registry (`runners.RUNNERS`) has for its spec type.

The worker is an RQ `SimpleWorker`: the model and CUDA context survive between jobs in one
process (a forking worker would break CUDA). A `SimpleWorker` does not heartbeat mid-job, so
the job's channel does (see `channel.RedisChannel.heartbeat`) and jobs are enqueued with a long
`job_timeout`.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from crucible_shared.jobs import JobSpec
from crucible_shared.lifecycle import JobStatus
from pydantic import TypeAdapter

from crucible_trainer.runtime.channel import JobChannel, RedisChannel
from crucible_trainer.runtime.runners import runner_for
from crucible_trainer.settings import Settings

log = logging.getLogger(__name__)
_SPEC = TypeAdapter(JobSpec)


def quiet_libraries() -> None:
    """For jobs run in a terminal (`crucible train --local`): no weight-loading progress bars or
    library deprecation notices between the job's own lines."""
    import warnings

    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    warnings.filterwarnings("ignore", category=FutureWarning)


def execute(spec: Any, job_id: str, settings: Settings, channel: JobChannel) -> dict[str, Any]:
    """Run a parsed job to its end on `channel`: started, heartbeating, finished (or failed), then
    give its memory back before the worker takes the next job.

    A run that lost its job (`channel.superseded()`: re-queued while it was cut off from Redis,
    or started by another run) ends without a word: the run holding the job writes its story.
    A worker stopped outright (RQ's cold shutdown, a second SIGTERM) hands its job back as a warm
    stop does, rather than failing it.
    """
    from crucible_trainer.runtime.hardware import release_memory

    try:
        return _execute(spec, job_id, settings, channel)
    finally:
        release_memory()


def _execute(spec: Any, job_id: str, settings: Settings, channel: JobChannel) -> dict[str, Any]:
    from crucible_trainer.runtime.cancel import Cancelled, Interrupted, Superseded

    if not channel.start():
        return {"job_id": job_id, "status": "skipped"}
    superseded = {"job_id": job_id, "status": "superseded"}
    try:
        with channel.heartbeat(settings.heartbeat_s):
            summary = asyncio.run(runner_for(spec)(spec, job_id, settings, channel).run())
    except Cancelled:
        summary = {"job_id": job_id, "status": JobStatus.cancelled.value}
    except Interrupted as stop:
        if channel.superseded():
            return superseded
        channel.release(f"the worker stopped after step {stop.step}; the job resumes from its checkpoint")
        return {"job_id": job_id, "status": JobStatus.queued.value}
    except Superseded as exc:  # found out by a generator (fence) or the gate, maybe before the outbox
        log.warning("job %s: this run was superseded (%s)", job_id, exc)
        return superseded
    except SystemExit:  # RQ's cold shutdown raises it in the job
        if not channel.superseded():
            channel.release("the worker was stopped mid-step; the job resumes from its last checkpoint")
        return {"job_id": job_id, "status": JobStatus.queued.value}
    except BaseException as exc:
        if channel.superseded():
            log.warning("job %s: this run was superseded (%r)", job_id, exc)
            return superseded
        channel.finish(JobStatus.failed, error=f"{type(exc).__name__}: {exc}")
        raise
    if channel.superseded():
        return superseded
    channel.finish(JobStatus(summary.get("status", JobStatus.finished.value)), summary=summary)
    return summary


def channel_redis(url: str) -> Any:
    """The Redis client of a job's channel: bounded waits (a partition must not hang the job), and
    one retry on a pooled connection that a Redis restart closed (safe: the outbox's script skips
    events already delivered, and a refused transition is reported, not repeated blindly)."""
    from redis import Redis
    from redis.backoff import NoBackoff
    from redis.exceptions import ConnectionError
    from redis.retry import Retry

    return Redis.from_url(
        url,
        socket_timeout=10,
        socket_connect_timeout=5,
        retry=Retry(NoBackoff(), 1, supported_errors=(ConnectionError,)),
    )


def run_job(job_id: str, spec: dict[str, Any]) -> dict[str, Any]:
    """Entry point of every queued job (`crucible_shared.lifecycle.JOB_FUNCTION`)."""
    settings = Settings()
    if not settings.redis_url:
        raise RuntimeError("the worker has no REDIS_URL")
    channel = RedisChannel(
        channel_redis(settings.redis_url), job_id, outage_wait_s=settings.redis_outage_wait_s
    )
    return execute(_SPEC.validate_python(spec), job_id, settings, channel)
