"""What the update asks of the processes that run it: one (`LOCAL`), or several data-parallel ranks
(`crucible_trainer.distributed.parallel.DataParallel`).

`plan` turns the batch's order into optimizer steps of micro-batches (this rank's share of each);
`begin` opens a micro-batch (`last`: the step's gradients are complete after it); `backward` runs
its backward; `reduce` sums the step's gradients over the ranks (timed as a part of its own);
`score` gives log-probs of every sample; `sum` adds figures over the ranks. One process: the
micro-batches of `grad_accum` each, a plain backward, the policy's own scoring, the figures as
they are.
"""

from __future__ import annotations

from typing import Any

import torch


class Parallel:
    """One process holds the whole update (the default)."""

    world = 1

    def plan(self, order: list[int], micro_batch: int, grad_accum: int | None) -> list[list[list[int]]]:
        """Optimizer steps, each a list of micro-batches (indices into the trained samples)."""
        micro = [order[i : i + micro_batch] for i in range(0, len(order), micro_batch)]
        accum = grad_accum or max(1, len(micro))
        return [micro[i : i + accum] for i in range(0, len(micro), accum)]

    def begin(self, last: bool) -> None:
        """A micro-batch starts; `last`: the last of its optimizer step."""

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def reduce(self, policy: Any) -> None:
        """The optimizer step's gradients, complete: summed over the ranks where they are not yet."""

    def idle_loss(self, policy: Any) -> torch.Tensor:
        """A zero loss through the whole model, for a rank with no share of a micro-batch."""
        raise AssertionError("one process always has a share of every micro-batch")

    def score(
        self,
        policy: Any,
        prompts: list[list[int]],
        completions: list[list[int]],
        micro_batch: int,
        reference: bool = False,
    ) -> list[list[float]]:
        return policy.score(prompts, completions, micro_batch, reference=reference)

    def sum(self, values: list[float]) -> list[float]:
        return [float(v) for v in values]


LOCAL = Parallel()
