"""RQ job functions (the payloads are JSON: a job id and a spec dict) and the job-record updates.

The worker is an RQ `SimpleWorker`: the model and CUDA context survive between jobs in one
process (a forking worker would break CUDA). A `SimpleWorker` does not heartbeat mid-job, so
jobs are enqueued with a long `job_timeout`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Any

from crucible_shared import keys
from crucible_shared.jobs import EvalJob, JobSpec, TrainJob
from pydantic import TypeAdapter

log = logging.getLogger(__name__)
_SPEC = TypeAdapter(JobSpec)


def record(redis: Any, job_id: str, **fields: Any) -> None:
    """Update the job's record (a Redis hash); values that are not strings are JSON-encoded."""
    if redis is None:
        return
    mapping = {k: v if isinstance(v, str) else json.dumps(v, default=str) for k, v in fields.items()}
    redis.hset(keys.job(job_id), mapping=mapping)


class Heartbeat:
    """Writes `heartbeat_at` into the job record every few seconds from a thread, so a killed
    worker shows up as a silent job (the gateway then marks it failed) even mid-step."""

    def __init__(self, redis: Any, job_id: str, every_s: float = 5.0) -> None:
        import threading

        self.redis, self.job_id, self.every_s = redis, job_id, every_s
        self.stop_event = threading.Event()
        self.thread = threading.Thread(target=self._beat, name=f"heartbeat-{job_id}", daemon=True)

    def _beat(self) -> None:
        while not self.stop_event.is_set():
            try:
                record(self.redis, self.job_id, heartbeat_at=time.time())
            except Exception as exc:  # a Redis blip must not kill the job
                log.warning("heartbeat failed: %r", exc)
            self.stop_event.wait(self.every_s)

    def __enter__(self) -> Heartbeat:
        if self.redis is not None:
            self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop_event.set()


def run_job(job_id: str, spec: dict[str, Any]) -> dict[str, Any]:
    """Entry point of every queued job."""
    from redis import Redis

    from crucible_trainer.settings import Settings

    settings = Settings()
    redis = Redis.from_url(settings.redis_url) if settings.redis_url else None
    parsed = _SPEC.validate_python(spec)
    record(redis, job_id, status="running", started_at=time.time(), heartbeat_at=time.time())
    try:
        with Heartbeat(redis, job_id, settings.heartbeat_s):
            if isinstance(parsed, TrainJob):
                from crucible_trainer.train import run_train_job

                summary = asyncio.run(run_train_job(parsed, job_id, settings, redis=redis))
            else:
                summary = asyncio.run(run_eval_job(parsed, job_id, settings, redis=redis))
    except BaseException as exc:
        record(
            redis,
            job_id,
            status="failed",
            finished_at=time.time(),
            error=f"{type(exc).__name__}: {exc}"[:2000],
        )
        raise
    status = summary.get("status", "finished")
    record(redis, job_id, status=status, finished_at=time.time(), summary=summary)
    return summary


async def run_eval_job(spec: EvalJob, job_id: str, settings: Any, *, redis: Any = None) -> dict[str, Any]:
    """Evaluate the base model (or an adapter loaded for the occasion) on the spec's data."""
    from pathlib import Path

    from crucible_shared.generator_client import GeneratorPool
    from crucible_shared.sandbox_client import SandboxClient

    from crucible_trainer import evaluation
    from crucible_trainer.cancel import CancelToken
    from crucible_trainer.events import EventSink
    from crucible_trainer.train import eval_config, load_selection, served_base_name

    run_dir = Path(settings.runs_dir) / job_id
    events = EventSink(job_id, run_dir, redis)
    cancel = CancelToken(redis, job_id, settings.cancel_poll_s)
    cancel.start()
    pool = GeneratorPool.from_urls(settings.generator_urls)
    sandbox = SandboxClient(settings.sandbox_url, api_key=settings.sandbox_api_key)
    adapter_name = None
    try:
        await cancel.guard(pool.wait_ready(timeout=600))
        model = await served_base_name(pool)
        if spec.adapter:
            adapter_name = f"eval-{job_id}"
            await pool.load_adapter(adapter_name, str(Path(spec.adapter).resolve()))
            model = adapter_name
        selected = load_selection(spec.data)
        config = eval_config(
            model, spec.n, spec.temperature, spec.top_p, spec.max_tokens, spec.ks, spec.seed, spec.model.chat
        )
        events.emit("status", status="running", tasks=len(selected))
        report = await cancel.guard(evaluation.evaluate(selected, pool, sandbox, config))
        evaluation.write_report(report, run_dir / "eval")
        summary = {
            "job_id": job_id,
            "status": "finished",
            "run_dir": str(run_dir),
            "report": str(run_dir / "eval"),
        }
        events.emit("status", status="finished", summary=summary)
        return summary
    finally:
        cancel.stop()
        if adapter_name:
            await pool.unload_adapter(adapter_name, missing_ok=True)
        await pool.aclose()
        await sandbox.close()
