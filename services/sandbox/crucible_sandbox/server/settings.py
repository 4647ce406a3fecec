"""Sandbox settings, read from `CRUCIBLE_SANDBOX_*` environment variables."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Literal

from crucible_shared.settings import split_csv
from crucible_shared.tenants import TenantTable
from pydantic import AliasChoices, Field, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="CRUCIBLE_SANDBOX_", extra="ignore")

    host: str = "127.0.0.1"
    port: int = Field(8002, ge=0, le=65535)
    workers: int = Field(
        default_factory=lambda: 2 * (os.cpu_count() or 1),
        ge=1,
        le=512,
        description="Worker slots (a worker and its zygote each); two per core keeps every core busy.",
    )
    queue_size: int = Field(16384, ge=1, description="Runs waiting or running before new work gets a 429.")
    batch_concurrency: int = Field(
        0,
        ge=0,
        description="Slots batches run on (0 = all but one, so single runs never queue behind a batch).",
    )
    # Both default to "no lower priority": per-test limits are wall-clock, so on a host shared with
    # CPU-heavy work (a CPU generator decoding while an evaluation executes) deprioritised batch runs
    # would time out and get wrong verdicts. On a host of its own the sandbox can set
    # `idle` / 10 to give single runs the CPU first.
    batch_nice: int = Field(
        0,
        ge=0,
        le=19,
        description="CPU niceness of the batch slots' processes (> 0: single runs get the CPU first).",
    )
    batch_policy: Literal["idle", "batch", "other"] = Field(
        "other",
        description="Linux scheduling policy of the batch slots' processes: `other` (normal), `batch` "
        "(SCHED_BATCH: they never preempt on wake-up) or `idle` (SCHED_IDLE: they only take CPU time "
        "no normal process wants; only for a host of its own, else batch runs may time out).",
    )
    cache_entries: int = Field(20_000, ge=0, description="Result cache size (0 disables it).")
    api_keys: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="Accepted bearer keys, comma-separated in the env; empty = auth off.",
    )
    languages: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="Languages runs may use, comma-separated in the env (empty: every one whose toolchain is "
        "installed); Python is always on.",
    )
    tenants_file: Path | None = Field(
        None, description="Tenants JSON (keys, names, quotas; see docs/deploy.md)."
    )
    tenants: str = Field("", description="The same tenants JSON, inline.")
    per_key_concurrency: int = Field(
        0,
        ge=0,
        description="Runs one tenant may have holding a worker (its `concurrent_runs` quota by default); "
        "0 = all workers but one, so another tenant's run always finds a worker free.",
    )
    tenant_queued_runs: int = Field(
        4096,
        ge=1,
        description="Runs one tenant may have admitted and not finished (`queued_runs` by default).",
    )
    tenant_worker_seconds_per_minute: float = Field(
        0.0,
        ge=0,
        # ..._CPU_SECONDS_PER_MINUTE: the name it had, still accepted.
        validation_alias=AliasChoices(
            "tenant_worker_seconds_per_minute",
            "CRUCIBLE_SANDBOX_TENANT_WORKER_SECONDS_PER_MINUTE",
            "CRUCIBLE_SANDBOX_TENANT_CPU_SECONDS_PER_MINUTE",
        ),
        description="Worker-seconds (time holding a worker, which bounds CPU time) one tenant's runs may "
        "take over a sliding minute (`worker_seconds_per_minute` by default); 0 = no limit.",
    )

    # Request size limits.
    max_code_bytes: int = Field(256 << 10, ge=1)
    max_tests_bytes: int = Field(16 << 20, ge=1)
    max_batch_runs: int = Field(4096, ge=1)
    max_body_bytes: int = Field(64 << 20, ge=1)

    # Defaults applied when a request leaves a limit unset, and the maxima that cap any request.
    default_wall_time_s: float = 10.0
    default_test_time_s: float = 5.0
    default_memory_mb: int = 512
    default_output_bytes: int = 64 << 10
    max_wall_time_s: float = 60.0
    max_memory_mb: int = 4096
    max_output_bytes: int = 8 << 20
    default_compile_time_s: float = Field(10.0, gt=0, description="Compile step of compiled languages.")
    max_compile_time_s: float = Field(60.0, gt=0)
    default_compile_memory_mb: int = Field(1024, ge=16, description="Compile step, all its processes.")
    max_compile_memory_mb: int = Field(4096, ge=16)
    max_report_bytes: int = Field(
        32 << 20, ge=1 << 20, description="Cap on what a run's processes write to the harness channel."
    )
    file_bytes: int = Field(16 << 20, description="Largest file a run may write.")
    open_files: int = 64
    processes: int = Field(
        32, description="Processes per run (RLIMIT_NPROC, applied only where runs have a uid of their own)."
    )

    # Isolation (see the `crucible_sandbox.isolation` package).
    isolate: bool = Field(True, description="Use namespaces, uid switch and cgroups where the host allows.")
    unsafe_no_isolation: bool = Field(
        False, description="Allow `isolate=false` while running as root (programs then run as uid 0)."
    )
    mount_namespace: bool = Field(
        True,
        description="Give each slot a root of its own in a mount namespace (root only); false, or a host "
        "that refuses mounts, uses the Landlock fallback.",
    )
    memory_cgroup: bool = Field(
        True,
        description="Hold each run's memory in a cgroup where one can be made; false, or none delegated, "
        "samples the run's processes instead.",
    )
    uid_base: int = Field(61000, ge=1000, description="Run uid of slot i is uid_base + i (root only).")
    tmpfs_mb: int = Field(64, ge=1, description="Size of each run's private /tmp.")
    work_root: str = "/tmp/crucible-sandbox"

    @field_validator("api_keys", "languages", mode="before")
    @classmethod
    def _split_keys(cls, value: object) -> object:
        return split_csv(value)

    def tenant_table(self) -> TenantTable:
        """Keys -> tenants: `api_keys` (each its own tenant) plus `tenants_file` / `tenants`."""
        return TenantTable.load(self.api_keys, self.tenants_file, self.tenants, env="CRUCIBLE_SANDBOX")

    @model_validator(mode="after")
    def _check(self) -> Settings:
        self.tenant_table()  # a malformed tenants document or a weak key stops the start
        if self.default_wall_time_s > self.max_wall_time_s:
            raise ValueError("default_wall_time_s exceeds max_wall_time_s")
        return self
