"""The standalone `sft` / `dpo` train job: TRL on a user's JSONL file, evaluated before and after.

`jobs.runner_for` sends train jobs of an offline method here instead of the online loop
(`train.py` samples, executes and updates every step; nothing here samples). The job checks
`method.path` (`trl_train.load_rows`), evaluates the starting policy when `eval` asks for it,
trains with `trl_train.train` (the code the pipeline's `train` stage runs), publishes the adapter
to the generators as `<job>-v<steps>` and evaluates it, writing what online jobs write into its
run dir: `adapter/`, `metrics.jsonl`, `eval/before|after|before_after`, `summary.json`. Run again
after a kill or a cancel (same job id), it resumes from its TRL checkpoints in `trainer/`.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

from crucible_shared.jobs import DPOConfig, SFTConfig, TrainJob
from crucible_shared.lifecycle import JobStatus
from crucible_shared.paths import with_checked_paths

from crucible_trainer import evaluation
from crucible_trainer.cancel import Cancelled, CancelToken
from crucible_trainer.channel import JobChannel
from crucible_trainer.evaljob import eval_summary
from crucible_trainer.events import EventSink, start_wandb
from crucible_trainer.offline.artifacts import content_hash, json_hash
from crucible_trainer.offline.rows import load_rows
from crucible_trainer.offline.services import JobServices
from crucible_trainer.offline.trl_train import Hooks, OfflineRun, train
from crucible_trainer.settings import Settings


async def run_offline_train_job(
    spec: TrainJob, job_id: str, settings: Settings, channel: JobChannel
) -> dict[str, Any]:
    method = spec.method
    assert isinstance(method, SFTConfig | DPOConfig)
    roots = settings.path_roots()
    paths = roots.check(spec, real=True)
    spec = with_checked_paths(spec, roots.check(spec))
    run_dir = Path(settings.runs_dir) / job_id
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "spec.json").write_text(spec.model_dump_json(indent=2))
    events = EventSink(channel, run_dir)
    cancel = CancelToken(channel, settings.cancel_poll_s)
    services = JobServices(settings, job_id, spec.model.base, cancel, events)
    summary: dict[str, Any] = {"job_id": job_id, "run_dir": str(run_dir), "method": method.name}
    rows = load_rows(paths["method.path"], method.name)
    init = paths.get("model.init_adapter")
    identity = json_hash(
        {
            "spec": spec.model_dump(
                mode="json", exclude={"eval", "logging", "checkpoint", "max_attempts", "name"}
            ),
            "data": content_hash(paths["method.path"]),
            "init_adapter": content_hash(init) if init else None,
        }
    )
    cancel.start()
    events.emit("status", status="starting", method=method.name, rows=len(rows))
    events.wandb_run = start_wandb(
        job_id,
        spec.logging.wandb_mode,
        spec.logging.wandb_project,
        spec.logging.run_name,
        run_dir,
        spec.model_dump(mode="json"),
    )

    async def evaluate(adapter: Path | None, version: int, label: str) -> Any:
        assert spec.eval is not None
        model = await services.serve(adapter, version)
        report = await services.evaluate(
            spec.eval,
            run_dir / "eval" / label,
            model=model,
            chat=spec.model.chat,
            seed=spec.seed,
            label=label,
            step=version,
        )
        summary.setdefault("eval", {})[label] = eval_summary(report)
        return report

    def on_metrics(step: int, total: int, values: dict[str, float]) -> None:
        events.metrics(step, values)
        channel.progress(step, total, values, services.model_name)

    def on_event(kind: str, **data: Any) -> None:
        if kind == "resumed":
            events.forget_after(data["step"])  # those steps run again
        events.emit(kind, **data)

    try:
        try:
            before = None
            if spec.eval is not None and spec.eval.before:
                saved = run_dir / "eval" / "before" / "report.json"
                if saved.exists():  # an earlier attempt of this job evaluated the same policy
                    before = evaluation.load_report(saved)
                    summary.setdefault("eval", {})["before"] = eval_summary(before)
                else:
                    before = await evaluate(init, 0, "before")
            run = OfflineRun(
                method=method,
                model=spec.model,
                optim=spec.optim,
                rows=rows,
                work_dir=run_dir / "trainer",
                adapter_dir=run_dir / "adapter",
                seed=spec.seed,
                checkpoint_every=spec.checkpoint.every,
                start_adapter=str(init) if init else None,  # resolved inside the adapter roots
                identity=identity,
            )
            hooks = Hooks(metrics=on_metrics, event=on_event, stop_requested=lambda: cancel.requested)
            result = await asyncio.to_thread(train, run, hooks)
            summary.update(status=JobStatus.finished.value, steps=result["steps"], adapter=result["adapter"])
            if spec.eval is not None:
                after = await evaluate(run.adapter_dir, result["steps"], "after")
                summary["model_name"] = services.model_name
                if before is not None:
                    out = run_dir / "eval" / "before_after"
                    evaluation.compare_reports(before, after, out)
                    summary["before_after"] = str(out)
        finally:
            await services.close()
    except Cancelled:
        summary["status"] = JobStatus.cancelled.value
        events.emit("status", status="cancelled")
    finally:
        cancel.stop()
        if events.wandb_run is not None:
            events.wandb_run.finish()
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
    if summary["status"] == JobStatus.finished.value:
        events.emit("status", status="finished", summary=summary)
    return summary
