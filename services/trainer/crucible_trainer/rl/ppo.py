"""PPO-clip over stored rollouts: log p_old recorded once, batch-normalised advantages, several
epochs with the clipped surrogate (config: `crucible_shared.jobs.PPOConfig`)."""

from __future__ import annotations

from crucible_shared.jobs import PPOConfig

from crucible_trainer.rl.advantages import batch_normalised
from crucible_trainer.rl.context import StepContext, first_prompts, reward_metrics
from crucible_trainer.rl.rollout import Sample
from crucible_trainer.rl.update import UpdateConfig


async def collect(
    ctx: StepContext, cfg: PPOConfig, task_indices: list[int], build_prompt
) -> tuple[list[Sample], dict[str, float]]:
    prompts = first_prompts(ctx, task_indices, build_prompt)
    batch = await ctx.sample(prompts, cfg.samples)
    scored = [s for s in batch if s.reward is not None]
    if scored:
        for s, a in zip(scored, batch_normalised([s.reward for s in scored]), strict=True):
            s.advantage = a
    return batch, reward_metrics(batch)


def update_config(cfg: PPOConfig, micro_batch: int, grad_accum: int | None, max_tokens: int) -> UpdateConfig:
    return UpdateConfig(
        objective="clip",
        iterations=cfg.epochs,
        clip_eps=cfg.clip_eps,
        aggregation="token",
        micro_batch=micro_batch,
        grad_accum=grad_accum,
        max_tokens=max_tokens,
        always_score_old=True,
    )
