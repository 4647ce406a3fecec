"""One train job over several processes: the spec's `distributed` section and what a worker
reports it can launch.

`train_gpus` ranks update the policy data-parallel (`torch.distributed`, launched by `torchrun`
from the worker that took the job): DDP replicates the LoRA policy on every rank (the default);
FSDP2 (`fully_shard`) shards the base model's weights, the adapter and its optimizer state over
them, for a policy that does not fit one card. Rollouts are generated once per step, by rank 0,
which also owns the job's channel, checkpoints and adapter publishing; each rank updates on its
share of the batch (docs/jobs.md, "Several GPUs").

A worker records how many ranks it may launch (`keys.worker_ranks()`, one field per worker); the
gateway refuses a spec that asks for more than the largest live worker has, and a worker that
takes a job it cannot run fails it at its start with the same message.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic_core import PydanticCustomError

MAX_RANKS = 64


class DistributedSpec(BaseModel):
    """How many processes train one job, and how they share the policy."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    train_gpus: int = Field(
        1, ge=1, le=MAX_RANKS, description="Ranks that update the policy (one GPU each; 1: one process)."
    )
    strategy: Literal["ddp", "fsdp"] = Field(
        "ddp",
        description="ddp: every rank holds the whole policy (LoRA); fsdp: FSDP2 shards weights and "
        "optimizer state over the ranks (models that do not fit one card).",
    )
    timeout_s: float = Field(
        600.0,
        ge=10,
        le=86_400,
        description="Longest wait of one collective (all-reduce, all-gather) before the job fails: "
        "a rank that hangs fails the job after this long.",
    )

    @model_validator(mode="after")
    def _check(self) -> DistributedSpec:
        if self.strategy == "fsdp" and self.train_gpus < 2:
            raise PydanticCustomError(
                "value_error",
                "{field}: {reason}",
                {"field": "strategy", "reason": "fsdp shards over ranks: set train_gpus to 2 or more"},
            )
        return self


def too_many_ranks(asked: int, available: int) -> str:
    """The message of a job that asks for more ranks than a worker can launch."""
    return (
        f"distributed.train_gpus: the job asks for {asked} ranks and the largest trainer worker can "
        f"launch {available}; lower train_gpus or start a worker with more GPUs "
        "(CRUCIBLE_TRAINER_MAX_RANKS, docs/deploy.md)"
    )
