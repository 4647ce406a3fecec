"""A step's update started on the groups already scored, while the sandbox still runs the last
programs (`optim.early_update`).

A step's samples are scored as their completions arrive (`rollout.py`), so when generation ends
most groups are scored, but the step still waits for the programs of its last completions, and a
program that loops runs to its time limit: on a GPU the card has nothing to do meanwhile. When a
group's advantages need only that group's rewards (GRPO with group or no scaling), and the loss of
every micro-batch is divided by the whole batch's count, which is known when generation ends (every
sample counts, by its completion's tokens: `update.Normaliser`), the forward and backward passes
of the groups already scored can run during that wait, and the step's one optimizer step follows
the last group. The gradient is the sum of the same terms as the whole batch's update (in another
order: float rounding aside), over the same samples (`update.trainable`).

`EarlyGroups` is the hand-over. The roller reports each scored sample (`scored`) and, when
generation ends, the batch in its final order (`generated`); a method that can set one group's
advantages opens the stream with that function (`open`, GRPO); the loop closes it with the batch
`collect` returned (`close`: what no group handed out yet, with the method's final advantages) or
with the step's error. `update_early` runs on the policy's thread and takes micro-batches
(`micro_batches`) as they fill: the longest ready samples first while groups are still out, the
rest once the stream is closed.
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import nullcontext
from dataclasses import replace
from typing import Any

import torch

from crucible_trainer.rl import throughput
from crucible_trainer.rl.policy import Policy
from crucible_trainer.rl.rollout import Sample
from crucible_trainer.rl.timing import PartTimer
from crucible_trainer.rl.update import (
    Normaliser,
    UpdateConfig,
    _micro_loss,
    drop_failed_pass,
    optimizer_step,
    trainable,
)

log = logging.getLogger(__name__)


class StepFailed(RuntimeError):
    """The step's collection failed after its update began: the update stops without a step."""


class EarlyGroups:
    """The scored groups of one step, handed from the event loop to the policy's thread."""

    def __init__(self) -> None:
        self.generated_event = asyncio.Event()  # set on the loop's thread when generation ends
        self._cond = threading.Condition()
        self._advantages: Callable[[list[Sample]], object] | None = None
        self._batch: list[Sample] | None = None
        self._where: dict[int, int] = {}  # id(sample) -> its index in the batch
        self._sizes: dict[int, int] = {}
        self._members: dict[int, list[Sample]] = defaultdict(list)
        self._ready: list[int] = []  # trainable indices not handed out yet
        self._handed: set[int] = set()
        self._closed = False
        self._error: BaseException | None = None
        self.handed_early = 0  # micro-batches handed out before the stream closed
        self.waited_s = 0.0  # how long the update waited for groups (not its own time)

    # -- the event loop's side -------------------------------------------------------------
    def open(self, advantages: Callable[[list[Sample]], object]) -> None:
        """The method sets one group's advantages with `advantages(members)` (in batch order)."""
        self._advantages = advantages

    def scored(self, samples: list[Sample]) -> None:
        """Samples whose rewards are set."""
        with self._cond:
            for s in samples:
                self._members[s.group].append(s)
            self._release([s.group for s in samples])

    def generated(self, batch: list[Sample]) -> None:
        """Every completion of the step has arrived: `batch` in the order `collect` returns it."""
        with self._cond:
            self._batch = batch
            self._where = {id(s): i for i, s in enumerate(batch)}
            for s in batch:
                self._sizes[s.group] = self._sizes.get(s.group, 0) + 1
            self._release(list(self._members))
            self._cond.notify_all()
        self.generated_event.set()

    def close(self, batch: list[Sample] | None = None, error: BaseException | None = None) -> None:
        """The step's samples are final (`batch`, as `collect` returned it) or it failed (`error`)."""
        with self._cond:
            if error is None and batch is not None and self._batch is not None:
                if len(batch) != len(self._batch) or any(
                    a is not b for a, b in zip(batch, self._batch, strict=True)
                ):
                    error = RuntimeError("the method's batch is not the one its rollouts generated")
                else:  # what no group handed out, with the method's own advantages
                    out = self._handed | set(self._ready)
                    self._ready += [i for i, s in enumerate(batch) if i not in out and _trains(s)]
            elif error is None:
                error = RuntimeError("the step's rollouts never reported their batch")
            self._error, self._closed = error, True
            self._cond.notify_all()

    def _release(self, groups: list[int]) -> None:
        """Complete groups (their size known once generation ends) get their advantages."""
        if self._batch is None or self._advantages is None:
            return
        for g in dict.fromkeys(groups):
            members = self._members.get(g, [])
            if not members or len(members) != self._sizes.get(g):
                continue
            members.sort(key=lambda s: self._where[id(s)])  # as `by_group` orders the batch
            self._advantages(members)
            self._ready += [self._where[id(s)] for s in members if _trains(s)]
            del self._members[g]
        self._cond.notify_all()

    # -- the policy thread's side ------------------------------------------------------------
    def batch(self) -> list[Sample]:
        """The step's batch, once generation has ended."""
        with self._cond:
            self._cond.wait_for(lambda: self._batch is not None or self._closed)
            self._raise()
            assert self._batch is not None
            return self._batch

    def micro_batches(self, size: int) -> Iterator[list[int]]:
        """Indices into the batch, `size` at a time: while groups are still out, full micro-batches
        of the longest samples ready; once the stream is closed, the rest, longest first."""
        assert self._batch is not None
        batch = self._batch

        def length(i: int) -> tuple[int, int]:
            return len(batch[i].prompt_ids) + len(batch[i].completion_ids), len(batch[i].completion_ids)

        while True:
            with self._cond:
                started = time.perf_counter()
                self._cond.wait_for(lambda: self._closed or len(self._ready) >= size)
                self.waited_s += time.perf_counter() - started
                self._raise()
                pool = sorted(self._ready, key=length, reverse=True)
                last = self._closed
                take = len(pool) if last else len(pool) // size * size
                out, self._ready = pool[:take], pool[take:]
                self._handed.update(out)
                if not last:
                    self.handed_early += take // size
            yield from (out[i : i + size] for i in range(0, len(out), size))
            if last:
                return

    def _raise(self) -> None:
        if self._error is not None:
            raise StepFailed(f"the step's collection failed: {self._error!r}") from self._error


