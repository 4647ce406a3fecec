"""REINFORCE with reward r - alpha * tokens / 100 and an optional mean baseline
(config: `crucible_shared.jobs.ReinforceConfig`; alpha is `reward.length_penalty`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from crucible_shared.jobs import ReinforceConfig, TrainJob

from crucible_trainer.rl.advantages import mean_baseline
from crucible_trainer.rl.context import StepContext, collect_first_attempts
from crucible_trainer.rl.rollout import Sample
from crucible_trainer.rl.update import UpdateConfig


def judge(cfg: ReinforceConfig) -> None:  # no pre-filter: every problem trains
    return None


async def collect(
    ctx: StepContext, cfg: ReinforceConfig, indices: list[int]
) -> tuple[list[Sample], dict[str, float]]:
    # Without the baseline a sample's advantage is its reward as it is.
    return await collect_first_attempts(ctx, indices, cfg.samples, mean_baseline if cfg.baseline else list)


def update_config(cfg: ReinforceConfig, job: TrainJob) -> UpdateConfig:
    return UpdateConfig(
        objective="reinforce",
        iterations=1,
        micro_batch=job.optim.micro_batch,
        grad_accum=job.optim.grad_accum,
        length_buckets=job.optim.length_buckets,
        max_tokens=job.rollout.max_tokens,
    )


def report(cfg: object, run_dir: Path) -> dict[str, Any]:
    return {}
