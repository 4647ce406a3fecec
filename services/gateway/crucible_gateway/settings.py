"""Gateway settings, read from `CRUCIBLE_GATEWAY_*` (and `REDIS_URL`) environment variables."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

from crucible_shared.jobs import MAX_STEPS
from crucible_shared.lifecycle import JobKind
from crucible_shared.paths import PathRoots
from crucible_shared.settings import split_csv
from crucible_shared.tenants import TenantTable
from pydantic import AliasChoices, Field, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="CRUCIBLE_GATEWAY_", extra="ignore")

    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    redis_url: str = Field(
        "redis://127.0.0.1:6379/0", validation_alias=AliasChoices("CRUCIBLE_GATEWAY_REDIS_URL", "REDIS_URL")
    )
    api_keys: Annotated[list[str], NoDecode] = Field(
        default_factory=list, description="Accepted bearer keys; empty = auth off."
    )
    tenants_file: Path | None = Field(
        None, description="Tenants JSON (keys, names, quotas; see docs/deploy.md)."
    )
    tenants: str = Field("", description="The same tenants JSON, inline.")
    tenant_active_jobs: int = Field(
        100,
        ge=0,
        description="Queued + running jobs one tenant may have (its `active_jobs` quota by default).",
    )
    tenant_spec_bytes: int = Field(
        256 * 1024,
        ge=1,
        description="Largest job spec (JSON) one tenant may submit (`spec_bytes` by default).",
    )
    tenant_event_streams: int = Field(
        32, ge=0, description="Event streams one tenant may hold open (`event_streams` by default)."
    )
    runs_dir: Path = Field(
        Path("runs/jobs"), description="The trainer's run dirs (artifacts are served from here)."
    )
    adapter_dir: Path = Field(Path("runs/adapters"), description="The adapter store.")
    train_job_timeout_s: int = Field(7 * 24 * 3600, ge=60, description="RQ job_timeout of train jobs.")
    eval_job_timeout_s: int = Field(24 * 3600, ge=60, description="RQ job_timeout of eval jobs.")

    def job_timeout_s(self, kind: JobKind) -> int:
        """The RQ job_timeout of a job of `kind` (pipelines train: they get the train jobs')."""
        return self.eval_job_timeout_s if kind is JobKind.eval else self.train_job_timeout_s

    heartbeat_timeout_s: float = Field(
        60.0, gt=0, description="A running job silent this long has lost its worker (see max_attempts)."
    )
    reap_interval_s: float = Field(5.0, gt=0, description="How often silent jobs are looked for.")
    queue_settle_s: float = Field(
        10.0,
        gt=0,
        description="How long a queued job whose RQ job is gone (a stopping worker handed it back) waits "
        "before the reaper enqueues it again: a submission or retry between its record and its enqueue "
        "is left be.",
    )
    max_attempts: int = Field(
        2,
        ge=1,
        le=10,
        description="Runs of a job when its worker is lost (resumed from the last checkpoint), unless "
        "its spec says otherwise; 1 turns automatic retries off.",
    )
    stream_poll_s: float = Field(
        0.25, gt=0, le=10, description="How often an idle event stream looks for news."
    )
    redis_connections: int = Field(64, ge=4, description="Size of the Redis connection pool.")
    max_body_bytes: int = Field(
        1024 * 1024, ge=1024, description="Largest request body accepted (job specs are small)."
    )
    max_steps: int = Field(
        10_000,
        ge=1,
        le=MAX_STEPS,
        description="Most training steps a job may ask for (`optim.steps`; `method.max_steps` of SFT / "
        "DPO; `train.max_steps` of a pipeline): a job asking for more is refused at submission, so "
        "a typo cannot hold a worker for weeks.",
    )
    max_work_tokens: int = Field(
        2_000_000_000,
        ge=1,
        description="Most tokens a job may generate or train on, counted from its spec (samples x "
        "tokens; a pipeline's evaluations, sampling and training rounds: `crucible_gateway.work`): a "
        "job asking for more is refused at submission.",
    )
    production: bool = Field(False, description="Refuse to start without API keys.")

    def path_roots(self) -> PathRoots:
        """Where submitted jobs may read files (`CRUCIBLE_*_ROOTS`, plus the adapter store and runs)."""
        return PathRoots().with_adapter_dirs(self.adapter_dir, self.runs_dir)

    @field_validator("api_keys", mode="before")
    @classmethod
    def _split_keys(cls, value: object) -> object:
        return split_csv(value)

    def tenant_table(self) -> TenantTable:
        """Keys -> tenants: `api_keys` (each its own tenant) plus `tenants_file` / `tenants`."""
        return TenantTable.load(self.api_keys, self.tenants_file, self.tenants, env="CRUCIBLE_GATEWAY")

    @model_validator(mode="after")
    def _check(self) -> Settings:
        table = self.tenant_table()  # a malformed tenants document or a weak key stops the start
        if self.production and not table.auth:
            raise ValueError("production: set CRUCIBLE_GATEWAY_API_KEYS or CRUCIBLE_GATEWAY_TENANTS(_FILE)")
        return self
