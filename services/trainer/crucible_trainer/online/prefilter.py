"""A job's pre-filter: which problems are worth training on, judged before it trains or while it does.

A method with a pre-filter (GRPO's and SRRL's `filter.mode: pre`; the method's `judge`) judges a
problem from a few first attempts of the starting policy. Judging the whole pool before step 1
took 21 s of a 150 s Qwen2.5-Coder-1.5B run (docs/benchmarks.md, lease I), while step 1 needs only
its `problems_per_step` problems. So a job whose policy is on a GPU streams the judging: the
problems are judged in the order its sampler's first epoch draws them, `CHUNK_STEPS` steps'
worth at a time, on a task of their own, and each draw waits only for the verdicts it reaches
(`ProblemSampler.take`; the step's `time/filter_wait_s`). Step 1 starts after the first chunk;
the rest are judged beside the steps. Every verdict still comes from the starting policy, the
base model, which the generator serves under its own name all along: the kept problems are those
judging everything first would keep. Streamed, the first epoch is the whole pool's shuffle without
the rejected problems; later epochs shuffle the kept ones.

Two kinds of job judge every problem before step 1 and train on the kept problems shuffled
(`ProblemSampler.restrict`), as before streaming: one with `init_adapter` (its starting adapter
is retired once step 1 publishes) and one on a CPU, where the generator's decoding and the update
share the cores and slow each other down more than overlapping them gains.

Kept across restarts: the verdicts go to the run dir's `filter.json` as each chunk's come in
(and every checkpoint's sampler state holds those it had), so a job resumed or retried judges
only what is left, and draws what a job that never stopped would have drawn from the same
verdicts.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from crucible_shared.jobs import ModelSpec

from crucible_trainer.methods.groups import Judge
from crucible_trainer.rl.context import StepContext
from crucible_trainer.runtime.atomic import output_file

log = logging.getLogger(__name__)

CHUNK_STEPS = 2  # streamed: each chunk judges this many steps' worth of problems


def streams(model: ModelSpec) -> bool:
    """Whether a job with this (resolved) model section judges while it trains (see above)."""
    return model.device is not None and model.device.startswith("cuda") and not model.init_adapter


class PreFilter:
    """One job's pre-filter: `start` where its loop begins, `close` where it ends."""

    def __init__(
        self,
        judge: Judge,
        ctx: StepContext,
        path: Path,
        task_ids: list[str],
        gate: Callable[[], None],
        emit: Callable[..., None],
        summary: dict[str, Any],
    ) -> None:
        self.judge, self.ctx, self.sampler = judge, ctx, ctx.sampler
        self.path, self.task_ids, self.gate, self.emit, self.summary = path, task_ids, gate, emit, summary
        self.chunk = max(1, CHUNK_STEPS * ctx.job.optim.problems_per_step)
        self.saved: dict[int, bool] = {}  # what `filter.json` holds
        self.order: list[int] = []
        self.task: asyncio.Task[None] | None = None

    async def start(self, first_step: int, streamed: bool) -> None:
        """Where the loop begins at `first_step`: the choice made before a restart reused, then
        every problem judged before returning, or the judging started (`streamed`) on a task."""
        saved = json.loads(self.path.read_text()) if self.path.exists() else {}
        if "verdicts" not in saved and (saved or not streamed):
            await self._judge_first(first_step, saved)
            return
        self.saved = {int(i): bool(kept) for i, kept in saved.get("verdicts", [])}
        self.order = saved.get("order", [])
        if first_step == 1:
            order = self.sampler.screen()
            if order != self.order:  # another job's file (never this one's)
                self.order, self.saved = order, {}
        elif self.sampler.verdicts is None:
            return  # judged before the checkpoint the job resumed from
        elif not self.order:  # the file is gone: the verdicts the checkpoint has, then the rest
            self.order = [*self.sampler.verdicts, *self.sampler.unjudged()]
        self.sampler.judge(self.saved)  # those of the checkpoint and any made after it
        self.task = asyncio.ensure_future(self._judge_rest())

    async def _judge_first(self, first_step: int, saved: dict[str, Any]) -> None:
        """Every problem judged before training (or the choice `filter.json` holds), the sampler
        restricted to the kept ones; with none kept, every problem trains."""
        if first_step > 1:
            return  # the checkpoint's sampler holds the choice
        everything = list(range(len(self.task_ids)))
        took: dict[str, float] = {}
        if saved:
            chosen = saved["indices"]
        else:
            started = time.perf_counter()
            verdicts = await self.judge(self.ctx, everything, 0)
            chosen = [i for i in everything if verdicts[i]]
            if not chosen:
                log.warning("the pre-filter kept no problem; training on all of them")
                return
            took = self._took(started)
            self._write(
                {"indices": chosen, "kept": [self.task_ids[i] for i in chosen], "of": len(everything)}
            )
        self.sampler.restrict(chosen)
        self._record(len(chosen), **took)

    async def _judge_rest(self) -> None:
        started = time.perf_counter()
        try:
            while todo := self.sampler.unjudged()[: self.chunk]:
                verdicts = await self.judge(self.ctx, todo, 1 + len(self.saved))
                self.saved.update(verdicts)
                record: dict[str, Any] = {"order": self.order, "verdicts": sorted(self.saved.items())}
                if len(self.saved) == len(self.order):
                    kept = [i for i in self.order if self.saved[i]]
                    record |= {
                        "indices": kept,
                        "kept": [self.task_ids[i] for i in kept],
                        "of": len(self.order),
                    }
                self._write(record)
                self.sampler.judge(verdicts)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the draw that needs a verdict still to come fails the job with it
            log.warning(
                "the pre-filter stopped after %d of %d problems: %r", len(self.saved), len(self.order), exc
            )
            self.sampler.stopped(exc)
            return
        self._record(len(self.sampler.pool), streamed=True, **self._took(started))

    async def close(self) -> None:
        """Stop a judging still running (the job ended first): the summary says how far it got."""
        if self.task is None:
            return
        if not self.task.done():
            self.task.cancel()
        await asyncio.gather(self.task, return_exceptions=True)
        if self.sampler.verdicts is not None:
            kept = sum(self.saved.values())
            self.summary["difficulty_filter"] = {
                "kept": kept,
                "judged": len(self.saved),
                "of": len(self.order),
            }

    def _took(self, started: float) -> dict[str, float]:
        """Where the judging's time went: until the last completion, then programs still running."""
        return {
            "seconds": round(time.perf_counter() - started, 2),
            "generate_s": round(self.ctx.timing.generate_s, 2),
            "execute_tail_s": round(self.ctx.timing.execute_tail_s, 2),
        }

    def _write(self, record: dict[str, Any]) -> None:
        with output_file(self.path) as tmp:
            tmp.write_text(json.dumps(record, indent=1))
            self.gate()

    def _record(self, kept: int, **figures: Any) -> None:
        of = len(self.task_ids)
        self.summary["difficulty_filter"] = {"kept": kept, "of": of, **figures}
        self.emit("difficulty_filter", kept=kept, of=of)
