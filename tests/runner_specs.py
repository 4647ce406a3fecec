"""Small specs of the runners that need no model of their own to start: an evaluation, an SFT job on
a one-row file and a baseline-only pipeline (shared by the runner and job-run tests)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from crucible_shared.jobs import EvalJob, JobSpec, PipelineJob, TrainJob

KINDS = ["eval", "sft", "pipeline"]


def small_job(kind: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> JobSpec:
    """The spec of `kind`; its SFT rows are written under `tmp_path`, made a data root."""
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps({"prompt": "p", "completion": "c"}) + "\n")
    monkeypatch.setenv("CRUCIBLE_DATA_ROOTS", str(tmp_path))
    logging = {"wandb_mode": "disabled"}
    if kind == "eval":
        return EvalJob()
    if kind == "sft":
        return TrainJob.model_validate({"method": {"name": "sft", "path": str(rows)}, "logging": logging})
    return PipelineJob.model_validate({"stages": ["baseline"], "logging": logging})
