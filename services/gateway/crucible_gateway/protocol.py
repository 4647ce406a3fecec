"""Gateway protocol (v1): job views, listings, artifacts. The job specs themselves live in
`crucible_shared.jobs` (the trainer validates the same models)."""

from __future__ import annotations

from enum import StrEnum
from typing import Any

from pydantic import BaseModel, Field


class JobStatus(StrEnum):
    queued = "queued"
    running = "running"
    finished = "finished"
    failed = "failed"
    cancelled = "cancelled"


FINAL = {JobStatus.finished, JobStatus.failed, JobStatus.cancelled}


class JobCreated(BaseModel):
    id: str
    status: JobStatus
    location: str = Field(description="URL of the job's record.")
    events: str = Field(description="URL of the job's event stream (SSE).")


class JobView(BaseModel):
    id: str
    kind: str
    name: str | None = None
    status: JobStatus
    created_at: float
    started_at: float | None = None
    finished_at: float | None = None
    step: int | None = Field(None, description="Last finished training step.")
    total_steps: int | None = None
    policy_version: str | None = Field(None, description="Adapter version the generator serves for this job.")
    metrics: dict[str, Any] | None = Field(None, description="Latest step's metrics.")
    error: str | None = None
    summary: dict[str, Any] | None = None
    spec: dict[str, Any] | None = None
    attempts: int = 1


class JobList(BaseModel):
    jobs: list[JobView]
    total: int
    offset: int
    limit: int


class Artifact(BaseModel):
    path: str
    size: int
    url: str


class ArtifactList(BaseModel):
    job_id: str
    artifacts: list[Artifact]


class AdapterView(BaseModel):
    name: str = Field(description="The name the generator serves it under: <job>-v<step>.")
    job_id: str
    version: int
    path: str


class AdapterList(BaseModel):
    adapters: list[AdapterView]
