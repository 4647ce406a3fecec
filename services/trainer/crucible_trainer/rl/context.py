"""What a method needs to collect a step: the roller, the prompts, the problem sampler, the spec, the
name of the policy version rollouts are sampled from (and of the frozen base), and the method's
state that lives across steps and checkpoints."""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from crucible_shared.jobs import TrainJob

from crucible_trainer import tasks
from crucible_trainer.rl.rollout import Prompt, Roller, Sample, Timing

if TYPE_CHECKING:
    from crucible_trainer.rl.early import EarlyGroups

log = logging.getLogger(__name__)


class ProblemSampler:
    """The order problems are trained in: epochs of the pool, each shuffled by one seeded RNG.

    A streamed pre-filter (online/prefilter.py) judges the first epoch while training runs: after
    `screen`, draws take that epoch's problems judged worth training (`judge`), in its order,
    never passing one not judged yet (`take` waits for its verdict); once every problem has one,
    the pool is the kept problems and later epochs shuffle those.

    Its whole state (pool, what is left of the current epoch, the RNG, the verdicts) goes into
    checkpoints, so a resumed job draws exactly the problems an uninterrupted one would have.
    """

    def __init__(self, pool: list[int], seed: int) -> None:
        self.pool = list(pool)
        self.rng = random.Random(seed)
        self.queue: list[int] = []
        self.verdicts: dict[int, bool] | None = None  # while a pre-filter streams: those so far
        self._news = asyncio.Event()  # a verdict came in, or the judging stopped
        self.error: BaseException | None = None  # why the judging stopped, if it did

    def draw(self, n: int) -> list[int]:
        if self.verdicts is not None:
            if not self.ready(n):
                raise RuntimeError("these draws reach problems not judged yet: await `take`")
            out: list[int] = []
            while len(out) < n:
                index = self.queue.pop(0)
                if self.verdicts[index]:
                    out.append(index)
            return out
        while len(self.queue) < n:
            chunk = self.pool[:]
            self.rng.shuffle(chunk)
            self.queue += chunk
        out, self.queue = self.queue[:n], self.queue[n:]
        return out

    def restrict(self, pool: list[int]) -> None:
        """Train on `pool` from now on (the pre-filter's choice)."""
        keep = set(pool)
        self.pool, self.queue = list(pool), [i for i in self.queue if i in keep]

    def screen(self) -> list[int]:
        """Begin judging the first epoch, shuffled as a first draw shuffles it; returns its order."""
        if self.queue or self.verdicts is not None:
            raise RuntimeError("a pre-filter streams from the first draw of a job only")
        self.queue = self.pool[:]
        self.rng.shuffle(self.queue)
        self.verdicts = {}
        return list(self.queue)

    def unjudged(self) -> list[int]:
        """The problems still to judge, in the order draws reach them."""
        return [] if self.verdicts is None else [i for i in self.queue if i not in self.verdicts]

    def judge(self, verdicts: dict[int, bool]) -> None:
        """Take these verdicts; once every problem has one, the pool is the kept problems (all of
        them, with a warning, if none is kept) and draws no longer wait."""
        if self.verdicts is None:
            raise RuntimeError("no pre-filter is streaming")
        self.verdicts.update(verdicts)
        if not self.unjudged():
            kept = [i for i in self.pool if self.verdicts[i]]
            if kept:
                self.queue = [i for i in self.queue if self.verdicts[i]]
            else:
                log.warning("the pre-filter kept no problem; training on all of them")
                kept = self.pool
            self.pool, self.verdicts = kept, None
        self._news.set()

    def stopped(self, error: BaseException) -> None:
        """The judging stopped on `error`: a draw that needs a verdict still to come raises it."""
        self.error = error
        self._news.set()

    def ready(self, n: int) -> bool:
        """Whether `n` problems can be drawn without passing one not judged yet."""
        if self.verdicts is None or n <= 0:
            return True
        found = 0
        for index in self.queue:
            if index not in self.verdicts:
                return False
            found += self.verdicts[index]
            if found >= n:
                return True
        return False

    async def take(self, n: int) -> list[int]:
        """`draw(n)` once the verdicts it needs are in (at once when no pre-filter streams)."""
        while not self.ready(n):
            if self.error is not None:
                raise self.error
            self._news.clear()
            await self._news.wait()
        return self.draw(n)

    def state(self) -> dict[str, Any]:
        verdicts = None if self.verdicts is None else dict(self.verdicts)
        return {"pool": self.pool, "queue": self.queue, "rng": self.rng.getstate(), "verdicts": verdicts}

    def load(self, state: dict[str, Any]) -> None:
        self.pool, self.queue = list(state["pool"]), list(state["queue"])
        version, internal, gauss = state["rng"]
        self.rng.setstate((version, tuple(internal), gauss))
        verdicts = state.get("verdicts")  # absent from checkpoints older than streamed pre-filters
        self.verdicts = None if verdicts is None else {int(i): bool(v) for i, v in verdicts.items()}


