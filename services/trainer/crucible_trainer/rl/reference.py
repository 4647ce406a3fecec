"""The KL reference's log-probs of a step's completions, scored as they arrive
(`optim.reference_ahead`).

With a KL term (`kl_beta` > 0) the update scores every sample under the starting policy before its
first training pass: one no-grad forward per micro-batch of the whole batch, on the update's path
(about a quarter of SmolLM2-135M's update in the benchmark's step: docs/benchmarks.md). Those
values depend only on the tokens and the frozen starting weights, and the completions stream in
one by one while the generator still decodes the longer ones (`rollout.py`), when the trainer's
card has nothing to do. `ReferenceAhead` scores them then, on the policy's own thread (between
whatever else the job runs there), a micro-batch at a time as they arrive, and the rest when
generation ends, beside the sandbox's last programs. Each sample keeps its values
(`Sample.ref_logprobs`); the update scores only the samples that have none (`update.reference`).

Completions arrive shortest first, so each micro-batch holds similar lengths and pads little. The
values are the update's own scoring of the same tokens, in micro-batches of other members (equal
to float rounding where kernels depend on the batch's shape, as in the update itself).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from crucible_trainer.rl.rollout import Sample


class ReferenceAhead:
    """One step's reference scoring beside its rollouts: `add` each sample as it arrives (on the
    event loop), `generated` when generation ends, then `finish` before the update."""

    def __init__(self, policy: Any, micro_batch: int) -> None:
        self.policy, self.micro_batch = policy, max(1, micro_batch)
        self._pending: list[Sample] = []
        self._runs: list[asyncio.Future[None]] = []
        self.sequences = 0  # samples scored ahead
        self.busy_s = 0.0  # time the policy's thread spent scoring them

    def add(self, sample: Sample) -> None:
        """A completion that arrived; a full micro-batch goes to the policy's thread."""
        self._pending.append(sample)
        if len(self._pending) >= self.micro_batch:
            self._flush()

    def generated(self) -> None:
        """Generation ended: the samples short of a micro-batch are scored now, beside the
        sandbox's last programs."""
        self._flush()

    def _flush(self) -> None:
        batch, self._pending = self._pending, []
        if batch:
            self._runs.append(asyncio.ensure_future(self.policy.call(self._score, batch)))

    def _score(self, batch: list[Sample]) -> None:
        """On the policy's thread: the starting policy's log-probs of `batch`'s completions."""
        started = time.perf_counter()
        values = self.policy.score(
            [s.prompt_ids for s in batch], [s.completion_ids for s in batch], self.micro_batch, reference=True
        )
        for sample, logprobs in zip(batch, values, strict=True):
            sample.ref_logprobs = logprobs
        self.sequences += len(batch)
        self.busy_s += time.perf_counter() - started

    async def finish(self) -> dict[str, float]:
        """Wait for every scoring sent (raising the first error) and return the step's figures."""
        self._flush()
        runs, self._runs = self._runs, []
        await asyncio.gather(*runs)
        return {
            "update/reference_ahead_sequences": float(self.sequences),
            "time/reference_ahead_s": self.busy_s,
        }

    async def close(self) -> None:
        """The step failed: what was sent is awaited, its errors dropped (the step's own error is
        the one reported). The policy's thread runs one call at a time, so whatever comes next
        there starts after these scorings, never inside one."""
        runs, self._runs, self._pending = self._runs, [], []
        await asyncio.gather(*runs, return_exceptions=True)
