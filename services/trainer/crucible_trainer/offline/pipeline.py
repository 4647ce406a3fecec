"""The `pipeline` job: the offline learning pipeline over one run dir (docs/pipeline.md).

    baseline -> [generate -> annotate -> build -> train] x rounds -> merge -> evaluate -> analyze

Each stage is a `StagePlan` (the spec sections it reads, its input and output files) and a body.
The driver runs the stages `spec.stages` names, in this order: a stage whose inputs are missing
stops the job naming the stage that writes them; a stage whose outputs are up to date
(`stages.StageBook`) is skipped; the others run and are recorded. Round r samples from round
r-1's adapter (round 1 from the starting policy), hot-swapped into every generator replica.

Run dir:

    spec.json, pipeline.json (stage records), summary.json, report.md, metrics.jsonl
    eval/before/                       baseline: report.json / .md / .png of the starting policy
    round-<r>/candidates.jsonl         generate
    round-<r>/candidates_annotated.jsonl  annotate
    round-<r>/nbest.jsonl, pairs.jsonl, manifest.json  build
    round-<r>/trainer/, adapter/       train: TRL checkpoints, the round's LoRA
    merged/                            merge: the last adapter folded into the base
    eval/after/, eval/before_after/    evaluate: the trained policy, and the comparison
    analysis/                          analyze
"""

from __future__ import annotations

import asyncio
import shutil
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

from crucible_shared.jobs import ROUND_STAGES, PipelineJob

from crucible_trainer import evaluation, tasks
from crucible_trainer.evaluation.job import eval_summary
from crucible_trainer.offline import analysis, attempts, report
from crucible_trainer.offline.annotate import annotate
from crucible_trainer.offline.artifacts import (
    json_hash,
    link_tree,
    read_rows,
    write_json,
    write_rows,
)
from crucible_trainer.offline.build import build, require
from crucible_trainer.offline.build import manifest as build_manifest
from crucible_trainer.offline.sampling import generate
from crucible_trainer.offline.services import JobServices
from crucible_trainer.offline.stages import Input, StageBook, StagePlan
from crucible_trainer.runtime.channel import JobChannel
from crucible_trainer.runtime.jobrun import JobRun
from crucible_trainer.runtime.sink import resume_events
from crucible_trainer.settings import Settings

Body = Callable[[], Awaitable[dict[str, Any]]]


