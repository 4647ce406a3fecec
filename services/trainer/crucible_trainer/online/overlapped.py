"""The training loop's steps when rollouts overlap the update (`overlap.max_staleness` > 0).

`TrainRun` (train.py) mixes these in: `_start_ahead` checks the version the run starts from and
starts the background collection (rl/overlap.py), `_overlapped_step` trains one step on samples
collected ahead: it checks the versions they claim, updates with the lag corrected
(rl/correction.py), publishes the new version, lets rollouts of it start, and checks it while the
trainer still holds exactly it (on a GPU while the next step waits for its rollouts; that step's
update starts only once the check passed). Everything else (metrics, checkpoints, evaluation) is the loop's.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Awaitable, Callable
from typing import Any

from crucible_shared.generator_client import GeneratorPool

from crucible_trainer.rl.ahead import Ahead, Versions, check_claims
from crucible_trainer.rl.context import ProblemSampler, PromptBook, StepContext
from crucible_trainer.rl.policy import Policy
from crucible_trainer.rl.publish import Publisher
from crucible_trainer.rl.rollout import Roller, Sample, Timing


class OverlappedSteps:
    """Mixed into `TrainRun`: the attributes and helpers used here are that class's."""

    spec: Any
    summary: dict[str, Any]
    ahead: Ahead | None
    method: Any
    cancel: Any
    events: Any
    _context: Callable[..., StepContext]
    _stale_check: Callable[..., Awaitable[dict[str, float]]]
    _log_rollouts: Callable[[int, list[Sample]], None]
    update_policy: Callable[..., dict[str, float]]  # TrainRun's: one process, or the ranks
    channel: Any

    async def _start_ahead(
        self,
        roller: Roller,
        prompts: PromptBook,
        sampler: ProblemSampler,
        publisher: Publisher,
        pool: GeneratorPool,
        policy: Policy,
        start: int,
        version: int,
    ) -> Ahead:
        """Check the version the run starts from (the trainer holds exactly it now), then start
        collecting rollouts ahead of the update (rl/overlap.py)."""
        versions = Versions(version, publisher.model_name)
        if self.spec.publish.stale_check:
            probe = prompts.first(0)
            checked = await self._stale_check(pool, policy, publisher.model_name, version, probe)
            self.summary["stale_check_start"] = checked
            versions.checked.add(version)

        async def collect(
            step: int, version: int, name: str
        ) -> tuple[list[Sample], dict[str, float], Timing]:
            ctx = self._context(roller, prompts, sampler, publisher, step, version, name)
            batch = sampler.draw(self.spec.optim.problems_per_step)
            samples, metrics = await self.method.collect(ctx, self.spec.method, batch)
            return samples, metrics, ctx.timing

        ahead = Ahead(
            collect,
            sampler,
            publisher,
            versions,
            start,
            self.spec.optim.steps,
            self.spec.overlap.max_staleness,
        )
        ahead.start()
        return ahead

    async def _check_published(
        self, pool: GeneratorPool, policy: Policy, name: str, version: int, probe: str
    ) -> dict[str, float]:
        """The stale-policy check of a version just published (the trainer holds exactly it until
        the next update, which waits for this)."""
        assert self.ahead is not None
        checked = await self._stale_check(pool, policy, name, version, probe)
        self.ahead.versions.checked.add(version)
        return checked

    async def _overlapped_step(
        self, policy: Policy, publisher: Publisher, pool: GeneratorPool, prompts: PromptBook, step: int
    ) -> tuple[dict[str, float], dict[str, Any]]:
        """One step on samples collected ahead: check their versions, update with the lag
        corrected, publish, check the new version while the trainer holds it (on a GPU beside the
        next step's wait for its rollouts). Returns the metrics and the sampler state its
        checkpoint saves."""
        assert self.ahead is not None
        spec, versions = self.spec, self.ahead.versions
        t0 = time.perf_counter()
        got = await self.cancel.guard(self.ahead.next())
        metrics = dict(got.metrics)
        if self.ahead.checking is not None:  # the version this update starts from, checked meanwhile
            metrics.update(await self.cancel.guard(self.ahead.checking))
            self.ahead.checking = None
        t1 = time.perf_counter()
        metrics.update(
            check_claims(
                got.samples,
                step,
                spec.overlap.max_staleness,
                versions.checked if spec.publish.stale_check else None,
            )
        )
        ucfg = dataclasses.replace(self.method.update_config(spec.method, spec), tis_cap=spec.overlap.cap)
        metrics.update(
            await asyncio.to_thread(self.update_policy, policy, got.samples, ucfg, spec.seed + step)
        )
        self.channel.gate()  # a run paused in its update and superseded meanwhile stops here
        t2 = time.perf_counter()
        self._log_rollouts(step, got.samples)
        metrics.update(await publisher.publish(policy, step))
        self.events.emit(
            "adapter_published", step=step, name=publisher.model_name, load_s=metrics["publish/load_s"]
        )
        # Rollouts of the new version may start now; none trains before its check passed.
        await versions.advance(step, publisher.model_name)
        if spec.publish.stale_check:
            self.ahead.checking = asyncio.create_task(
                self._check_published(pool, policy, publisher.model_name, step, prompts.first(0))
            )
            if step == spec.optim.steps or not policy.device.startswith("cuda"):
                # On a CPU the trainer's scoring and the generator share the cores (as in the
                # synchronous loop, the check runs alone); on a GPU it runs while the next step
                # waits for its rollouts, and that step's update waits for it.
                metrics.update(await self.cancel.guard(self.ahead.checking))
                self.ahead.checking = None
        metrics.update(
            {
                "lr": policy.lr,
                "policy_version": float(step),
                "time/rollout_s": got.rollout_s,
                "time/generate_s": got.timing.generate_s,
                "time/execute_tail_s": got.timing.execute_tail_s,
                "time/execute_busy_s": got.timing.execute_busy_s,
                "time/rollout_wait_s": t1 - t0,  # the part of the rollouts the update did not hide
                "time/train_s": t2 - t1,
                "time/step_s": time.perf_counter() - t0,
            }
        )
        return metrics, got.sampler_state
