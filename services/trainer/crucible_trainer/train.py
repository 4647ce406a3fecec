"""The training job: one loop for every method, run by the RQ worker and by `crucible train` alike.

Per step: sample problems -> rollouts from the generator (current adapter version) -> sandbox
results -> rewards -> advantages -> policy update -> publish the new version to every generator
replica -> stale-policy check -> metrics/events -> checkpoint -> interval evaluation.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import time
from pathlib import Path
from typing import Any

from crucible_shared.generator_client import GeneratorPool
from crucible_shared.jobs import GRPOConfig, PPOConfig, ReinforceConfig, SRRLConfig, TrainJob
from crucible_shared.sandbox_client import SandboxClient

from crucible_trainer import checkpoint, tasks
from crucible_trainer.cancel import Cancelled, CancelToken
from crucible_trainer.events import EventSink, start_wandb
from crucible_trainer.policy import Policy
from crucible_trainer.publish import Publisher, stale_check
from crucible_trainer.rl import grpo, ppo, reinforce, srrl
from crucible_trainer.rl.context import StepContext
from crucible_trainer.rl.rollout import Prompt, Roller
from crucible_trainer.rl.update import update
from crucible_trainer.settings import Settings

log = logging.getLogger(__name__)


def load_selection(data: Any) -> list[Any]:
    """Tasks of a job's data section."""
    return tasks.load_tasks(data)


def refined_code(text: str, task: Any) -> str:
    return tasks.extract_refined_code(text)


class StalePolicyError(RuntimeError):
    """The generator does not serve the policy the trainer just published."""


def _messages_to_text(messages: list[dict]) -> str:
    return "\n\n".join(m["content"] for m in messages)


async def served_base_name(pool: GeneratorPool) -> str:
    """The generator's base model name (the entry of /v1/models that is not an adapter)."""
    listing = await pool.pick().models()
    for card in listing.data:
        if getattr(card, "parent", None) in (None, ""):
            return card.id
    return listing.data[0].id


