"""The standalone `sft` / `dpo` train job: TRL on a user's JSONL file, evaluated before and after.

The runner registry (`runners.RUNNERS`) sends train jobs of an offline method here instead of the online loop
(`online/train.py` samples, executes and updates every step; nothing here samples). The job checks
`method.path` (`trl_train.load_rows`), evaluates the starting policy when `eval` asks for it,
trains with `trl_train.train` (the code the pipeline's `train` stage runs), publishes the adapter
to the generators as `<job>-v<steps>` and evaluates it, writing what online jobs write into its
run dir: `adapter/`, `metrics.jsonl`, `eval/before|after|before_after`, `summary.json`. Run again
after a kill or a cancel (same job id), it resumes from its TRL checkpoints in `trainer/`.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from crucible_shared.jobs import DPOConfig, SFTConfig, TrainJob

from crucible_trainer import evaluation
from crucible_trainer.evaluation.job import eval_summary
from crucible_trainer.offline import attempts
from crucible_trainer.offline.artifacts import content_hash, json_hash
from crucible_trainer.offline.rows import load_rows
from crucible_trainer.offline.services import JobServices
from crucible_trainer.offline.trl_train import Hooks, OfflineRun, train
from crucible_trainer.runtime.channel import JobChannel
from crucible_trainer.runtime.jobrun import JobRun
from crucible_trainer.runtime.sink import resume_events
from crucible_trainer.settings import Settings


class OfflineTrainRun(JobRun):
    """An `sft` / `dpo` train job (see the module's docstring)."""

    spec: TrainJob

    async def prepare(self) -> None:
        spec, method = self.spec, self.spec.method
        assert isinstance(method, SFTConfig | DPOConfig)
        self.method = method
        self.summary["method"] = method.name
        self.services = JobServices(self, spec.model.base)
        self.rows = load_rows(self.paths["method.path"], method.name)
        self.init = self.paths.get("model.init_adapter")
        self.identity = json_hash(
            {
                "spec": spec.model_dump(
                    mode="json", exclude={"eval", "logging", "checkpoint", "max_attempts", "name"}
                ),
                "data": content_hash(self.paths["method.path"]),
                "init_adapter": content_hash(self.init) if self.init else None,
            }
        )

    def starting(self) -> dict[str, Any]:
        return {"method": self.method.name, "rows": len(self.rows)}

    async def close(self) -> None:
        if hasattr(self, "services"):
            await self.services.retire_adapters()

    async def _evaluate(self, adapter: Path | None, version: int, label: str) -> Any:
        spec = self.spec
        assert spec.eval is not None
        model = await self.services.serve(adapter, version)
        report = await self.services.evaluate(
            spec.eval,
            self.run_dir / "eval" / label,
            model=model,
            chat=spec.model.chat,
            seed=spec.seed,
            label=label,
            step=version,
        )
        self.summary.setdefault("eval", {})[label] = eval_summary(report)
        return report

    def _on_metrics(self, step: int, total: int, values: dict[str, float]) -> None:
        self.events.metrics(step, values)
        self.channel.progress(step, total, values, self.services.model_name)

    def _on_event(self, kind: str, **data: Any) -> None:
        if kind == "resumed":
            resume_events(self.events, data["step"])  # those steps run again, each event once
        self.events.emit(kind, **data)

    async def body(self) -> None:
        spec, run_dir = self.spec, self.run_dir
        before = None
        if spec.eval is not None and spec.eval.before:
            saved = run_dir / "eval" / "before" / "report.json"
            if saved.exists():  # an earlier attempt of this job evaluated the same policy
                before = evaluation.load_report(saved)
                self.summary.setdefault("eval", {})["before"] = eval_summary(before)
            else:
                before = await self._evaluate(self.init, 0, "before")
        base = run_dir / "trainer"
        work_dir, resume_from = attempts.work_dir(run_dir, base, self.channel)
        run = OfflineRun(
            method=self.method,
            model=self.loaded_model(),
            base_name=spec.model.base if "model.base" in self.loaded else None,
            optim=spec.optim,
            rows=self.rows,
            work_dir=work_dir,
            resume_from=resume_from,
            adapter_dir=run_dir / "adapter",
            seed=spec.seed,
            checkpoint_every=spec.checkpoint.every,
            start_adapter=str(self.loaded["model.init_adapter"]) if self.init else None,
            identity=self.identity,
        )
        hooks = Hooks(
            metrics=self._on_metrics,
            event=self._on_event,
            stop_requested=lambda: self.cancel.requested,
            gate=self.channel.gate,
            saved=lambda checkpoint: attempts.commit(run_dir, base, checkpoint, self.channel),
        )
        result = await asyncio.to_thread(train, run, hooks)
        self.summary.update(steps=result["steps"], adapter=result["adapter"])
        if spec.eval is not None:
            after = await self._evaluate(run.adapter_dir, result["steps"], "after")
            self.summary["model_name"] = self.services.model_name
            if before is not None:
                out = run_dir / "eval" / "before_after"
                self.events.folder(out, lambda folder: evaluation.compare_reports(before, after, folder))
                self.summary["before_after"] = str(out)


async def run_offline_train_job(
    spec: TrainJob, job_id: str, settings: Settings, channel: JobChannel
) -> dict[str, Any]:
    """`OfflineTrainRun(...).run()`, for scripts and tests that run one job in-process."""
    return await OfflineTrainRun(spec, job_id, settings, channel).run()
