"""The training loop's steps when rollouts overlap the update (`overlap.max_staleness` > 0).

The loop (`TrainRun`, online/train.py) holds one `OverlappedSteps` for the run. `start` checks
the version the run starts from and starts the background collection (`rl.ahead.Ahead`); `step`
trains one step on samples collected ahead: it checks the versions they claim, updates with the
lag corrected (rl/correction.py), publishes the new version, lets rollouts of it start, and checks
it while the trainer still holds exactly it (on a GPU while the next step waits for its rollouts;
that step's update starts only once the check passed); `close` stops the collection. What it uses
of the run is handed to it (`RunHooks`); everything else (metrics, checkpoints, evaluation) is
the loop's.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from crucible_shared.generator_client import GeneratorPool
from crucible_shared.jobs import TrainJob

from crucible_trainer.methods import MethodModule
from crucible_trainer.rl.ahead import Ahead, Collect, Versions, check_claims
from crucible_trainer.rl.context import ProblemSampler, PromptBook
from crucible_trainer.rl.policy import Policy
from crucible_trainer.rl.publish import Publisher
from crucible_trainer.rl.rollout import Sample
from crucible_trainer.rl.update import UpdateConfig
from crucible_trainer.runtime.cancel import CancelToken
from crucible_trainer.runtime.sink import EventSink


@dataclass(frozen=True)
class RunHooks:
    """What the overlapped steps use of the run that holds them."""

    # (pool, policy, served name, version, probe) -> `stale/*` figures; raises on a stale version
    stale_check: Callable[[GeneratorPool, Policy, str, int, str], Awaitable[dict[str, float]]]
    # (policy, samples, config, seed) -> metrics: one process, or the ranks (distributed.leader)
    update_policy: Callable[[Policy, list[Sample], UpdateConfig, int], dict[str, float]]
    log_rollouts: Callable[[int, list[Sample]], None]  # the step's rollouts file and sample event
    gate: Callable[[], None]  # raises once the run no longer holds its job (`JobChannel.gate`)


class OverlappedSteps:
    """The run's steps on rollouts collected ahead of the update: `start`, then `step` once per
    step, in order, and `close` whatever happened."""

    def __init__(
        self,
        spec: TrainJob,
        method: MethodModule,
        *,
        policy: Policy,
        publisher: Publisher,
        pool: GeneratorPool,
        prompts: PromptBook,
        cancel: CancelToken,
        events: EventSink,
        hooks: RunHooks,
    ) -> None:
        self.spec, self.method, self.hooks = spec, method, hooks
        self.policy, self.publisher, self.pool, self.prompts = policy, publisher, pool, prompts
        self.cancel, self.events = cancel, events
        self.ahead: Ahead | None = None  # the background collection, once started

    async def start(
        self, collect: Collect, sampler: ProblemSampler, first: int, version: int
    ) -> dict[str, float] | None:
        """Check the version the run starts from (the trainer holds exactly it now), then start
        collecting the rollouts of steps `first`, `first + 1`, ... ahead of the update
        (rl/ahead.py). Returns the check's figures (None without `publish.stale_check`)."""
        name = self.publisher.model_name
        versions = Versions(version, name)
        checked = None
        if self.spec.publish.stale_check:
            checked = await self.hooks.stale_check(
                self.pool, self.policy, name, version, self.prompts.first(0)
            )
            versions.checked.add(version)
        self.ahead = Ahead(
            collect,
            sampler,
            self.publisher,
            versions,
            first,
            self.spec.optim.steps,
            self.spec.overlap.max_staleness,
        )
        self.ahead.start()
        return checked

    async def close(self) -> None:
        if self.ahead is not None:
            await self.ahead.close()

    async def _check_published(self, name: str, version: int) -> dict[str, float]:
        """The stale-policy check of a version just published (the trainer holds exactly it until
        the next update, which waits for this)."""
        assert self.ahead is not None
        checked = await self.hooks.stale_check(self.pool, self.policy, name, version, self.prompts.first(0))
        self.ahead.versions.checked.add(version)
        return checked

    async def step(self, step: int) -> tuple[dict[str, float], dict[str, Any]]:
        """One step on samples collected ahead: check their versions, update with the lag
        corrected, publish, check the new version while the trainer holds it (on a GPU beside the
        next step's wait for its rollouts). Returns the metrics and the sampler state its
        checkpoint saves."""
        assert self.ahead is not None, "start() first"
        spec, ahead, policy, publisher = self.spec, self.ahead, self.policy, self.publisher
        versions = ahead.versions
        t0 = time.perf_counter()
        got = await self.cancel.guard(ahead.next())
        metrics = dict(got.metrics)
        if ahead.checking is not None:  # the version this update starts from, checked meanwhile
            metrics.update(await self.cancel.guard(ahead.checking))
            ahead.checking = None
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
            await policy.call(self.hooks.update_policy, policy, got.samples, ucfg, spec.seed + step)
        )
        self.hooks.gate()  # a run paused in its update and superseded meanwhile stops here
        t2 = time.perf_counter()
        self.hooks.log_rollouts(step, got.samples)
        metrics.update(await publisher.publish(policy, step))
        self.events.emit(
            "adapter_published", step=step, name=publisher.model_name, load_s=metrics["publish/load_s"]
        )
        # Rollouts of the new version may start now; none trains before its check passed.
        await versions.advance(step, publisher.model_name)
        if spec.publish.stale_check:
            ahead.checking = asyncio.create_task(self._check_published(publisher.model_name, step))
            if step == spec.optim.steps or not policy.device.startswith("cuda"):
                # On a CPU the trainer's scoring and the generator share the cores (as in the
                # synchronous loop, the check runs alone); on a GPU it runs while the next step
                # waits for its rollouts, and that step's update waits for it.
                metrics.update(await self.cancel.guard(ahead.checking))
                ahead.checking = None
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
