"""A queued job for the stop tests: the worker's real `execute` on a real `RedisChannel`, with a
job loop that never ends by itself (a long training step), emitting an event every 0.2 s."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from crucible_shared import keys
from crucible_shared.lifecycle import JobRecord, JobStatus, encode_fields

SPEC = {"kind": "eval", "name": "endless", "data": {"dataset": "mbpp", "ids": [11, 12]}, "max_tokens": 64}


def queue_record(redis: Any, job_id: str) -> None:
    """The record a submission writes (the RQ job is the caller's)."""
    record = JobRecord(
        id=job_id, kind="eval", status=JobStatus.queued, created_at=time.time(), max_attempts=2
    )
    redis.hset(keys.job(job_id), mapping=encode_fields(record.model_dump(exclude={"id"})))
    redis.zadd(keys.status_index("queued"), {job_id: time.time()})


def as_runner(loop: Any) -> Any:
    """A job loop `loop(spec, job_id, settings, channel)` in the shape `runtime.entry.execute` runs: a runner
    class (`runners.runner_for(spec)`) whose instances have an async `run()`."""

    class Runner:
        def __init__(self, *args: Any) -> None:
            self.args = args

        async def run(self) -> dict[str, Any]:
            return await loop(*self.args)

    return Runner


def run(job_id: str) -> dict[str, Any]:
    """The RQ job function (enqueued as `tests.integration.endless_job.run`)."""
    from crucible_trainer.runtime import entry as jobs
    from crucible_trainer.runtime.cancel import CancelToken
    from crucible_trainer.runtime.channel import RedisChannel
    from crucible_trainer.settings import Settings

    async def endless(spec: Any, job_id: str, settings: Any, channel: Any) -> dict[str, Any]:
        token = CancelToken(channel, poll_s=0.1)
        token.start()
        try:
            step = 0
            while True:
                step += 1
                channel.emit("metrics", step=step, metrics={})
                await token.guard(asyncio.sleep(0.2))
        finally:
            token.stop()

    jobs.runner_for = lambda spec: as_runner(endless)  # type: ignore[assignment]
    settings = Settings()
    assert settings.redis_url
    channel = RedisChannel(jobs.channel_redis(settings.redis_url), job_id)
    return jobs.execute(jobs._SPEC.validate_python(SPEC), job_id, settings, channel)