class PipelineRun(JobRun):
    """State of one pipeline job; `run()` executes its stages to the end, a cancel or an error."""

    spec: PipelineJob

    def __init__(self, spec: PipelineJob, job_id: str, settings: Settings, channel: JobChannel) -> None:
        super().__init__(spec, job_id, settings, channel)
        self.summary["stages"] = {}

    # -- paths ----------------------------------------------------------------------------------
    def round_dir(self, r: int) -> Path:
        return self.run_dir / f"round-{r}"

    def adapter(self, r: int) -> Path:
        return self.round_dir(r) / "adapter"

    def start_adapter(self, r: int) -> Input | None:
        """What round r samples from and trains on top of: round r-1's adapter, or the init adapter."""
        if r > 1:
            return Input(self.adapter(r - 1), f"the `train` stage of round {r - 1}")
        if self.spec.model.init_adapter:
            return Input(self.paths["model.init_adapter"], "model.init_adapter (the spec)")
        return None

    # -- the job --------------------------------------------------------------------------------
    async def prepare(self) -> None:
        spec = self.spec
        if spec.reuse and spec.reuse != self.job_id:
            self._reuse(Path(self.settings.runs_dir) / spec.reuse)
        self.book = StageBook(self.run_dir)
        self.services = JobServices(self, spec.model.base)

    def starting(self) -> dict[str, Any]:
        return {"stages": self.spec.stages, "rounds": self.spec.rounds}

    async def body(self) -> None:
        for plan, body in self._plans():
            await self._stage(plan, body)

    async def close(self) -> None:
        if hasattr(self, "services"):
            await self.services.retire_adapters()

    def _reuse(self, source: Path) -> None:
        """Start from another pipeline run's artifacts (once: a retried job keeps its own).

        `reuse` is one path component (its pattern); a run dir that is a link is refused, and
        links inside it are not followed (`link_tree`)."""
        if source.is_symlink() or (source / "pipeline.json").is_symlink():
            raise ValueError(f"reuse: the run dir of {source.name} is a symbolic link ({source})")
        if not (source / "pipeline.json").exists():
            raise FileNotFoundError(
                f"reuse: {source.name} has no pipeline run dir with stage records ({source})"
            )
        if (self.run_dir / "pipeline.json").exists():
            return
        names = ["eval", "merged", "analysis", *sorted(p.name for p in source.glob("round-*"))]
        link_tree(source, self.run_dir, names)
        # Records last: they only vouch for files that are already there.
        link_tree(source, self.run_dir, ["pipeline.json"])

    async def _stage(self, plan: StagePlan, body: Body) -> None:
        self.cancel.check()
        self.book.check_inputs(plan)
        signature = await asyncio.to_thread(self.book.signature, plan)
        if await asyncio.to_thread(self.book.fresh, plan, signature):
            self.summary["stages"][plan.key] = {"status": "skipped", "seconds": 0.0}
            self.events.emit("stage", stage=plan.key, status="skipped", reason="outputs up to date")
            return
        self.events.emit("stage", stage=plan.key, status="started")
        self._signature = signature  # the running stage's: train ties its checkpoints to it
        started = time.perf_counter()
        detail = await body()
        seconds = time.perf_counter() - started
        await asyncio.to_thread(self.book.record, plan, signature, seconds, detail)
        self.summary["stages"][plan.key] = {"status": "ran", "seconds": round(seconds, 3)}
        self.events.emit("stage", stage=plan.key, status="finished", seconds=round(seconds, 3), **detail)

    def _plans(self) -> Iterator[tuple[StagePlan, Body]]:
        wanted = set(self.spec.stages)
        if "baseline" in wanted:
            yield self._baseline()
        makers = {
            "generate": self._generate,
            "annotate": self._annotate,
            "build": self._build,
            "train": self._train,
        }
        for r in range(1, self.spec.rounds + 1):
            for name in ROUND_STAGES:
                if name in wanted:
                    yield makers[name](r)
        for name, single in (
            ("merge", self._merge),
            ("evaluate", self._evaluate),
            ("analyze", self._analyze),
        ):
            if name in wanted:
                yield single()

    # -- stages -----------------------------------------------------------------------------------
    def _data_inputs(self) -> list[Input]:
        path = self.paths.get("data.path")
        return [Input(path, "data.path (the spec)")] if path else []

    def _eval_inputs(self) -> list[Input]:
        path = self.paths.get("eval.data.path")
        return [Input(path, "eval.data.path (the spec)")] if path else []

    def _model_config(self) -> dict[str, Any]:
        # The model's identity; init_adapter's content is an input, `device` changes nothing.
        return self.spec.model.model_dump(mode="json", exclude={"device", "init_adapter"})

    async def _eval(self, out: Path, model: str, label: str, step: int) -> Any:
        spec = self.spec
        return await self.services.evaluate(
            spec.eval, out, model=model, chat=spec.model.chat, seed=spec.seed, label=label, step=step
        )

    def _baseline(self) -> tuple[StagePlan, Body]:
        spec = self.spec
        start = self.start_adapter(1)
        out = self.run_dir / "eval" / "before"
        plan = StagePlan(
            "baseline",
            "baseline",
            {"model": self._model_config(), "eval": spec.eval.model_dump(mode="json"), "seed": spec.seed},
            [*([start] if start else []), *self._eval_inputs()],
            [out / "report.json"],
        )

        async def body() -> dict[str, Any]:
            model = await self.services.serve(start.path if start else None, 0)
            report_ = await self._eval(out, model, "before", 0)
            return {"model": model, **eval_summary(report_)}

        return plan, body

    def _generate(self, r: int) -> tuple[StagePlan, Body]:
        spec = self.spec
        start = self.start_adapter(r)
        out = self.round_dir(r) / "candidates.jsonl"
        config = {
            "model": self._model_config(),
            "data": spec.data.model_dump(mode="json"),
            "generate": spec.generate.model_dump(mode="json"),
            "seed": spec.seed,
            "round": r,
        }
        plan = StagePlan(
            f"round-{r}/generate",
            "generate",
            config,
            [*([start] if start else []), *self._data_inputs()],
            [out],
        )

        async def body() -> dict[str, Any]:
            problems = tasks.load_tasks(spec.data)
            if not problems:
                raise ValueError("data: the selection is empty: check data.split / ids / id_range / limit")
            pool = await self.services.pool()
            model = await self.services.serve(start.path if start else None, r - 1)
            rows = await self.cancel.guard(
                generate(
                    problems,
                    pool,
                    spec.generate,
                    model=model,
                    chat=spec.model.chat,
                    seed=spec.seed,
                    round=r,
                    progress=self._progress(plan.key),
                )
            )
            write_rows(out, rows)
            return {"problems": len(problems), "candidates": len(rows), "model": model}

        return plan, body

    def _annotate(self, r: int) -> tuple[StagePlan, Body]:
        spec = self.spec
        source = self.round_dir(r) / "candidates.jsonl"
        out = self.round_dir(r) / "candidates_annotated.jsonl"
        config = {
            "data": spec.data.model_dump(mode="json"),
            "annotate": spec.annotate.model_dump(mode="json"),
        }
        inputs = [Input(source, f"the `generate` stage of round {r}"), *self._data_inputs()]
        plan = StagePlan(f"round-{r}/annotate", "annotate", config, inputs, [out])

        async def body() -> dict[str, Any]:
            rows = read_rows(source)
            problems = {t.task_id: t for t in tasks.load_tasks(spec.data)}
            sandbox = await self.services.sandbox()
            annotated = await self.cancel.guard(
                annotate(rows, problems, sandbox, spec.annotate, progress=self._progress(plan.key))
            )
            write_rows(out, annotated)
            passing = sum(1 for a in annotated if a["passed"])
            return {"candidates": len(annotated), "passing": passing}

        return plan, body

    def _build(self, r: int) -> tuple[StagePlan, Body]:
        spec = self.spec
        folder = self.round_dir(r)
        source = folder / "candidates_annotated.jsonl"
        outputs = {name: folder / name for name in ("nbest.jsonl", "pairs.jsonl", "manifest.json")}
        config = {"build": spec.build.model_dump(mode="json"), "method": spec.train.name}
        plan = StagePlan(
            f"round-{r}/build",
            "build",
            config,
            [Input(source, f"the `annotate` stage of round {r}")],
            list(outputs.values()),
        )

        async def body() -> dict[str, Any]:
            rows = read_rows(source)
            built = build(rows, spec.build)
            require(built, rows, spec.train.name, spec.build)
            write_rows(outputs["nbest.jsonl"], built.nbest)
            write_rows(outputs["pairs.jsonl"], built.pairs)
            counts = built.counts(rows)
            generated = self.book.records.get(f"round-{r}/generate", {}).get("detail") or {}
            sources = {
                "job_id": self.job_id,
                "data": spec.data.describe(),
                "model": generated.get("model"),
                "generate": spec.generate.model_dump(mode="json"),
            }
            datasets = {n: p for n, p in outputs.items() if n != "manifest.json"}
            manifest = build_manifest(
                built,
                rows,
                spec.build,
                method=spec.train.name,
                round=r,
                sources=sources,
                inputs={source.name: source},
                outputs=datasets,
            )
            write_json(outputs["manifest.json"], manifest)
            return {k: counts[k] for k in ("problems", "candidates", "passing", "nbest", "pairs")}

        return plan, body

    def _train(self, r: int) -> tuple[StagePlan, Body]:
        spec = self.spec
        method = spec.train
        data = self.round_dir(r) / ("nbest.jsonl" if method.name == "sft" else "pairs.jsonl")
        start = self.start_adapter(r)
        config = {
            "method": method.model_dump(mode="json"),
            "optim": spec.optim.model_dump(mode="json"),
            "model": self._model_config(),
            "seed": spec.seed,
        }
        inputs = [Input(data, f"the `build` stage of round {r}"), *([start] if start else [])]
        plan = StagePlan(f"round-{r}/train", "train", config, inputs, [self.adapter(r)])

        async def body() -> dict[str, Any]:
            # Imported here: transformers and TRL load only when training runs.
            from crucible_trainer.offline.trl_train import Hooks, OfflineRun, train

            offset = self._step_offset(r)
            base = self.round_dir(r) / "trainer"
            work_dir, resume_from = attempts.work_dir(self.run_dir, base, self.channel)
            run = OfflineRun(
                method=method,
                model=self.loaded_model(),
                base_name=spec.model.base if "model.base" in self.loaded else None,
                optim=spec.optim,
                rows=read_rows(data),
                work_dir=work_dir,
                resume_from=resume_from,
                adapter_dir=self.adapter(r),
                seed=spec.seed,
                checkpoint_every=spec.checkpoint.every,
                # Round 1 loads the snapshot of the checked init adapter, later ones the run's own.
                start_adapter=str(self.loaded["model.init_adapter"] if r == 1 else start.path)
                if start
                else None,
                identity=json_hash(self._signature),
                step_offset=offset,
            )
            hooks = Hooks(
                metrics=lambda step, total, values: self._train_metrics(r, step, total, values),
                event=self._train_event,
                stop_requested=lambda: self.cancel.requested,
                gate=self.channel.gate,
                saved=lambda checkpoint: attempts.commit(self.run_dir, base, checkpoint, self.channel),
            )
            self.events.emit("status", status="training", round=r, method=method.name, rows=len(run.rows))
            result = await asyncio.to_thread(train, run, hooks)
            # The new policy goes to the generators now: the next round samples from it.
            await self.services.serve(self.adapter(r), r)
            return result

        return plan, body

    def _merge(self) -> tuple[StagePlan, Body]:
        spec, last = self.spec, self.spec.rounds
        out = self.run_dir / "merged"
        config = {"base": spec.model.base, "merge": spec.merge.model_dump(mode="json")}
        plan = StagePlan(
            "merge", "merge", config, [Input(self.adapter(last), f"the `train` stage of round {last}")], [out]
        )

        async def body() -> dict[str, Any]:
            from crucible_trainer.offline.merge import merge_adapter

            await asyncio.to_thread(
                merge_adapter, self.loaded_model().base, self.adapter(last), out, spec.merge.dtype
            )
            return {"path": str(out)}

        return plan, body

    def _evaluate(self) -> tuple[StagePlan, Body]:
        spec, last = self.spec, self.spec.rounds
        before = self.run_dir / "eval" / "before" / "report.json"
        after, compared = self.run_dir / "eval" / "after", self.run_dir / "eval" / "before_after"
        # The comparison needs the baseline's report; without it the stage still evaluates.
        compare = before.exists()
        config = {"model": self._model_config(), "eval": spec.eval.model_dump(mode="json"), "seed": spec.seed}
        inputs = [Input(self.adapter(last), f"the `train` stage of round {last}"), *self._eval_inputs()]
        outputs = [after / "report.json"]
        if compare:
            inputs.append(Input(before, "the `baseline` stage"))
            outputs.append(compared / "comparison.md")
        plan = StagePlan("evaluate", "evaluate", config, inputs, outputs)

        async def body() -> dict[str, Any]:
            model = await self.services.serve(self.adapter(last), last)
            report_ = await self._eval(after, model, "after", self._step_offset(last + 1))
            if compare:
                self.events.folder(
                    compared, lambda folder: evaluation.compare_reports(before, report_, folder)
                )
            elif compared.exists():
                self.channel.gate()
                shutil.rmtree(compared)
            else:
                self.events.emit("notice", message="no comparison: run the `baseline` stage for before/after")
            return {"model": model, **eval_summary(report_)}

        return plan, body

    def _analyze(self) -> tuple[StagePlan, Body]:
        rounds = range(1, self.spec.rounds + 1)
        sources = {r: self.round_dir(r) / "candidates_annotated.jsonl" for r in rounds}
        out = self.run_dir / "analysis"
        inputs = [Input(p, f"the `annotate` stage of round {r}") for r, p in sources.items()]
        plan = StagePlan("analyze", "analyze", {}, inputs, [out / "analysis.json"])

        async def body() -> dict[str, Any]:
            def work() -> dict[str, Any]:
                result = {
                    "rounds": {f"round-{r}": analysis.analyze_round(read_rows(p)) for r, p in sources.items()}
                }
                if out.exists():
                    shutil.rmtree(out)
                analysis.write(result, out)
                return result

            result = await asyncio.to_thread(work)
            first = result["rounds"]["round-1"]
            return {
                "distinct_programs_per_problem": first["distinct_programs_per_problem"]["mean"],
                "mean_pairwise_similarity": first["mean_pairwise_similarity"],
                "pass_rate": first["pass_rate"],
            }

        return plan, body

    # -- training's link to the job ---------------------------------------------------------------
    def _step_offset(self, r: int) -> int:
        """Training steps of the rounds before r, so metrics.jsonl counts steps across rounds."""
        steps = 0
        for q in range(1, r):
            detail = self.book.records.get(f"round-{q}/train", {}).get("detail") or {}
            steps += int(detail.get("steps") or 0)
        return steps

    def _train_metrics(self, r: int, step: int, total: int, values: dict[str, float]) -> None:
        self.events.metrics(step, {**values, "round": float(r)})
        self.channel.progress(step, total, values, self.services.model_name)

    def _train_event(self, kind: str, **data: Any) -> None:
        if kind == "resumed":
            resume_events(self.events, data["step"])  # those steps run again, each event once
        self.events.emit(kind, **data)

    def _progress(self, key: str) -> Callable[[int, int], None]:
        """Progress events of a long stage, about every tenth of the way."""
        last = {"shown": -1}

        def report_(done: int, total: int) -> None:
            tenth = done * 10 // max(total, 1)
            if tenth > last["shown"]:
                last["shown"] = tenth
                self.events.emit("stage_progress", stage=key, done=done, total=total)

        return report_

    # -- results ------------------------------------------------------------------------------------
    def write_summary(self) -> None:
        """The summary with the rounds' counts, evaluations and artifacts, and report.md from it."""
        rounds = {
            f"round-{r}": counts
            for r in range(1, self.spec.rounds + 1)
            if (counts := report.round_counts(self.round_dir(r) / "manifest.json")) is not None
        }
        if rounds:
            self.summary["rounds"] = rounds
        evals = {}
        for label in ("before", "after"):
            path = self.run_dir / "eval" / label / "report.json"
            if path.exists():
                evals[label] = eval_summary(evaluation.load_report(path))
        if evals:
            self.summary["eval"] = evals
        for key, path in (
            ("adapter", self.adapter(self.spec.rounds)),
            ("merged", self.run_dir / "merged"),
            ("before_after", self.run_dir / "eval" / "before_after"),
            ("analysis", self.run_dir / "analysis"),
        ):
            if path.exists():
                self.summary[key] = str(path)
        self.summary["report"] = str(self.run_dir / "report.md")
        (self.run_dir / "report.md").write_text(report.render(self.summary, self.run_dir))
        super().write_summary()


async def run_pipeline_job(
    spec: PipelineJob, job_id: str, settings: Settings, channel: JobChannel
) -> dict[str, Any]:
    """`PipelineRun(...).run()`, for scripts and tests that run one job in-process."""
    return await PipelineRun(spec, job_id, settings, channel).run()
