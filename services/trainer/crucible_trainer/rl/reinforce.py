"""REINFORCE with reward r - alpha * tokens / 100 and an optional mean baseline
(config: `crucible_shared.jobs.ReinforceConfig`; alpha is `reward.length_penalty`)."""

from __future__ import annotations

from crucible_shared.jobs import ReinforceConfig

from crucible_trainer.rl.advantages import mean_baseline
from crucible_trainer.rl.context import StepContext, first_prompts, reward_metrics
from crucible_trainer.rl.rollout import Sample
from crucible_trainer.rl.update import UpdateConfig


async def collect(
    ctx: StepContext, cfg: ReinforceConfig, task_indices: list[int], build_prompt
) -> tuple[list[Sample], dict[str, float]]:
    prompts = first_prompts(ctx, task_indices, build_prompt)
    batch = await ctx.sample(prompts, cfg.samples)
    scored = [s for s in batch if s.reward is not None]
    if scored:
        rewards = [s.reward for s in scored]
        for s, a in zip(scored, mean_baseline(rewards) if cfg.baseline else rewards, strict=True):
            s.advantage = a
    return batch, reward_metrics(batch)


def update_config(
    cfg: ReinforceConfig, micro_batch: int, grad_accum: int | None, max_tokens: int
) -> UpdateConfig:
    return UpdateConfig(
        objective="reinforce",
        iterations=1,
        micro_batch=micro_batch,
        grad_accum=grad_accum,
        max_tokens=max_tokens,
    )
