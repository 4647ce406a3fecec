"""Where a job's progress goes: its Redis stream, `metrics.jsonl` in its run dir, and W&B."""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Any

from crucible_shared import keys

log = logging.getLogger(__name__)
STREAM_MAXLEN = 10_000


class EventSink:
    def __init__(self, job_id: str, run_dir: Path, redis: Any = None, wandb_run: Any = None) -> None:
        self.job_id, self.run_dir, self.redis, self.wandb_run = job_id, run_dir, redis, wandb_run
        run_dir.mkdir(parents=True, exist_ok=True)
        self.metrics_path = run_dir / "metrics.jsonl"

    def emit(self, kind: str, **data: Any) -> None:
        """Append an event to the job's stream (and log it)."""
        record = {"type": kind, "time": time.time(), **data}
        if self.redis is not None:
            try:
                self.redis.xadd(
                    keys.events(self.job_id), {"data": json.dumps(record, default=str)}, maxlen=STREAM_MAXLEN
                )
            except Exception as exc:  # progress reporting must never kill a training run
                log.warning("could not publish event: %r", exc)
        log.info("%s %s", kind, json.dumps(data, default=str)[:500])

    def metrics(self, step: int, values: dict[str, float]) -> None:
        row = {"step": step, **values}
        with self.metrics_path.open("a") as f:
            f.write(json.dumps(row) + "\n")
        if self.wandb_run is not None:
            self.wandb_run.log(values, step=step)
        self.emit("metrics", step=step, metrics=values)


def start_wandb(
    job_id: str, mode: str, project: str, run_name: str | None, run_dir: Path, config: dict
) -> Any:
    """A W&B run, or None when disabled (tests set WANDB_MODE=disabled)."""
    mode = os.environ.get("WANDB_MODE", mode)
    if mode == "disabled":
        return None
    try:
        import wandb
    except ImportError:
        log.warning("wandb is not installed; logging to metrics.jsonl only")
        return None
    return wandb.init(
        project=project,
        name=run_name or job_id,
        id=job_id,
        mode=mode,
        dir=str(run_dir),
        config=config,
        resume="allow",
    )
