"""The training job: one loop for every method, run by the RQ worker and by `crucible train --local`.

Per step: problems from the sampler (on a GPU a pre-filter judges them while the steps run, and a
draw waits only for the verdicts it reaches: online/prefilter.py) -> the method collects samples
(rollouts from the generator at the current adapter version, sandbox results, rewards,
advantages), and meanwhile (on a GPU; just before, on a CPU) the stale-policy check of that
version -> policy update -> publish the new version to every generator replica -> metrics,
rollouts, events -> checkpoint -> interval evaluation. The method is looked up in `crucible_trainer.methods.REGISTRY`; nothing here depends
on which one it is.

The trainer's model loads in the background from `setup` on: the first calls of a fresh job
(waiting for the services, the pre-filter's samples, the "before" evaluation) need the generator
and the sandbox, not the policy, so its load costs a job no time of its own unless they are
shorter (the summary's `policy_load_s` and `policy_wait_s`). On one GPU its first passes follow
there too (`Policy.warm_kernels`: kernels compiled and loaded on first use), not in step 1.

The stale-policy check asks the generator to score a probe with the version a step samples from
and compares it with the trainer's policy, which still holds exactly that version until the
step's update: run beside the rollouts, it costs a GPU step no time, and a generator that serves
other weights fails the step before its samples train anything. The version published after the
last step is checked once more before the final evaluation.

A checkpoint holds the adapter, the optimizer, every RNG, the problem sampler and the method's
state (`StepContext.state`, e.g. SPIRAL's baselines), so a job killed at step k and resumed trains
on the same problems in the same order as one that never stopped; the "before" evaluation and the
pre-filter's verdicts stay in the run dir for it.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from pathlib import Path
from typing import Any

from crucible_models import load_tokenizer
from crucible_shared.generator_client import GeneratorPool
from crucible_shared.jobs import TrainJob, early_update_blocker
from crucible_shared.sandbox_client import SandboxClient

from crucible_trainer import evaluation, tasks
from crucible_trainer.evaluation.job import evaluate_spec, served_base
from crucible_trainer.methods import method_module
from crucible_trainer.online import checkpoint, prefilter
from crucible_trainer.online.overlapped import OverlappedSteps, RunHooks
from crucible_trainer.rl.ahead import Collect
from crucible_trainer.rl.context import ProblemSampler, PromptBook, StepContext
from crucible_trainer.rl.early import EarlyGroups, update_early
from crucible_trainer.rl.policy import Policy, name_base
from crucible_trainer.rl.publish import Publisher, StalePolicyError, stale_check
from crucible_trainer.rl.rollout import Roller, Sample, Timing
from crucible_trainer.rl.update import UpdateConfig, update
from crucible_trainer.runtime import hardware
from crucible_trainer.runtime.cancel import Interrupted, Superseded
from crucible_trainer.runtime.channel import JobChannel
from crucible_trainer.runtime.jobrun import JobRun
from crucible_trainer.runtime.sink import resume_events, rollout_row
from crucible_trainer.settings import Settings

log = logging.getLogger(__name__)


async def draw(sampler: ProblemSampler, n: int) -> tuple[list[int], float]:
    """A step's `n` problems and the seconds the draw waited for a pre-filter's verdicts (the
    step's `time/filter_wait_s`)."""
    started = time.perf_counter()
    problems = await sampler.take(n)
    return problems, time.perf_counter() - started


class TrainRun(JobRun):
    """State of one training job; `run()` (the base's) executes it to the end, a cancel or an error."""

    spec: TrainJob

    def __init__(self, spec: TrainJob, job_id: str, settings: Settings, channel: JobChannel) -> None:
        super().__init__(spec, job_id, settings, channel)
        self.method = method_module(spec.method)
        self.problems: list[Any] = []
        self.method_state: dict[str, Any] = {}  # the method's state across steps (StepContext.state)
        # Its steps on rollouts collected ahead of the update (overlap.max_staleness > 0).
        self.overlapped: OverlappedSteps | None = None
        self.pre_filter: prefilter.PreFilter | None = None  # its judging may run beside the steps

    # -- what data-parallel ranks replace (crucible_trainer.distributed.leader) ----------------
    def make_policy(self) -> Policy:
        policy = Policy(self.loaded_model(), self.spec.optim, self.spec.seed)
        if "model.base" in self.loaded:  # saved adapters name the job's model, not the snapshot
            name_base(policy.model, self.spec.model.base)
        return policy

    def update_policy(
        self, policy: Policy, samples: list[Sample], cfg: UpdateConfig, seed: int
    ) -> dict[str, float]:
        return update(policy, samples, cfg, seed)

    # -- the job ------------------------------------------------------------------------------
    async def setup(self) -> None:
        """The machine's settings, the tasks and the policy (W&B logs the resolved spec)."""
        self.spec, chosen = await asyncio.to_thread(hardware.resolve, self.spec, self.loaded_model().base)
        spec = self.spec
        self.summary["settings"] = chosen
        self.events.emit("settings", **chosen)
        self.problems = tasks.load_tasks(spec.data)
        if not self.problems:
            raise ValueError("the data selection is empty: check data.split / ids / id_range / limit")
        self.tokenizer = await asyncio.to_thread(load_tokenizer, self.loaded_model().base)
        # The policy loads while the job's first calls run: waiting for the services, the
        # pre-filter's samples and the "before" evaluation need the generator and the sandbox,
        # not the trainer's model (`loaded_policy` awaits it where it is first needed).
        self._loading = asyncio.create_task(asyncio.to_thread(self._timed_policy))

    def _timed_policy(self) -> Policy:
        started = time.perf_counter()
        policy = self.make_policy()
        self.summary["policy_load_s"] = round(time.perf_counter() - started, 3)
        # norms, MLPs and attentions on fused kernels
        self.summary["fused_modules"] = getattr(policy, "fused", 0)
        self.summary["fused_lora_layers"] = getattr(policy, "fused_lora", 0)
        return policy

    def _warm_kernels(self, prompts: PromptBook) -> None:
        """Once the policy has loaded, on CUDA: its first passes (`Policy.warm_kernels`: a
        micro-batch of the job's size, its first prompt's length and the rollout's max tokens) on
        its thread, ahead of whatever the job asks of the policy next (its calls run in order),
        while the generator works without it: the pre-filter, the "before" evaluation, step 1's
        rollouts. One rank only: a data-parallel rank's backward would wait for the others. Its
        seconds are the summary's `kernel_warm_up_s`; one that fails only logs (step 1 meets the
        same problem and reports it)."""
        spec = self.spec
        if spec.distributed.train_gpus != 1:
            return
        rows, completion = spec.optim.micro_batch, spec.rollout.max_tokens  # resolved by `setup`

        async def warm() -> None:
            try:
                policy = await asyncio.shield(self._loading)
                if not policy.device.startswith("cuda") or policy.runner is not policy.model:
                    return
                prompt = len(self.tokenizer(prompts.first(0)).input_ids)
                took = await policy.call(policy.warm_kernels, rows, prompt, completion)
            except Exception as exc:  # the load's error is the job's where it needs the policy
                log.warning("the policy's kernel warm-up stopped: %r", exc)
                return
            self.summary["kernel_warm_up_s"] = round(took, 2)

        self._warming = asyncio.create_task(warm())

    async def loaded_policy(self) -> Policy:
        """The policy, once `setup`'s background load has made it (its error, if it failed);
        the summary's `policy_wait_s` sums how long the job waited for it."""
        started = time.perf_counter()
        policy = await self.cancel.guard(asyncio.shield(self._loading))
        waited = self.summary.get("policy_wait_s", 0.0) + time.perf_counter() - started
        self.summary["policy_wait_s"] = round(waited, 3)
        return policy

    async def close(self) -> None:
        # A load still running (the job failed or was cancelled before it needed the policy)
        # is waited for: its thread cannot be stopped, and the next job must not share the card
        # with a model no one holds.
        loading = getattr(self, "_loading", None)
        if loading is not None and not loading.done():
            await asyncio.wait([loading])
        warming = getattr(self, "_warming", None)
        if warming is not None and not warming.done():
            await asyncio.wait([warming])  # its passes on the card end with the job (it logs its errors)
        if loading is not None and loading.done() and not loading.cancelled():
            loading.exception()  # retrieved: the job's own error (or the load's, raised) is reported

    async def body(self) -> None:
        settings, spec = self.settings, self.spec
        pool, sandbox = self.pool, self.sandbox
        await self.cancel.guard(pool.wait_ready(timeout=600))
        await self.cancel.guard(sandbox.wait_ready(timeout=120))
        base_name = await served_base(pool, spec.model.base)
        publisher = Publisher(
            pool,
            Path(settings.adapter_dir),
            self.job_id,
            spec.publish.staleness_window,
            base_name,
            channel=self.channel,
        )
        try:
            await self._loop(pool, sandbox, publisher)
        finally:
            if self.pre_filter is not None:
                await self.pre_filter.close()
            if self.overlapped is not None:
                await self.overlapped.close()
            # A finished, cancelled or failed job frees its generator slots (--max-loras is
            # small); its adapters stay in the store for evaluation or serving.
            try:  # its own versions only (names of its own: `channel.tag`), superseded or not
                await publisher.retire_all()
            except Exception as exc:
                log.warning("could not unload %s's adapters: %r", self.job_id, exc)

    async def _loop(self, pool: GeneratorPool, sandbox: SandboxClient, publisher: Publisher) -> None:
        spec = self.spec
        chat = spec.model.chat
        roller = Roller(
            pool,
            sandbox,
            self.problems,
            spec.reward,
            lambda text, task: tasks.answer_to_code(task, text, chat=chat),
        )
        prompts = PromptBook(self.problems, chat, self.tokenizer)
        self._warm_kernels(prompts)
        sampler = ProblemSampler(list(range(len(self.problems))), spec.seed)
        start, version = await self._resume(publisher, sampler)
        if start == 1 and spec.model.init_adapter:
            await publisher.publish(await self.loaded_policy(), 0)
        await self._start_pre_filter(self._context(roller, prompts, sampler, publisher, 0), start)
        before = await self._before(pool, sandbox, publisher.model_name, start)
        policy = await self.loaded_policy()
        if spec.overlap.max_staleness:
            self.overlapped = self._overlapped(policy, publisher, pool, prompts)
            checked = await self.overlapped.start(
                self._collector(roller, prompts, sampler, publisher), sampler, start, version
            )
            if checked is not None:
                self.summary["stale_check_start"] = checked
        for step in range(start, spec.optim.steps + 1):
            self.cancel.check()
            if self.overlapped is not None:
                metrics, drawn = await self.overlapped.step(step)
            else:
                ctx = self._context(roller, prompts, sampler, publisher, step, version)
                batch, waited = await self.cancel.guard(draw(sampler, spec.optim.problems_per_step))
                # The served version is the trainer's policy only when nothing trained since it was
                # published (with publish.every > 1 the rollouts of the steps between are off-policy).
                served_is_policy = spec.publish.stale_check and version == step - 1
                metrics = await self._step(ctx, policy, publisher, pool, batch, served_is_policy)
                metrics["time/filter_wait_s"] = waited
                drawn = sampler.state()
            version = step if step % spec.publish.every == 0 else version
            if self.channel.superseded():
                raise Superseded()  # another run holds the job (and its run dir): write nothing
            # The row, then the checkpoint, then the event: a step's event is in the stream only
            # once its checkpoint is committed, so a run resumed from an earlier checkpoint never
            # sends a step twice; one that died between the two sends it again from the row
            # (`recover_events`).
            self.events.metrics(step, metrics, emit=False)
            stopping = self.channel.stop_requested()
            if stopping or step % spec.checkpoint.every == 0 or step == spec.optim.steps:
                extra = {"version": version, "sampler": drawn, "method": self.method_state}
                await policy.call(checkpoint.save, policy, self.run_dir, step, extra, self.channel)
            self.events.step_event(step, metrics)
            self.channel.progress(step, spec.optim.steps, metrics, publisher.model_name)
            if self.channel.superseded():
                raise Superseded()
            if stopping and step < spec.optim.steps:
                raise Interrupted(step)
            if (
                spec.eval is not None
                and spec.eval.every
                and step % spec.eval.every == 0
                and step < spec.optim.steps
            ):
                await self._evaluate(pool, sandbox, publisher.model_name, f"step-{step}", step)
        if spec.publish.stale_check and version == spec.optim.steps and publisher.current:
            probe = prompts.first(0)
            self.summary["stale_check"] = await self._stale_check(
                pool, policy, publisher.model_name, version, probe
            )
        self.channel.gate()
        final_adapter = await policy.call(policy.save_adapter, self.run_dir / "adapter", self.channel.gate)
        self.summary.update(
            steps=spec.optim.steps,
            adapter=str(final_adapter),
            model_name=publisher.model_name,
        )
        if spec.eval is not None:
            after = await self._evaluate(pool, sandbox, publisher.model_name, "after", spec.optim.steps)
            if before is not None:
                out = self.run_dir / "eval" / "before_after"
                self.events.folder(out, lambda folder: evaluation.compare_reports(before, after, folder))
                self.summary["before_after"] = str(out)
        self.summary.update(self.method.report(spec.method, self.run_dir))
        self._learning_curve()

    async def _resume(self, publisher: Publisher, sampler: ProblemSampler) -> tuple[int, int]:
        """The first step to run (1, or the one after the newest checkpoint, restored) and the
        adapter version the generators serve from then on."""
        found = await asyncio.to_thread(checkpoint.resumable, self.run_dir, self.channel)
        if found is None:
            await publisher.adopt(0)  # an earlier run's versions, if any, are not this run's
            await asyncio.to_thread(resume_events, self.events, 0)  # nor its rows and journals
            return 1, 0
        policy = await self.loaded_policy()
        state = await policy.call(checkpoint.restore, policy, found)
        extra = state["extra"]
        if "sampler" in extra:
            sampler.load(extra["sampler"])
        self.method_state.update(extra.get("method", {}))
        version = extra.get("version", state["step"])
        await publisher.adopt(version, policy if version == state["step"] else None)
        # Every step's row and event once: later rows dropped (those steps run again), events an
        # earlier run never delivered recovered, those it delivered not sent again.
        await asyncio.to_thread(resume_events, self.events, state["step"])
        self.events.emit("resumed", step=state["step"], checkpoint=str(found))
        return state["step"] + 1, version

    def _context(
        self,
        roller: Roller,
        prompts: PromptBook,
        sampler: ProblemSampler,
        publisher: Publisher,
        step: int,
        version: int = 0,
        model_name: str | None = None,
    ) -> StepContext:
        return StepContext(
            self.spec,
            roller,
            prompts,
            sampler,
            model_name or publisher.model_name,
            step,
            base_name=publisher.base_name,
            state=self.method_state,
            version=version,
        )

    def _overlapped(
        self, policy: Policy, publisher: Publisher, pool: GeneratorPool, prompts: PromptBook
    ) -> OverlappedSteps:
        hooks = RunHooks(self._stale_check, self.update_policy, self._log_rollouts, self.channel.gate)
        return OverlappedSteps(
            self.spec,
            self.method,
            policy=policy,
            publisher=publisher,
            pool=pool,
            prompts=prompts,
            cancel=self.cancel,
            events=self.events,
            hooks=hooks,
        )

    def _collector(
        self, roller: Roller, prompts: PromptBook, sampler: ProblemSampler, publisher: Publisher
    ) -> Collect:
        """How the background collection gets one step's samples: the method's own `collect`,
        from the version and served name it is given."""

        async def collect(
            step: int, version: int, name: str
        ) -> tuple[list[Sample], dict[str, float], Timing]:
            ctx = self._context(roller, prompts, sampler, publisher, step, version, name)
            batch, waited = await draw(sampler, self.spec.optim.problems_per_step)
            samples, metrics = await self.method.collect(ctx, self.spec.method, batch)
            return samples, {**metrics, "time/filter_wait_s": waited}, ctx.timing

        return collect

    async def _start_pre_filter(self, ctx: StepContext, start: int) -> None:
        """The method's pre-filter, if it has one (online/prefilter.py): every problem judged by
        the starting policy before step `start`, or, for a policy on a GPU that starts from the
        base model, judged while the steps run (`body` stops what is left when the job ends)."""
        judge = self.method.judge(self.spec.method)
        if judge is None:
            return
        streamed = prefilter.streams(self.spec.model)
        if streamed:  # by the base model (the starting policy) whichever version is served by then
            ctx.model_name = ctx.base_name
        self.pre_filter = prefilter.PreFilter(
            judge,
            ctx,
            self.run_dir / "filter.json",
            [p.task_id for p in self.problems],
            self.channel.gate,
            self.events.emit,
            self.summary,
        )
        await self.cancel.guard(self.pre_filter.start(start, streamed))

    async def _step(
        self,
        ctx: StepContext,
        policy: Policy,
        publisher: Publisher,
        pool: GeneratorPool,
        batch: list[int],
        check: bool,
    ) -> dict[str, float]:
        spec, step = self.spec, ctx.step
        ucfg = self.method.update_config(spec.method, spec)
        ctx.early = EarlyGroups() if self._updates_early(policy) else None
        collecting: asyncio.Future[tuple[list[Sample], dict[str, float]]] | None = None
        updating: asyncio.Future[dict[str, float]] | None = None
        checked_after = 0.0  # the part of the check that generation did not hide (early update)
        t0 = time.perf_counter()

        checking = (
            asyncio.create_task(
                self._stale_check(pool, policy, ctx.model_name, step - 1, ctx.prompts.first(0))
            )
            if check
            else None
        )
        try:
            if checking is not None and not policy.device.startswith("cuda"):
                # On a CPU the trainer's scoring would share the cores the generator decodes on
                # (two thread pools on the same cores slow both down far more than running one
                # after the other): the check runs first. On a GPU it runs beside the rollouts.
                await self.cancel.guard(checking)
            waited = time.perf_counter() - t0
            collecting = asyncio.ensure_future(self.method.collect(ctx, spec.method, batch))
            if ctx.early is not None:
                # The update starts when generation ends (and the check, on the same policy, is
                # done), on the groups scored by then, while the last programs still run.
                generated = asyncio.ensure_future(ctx.early.generated_event.wait())
                await self.cancel.guard(
                    asyncio.wait({collecting, generated}, return_when=asyncio.FIRST_COMPLETED)
                )
                generated.cancel()
                generated_at = time.perf_counter()
                if ctx.early.generated_event.is_set():  # else collect ended first (its error, below)
                    if checking is not None:
                        await self.cancel.guard(asyncio.shield(checking))
                    early_from = time.perf_counter()
                    checked_after = early_from - generated_at
                    updating = asyncio.ensure_future(
                        policy.call(update_early, policy, ctx.early, ucfg, spec.seed + step)
                    )
            samples, metrics = await self.cancel.guard(collecting)
            if updating is not None and ctx.early is not None:
                ctx.early.close(samples)
            t1 = time.perf_counter()
            checked = await self.cancel.guard(checking) if checking is not None else {}
        except BaseException as exc:
            if collecting is not None and not collecting.done():
                collecting.cancel()
            if updating is not None and ctx.early is not None:
                ctx.early.close(error=exc)  # the update stops, its gradients dropped
                await asyncio.gather(updating, return_exceptions=True)
            raise
        finally:
            if checking is not None and not checking.done():
                checking.cancel()
            elif checking is not None and not checking.cancelled():
                checking.exception()  # retrieved: the step's own error is the one to report
        t2 = time.perf_counter()
        metrics.update(checked)
        if updating is not None:
            metrics.update(await updating)  # as the update below, not abandoned halfway
            metrics["time/update_beside_tail_s"] = t1 - early_from
        else:
            metrics.update(await policy.call(self.update_policy, policy, samples, ucfg, spec.seed + step))
        self.channel.gate()  # a run paused in its update and superseded meanwhile stops here
        t3 = time.perf_counter()
        metrics["lr"] = policy.lr
        metrics["time/rollout_s"] = t1 - t0 - waited
        metrics["time/generate_s"] = ctx.timing.generate_s
        metrics["time/execute_tail_s"] = ctx.timing.execute_tail_s
        metrics["time/execute_busy_s"] = ctx.timing.execute_busy_s
        if check:  # the part of the check the rollouts did not hide
            metrics["time/stale_wait_s"] = waited + checked_after + t2 - t1
        metrics["time/train_s"] = t3 - t2
        self._log_rollouts(step, samples)
        if step % spec.publish.every == 0:
            metrics.update(await publisher.publish(policy, step))
            self.events.emit(
                "adapter_published", step=step, name=publisher.model_name, load_s=metrics["publish/load_s"]
            )
        metrics["time/step_s"] = time.perf_counter() - t0
        metrics["policy_version"] = float(step if publisher.current else 0)
        return metrics

    def _updates_early(self, policy: Policy) -> bool:
        """Whether this step's update starts on the groups already scored (`optim.early_update`):
        where the job allows it (`early_update_blocker`), with this class's own one-process update,
        and, on `auto`, on a GPU (on a CPU the passes would take the cores the sandbox runs on)."""
        mode = self.spec.optim.early_update
        if mode is False or early_update_blocker(self.spec) is not None:
            return False
        if type(self).update_policy is not TrainRun.update_policy:  # data-parallel ranks share the batch
            return False
        return mode is True or policy.device.startswith("cuda")

    async def _stale_check(
        self, pool: GeneratorPool, policy: Policy, model_name: str, version: int, probe: str
    ) -> dict[str, float]:
        """`stale/*` figures of the generator serving `model_name` against the trainer's policy,
        or StalePolicyError when they differ by more than the tolerance. The probe is the first
        problem's prompt: the same for the whole job, so rows compare."""
        spec = self.spec.publish
        started = time.perf_counter()
        check = await stale_check(pool, policy, model_name, probe)
        check["time/stale_check_s"] = time.perf_counter() - started
        if not check["stale/diff"] <= spec.stale_tolerance:
            self.events.emit(
                "stale_policy",
                version=version,
                name=model_name,
                diff=check["stale/diff"],
                tolerance=spec.stale_tolerance,
            )
            raise StalePolicyError(
                f"the generator's log-probs for {model_name} (version {version}) differ from the trainer's "
                f"by {check['stale/diff']:.4f} per token (tolerance {spec.stale_tolerance})"
            )
        return check

    def _log_rollouts(self, step: int, samples: list[Sample]) -> None:
        rows = [rollout_row(step, s, s.problem_id or self.problems[s.task_index].task_id) for s in samples]
        for i, s in enumerate(samples):
            rows[i]["sample"] = i
            rows[i]["parent"] = s.parent
            rows[i]["run"] = self.channel.token  # which run of the job wrote it (None: in-process)
        self.events.rollouts(step, rows)
        every = self.spec.logging.samples_every
        if every and step % every == 0 and rows:
            shown = random.Random(self.spec.seed * 31 + step).choice(rows)
            self.events.emit(
                "sample",
                **{
                    k: shown[k]
                    for k in ("step", "problem_id", "phase", "reward", "status", "message", "completion")
                },
            )

    async def _before(self, pool: GeneratorPool, sandbox: SandboxClient, model: str, start: int) -> Any:
        """The starting policy's report: evaluated on a fresh run, read back on a resumed one."""
        spec = self.spec.eval
        if spec is None or not spec.before:
            return None
        saved = self.run_dir / "eval" / "before" / "report.json"
        if start > 1 and saved.exists():
            return evaluation.load_report(saved)
        return await self._evaluate(pool, sandbox, model, "before", 0)

    async def _evaluate(
        self, pool: GeneratorPool, sandbox: SandboxClient, model: str, label: str, step: int
    ) -> Any:
        assert self.spec.eval is not None
        report, summary = await evaluate_spec(
            self.spec.eval,
            pool,
            sandbox,
            model=model,
            chat=self.spec.model.chat,
            seed=self.spec.seed,
            out=self.run_dir / "eval" / label,
            cancel=self.cancel,
            events=self.events,
            label=label,
        )
        self.summary.setdefault("eval", {})[label] = summary
        self.events.eval_point(step, label, summary)
        return report

    def _learning_curve(self) -> None:
        from crucible_trainer.online.curves import learning_curve

        path = learning_curve(self.run_dir / "metrics.jsonl", self.run_dir / "learning_curve.png")
        if path:
            self.summary["learning_curve"] = str(path)


async def run_train_job(
    spec: TrainJob, job_id: str, settings: Settings, channel: JobChannel
) -> dict[str, Any]:
    """`TrainRun(...).run()`, for scripts and tests that run one job in-process."""
    return await TrainRun(spec, job_id, settings, channel).run()
