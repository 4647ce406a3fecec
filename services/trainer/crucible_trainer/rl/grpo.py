"""GRPO: G samples per prompt, advantages relative to the group (config: `crucible_shared.jobs.GRPOConfig`)."""

from __future__ import annotations

from collections import defaultdict

from crucible_shared.jobs import GRPOConfig

from crucible_trainer.rl.advantages import group_advantages, zero_signal
from crucible_trainer.rl.context import StepContext, first_prompts, reward_metrics
from crucible_trainer.rl.rollout import Sample
from crucible_trainer.rl.update import UpdateConfig


def assign_group_advantages(batch: list[Sample], scale: str) -> tuple[int, int]:
    """Set `advantage` on every scored sample, group by group; returns (groups, zero-signal groups)."""
    groups: dict[int, list[Sample]] = defaultdict(list)
    for s in batch:
        if s.reward is not None:
            groups[s.group].append(s)
    keys = sorted(groups)
    rewards = [[s.reward for s in groups[k]] for k in keys]
    if not rewards:
        return 0, 0
    for k, adv in zip(keys, group_advantages(rewards, scale=scale), strict=True):
        for s, a in zip(groups[k], adv, strict=True):
            s.advantage = a
    return len(keys), zero_signal(rewards)


async def collect(
    ctx: StepContext, cfg: GRPOConfig, task_indices: list[int], build_prompt
) -> tuple[list[Sample], dict[str, float]]:
    prompts = first_prompts(ctx, task_indices, build_prompt)
    batch = await ctx.sample(prompts, ctx.job.rollout.group_size)
    n_groups, zero = assign_group_advantages(batch, cfg.scale)
    metrics = reward_metrics(batch)
    metrics["zero_signal_groups"] = float(zero)
    metrics["zero_signal_fraction"] = zero / n_groups if n_groups else 1.0
    return batch, metrics


def update_config(cfg: GRPOConfig, micro_batch: int, grad_accum: int | None, max_tokens: int) -> UpdateConfig:
    return UpdateConfig(
        objective="clip",
        iterations=cfg.num_iterations,
        clip_eps=cfg.clip_eps,
        clip_eps_high=cfg.clip_eps_high,
        kl_beta=cfg.kl_beta,
        aggregation=cfg.loss,
        micro_batch=micro_batch,
        grad_accum=grad_accum,
        max_tokens=max_tokens,
    )
