"""Rollouts: prompts -> completions from the generator -> programs run by the sandbox -> rewards.

All prompts of a step go to the generator in one request, so it decodes them as one batch, and
that request is streamed: each completion comes back as soon as it finishes, and its program goes
to the sandbox then (with the others that finished within `LINGER_S`), while longer completions
still decode. A program that runs to its time limit is then hidden behind generation unless it
comes from one of the last completions; before, every program waited for the step's longest
completion, and one loop added its whole limit to the step.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from crucible_shared.generator_client import GeneratorPool, sample_of
from crucible_shared.jobs import RewardSpec
from crucible_shared.sandbox import RunResult
from crucible_shared.sandbox_client import SandboxClient

from crucible_trainer.rl.rewards import length_cost
from crucible_trainer.rl.rewards import reward as reward_of

if TYPE_CHECKING:
    from crucible_trainer.rl.early import EarlyGroups

LINGER_S = 0.02  # how long a finished completion waits for others to share its sandbox batch


@dataclass
class Sample:
    """One completion with everything the update and the metrics need."""

    task_index: int
    group: int  # samples of one group share an advantage baseline
    prompt_ids: list[int]
    completion_ids: list[int]
    text: str
    code: str
    gen_logprobs: list[float] | None
    finish_reason: str | None
    phase: str = "c1"  # "c1" first attempt, "c2" refinement (SRRL)
    parent: int | None = None  # index of the c1 sample a refinement refines
    result: RunResult | None = None
    reward: float | None = None
    length_cost: float = 0.0  # the length penalty inside `reward` (rewards.length_cost)
    advantage: float = 0.0
    problem_id: str | None = None  # its label in rollout logs when not its task's id (a game's turn)
    info: dict[str, Any] = field(default_factory=dict)  # extra columns of its rollout-log row
    version: int = 0  # the policy version (published adapter) that sampled it; gen_logprobs are its
    is_weights: list[float] | None = None  # per-token importance weights of its update (rl/correction.py)

    @property
    def task_reward(self) -> float | None:
        """The reward before the length penalty: what the program's run earned."""
        return None if self.reward is None else round(self.reward + self.length_cost, 10)


@dataclass
class Timing:
    generate_s: float = 0.0  # wall time until the last completion arrived
    execute_tail_s: float = 0.0  # wall time after that until the last result (execution not hidden)
    execute_busy_s: float = 0.0  # summed time of sandbox requests (overlapped with generation)


@dataclass
class Prompt:
    task_index: int
    group: int
    text: str
    phase: str = "c1"
    parent: int | None = None


class Roller:
    """Samples and scores completions for a list of prompts."""

    def __init__(
        self, generator: GeneratorPool, sandbox: SandboxClient, tasks: list[Any], reward: RewardSpec, extract
    ) -> None:
        self.generator, self.sandbox, self.tasks, self.reward_spec = generator, sandbox, tasks, reward
        self.extract = extract  # (text, task) -> code

    def _sample(self, choice: Any, n: int, prompts: list[Prompt], extract: Any) -> tuple[int, Sample]:
        """A streamed choice as a `Sample` (its code extracted), with its place in the batch."""
        s = sample_of(choice, n)
        prompt = prompts[s.prompt_index]
        x = Sample(
            task_index=prompt.task_index,
            group=prompt.group,
            prompt_ids=list(s.prompt_token_ids or []),
            completion_ids=list(s.token_ids or []),
            text=s.text,
            code=extract(s.text, self.tasks[prompt.task_index]),
            gen_logprobs=s.logprobs,
            finish_reason=s.finish_reason,
            phase=prompt.phase,
            parent=prompt.parent,
        )
        return s.index, x

    async def roll(
        self,
        prompts: list[Prompt],
        *,
        model: str,
        n: int,
        temperature: float,
        top_p: float,
        max_tokens: int,
        stop: list[str] | None = None,
        seed: int,
        extract=None,
        timing: Timing | None = None,
        early: EarlyGroups | None = None,
    ) -> list[Sample]:
        """`n` completions of each prompt, in prompt order, each run and scored. `early`: told of
        each scored sample and, when generation ends, of the batch (`rl/early.py`)."""
        extract = extract or self.extract
        timing = timing or Timing()
        if not prompts:
            return []
        started = time.perf_counter()
        limits, out, runs = self.reward_spec.limits(), [], []
        pending: list[Sample] = []
        arrived = asyncio.Event()

        async def judge(batch: list[Sample]) -> None:
            sent = time.perf_counter()
            requests = [self.tasks[x.task_index].run_request(x.code, limits) for x in batch]
            for x, result in zip(batch, await self.sandbox.run_batch(requests), strict=True):
                x.result = result
                x.length_cost = length_cost(len(x.completion_ids), self.reward_spec.length_penalty)
                x.reward = reward_of(
                    result,
                    self.reward_spec.kind,
                    generated_tokens=len(x.completion_ids),
                    length_penalty=self.reward_spec.length_penalty,
                )
            timing.execute_busy_s += time.perf_counter() - sent
            if early is not None:
                early.scored(batch)

        def flush() -> None:
            """The pending programs to the sandbox, in one batch."""
            batch, pending[:] = list(pending), []
            if batch:
                runs.append(asyncio.ensure_future(judge(batch)))

        async def send() -> None:
            """Flush after each arrival and a moment for more to gather (choices finishing in one
            decode step arrive together)."""
            while True:
                await arrived.wait()
                arrived.clear()
                await asyncio.sleep(LINGER_S)
                flush()

        sender = asyncio.ensure_future(send())
        try:
            # One request for the whole step (the generator decodes every row in one batch),
            # streamed: each program runs while longer completions still decode.
            async for choice in self.generator.complete_stream(
                [p.text for p in prompts],
                model=model,
                n=n,
                temperature=temperature,
                top_p=top_p,
                max_tokens=max_tokens,
                stop=stop,
                seed=seed,
                logprobs=0,
            ):
                index, x = self._sample(choice, n, prompts, extract)
                out.append((index, x))
                pending.append(x)
                arrived.set()
            generated = time.perf_counter()
            if len(out) != len(prompts) * n:  # a group short of samples would shift its baseline
                raise RuntimeError(f"the generator streamed {len(out)} of {len(prompts) * n} completions")
            ordered = [x for _, x in sorted(out, key=lambda pair: pair[0])]
            if early is not None:
                early.generated(ordered)
            sender.cancel()
            await asyncio.gather(sender, return_exceptions=True)
            flush()  # what arrived during the last linger
            await asyncio.gather(*runs)
        finally:
            sender.cancel()
            for run in runs:
                run.cancel()
        finished = time.perf_counter()
        timing.generate_s += generated - started
        timing.execute_tail_s += finished - generated
        return ordered
