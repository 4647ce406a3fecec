"""Where a job's story goes: its channel (event stream), files in its run dir, and W&B.

* `metrics.jsonl`: one row per training step, plus one per evaluation (`eval/pass@1`,
  `eval/problems_passed` at the step it ran), so interval evaluations form a time series.
* `rollouts/step-NNNNNN.jsonl`: every sample of a step (problem id, phase, prompt hash,
  completion, reward, status, first failure message), and a W&B table of them when W&B is on.
* `.outbox/run-<token>.jsonl`: the run's journal, the events Redis has not taken yet (an outage),
  each with the step it belongs to, so a run resumed after this one died sends those of the steps
  its checkpoint holds (`recover_events`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from crucible_shared import jsonl

from crucible_trainer.runtime.channel import JobChannel, metrics_steps

log = logging.getLogger(__name__)
JOURNAL = ".outbox"  # the run dir's folder of journals (hidden: not an artifact)


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
        "length_cost": getattr(sample, "length_cost", 0.0),  # the length penalty inside `reward`
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
        self.journal_dir = run_dir / JOURNAL
        self.step_now = 0  # the newest step this run's events named: the step a journaled one belongs to
        self._journaled = 0  # the number of the last event in this run's journal
        self._journal_lock = threading.Lock()  # events come from the loop and from worker threads

    def emit(self, kind: str, **data: Any) -> None:
        """Append an event to the job's stream (and log it): `kind` and `data` are one of
        `crucible_shared.events.JobEvent`, which the channel validates as it writes."""
        step = data.get("step")
        if isinstance(step, int) and not isinstance(step, bool):
            self.step_now = max(self.step_now, step)
        self.channel.emit(kind, **data)
        self.journal()
        log.info("%s %s", kind, json.dumps(data, default=str)[:500])

    def journal(self, step: int | None = None) -> None:
        """Add the run's events that still wait for Redis to its journal (belonging to `step`,
        else the newest step its events named). Written only while the run holds its lease, and
        only then: while Redis takes every event at once this writes nothing."""
        with self._journal_lock:
            waiting = self.channel.undelivered(self._journaled)
            if not waiting:
                return
            self.journal_dir.mkdir(parents=True, exist_ok=True)
            at = self.step_now if step is None else step
            journal = self.journal_dir / f"run-{self.channel.token}.jsonl"
            append_lines(
                journal, [json.dumps({"seq": seq, "step": at, "data": data}) for seq, data in waiting]
            )
            self._journaled = waiting[-1][0]

    def _append(self, row: dict[str, Any]) -> None:
        self.channel.gate()  # only the run holding the job writes its run dir
        append_lines(self.metrics_path, [json.dumps(row, default=str)])

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

    def folder(self, out: Path, write: Callable[[Path], Any]) -> Any:
        """`write(folder)` into a folder of this run's own, put in place of `out` once the gate
        passed: a report (`eval/<label>/`, `before_after/`) is the live run's whole, never one a
        superseded run wrote over or into. Returns what `write` returns."""
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_name(f".{out.name}{self.channel.tag}.tmp")
        old = out.with_name(f".{out.name}{self.channel.tag}.old")
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            result = write(tmp)
            self.channel.gate()
            shutil.rmtree(old, ignore_errors=True)
            if out.exists():
                os.replace(out, old)  # a folder replaces no folder in one rename: aside, then gone
            os.replace(tmp, out)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
            shutil.rmtree(old, ignore_errors=True)
        return result

    def forget_after(self, step: int) -> None:
        """After a resume from `step`: drop what was logged for later steps (they run again)."""
        self.channel.gate()
        if self.metrics_path.exists():
            kept = [json.dumps(row) for row in metrics_rows(self.metrics_path) if row.get("step", 0) <= step]
            self.metrics_path.write_text("".join(line + "\n" for line in kept))
        for path in self.rollouts_dir.glob("step-*.jsonl"):
            if int(path.stem.split("-")[1]) > step:
                path.unlink()


def append_lines(path: Path, lines: list[str]) -> None:
    """Append `lines` to a JSON-lines file. A last line cut short by a run killed while writing it
    (no line end) is ended first, so that it stays a line of its own, which the readers skip,
    rather than taking the first new line with it."""
    with path.open("a+b") as f:
        data = "".join(line + "\n" for line in lines).encode()
        if f.tell():
            f.seek(-1, os.SEEK_END)
            if f.read(1) != b"\n":
                data = b"\n" + data
        f.write(data)


def metrics_rows(path: Path) -> list[dict[str, Any]]:
    """The rows of a `metrics.jsonl`, without a last line cut short by a run killed
    while writing it (or a full disk): that step had no checkpoint yet, so it runs again and logs
    its row anew."""
    return jsonl.rows(path.read_text())


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
    """After a resume from step `upto`: the events of steps up to it that never reached the job's
    stream (an earlier run recorded them during a Redis outage and died, or lost the job, before
    delivering them), sent in order before anything of the resumed run's own: as they were
    recorded, from the earlier runs' journals, and any step's `metrics` event still missing from
    its `metrics.jsonl` row. The earlier journals are then removed (their later steps run again).
    Returns how many were sent."""
    stream = sink.channel.stream_data()
    if stream is None:
        return 0
    seen = set(stream)
    delivered = metrics_steps(stream)
    found: list[tuple[int, int, str | dict[str, Any]]] = []  # (step, source, JSON | metrics row)
    own = f"run-{sink.channel.token}.jsonl"
    journals = sorted(
        (p for p in sink.journal_dir.glob("run-*.jsonl") if p.name != own),
        key=lambda p: int(p.stem.split("-")[1]) if p.stem.split("-")[1].isdigit() else 0,
    )
    for path in journals:
        for entry in jsonl.rows(path.read_text()):  # no line a run was killed while writing
            data, step = entry.get("data"), entry.get("step")
            if isinstance(data, str) and isinstance(step, int) and step <= upto and data not in seen:
                seen.add(data)
                delivered |= metrics_steps([data])
                found.append((step, 0, data))
    if sink.metrics_path.exists():
        for row in metrics_rows(sink.metrics_path):
            step = row.get("step")
            if isinstance(step, int) and step <= upto and "eval_label" not in row and step not in delivered:
                delivered.add(step)
                found.append((step, 1, {k: v for k, v in row.items() if k != "step"}))
    found.sort(key=lambda f: (f[0], f[1]))  # by step; a step's journal first, in its order
    for step, _, event in found:
        if isinstance(event, str):
            sink.channel.resend(event)
        else:
            sink.channel.emit("metrics", step=step, metrics=event)
        sink.journal(step)  # Redis away again: kept in this run's journal
    if journals:
        sink.channel.gate()
        for path in journals:
            path.unlink(missing_ok=True)
    return len(found)


def start_wandb(
    job_id: str,
    mode: str | None,
    project: str,
    run_name: str | None,
    run_dir: Path,
    config: dict,
    tag: str = "",
) -> Any:
    """A W&B run, or None when disabled. The spec's `logging.wandb_mode` wins when it is set;
    unset, the worker's WANDB_MODE (tests set it to disabled), else offline.

    Each run of a job logs to a W&B run of its own, `<job id><tag>` (`channel.tag`: `-r<token>`
    for a job's later runs), grouped under the job id: a superseded run still logging can never
    write into the history of the run that holds the job, and what a run logs passed its gate
    first (`EventSink`), as its files did."""
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
        id=f"{job_id}{tag}",
        group=job_id,
        mode=mode,
        dir=str(run_dir),
        config=config,
        resume="allow",
    )