def _trains(s: Sample) -> bool:
    return bool(trainable([s], kl_beta=0.0))


class _Passes:
    """Forward and backward passes over micro-batches of one batch (`run`). `ran` lists the
    micro-batches of the recorded run; `out_of_memory` counts the passes that ran out of GPU memory
    and ran again (with the micro-batches before them, their gradients dropped, the policy holding
    less: `Policy.spare_memory`), as `update` runs a step again."""

    def __init__(
        self, policy: Policy, batch: list[Sample], cfg: UpdateConfig, norm: Normaliser, timer: PartTimer
    ):
        self.policy, self.batch, self.cfg, self.norm, self.timer = policy, batch, cfg, norm, timer
        self.ran: list[list[int]] = []
        self.out_of_memory = 0

    def zeros(self) -> list[torch.Tensor]:
        """Sums of the loss, clip fraction, KL and ratio, none added yet."""
        return [torch.zeros((), dtype=torch.float32, device=self.policy.device) for _ in range(4)]

    def run(self, micro: Any, record: bool) -> list[torch.Tensor]:
        """Forward and backward over `micro`'s micro-batches (recorded in `ran`: `record`); their sums."""
        policy, sums = self.policy, self.zeros()
        source, again, done = iter(micro), [], []
        while (idx := again.pop(0) if again else next(source, None)) is not None:
            try:
                values = self._one(idx)
            except torch.OutOfMemoryError:
                if not policy.spare_memory():
                    raise
                failed = True
            else:
                failed = False
            if failed:  # out of the handler: the failed pass's tensors are gone with `_one`'s frame
                self.out_of_memory += 1
                drop_failed_pass(policy)
                again, sums = [*done, idx, *again], self.zeros()
                if record:
                    del self.ran[len(self.ran) - len(done) :]
                done = []
                continue
            sums = [a + b for a, b in zip(sums, values, strict=True)]
            done.append(idx)
            if record:
                self.ran.append(idx)
        return sums

    def _one(self, idx: list[int]) -> list[torch.Tensor]:
        """Forward and backward of one micro-batch; its loss, clip fraction, KL and ratio. Its graph
        lives in this frame only, so a pass that fails leaves none of it behind."""
        with self.timer.part("forward_backward"):
            out = _micro_loss(self.policy, self.batch, idx, self.cfg, self.norm, None, None)
            out.loss.backward()
        return [out.loss.detach(), *out.stats[:3]]


