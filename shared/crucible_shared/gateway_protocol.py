"""Gateway protocol (v1): what the job API answers. The job specs live in `crucible_shared.jobs`,
the job record and its statuses in `crucible_shared.lifecycle` (the trainer writes the same)."""

from __future__ import annotations

from pydantic import BaseModel, Field

from crucible_shared.lifecycle import JobRecord, JobStatus


class JobCreated(BaseModel):
    id: str
    status: JobStatus
    location: str = Field(description="URL of the job's record.")
    events: str = Field(description="URL of the job's event stream (SSE).")


class JobList(BaseModel):
    jobs: list[JobRecord]
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
