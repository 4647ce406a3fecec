"""The policy update of the methods with a clipped ratio (GRPO, SRRL, SPIRAL), written once: their
configs share `ClippedMethod`'s fields, so one function builds the update of each."""

from __future__ import annotations

from crucible_shared.jobs import ClippedMethod, TrainJob

from crucible_trainer.rl.update import UpdateConfig


def update_config(cfg: ClippedMethod, job: TrainJob) -> UpdateConfig:
    return UpdateConfig(
        objective="clip",
        iterations=cfg.num_iterations,
        clip_eps=cfg.clip_eps,
        clip_eps_high=cfg.clip_high,
        kl_beta=cfg.kl_beta,
        aggregation=cfg.loss,
        micro_batch=job.optim.micro_batch,
        grad_accum=job.optim.grad_accum,
        length_buckets=job.optim.length_buckets,
        max_tokens=job.rollout.max_tokens,
    )
