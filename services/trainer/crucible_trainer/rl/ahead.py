"""Rollouts that overlap the update (the train spec's `overlap.max_staleness: s`, s > 0).

A background task (`Ahead`) collects the steps' samples in order, with the method's own `collect`
(the same rollout code as the synchronous loop), while the training loop updates on the samples
collected before. Step j's rollouts start once the step before it is collected and the newest
published version is at least j - 1 - s (the version step j's update starts from is j - 1), and
sample from that newest version. With s = 1 on a generator slower than the update, step j samples
from version j - 2 while step j - 1 updates: the generator never waits for the update.

What stays exact:
* The problems: only this task draws from the sampler, steps in order, so every step gets the
  problems the synchronous loop would have given it. The sampler's state right after step j's
  collection (dynamic sampling draws during it) travels with step j's samples, and the checkpoint
  of step j saves that state, not the sampler's (already drawn ahead): a resumed overlapped run
  consumes the same problems in the same order.
* The versions: every sample claims the version that produced it (`Sample.version`, with the
  generator's log-probs of that version, `gen_logprobs`). Before a step trains, `check_claims`
  refuses a sample whose version lags more than s, is newer than the policy, or (with
  `publish.stale_check`) was not checked against the trainer when it was published: the loop
  checks each version right after publishing it, while the trainer still holds exactly it.
* The generators: a version stays loaded while a rollout samples from it (`Publisher.pin`),
  and is unloaded when that rollout ends if the staleness window no longer keeps it.

The lag is corrected in the loss with truncated importance sampling (rl/correction.py).
"""

from __future__ import annotations

import asyncio
import copy
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from crucible_trainer.rl.context import ProblemSampler
from crucible_trainer.rl.publish import Publisher, StalePolicyError
from crucible_trainer.rl.rollout import Sample, Timing

# (step, version, served name) -> the step's samples, the method's metrics and the rollout timing
Collect = Callable[[int, int, str], Awaitable[tuple[list[Sample], dict[str, float], Timing]]]


@dataclass
class Collected:
    """One step's samples, collected ahead of its update."""

    step: int
    version: int  # the version they were sampled from
    samples: list[Sample]
    metrics: dict[str, float]
    timing: Timing
    rollout_s: float  # wall time of the collection
    sampler_state: dict[str, Any]  # the sampler right after this step's draws (what its checkpoint saves)


class Versions:
    """The newest published version and its served name; waits for it to reach a bound."""

    def __init__(self, version: int, name: str) -> None:
        self.version, self.name = version, name
        self.checked: set[int] = set()  # versions the stale-policy check passed
        self._moved = asyncio.Condition()

    async def advance(self, version: int, name: str) -> None:
        async with self._moved:
            self.version, self.name = version, name
            self._moved.notify_all()

    async def at_least(self, version: int) -> tuple[int, str]:
        async with self._moved:
            await self._moved.wait_for(lambda: self.version >= version)
            return self.version, self.name


class Ahead:
    """Collects steps `first`..`last` in the background, at most `max_staleness` versions behind."""

    def __init__(
        self,
        collect: Collect,
        sampler: ProblemSampler,
        publisher: Publisher,
        versions: Versions,
        first: int,
        last: int,
        max_staleness: int,
    ) -> None:
        self.collect, self.sampler, self.publisher = collect, sampler, publisher
        self.versions, self.first, self.last, self.max_staleness = versions, first, last, max_staleness
        self.ready: asyncio.Queue[Collected] = asyncio.Queue()
        self.task: asyncio.Task[None] | None = None
        # The stale-policy check of the newest version, run by the training loop while it waits
        # for the next step's samples (online/overlapped.py); closed with the rest.
        self.checking: asyncio.Task[dict[str, float]] | None = None

    def start(self) -> None:
        self.task = asyncio.create_task(self._run(), name="rollouts-ahead")

    async def _run(self) -> None:
        for step in range(self.first, self.last + 1):
            version, name = await self.versions.at_least(step - 1 - self.max_staleness)
            self.publisher.pin(name)  # no await between reading the name and pinning it
            try:
                started = time.perf_counter()
                samples, metrics, timing = await self.collect(step, version, name)
                took = time.perf_counter() - started
            finally:
                await self.publisher.release(name)
            state = copy.deepcopy(self.sampler.state())
            await self.ready.put(Collected(step, version, samples, metrics, timing, took, state))

    async def next(self) -> Collected:
        """The next step's samples; the background task's error if it failed."""
        assert self.task is not None, "start() first"
        getting = asyncio.ensure_future(self.ready.get())
        try:
            await asyncio.wait({getting, self.task}, return_when=asyncio.FIRST_COMPLETED)
        except BaseException:
            getting.cancel()
            raise
        if getting.done():
            return getting.result()
        getting.cancel()
        self.task.result()  # raises the task's error
        raise RuntimeError("the rollouts ran out before the training loop did")

    async def close(self) -> None:
        """Stop collecting and checking (the job ended, failed or was cancelled); an error of
        those tasks is dropped here: the loop's own, if any, is the one reported."""
        for task in (self.task, self.checking):
            if task is None:
                continue
            if not task.done():
                task.cancel()
            try:
                await task
            except BaseException:
                pass


def check_claims(
    batch: list[Sample], step: int, max_staleness: int, checked: set[int] | None
) -> dict[str, float]:
    """Refuse to train step `step` on a sample whose claimed version is out of bounds or was never
    checked (`checked` None: the stale-policy check is off); returns the staleness figures."""
    lags = []
    for s in batch:
        lag = step - 1 - s.version
        if not 0 <= lag <= max_staleness:
            raise StalePolicyError(
                f"a sample of step {step} claims version {s.version}: it must be within {max_staleness} "
                f"versions of {step - 1}"
            )
        if checked is not None and s.version not in checked:
            raise StalePolicyError(
                f"a sample of step {step} claims version {s.version}, which the stale-policy check never passed"
            )
        lags.append(lag)
    if not lags:
        return {}
    return {
        "overlap/staleness_mean": sum(lags) / len(lags),
        "overlap/staleness_max": float(max(lags)),
        "overlap/version_min": float(step - 1 - max(lags)),
    }
