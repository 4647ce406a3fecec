"""A job's events: what the trainer (and the gateway's reaper) write to its stream, what
`GET /v1/jobs/{id}/events` sends as Server-Sent Events, and what the CLI renders.

`JobEvent` is a union discriminated by `type`; every emitter builds its events through `record`,
which validates them, so an event the CLI does not understand cannot be written. An event carries
the time it was written. `eval_finished` and `stage` carry open-ended figures (pass@k for every
k, each stage's counts) besides their declared fields. The SSE stream ends with `StreamEnd`
(event `end`), which is the stream's, not the job's.
"""

from __future__ import annotations

import time
import typing
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter

from crucible_shared.lifecycle import JobSummary


class _Event(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    time: float | None = Field(None, description="Unix time the event was written.")


class StatusEvent(_Event):
    """The job's phase: starting (every job's first event), training (a pipeline round's SFT or
    DPO), or its end: finished (with the summary), cancelled, failed (with the error)."""

    type: Literal["status"] = "status"
    status: Literal["starting", "training", "finished", "cancelled", "failed"]
    error: str | None = None
    summary: JobSummary | None = Field(None, description="finished: the job's summary.")
    method: str | None = Field(None, description="The training method (SFT / DPO jobs, pipeline rounds).")
    rows: int | None = Field(None, description="Rows trained on (SFT / DPO).")
    stages: list[str] | None = Field(None, description="A pipeline's stages.")
    rounds: int | None = Field(None, description="A pipeline's rounds.")
    round: int | None = Field(None, description="The pipeline round that is training.")


class NoticeEvent(_Event):
    """Something a person should know that changes nothing (a comparison that cannot be made)."""

    type: Literal["notice"] = "notice"
    message: str


class SettingsEvent(_Event):
    """What the job chose for this machine (`auto` settings resolved)."""

    type: Literal["settings"] = "settings"
    device: str
    dtype: str
    attn_implementation: str
    micro_batch: int
    gradient_checkpointing: bool | Literal["auto"] = Field(
        description="auto: decided for each micro-batch from its shape and the memory free when it runs."
    )
    gpu_free_gb: float | None = None
    gpu_total_gb: float | None = None
    sequence_mb: int | None = Field(None, description="Estimated update memory of one sequence.")


class MetricsEvent(_Event):
    """One training step's figures (the progress bar's)."""

    type: Literal["metrics"] = "metrics"
    step: int
    metrics: dict[str, float | None]


class EvalStartedEvent(_Event):
    type: Literal["eval_started"] = "eval_started"
    label: str = Field(description="before, step-N, after, baseline, ...")
    model: str
    tasks: int
    data: str = Field(description="The task selection, described.")


class EvalFinishedEvent(_Event):
    """An evaluation's headline numbers; `pass@k` for each reported k ride along as extra fields."""

    model_config = ConfigDict(extra="allow", populate_by_name=True)

    type: Literal["eval_finished"] = "eval_finished"
    label: str
    report: str = Field(description="The report's folder.")
    dataset: str
    greedy_pass_at_1: float | None = Field(None, alias="greedy_pass@1")
    problems: int
    problems_passed: int | None = None
    mean_generated_tokens: float | None = None
    hard_coded_answers: int | None = Field(None, description="Greedy answers that ignore their input.")

    @property
    def pass_at_k(self) -> dict[str, float]:
        """The sampled pass@k figures: {"pass@1": 0.5, ...}."""
        extra = self.model_extra or {}
        return {k: v for k, v in extra.items() if k.startswith("pass@") and v is not None}


class AdapterPublishedEvent(_Event):
    """A new adapter version hot-swapped into the generator."""

    type: Literal["adapter_published"] = "adapter_published"
    step: int
    name: str
    load_s: float


class DifficultyFilterEvent(_Event):
    type: Literal["difficulty_filter"] = "difficulty_filter"
    kept: int
    of: int


class ResumedEvent(_Event):
    type: Literal["resumed"] = "resumed"
    step: int
    checkpoint: str


class CheckpointEvent(_Event):
    """SFT / DPO saved a checkpoint."""

    type: Literal["checkpoint"] = "checkpoint"
    step: int
    path: str


class StalePolicyEvent(_Event):
    """The generator's log-probs of a published version differ from the trainer's (the job fails)."""

    type: Literal["stale_policy"] = "stale_policy"
    version: int = Field(description="The adapter version (its training step).")
    name: str
    diff: float = Field(description="Mean |log-prob difference| per token on the probe.")
    tolerance: float


class SampleEvent(_Event):
    """One sampled completion of a step, shown to the person watching."""

    type: Literal["sample"] = "sample"
    step: int
    problem_id: str
    phase: str
    reward: float | None
    status: str | None
    message: str
    completion: str


class StageEvent(_Event):
    """A pipeline stage started, finished (with its counts as extra fields) or was skipped."""

    model_config = ConfigDict(extra="allow", populate_by_name=True)

    type: Literal["stage"] = "stage"
    stage: str
    status: Literal["started", "finished", "skipped"]
    seconds: float | None = None
    reason: str | None = None


class StageProgressEvent(_Event):
    type: Literal["stage_progress"] = "stage_progress"
    stage: str
    done: int
    total: int


class RequeuedEvent(_Event):
    """The job went back to the queue: its worker was lost (the gateway's reaper: a new attempt)
    or stopping (the worker itself: no attempt used)."""

    type: Literal["requeued"] = "requeued"
    reason: str
    attempt: int | None = Field(None, description="The attempt it runs as next; None: no attempt used.")


class RawEvent(_Event):
    """A stream entry that was not JSON (the gateway passes it on as text)."""

    type: Literal["raw"] = "raw"
    data: str


JobEvent = Annotated[
    StatusEvent
    | NoticeEvent
    | SettingsEvent
    | MetricsEvent
    | EvalStartedEvent
    | EvalFinishedEvent
    | AdapterPublishedEvent
    | DifficultyFilterEvent
    | ResumedEvent
    | CheckpointEvent
    | StalePolicyEvent
    | SampleEvent
    | StageEvent
    | StageProgressEvent
    | RequeuedEvent
    | RawEvent,
    Field(discriminator="type"),
]
EVENT = TypeAdapter[JobEvent](JobEvent)
EVENT_CLASSES: tuple[type[BaseModel], ...] = typing.get_args(typing.get_args(JobEvent)[0])
EVENT_TYPES: tuple[str, ...] = tuple(cls.model_fields["type"].default for cls in EVENT_CLASSES)


class StreamEnd(BaseModel):
    """The SSE stream's last message (event `end`): the job is over and every event went out."""

    status: str = Field(description="The job's final status, or `gone`.")


def record(kind: str, **data: Any) -> dict[str, Any]:
    """The stream entry of one event: validated against `JobEvent` (ValidationError for an unknown
    type or a wrong field), stamped with the time; JSON-ready as the emitter's json.dumps makes it."""
    event = EVENT.validate_python({"type": kind, "time": time.time(), **data})
    return event.model_dump(by_alias=True, exclude_unset=True)


def parse(kind: str, data: dict[str, Any]) -> JobEvent:
    """A received event (SSE `event` and `data`) as its typed model; ValidationError otherwise."""
    return EVENT.validate_python({**data, "type": kind})


def sse_openapi() -> dict[int | str, dict[str, Any]]:
    """The OpenAPI `responses` entry of the event stream: its events, by type, as schemas."""
    schema = EVENT.json_schema(ref_template="#/components/schemas/{model}")
    schema.pop("$defs")
    return {
        200: {
            "description": "Server-Sent Events: `event` is the type, `data` the JSON event, `id` its "
            "stream id (resume with Last-Event-ID); the last one is `end` (data: StreamEnd).",
            "content": {"text/event-stream": {"schema": schema}},
        }
    }


def sse_components() -> dict[str, Any]:
    """The schemas `sse_openapi` refers to (for the OpenAPI document's components)."""
    defs = dict(EVENT.json_schema(ref_template="#/components/schemas/{model}")["$defs"])
    defs["StreamEnd"] = StreamEnd.model_json_schema()
    return defs
