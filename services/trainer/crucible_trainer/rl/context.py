"""What a method needs to collect a step's rollouts: the roller, the prompts, the spec, the policy's name."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from crucible_shared.jobs import TrainJob

from crucible_trainer.rl.rollout import Prompt, Roller, Sample, Timing


@dataclass
class StepContext:
    job: TrainJob
    roller: Roller
    tokenizer: Any
    model_name: str  # the adapter version rollouts are sampled from
    step: int
    timing: Timing = field(default_factory=Timing)

    def render(self, messages_or_text: list[dict] | str) -> str:
        """Chat messages through the model's chat template, or a plain completion prompt as is."""
        if isinstance(messages_or_text, str):
            return messages_or_text
        return self.tokenizer.apply_chat_template(
            messages_or_text, add_generation_prompt=True, tokenize=False
        )

    async def sample(
        self,
        prompts: list[Prompt],
        n: int,
        *,
        temperature: float | None = None,
        max_tokens: int | None = None,
        extract=None,
    ) -> list[Sample]:
        r = self.job.rollout
        return await self.roller.roll(
            prompts,
            model=self.model_name,
            n=n,
            temperature=r.temperature if temperature is None else temperature,
            top_p=r.top_p,
            max_tokens=max_tokens or r.max_tokens,
            stop=r.stop,
            seed=self.job.seed * 1_000_003 + self.step * 7919 + (0 if temperature is None else 1),
            extract=extract,
            timing=self.timing,
        )


def first_prompts(ctx: StepContext, task_indices: list[int], build_prompt) -> list[Prompt]:
    """One first-attempt prompt per problem of the step; each problem is its own group."""
    return [
        Prompt(task_index=t, group=i, text=ctx.render(build_prompt(t))) for i, t in enumerate(task_indices)
    ]


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
    return out