class TrainRun:
    """State of one training job; `run()` executes it to the end, a cancel or an error."""

    def __init__(
        self,
        spec: TrainJob,
        job_id: str,
        settings: Settings,
        *,
        redis: Any = None,
        cancel: CancelToken | None = None,
    ) -> None:
        self.spec, self.job_id, self.settings, self.redis = spec, job_id, settings, redis
        self.run_dir = Path(settings.runs_dir) / job_id
        self.cancel = cancel or CancelToken(redis, job_id, settings.cancel_poll_s)
        self.events = EventSink(job_id, self.run_dir, redis)
        self.tasks: list[Any] = []
        self.summary: dict[str, Any] = {"job_id": job_id, "run_dir": str(self.run_dir)}

    # -- prompts ------------------------------------------------------------------------------
    def build_prompt(self, index: int) -> list[dict] | str:
        task = self.tasks[index]
        return tasks.build_messages(task) if self.spec.model.chat else tasks.build_completion_prompt(task)

    def build_refinement(self, index: int, code: str, result: Any) -> list[dict] | str:
        messages = tasks.build_refinement_messages(self.tasks[index], code, result)
        return messages if self.spec.model.chat else _messages_to_text(messages)

    # -- the job ------------------------------------------------------------------------------
    async def run(self) -> dict[str, Any]:
        spec, settings = self.spec, self.settings
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "spec.json").write_text(spec.model_dump_json(indent=2))
        self.cancel.start()
        self.events.emit("status", status="starting")
        self.tasks = load_selection(spec.data)
        if not self.tasks:
            raise ValueError("the data selection is empty: check data.split / ids / id_range / limit")
        policy = await asyncio.to_thread(Policy, spec.model, spec.optim, spec.seed)
        wandb_run = start_wandb(
            self.job_id,
            spec.logging.wandb_mode,
            spec.logging.wandb_project,
            spec.logging.run_name,
            self.run_dir,
            spec.model_dump(mode="json"),
        )
        self.events.wandb_run = wandb_run
        pool = GeneratorPool.from_urls(settings.generator_urls)
        sandbox = SandboxClient(settings.sandbox_url, api_key=settings.sandbox_api_key)
        try:
            await self.cancel.guard(pool.wait_ready(timeout=600))
            await self.cancel.guard(sandbox.wait_ready(timeout=120))
            base_name = await served_base_name(pool)
            publisher = Publisher(
                pool, Path(settings.adapter_dir), self.job_id, spec.publish.staleness_window, base_name
            )
            try:
                return await self._loop(policy, pool, sandbox, publisher)
            finally:
                # A finished, cancelled or failed job frees its generator slots (--max-loras is
                # small); its adapters stay in the store for evaluation or serving.
                try:
                    await publisher.retire_all()
                except Exception as exc:
                    log.warning("could not unload %s's adapters: %r", self.job_id, exc)
        except Cancelled:
            self.events.emit("status", status="cancelled")
            self.summary["status"] = "cancelled"
            self._write_summary()
            return self.summary
        finally:
            self.cancel.stop()
            await pool.aclose()
            await sandbox.close()
            if wandb_run is not None:
                wandb_run.finish()

    async def _loop(
        self, policy: Policy, pool: GeneratorPool, sandbox: SandboxClient, publisher: Publisher
    ) -> dict[str, Any]:
        spec = self.spec
        chat = spec.model.chat
        roller = Roller(
            pool,
            sandbox,
            self.tasks,
            spec.reward,
            lambda text, task: tasks.answer_to_code(task, text, chat=chat),
        )
        start = 1
        found = checkpoint.latest(self.run_dir)
        if found is not None:
            state = await asyncio.to_thread(checkpoint.restore, policy, found)
            start = state["step"] + 1
            self.tasks_order = state["extra"].get("order")
            await publisher.adopt(state["extra"].get("version", state["step"]))
            self.events.emit("resumed", step=state["step"], checkpoint=str(found))
        elif spec.model.init_adapter:
            await publisher.publish(policy, 0)
        indices = list(range(len(self.tasks)))
        if spec.method.name == "grpo" and spec.method.difficulty_filter and start == 1:
            indices = await self._difficulty_filter(roller, publisher.model_name, indices)
        self._order_rng = random.Random(spec.seed)
        order: list[int] = []
        before = None
        if spec.eval is not None and spec.eval.before and start == 1:
            before = await self._evaluate(pool, sandbox, publisher.model_name, "before")
        version = start - 1
        for step in range(start, spec.optim.steps + 1):
            self.cancel.check()
            while len(order) < spec.optim.problems_per_step:
                chunk = indices[:]
                self._order_rng.shuffle(chunk)
                order += chunk
            batch_tasks, order = order[: spec.optim.problems_per_step], order[spec.optim.problems_per_step :]
            metrics = await self._step(step, policy, roller, publisher, pool, batch_tasks)
            version = step if step % spec.publish.every == 0 else version
            self.events.metrics(step, metrics)
            self._progress(step, metrics, publisher.model_name)
            if step % spec.checkpoint.every == 0 or step == spec.optim.steps:
                await asyncio.to_thread(checkpoint.save, policy, self.run_dir, step, {"version": version})
            if (
                spec.eval is not None
                and spec.eval.every
                and step % spec.eval.every == 0
                and step < spec.optim.steps
            ):
                await self._evaluate(pool, sandbox, publisher.model_name, f"step-{step}")
        final_adapter = await asyncio.to_thread(policy.save_adapter, self.run_dir / "adapter")
        self.summary.update(
            status="finished",
            steps=spec.optim.steps,
            adapter=str(final_adapter),
            model_name=publisher.model_name,
        )
        if spec.eval is not None:
            after = await self._evaluate(pool, sandbox, publisher.model_name, "after")
            if before is not None and after is not None:
                self._compare(before, after)
        self._learning_curve()
        self._write_summary()
        self.events.emit("status", status="finished", summary=self.summary)
        return self.summary

    async def _step(
        self,
        step: int,
        policy: Policy,
        roller: Roller,
        publisher: Publisher,
        pool: GeneratorPool,
        batch_tasks: list[int],
    ) -> dict[str, float]:
        spec, method = self.spec, self.spec.method
        ctx = StepContext(spec, roller, policy.tokenizer, publisher.model_name, step)
        t0 = time.perf_counter()
        if isinstance(method, GRPOConfig):
            collected = grpo.collect(ctx, method, batch_tasks, self.build_prompt)
            ucfg = grpo.update_config(
                method, spec.optim.micro_batch, spec.optim.grad_accum, spec.rollout.max_tokens
            )
        elif isinstance(method, SRRLConfig):
            collected = srrl.collect(
                ctx, method, batch_tasks, self.build_prompt, self.build_refinement, refined_code
            )
            ucfg = srrl.update_config(
                method, spec.optim.micro_batch, spec.optim.grad_accum, spec.rollout.max_tokens
            )
        elif isinstance(method, ReinforceConfig):
            collected = reinforce.collect(ctx, method, batch_tasks, self.build_prompt)
            ucfg = reinforce.update_config(
                method, spec.optim.micro_batch, spec.optim.grad_accum, spec.rollout.max_tokens
            )
        else:
            assert isinstance(method, PPOConfig)
            collected = ppo.collect(ctx, method, batch_tasks, self.build_prompt)
            ucfg = ppo.update_config(
                method, spec.optim.micro_batch, spec.optim.grad_accum, spec.rollout.max_tokens
            )
        samples, metrics = await self.cancel.guard(collected)
        t1 = time.perf_counter()
        metrics.update(await asyncio.to_thread(update, policy, samples, ucfg, spec.seed + step))
        t2 = time.perf_counter()
        metrics["lr"] = policy.lr
        metrics["time/rollout_s"] = t1 - t0
        metrics["time/generate_s"] = ctx.timing.generate_s
        metrics["time/execute_tail_s"] = ctx.timing.execute_tail_s
        metrics["time/execute_busy_s"] = ctx.timing.execute_busy_s
        metrics["time/train_s"] = t2 - t1
        if step % spec.publish.every == 0:
            metrics.update(await publisher.publish(policy, step))
            self.events.emit(
                "adapter_published", step=step, name=publisher.model_name, load_s=metrics["publish/load_s"]
            )
            if spec.publish.stale_check:
                probe = self._probe_prompt(policy)
                t3 = time.perf_counter()
                check = await stale_check(pool, policy, publisher.model_name, probe)
                metrics.update(check)
                metrics["time/stale_check_s"] = time.perf_counter() - t3
                if not check["stale/diff"] <= spec.publish.stale_tolerance:
                    self.events.emit("stale_policy", step=step, **check)
                    raise StalePolicyError(
                        f"the generator's log-probs for {publisher.model_name} differ from the trainer's by "
                        f"{check['stale/diff']:.4f} per token (tolerance {spec.publish.stale_tolerance})"
                    )
        metrics["time/step_s"] = time.perf_counter() - t0
        metrics["policy_version"] = float(step if publisher.current else 0)
        return metrics

    def _probe_prompt(self, policy: Policy) -> str:
        prompt = self.build_prompt(0)
        return (
            prompt
            if isinstance(prompt, str)
            else policy.tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False)
        )

    async def _difficulty_filter(self, roller: Roller, model: str, indices: list[int]) -> list[int]:
        """Keep problems the policy sometimes solves: 0 < pass rate < 1 over a quick pre-sampling pass."""
        method = self.spec.method
        ctx = StepContext(self.spec, roller, None, model, 0)
        prompts = [Prompt(task_index=t, group=i, text=self._render(t)) for i, t in enumerate(indices)]
        batch = await self.cancel.guard(ctx.sample(prompts, method.filter_samples))
        keep = []
        for i, t in enumerate(indices):
            group = [s for s in batch if s.group == i and s.reward is not None]
            rate = sum(1 for s in group if s.result.status == "passed") / len(group) if group else 0.0
            if 0 < rate < 1:
                keep.append(t)
        self.events.emit("difficulty_filter", kept=len(keep), of=len(indices))
        self.summary["difficulty_filter"] = {"kept": len(keep), "of": len(indices)}
        if not keep:
            log.warning("difficulty filter kept no problem; training on all of them")
            return indices
        return keep

    def _render(self, index: int) -> str:
        prompt = self.build_prompt(index)
        if isinstance(prompt, str):
            return prompt
        from crucible_shared.models import load_tokenizer

        if not hasattr(self, "_tokenizer"):
            self._tokenizer = load_tokenizer(self.spec.model.base)
        return self._tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False)

    async def _evaluate(
        self, pool: GeneratorPool, sandbox: SandboxClient, model_name: str, label: str
    ) -> Any:
        from crucible_trainer import evaluation

        spec = self.spec.eval
        assert spec is not None
        eval_tasks = load_selection(spec.data)
        config = eval_config(
            model_name,
            spec.n,
            spec.temperature,
            1.0,
            spec.max_tokens,
            spec.ks,
            self.spec.seed,
            self.spec.model.chat,
        )
        self.events.emit("eval_started", label=label, model=model_name, tasks=len(eval_tasks))
        report = await self.cancel.guard(evaluation.evaluate(eval_tasks, pool, sandbox, config))
        out = self.run_dir / "eval" / label
        evaluation.write_report(report, out)
        summary = _eval_summary(report)
        self.summary.setdefault("eval", {})[label] = summary
        self.events.emit("eval_finished", label=label, report=str(out), **summary)
        return report

    def _compare(self, before: Any, after: Any) -> None:
        from crucible_trainer import evaluation

        out = self.run_dir / "eval" / "before_after"
        evaluation.compare_reports(before, after, out)
        self.summary["before_after"] = str(out)

    def _progress(self, step: int, metrics: dict[str, float], model_name: str) -> None:
        if self.redis is None:
            return
        from crucible_shared import keys

        latest = {k: v for k, v in metrics.items() if not k.startswith("update/ratio")}
        try:
            self.redis.hset(
                keys.job(self.job_id),
                mapping={
                    "step": step,
                    "total_steps": self.spec.optim.steps,
                    "policy_version": model_name,
                    "metrics": json.dumps(latest),
                },
            )
        except Exception as exc:
            log.warning("could not record progress: %r", exc)

    def _learning_curve(self) -> None:
        from crucible_trainer.report import learning_curve

        path = learning_curve(self.run_dir / "metrics.jsonl", self.run_dir / "learning_curve.png")
        if path:
            self.summary["learning_curve"] = str(path)

    def _write_summary(self) -> None:
        (self.run_dir / "summary.json").write_text(json.dumps(self.summary, indent=2, default=str))


def eval_config(
    model: str,
    n: int,
    temperature: float,
    top_p: float,
    max_tokens: int,
    ks: list[int],
    seed: int,
    chat: bool,
) -> Any:
    """Temperature 0: one greedy answer per problem; else n samples at that temperature."""
    from crucible_trainer import evaluation

    if temperature == 0:
        return evaluation.EvalConfig(
            model=model, n=0, greedy=True, ks=[1], max_tokens=max_tokens, seed=seed, chat=chat
        )
    return evaluation.EvalConfig(
        model=model,
        n=n,
        temperature=temperature,
        top_p=top_p,
        greedy=False,
        ks=ks,
        max_tokens=max_tokens,
        seed=seed,
        chat=chat,
    )


def _eval_summary(report: Any) -> dict[str, Any]:
    return {
        **report.summary(),
        "problems": report.num_problems,
        "mean_generated_tokens": report.mean_generated_tokens,
    }


async def run_train_job(
    spec: TrainJob,
    job_id: str,
    settings: Settings | None = None,
    *,
    redis: Any = None,
    cancel: CancelToken | None = None,
) -> dict[str, Any]:
    return await TrainRun(spec, job_id, settings or Settings(), redis=redis, cancel=cancel).run()
