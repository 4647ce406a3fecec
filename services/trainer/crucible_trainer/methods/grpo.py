"""GRPO: G samples per prompt, advantages relative to the group (config: `crucible_shared.jobs.GRPOConfig`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from crucible_shared.jobs import GRPOConfig

from crucible_trainer.methods.clipped import update_config as update_config  # GRPO, SRRL, SPIRAL share it
from crucible_trainer.methods.groups import (
    Judge,
    assign_group_advantages,
    pre_filter,
    select_groups,
    zero_signal_metrics,
)
from crucible_trainer.rl.context import StepContext, first_prompts, reward_metrics
from crucible_trainer.rl.rollout import Sample


def judge(cfg: GRPOConfig) -> Judge | None:
    return pre_filter(cfg.filter)


async def collect(
    ctx: StepContext, cfg: GRPOConfig, indices: list[int]
) -> tuple[list[Sample], dict[str, float]]:
    async def groups(chosen: list[int], offset: int, round: int) -> tuple[list[Sample], dict[str, float]]:
        return await ctx.sample(first_prompts(ctx, chosen, offset), cfg.group_size, round=round), {}

    if ctx.early is not None:
        # Set only where one group's advantages need only its rewards (`early_update_blocker`):
        # the update may start on each group as it is scored (rl/early.py).
        ctx.early.open(lambda members: assign_group_advantages(members, cfg.scale))
    batch, sampled, _, filter_metrics = await select_groups(ctx, cfg.filter, indices, groups)
    assign_group_advantages(batch, cfg.scale)
    return batch, {**reward_metrics(sampled), **zero_signal_metrics(sampled), **filter_metrics}


def report(cfg: object, run_dir: Path) -> dict[str, Any]:
    return {}
