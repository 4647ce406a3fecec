"""Trainer settings, read from `CRUCIBLE_TRAINER_*` (and `REDIS_URL`) environment variables."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

from crucible_shared.paths import PathRoots
from crucible_shared.settings import split_csv
from pydantic import AliasChoices, Field, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="CRUCIBLE_TRAINER_", extra="ignore")

    generator_urls: Annotated[list[str], NoDecode] = Field(
        default_factory=lambda: ["http://127.0.0.1:8001"], description="Generator replicas (comma-separated)."
    )
    sandbox_url: str = "http://127.0.0.1:8002"
    sandbox_api_key: str | None = None
    adapter_dir: Path = Field(Path("runs/adapters"), description="Adapter store shared with the generators.")
    runs_dir: Path = Field(Path("runs/jobs"), description="Per-job run dirs: metrics, reports, checkpoints.")
    redis_url: str | None = Field(
        None, validation_alias=AliasChoices("CRUCIBLE_TRAINER_REDIS_URL", "REDIS_URL")
    )
    heartbeat_s: float = Field(5.0, gt=0, description="How often a running job reports that it is alive.")
    redis_outage_wait_s: float = Field(
        600.0,
        ge=0,
        description="How long a job that ends while Redis is unreachable waits for it, to record its end "
        "(its events are kept meanwhile).",
    )
    max_ranks: int | None = Field(
        None,
        ge=1,
        le=64,
        description="Ranks this worker may launch for one job (distributed.train_gpus); default: its "
        "GPU count, 1 without GPUs.",
    )
    standby_ranks: bool | None = Field(
        None,
        description="Keep a torchrun group of all the ranks this worker can launch (max_ranks) started, "
        "waiting for the next job of that many ranks with its cold start (imports, CUDA contexts) taken; "
        "each waiting rank holds a CUDA context (about 0.5 GB) on its card. Default: on where that is 2+ "
        "ranks, with CUDA and 8+ cores (runtime.warm).",
    )
    cancel_poll_s: float = Field(1.0, gt=0, description="How often a running job checks its cancel flag.")
    snapshot_dir: Path | None = Field(
        None,
        description="Where a run snapshots a local model.base / model.init_adapter it loads (files "
        "hard-linked on the same file system, else copied); default: the temp dir. Outside the roots.",
    )

    def path_roots(self) -> PathRoots:
        """Where jobs may read files (`CRUCIBLE_*_ROOTS`, plus the adapter store and run dirs)."""
        return PathRoots().with_adapter_dirs(self.adapter_dir, self.runs_dir)

    @field_validator("generator_urls", mode="before")
    @classmethod
    def _split(cls, value: object) -> object:
        return split_csv(value)
