"""PPO-clip over stored rollouts: log p_old recorded once, batch-normalised advantages, several
epochs with the clipped surrogate, the ratio per token or per sequence
(config: `crucible_shared.jobs.PPOConfig`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from crucible_shared.jobs import PPOConfig, TrainJob

from crucible_trainer.rl.advantages import batch_normalised
from crucible_trainer.rl.context import StepContext, collect_first_attempts
from crucible_trainer.rl.rollout import Sample
from crucible_trainer.rl.update import UpdateConfig


def judge(cfg: PPOConfig) -> None:  # no pre-filter: every problem trains
    return None


async def collect(
    ctx: StepContext, cfg: PPOConfig, indices: list[int]
) -> tuple[list[Sample], dict[str, float]]:
    return await collect_first_attempts(ctx, indices, cfg.samples, batch_normalised)


def update_config(cfg: PPOConfig, job: TrainJob) -> UpdateConfig:
    return UpdateConfig(
        objective="clip",
        iterations=cfg.epochs,
        clip_eps=cfg.clip_eps,
        ratio=cfg.ratio,
        aggregation="token" if cfg.ratio == "token" else "sequence",
        micro_batch=job.optim.micro_batch,
        grad_accum=job.optim.grad_accum,
        length_buckets=job.optim.length_buckets,
        max_tokens=job.rollout.max_tokens,
        always_score_old=True,
    )


def report(cfg: object, run_dir: Path) -> dict[str, Any]:
    return {}
