"""Evaluation as a job and inside training: one code path from an `EvalSpec` to a written report.

`evaluate_spec` runs an `EvalSpec` against what the generator serves under a model name and
writes `report.json` / `.md` / `.png` into a folder; the eval job (`EvalRun`) and every
evaluation of a training job (before, every N steps, after) call it. `served_base` checks that
the generator serves the base model a job names, so a job never silently evaluates or trains
against another model.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from crucible_shared import served
from crucible_shared.generator_client import GeneratorPool
from crucible_shared.jobs import EvalJob, EvalSpec
from crucible_shared.sandbox_client import SandboxClient

from crucible_trainer import evaluation, tasks
from crucible_trainer.runtime.cancel import CancelToken
from crucible_trainer.runtime.channel import JobChannel
from crucible_trainer.runtime.jobrun import JobRun
from crucible_trainer.runtime.sink import EventSink
from crucible_trainer.settings import Settings


class ServedModelMismatch(RuntimeError):
    """The generator serves another base model than the job names."""


async def served_base(pool: GeneratorPool, wanted: str) -> str:
    """The name the generator serves `wanted` under; `ServedModelMismatch` if it serves another."""
    bases = served.base_cards(await pool.pick().models())
    for card in bases:
        if served.same_model(wanted, card.id, card.root):
            return card.id
    raise ServedModelMismatch(
        f"model.base is {wanted!r} but the generator serves {served.describe(bases)}: submit the job "
        f"with model.base set to that model, or start the generator with {wanted!r}"
    )


def eval_summary(report: Any) -> dict[str, Any]:
    """The headline figures of a report, for events, summaries and the metrics series."""
    passed = [p.greedy_passed for p in report.problems if p.greedy_passed is not None]
    return {
        **report.summary(),
        "problems": report.num_problems,
        "problems_passed": sum(passed) if passed else None,
        "mean_generated_tokens": report.mean_generated_tokens,
        "hard_coded_answers": report.hard_coded_answers,
    }


async def evaluate_spec(
    spec: EvalSpec,
    pool: GeneratorPool,
    sandbox: SandboxClient,
    *,
    model: str,
    chat: bool,
    seed: int,
    out: Path,
    cancel: CancelToken,
    events: EventSink,
    label: str,
) -> tuple[Any, dict[str, Any]]:
    """Evaluate what the generator serves as `model` on `spec`; the report goes to `out`."""
    problems = tasks.load_tasks(spec.data)
    config = evaluation.EvalConfig.from_spec(spec, model=model, chat=chat, seed=seed)
    events.emit("eval_started", label=label, model=model, tasks=len(problems), data=spec.data.describe())
    report = await cancel.guard(evaluation.evaluate(problems, pool, sandbox, config, data=spec.data))
    events.folder(out, lambda folder: evaluation.write_report(report, folder))
    summary = eval_summary(report)
    events.emit("eval_finished", label=label, report=str(out), dataset=spec.data.dataset, **summary)
    return report, summary


class EvalRun(JobRun):
    """An eval job: the base model the spec names (with `adapter` loaded for the occasion)."""

    loads_model = False  # the generator serves it, found by the name the spec gives
    spec: EvalJob
    adapter_name: str | None = None  # the spec's adapter, once loaded into the generators

    async def body(self) -> None:
        spec = self.spec
        await self.cancel.guard(self.pool.wait_ready(timeout=600))
        model = await served_base(self.pool, spec.model.base)
        if spec.adapter:
            self.adapter_name = f"eval-{self.job_id}"
            await self.pool.load_adapter(self.adapter_name, str(self.paths["adapter"]))
            model = self.adapter_name
        out = self.run_dir / "eval"
        _, headline = await evaluate_spec(
            spec,
            self.pool,
            self.sandbox,
            model=model,
            chat=spec.model.chat,
            seed=spec.seed,
            out=out,
            cancel=self.cancel,
            events=self.events,
            label="eval",
        )
        self.summary.update(report=str(out), eval={"eval": headline})

    async def close(self) -> None:
        if self.adapter_name:
            await self.pool.unload_adapter(self.adapter_name, missing_ok=True)


async def run_eval_job(spec: EvalJob, job_id: str, settings: Settings, channel: JobChannel) -> dict[str, Any]:
    """`EvalRun(...).run()`, for scripts and tests that run one job in-process."""
    return await EvalRun(spec, job_id, settings, channel).run()