def update_early(policy: Policy, groups: EarlyGroups, cfg: UpdateConfig, seed: int = 0) -> dict[str, float]:
    """One pass, one optimizer step over the step's groups as `groups` hands them out (the loop
    starts it once generation has ended). Its metrics are `update.update`'s (its times without
    the waits for groups), plus `update/early_micro_batches`, the micro-batches handed out before the
    last group was scored, and `time/update_waited_s`, the waits. A step
    whose gradient is not finite runs again under the policy's fallback kernels, and one out of GPU
    memory with the policy holding less, as `update` does; a failed collection leaves no gradient
    behind."""
    del seed  # one pass in the given order: nothing is shuffled
    batch = groups.batch()
    # Every sample counts once scored, so the normaliser is the whole batch's now; a sandbox fault
    # (a sample left without a reward) changes it, which the check before the step catches.
    norm = Normaliser(float(len(batch)), float(sum(len(s.completion_ids) for s in batch)))
    timer = PartTimer(policy.device)
    counted = replace(policy.passes)
    passes = _Passes(policy, batch, cfg, norm, timer)
    ran = passes.ran
    retried, grad_norm, sums = 0, 0.0, passes.zeros()
    t0 = time.perf_counter()

    try:
        for attempt, kernels in enumerate([nullcontext, *policy.fallbacks]):
            with kernels():
                sums = passes.run(
                    groups.micro_batches(cfg.micro_batch) if attempt == 0 else list(ran), attempt == 0
                )
                if not ran:
                    break
                # What `update` would train, each sample once, divided by what it would divide by.
                if sorted(i for idx in ran for i in idx) != [i for i, s in enumerate(batch) if _trains(s)]:
                    raise RuntimeError("the micro-batches handed out are not the batch's trainable samples")
                scored = Normaliser.of(batch, cfg.micro_batch, None)
                # A sandbox fault dropped samples (no reward): the batch again, by its own count.
                if scored != norm:
                    log.warning(
                        "the batch's count changed while it was scored (%s -> %s): its passes run again",
                        norm,
                        scored,
                    )
                    policy.optimizer.zero_grad(set_to_none=True)
                    norm = passes.norm = scored
                    sums = passes.run(list(ran), False)
            grad_norm, again = optimizer_step(policy, timer, attempt)
            retried += int(attempt == 0 and again)
            if not again:
                break
    except BaseException:
        policy.optimizer.zero_grad(set_to_none=True)  # no half-accumulated gradient for the next step
        raise
    t1 = time.perf_counter()
    trained = [i for idx in ran for i in idx]
    metrics: dict[str, float] = {
        "update/sequences": float(len(trained)),
        "update/normaliser_sequences": norm.sequences,
        "update/normaliser_tokens": norm.tokens,
        "update/early_micro_batches": float(groups.handed_early),
        "time/update_waited_s": groups.waited_s,
    }
    if not ran:
        metrics.update({"loss": 0.0, "clip_fraction": 0.0, "grad_norm": 0.0, "kl": 0.0})
        return metrics
    stepped = math.isfinite(grad_norm)
    metrics.update(
        {
            "loss": float(sums[0]),
            "clip_fraction": float(sums[1]) / len(ran),
            "kl": float(sums[2]) / len(ran),
            "update/ratio_mean_iter0": float(sums[3]) / len(ran),
            "grad_norm": grad_norm if stepped else 0.0,
            "update/optimizer_steps": float(stepped),
            "update/skipped_nonfinite_steps": float(not stepped),
            "update/retried_nonfinite_steps": float(retried),
            "update/out_of_memory_retries": float(passes.out_of_memory),
            "update/memory_margin": float(policy.memory_margin),
            "time/update_score_s": 0.0,
            "time/update_passes_s": t1 - t0 - groups.waited_s,
        }
        | policy.passes.since(counted)
    )
    parts = timer.seconds()
    for part in ("ref", "old", "forward_backward", "allreduce", "optimizer"):
        metrics[f"time/update_{part}_s"] = parts.get(part, 0.0)
    lengths = [(len(batch[i].prompt_ids), len(batch[i].completion_ids)) for i in trained]
    seconds: dict[str, Any] = {**parts, "total": t1 - t0 - groups.waited_s}
    metrics.update(
        throughput.update_figures(
            policy, lengths, iterations=1, seconds=seconds, gpus=1, scored_old=False, scored_ref=False
        )
    )
    return metrics