class PromptBook:
    """Prompts of a job's problems, rendered as the generator gets them (chat template or plain)."""

    def __init__(self, problems: list[Any], chat: bool, tokenizer: Any) -> None:
        self.problems, self.chat, self.tokenizer = problems, chat, tokenizer

    def render(self, messages_or_text: list[dict] | str) -> str:
        if isinstance(messages_or_text, str):
            return messages_or_text
        return self.tokenizer.apply_chat_template(
            messages_or_text, add_generation_prompt=True, tokenize=False
        )

    def first(self, index: int) -> str:
        task = self.problems[index]
        return self.render(tasks.build_messages(task) if self.chat else tasks.build_completion_prompt(task))

    def refinement(self, index: int, code: str, result: Any, feedback: str = "first_failure") -> str:
        messages = tasks.build_refinement_messages(
            self.problems[index], code, result, all_tests=feedback == "all_tests"
        )
        if self.chat:
            return self.render(messages)
        return "\n\n".join(m["content"] for m in messages)


@dataclass
class StepContext:
    job: TrainJob
    roller: Roller
    prompts: PromptBook
    sampler: ProblemSampler
    model_name: str  # the adapter version rollouts are sampled from
    step: int
    timing: Timing = field(default_factory=Timing)
    base_name: str = ""  # the frozen base model, as the generator serves it (a fixed opponent, a reference)
    # The method's own state across steps (e.g. SPIRAL's baselines): one dict for the whole job,
    # saved in every checkpoint and restored on resume. Plain data only (it is pickled).
    state: dict[str, Any] = field(default_factory=dict)
    version: int = 0  # the policy version `model_name` serves: every sample claims it
    # The update that starts on the step's groups as they are scored (`rl/early.py`), when the
    # loop runs one; a method that can set one group's advantages opens it (GRPO).
    early: EarlyGroups | None = None

    async def sample(
        self,
        prompts: list[Prompt],
        n: int,
        *,
        temperature: float | None = None,
        max_tokens: int | None = None,
        extract=None,
        round: int = 0,
    ) -> list[Sample]:
        """`n` completions of each prompt, run and scored. `round` > 0 for extra draws of one step
        (dynamic sampling), so they get seeds of their own."""
        r = self.job.rollout
        seed = self.job.seed * 1_000_003 + self.step * 7919 + (0 if temperature is None else 1)
        out = await self.roller.roll(
            prompts,
            model=self.model_name,
            n=n,
            temperature=r.temperature if temperature is None else temperature,
            top_p=r.top_p,
            max_tokens=max_tokens or r.max_tokens,
            stop=r.stop,
            seed=seed + round * 104_729,
            extract=extract,
            timing=self.timing,
            early=self.early,
        )
        for s in out:
            s.version = self.version
        return out


def first_prompts(ctx: StepContext, task_indices: list[int], group_offset: int = 0) -> list[Prompt]:
    """One first-attempt prompt per problem of the step; each problem is its own group."""
    return [
        Prompt(task_index=t, group=group_offset + i, text=ctx.prompts.first(t))
        for i, t in enumerate(task_indices)
    ]


async def collect_first_attempts(
    ctx: StepContext,
    task_indices: list[int],
    samples: int,
    advantages: Callable[[list[float]], list[float]],
) -> tuple[list[Sample], dict[str, float]]:
    """`samples` completions of each problem's first prompt, every scored sample weighted by
    `advantages` of the scored rewards (in order), and the step's reward figures."""
    batch = await ctx.sample(first_prompts(ctx, task_indices), samples)
    scored = [s for s in batch if s.reward is not None]
    if scored:
        rewards = [s.reward for s in scored if s.reward is not None]
        for s, a in zip(scored, advantages(rewards), strict=True):
            s.advantage = a
    return batch, reward_metrics(batch)


def reward_metrics(batch: list[Sample]) -> dict[str, float]:
    """Mean/std reward, pass rate, completion length and dropped (sandbox fault) samples."""
    scored = [s for s in batch if s.reward is not None]
    out: dict[str, float] = {
        "samples": float(len(batch)),
        "dropped_sandbox_errors": float(len(batch) - len(scored)),
    }
    if scored:
        rewards = [s.reward for s in scored]
        mean = sum(rewards) / len(rewards)
        out["reward_mean"] = mean
        out["reward_std"] = (sum((r - mean) ** 2 for r in rewards) / len(rewards)) ** 0.5
        out["pass_rate"] = sum(1 for s in scored if s.result and s.result.status == "passed") / len(scored)
        out["completion_tokens_mean"] = sum(len(s.completion_ids) for s in scored) / len(scored)
        out["truncated_fraction"] = sum(1 for s in scored if s.finish_reason == "length") / len(scored)
        # Programs that gave one answer to every test (hard-coded): a rise means reward hacking.
        out["same_answer_fraction"] = sum(1 for s in scored if s.result and s.result.same_answer) / len(
            scored
        )
    return out
