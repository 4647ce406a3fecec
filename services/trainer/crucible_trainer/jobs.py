"""RQ job functions (the payloads are JSON: a job id and a spec dict), one runner per job kind.

The worker is an RQ `SimpleWorker`: the model and CUDA context survive between jobs in one
process (a forking worker would break CUDA). A `SimpleWorker` does not heartbeat mid-job, so
the job's channel does (see `channel.RedisChannel.heartbeat`) and jobs are enqueued with a long
`job_timeout`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from crucible_shared.jobs import OFFLINE_METHODS, JobSpec
from crucible_shared.lifecycle import JobStatus
from pydantic import TypeAdapter

from crucible_trainer.channel import JobChannel, RedisChannel
from crucible_trainer.settings import Settings

log = logging.getLogger(__name__)
_SPEC = TypeAdapter(JobSpec)

Runner = Callable[[Any, str, Settings, JobChannel], Awaitable[dict[str, Any]]]


def quiet_libraries() -> None:
    """For jobs run in a terminal (`crucible train --local`): no weight-loading progress bars or
    library deprecation notices between the job's own lines."""
    import warnings

    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    warnings.filterwarnings("ignore", category=FutureWarning)


def runner_for(kind: str, method: str | None = None, ranks: int = 1) -> Runner:
    """The coroutine that runs a job of `kind` (imported late: torch loads with the trainer).

    Train jobs of an offline method (SFT, DPO: TRL on a file) run `offline.job`, not the online
    loop of `train.py`, which samples, executes and updates every step. A train job of several
    ranks (`distributed.train_gpus`) runs them under `torchrun` (`distributed/launch.py`).
    """
    if kind == "train" and ranks > 1:
        from crucible_trainer.distributed.launch import run_distributed_job

        return run_distributed_job
    if kind == "train" and method in OFFLINE_METHODS:
        from crucible_trainer.offline.job import run_offline_train_job

        return run_offline_train_job
    if kind == "train":
        from crucible_trainer.train import run_train_job

        return run_train_job
    if kind == "eval":
        from crucible_trainer.evaljob import run_eval_job

        return run_eval_job
    if kind == "pipeline":
        from crucible_trainer.offline.pipeline import run_pipeline_job

        return run_pipeline_job
    raise ValueError(f"no runner for jobs of kind {kind!r}")


def execute(spec: Any, job_id: str, settings: Settings, channel: JobChannel) -> dict[str, Any]:
    """Run a parsed job to its end on `channel`: started, heartbeating, finished (or failed)."""
    from crucible_trainer.cancel import Cancelled, Interrupted

    if not channel.start():
        return {"job_id": job_id, "status": "skipped"}
    try:
        with channel.heartbeat(settings.heartbeat_s):
            ranks = getattr(getattr(spec, "distributed", None), "train_gpus", 1)
            runner = runner_for(spec.kind, getattr(getattr(spec, "method", None), "name", None), ranks)
            summary = asyncio.run(runner(spec, job_id, settings, channel))
    except Cancelled:
        summary = {"job_id": job_id, "status": JobStatus.cancelled.value}
    except Interrupted as stop:
        channel.release(f"the worker stopped after step {stop.step}; the job resumes from its checkpoint")
        return {"job_id": job_id, "status": JobStatus.queued.value}
    except BaseException as exc:
        channel.finish(JobStatus.failed, error=f"{type(exc).__name__}: {exc}")
        raise
    channel.finish(JobStatus(summary.get("status", JobStatus.finished.value)), summary=summary)
    return summary


def run_job(job_id: str, spec: dict[str, Any]) -> dict[str, Any]:
    """Entry point of every queued job (`crucible_shared.lifecycle.JOB_FUNCTION`)."""
    from redis import Redis

    settings = Settings()
    if not settings.redis_url:
        raise RuntimeError("the worker has no REDIS_URL")
    channel = RedisChannel(Redis.from_url(settings.redis_url), job_id)
    return execute(_SPEC.validate_python(spec), job_id, settings, channel)
