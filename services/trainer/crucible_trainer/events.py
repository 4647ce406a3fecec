"""Where a job's story goes: its channel (event stream), files in its run dir, and W&B.

* `metrics.jsonl`: one row per training step, plus one per evaluation (`eval/pass@1`,
  `eval/problems_passed` at the step it ran), so interval evaluations form a time series.
* `rollouts/step-NNNNNN.jsonl`: every sample of a step (problem id, phase, prompt hash,
  completion, reward, status, first failure message), and a W&B table of them when W&B is on.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Any

from crucible_trainer.channel import JobChannel

log = logging.getLogger(__name__)


def rollout_row(step: int, sample: Any, task_id: str) -> dict[str, Any]:
    """One sample as a rollouts-file row (the prompt by the hash of its token ids)."""
    result = sample.result
    prompt = ",".join(map(str, sample.prompt_ids)).encode()
    return {
        "step": step,
        "problem_id": task_id,
        "phase": sample.phase,
        "group": sample.group,
        "prompt_hash": hashlib.sha256(prompt).hexdigest()[:16],
        "completion": sample.text,
        "reward": sample.reward,
        "advantage": sample.advantage,
        "status": result.status.value if result is not None else None,
        "tests_passed": result.passed if result is not None else None,
        "tests_total": result.total if result is not None else None,
        "same_answer": result.same_answer if result is not None else None,
        "message": result.message if result is not None else "",
        "tokens": len(sample.completion_ids),
        "finish_reason": sample.finish_reason,
        "version": getattr(sample, "version", 0),
        **sample.info,
    }


class EventSink:
    def __init__(self, channel: JobChannel, run_dir: Path, wandb_run: Any = None) -> None:
        self.channel, self.run_dir, self.wandb_run = channel, run_dir, wandb_run
        run_dir.mkdir(parents=True, exist_ok=True)
        self.metrics_path = run_dir / "metrics.jsonl"
        self.rollouts_dir = run_dir / "rollouts"
        # Steps after the checkpoint a run resumed from whose `metrics` event an earlier run
        # already delivered: they run again (`checkpoint.every > 1`), their event is not sent twice.
        self.sent_steps: set[int] = set()

    def emit(self, kind: str, **data: Any) -> None:
        """Append an event to the job's stream (and log it): `kind` and `data` are one of
        `crucible_shared.events.JobEvent`, which the channel validates as it writes."""
        self.channel.emit(kind, **data)
        log.info("%s %s", kind, json.dumps(data, default=str)[:500])

    def _append(self, row: dict[str, Any]) -> None:
        self.channel.gate()  # only the run holding the job writes its run dir
        with self.metrics_path.open("a") as f:
            f.write(json.dumps(row, default=str) + "\n")

    def metrics(self, step: int, values: dict[str, float], *, emit: bool = True) -> None:
        """The step's `metrics.jsonl` row (and W&B), then its event unless `emit` is False (the
        training loop sends it after the step's checkpoint, `step_event`)."""
        self._append({"step": step, **values})
        if self.wandb_run is not None:
            self.wandb_run.log(values, step=step)
        if emit:
            self.step_event(step, values)

    def step_event(self, step: int, values: dict[str, float]) -> None:
        if step in self.sent_steps:  # replayed after a resume: the stream has this step's event
            return
        self.emit("metrics", step=step, metrics=values)

    def eval_point(self, step: int, label: str, summary: dict[str, Any]) -> None:
        """An evaluation as a point of the time series (`eval/<metric>` at `step`)."""
        values = {f"eval/{k}": v for k, v in summary.items() if isinstance(v, int | float) and v is not None}
        self._append({"step": step, "eval_label": label, **values})
        if self.wandb_run is not None:
            self.wandb_run.log(values, step=step)

    def rollouts(self, step: int, rows: list[dict[str, Any]]) -> Path:
        self.rollouts_dir.mkdir(parents=True, exist_ok=True)
        path = self.rollouts_dir / f"step-{step:06d}.jsonl"
        tmp = path.with_name(f".{path.name}{self.channel.tag}.tmp")  # no two runs share one
        tmp.write_text("".join(json.dumps(r, default=str) + "\n" for r in rows))
        try:
            self.channel.gate()
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        os.replace(tmp, path)
        if self.wandb_run is not None and rows:
            import wandb

            columns = list(rows[0])
            self.wandb_run.log(
                {"rollouts": wandb.Table(columns=columns, data=[[r[c] for c in columns] for r in rows])},
                step=step,
            )
        return path

    def forget_after(self, step: int) -> None:
        """After a resume from `step`: drop what was logged for later steps (they run again)."""
        self.channel.gate()
        if self.metrics_path.exists():
            kept = [
                line
                for line in self.metrics_path.read_text().splitlines()
                if line.strip() and json.loads(line).get("step", 0) <= step
            ]
            self.metrics_path.write_text("".join(line + "\n" for line in kept))
        for path in self.rollouts_dir.glob("step-*.jsonl"):
            if int(path.stem.split("-")[1]) > step:
                path.unlink()


def resume_events(sink: EventSink, upto: int) -> int:
    """A run resumed from the checkpoint of step `upto`: metrics.jsonl loses the rows of later steps
    (they run again), the stream gets the events of steps up to `upto` that no run delivered
    (`recover_events`), and the steps after it whose event is already in the stream (an earlier run
    ran them before it stopped) send no second one. Returns how many events were recovered."""
    sink.forget_after(upto)
    recovered = recover_events(sink, upto)
    sink.sent_steps = {step for step in sink.channel.delivered_steps() or () if step > upto}
    return recovered


def recover_events(sink: EventSink, upto: int) -> int:
    """After a resume from step `upto`: the `metrics` events of steps up to it that never reached
    the job's stream (an earlier run checkpointed them during a Redis outage and died before
    delivering them), sent again from their `metrics.jsonl` rows, in step order. Returns how many."""
    delivered = sink.channel.delivered_steps()
    if delivered is None or not sink.metrics_path.exists():
        return 0
    rows = {}
    for line in sink.metrics_path.read_text().splitlines():
        row = json.loads(line) if line.strip() else {}
        step = row.get("step")
        if isinstance(step, int) and step <= upto and "eval_label" not in row and step not in delivered:
            rows[step] = {k: v for k, v in row.items() if k != "step"}
    for step in sorted(rows):
        sink.channel.emit("metrics", step=step, metrics=rows[step])
    return len(rows)


def start_wandb(
    job_id: str, mode: str | None, project: str, run_name: str | None, run_dir: Path, config: dict
) -> Any:
    """A W&B run, or None when disabled. The spec's `logging.wandb_mode` wins when it is set;
    unset, the worker's WANDB_MODE (tests set it to disabled), else offline."""
    mode = mode or os.environ.get("WANDB_MODE") or "offline"
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
