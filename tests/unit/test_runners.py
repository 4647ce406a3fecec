"""Job kinds are one enum, runners are found by spec type, and every runner runs through one
`JobRun`: it starts with `starting`, and a cancel ends it the same way whatever the job (a
`cancelled` event, spec.json and summary.json in its run dir, a typed summary)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any, get_args

import pytest
from crucible_gateway.settings import Settings as GatewaySettings
from crucible_shared.jobs import EvalJob, JobSpec, Method, PipelineJob, TrainJob
from crucible_shared.lifecycle import QUEUES, JobKind, JobSummary
from crucible_trainer.runtime.channel import LocalChannel
from crucible_trainer.runtime.jobrun import JobRun
from crucible_trainer.runtime.runners import RUNNERS, runner_for
from crucible_trainer.settings import Settings

from tests.runner_specs import KINDS, small_job


def test_job_kinds_are_one_enum() -> None:
    spec_kinds = {cls.model_fields["kind"].default for cls in get_args(get_args(JobSpec)[0])}
    assert spec_kinds == set(JobKind) == set(QUEUES)
    timeouts = GatewaySettings(redis_url="redis://127.0.0.1:1", eval_job_timeout_s=120)
    assert {k: timeouts.job_timeout_s(k) for k in JobKind} == {
        JobKind.train: timeouts.train_job_timeout_s,
        JobKind.eval: 120,
        JobKind.pipeline: timeouts.train_job_timeout_s,
    }


def test_every_spec_type_has_a_job_run() -> None:
    methods = get_args(get_args(Method)[0])
    assert set(RUNNERS) == {*methods, EvalJob, PipelineJob}  # SFT and DPO included
    for config in methods:
        extra = {"path": "rows.jsonl"} if config.offline else {}
        spec = TrainJob.model_validate({"method": {"name": config.model_fields["name"].default, **extra}})
        assert issubclass(runner_for(spec), JobRun)
    assert runner_for(EvalJob()).__name__ == "EvalRun" and runner_for(PipelineJob()).__name__ == "PipelineRun"
    assert runner_for(TrainJob()).__name__ == "TrainRun"
    with pytest.raises(ValueError, match="no runner"):
        runner_for(object())


def cancelled_run(spec: Any, tmp_path: Path) -> tuple[dict, list[dict]]:
    """Run `spec` with its cancel flag already up, against services that are not there."""
    received: list[dict] = []
    channel = LocalChannel("job-1", lambda kind, data: received.append(data))
    channel.cancel()
    settings = Settings(
        generator_urls=["http://127.0.0.1:9"],
        sandbox_url="http://127.0.0.1:9",
        runs_dir=tmp_path / "jobs",
        cancel_poll_s=0.05,
    )
    return asyncio.run(runner_for(spec)(spec, "job-1", settings, channel).run()), received


@pytest.mark.parametrize("kind", KINDS)
def test_every_runner_starts_and_is_cancelled_the_same_way(kind, tmp_path, monkeypatch) -> None:
    spec = small_job(kind, tmp_path, monkeypatch)
    summary, received = cancelled_run(spec, tmp_path)
    statuses = [e["status"] for e in received if e["type"] == "status"]
    assert statuses == ["starting", "cancelled"], received
    assert JobSummary.model_validate(summary).status == "cancelled"
    run_dir = tmp_path / "jobs" / "job-1"
    assert json.loads((run_dir / "summary.json").read_text()) == summary
    assert (run_dir / "spec.json").exists()


def test_records_written_before_the_typed_summary_still_read() -> None:
    from crucible_shared.lifecycle import JobRecord

    old = {"job_id": "j", "status": "cancelled", "eval": {"greedy_pass@1": 0.5}, "rounds": {"round-1": {}}}
    raw = {"kind": "eval", "status": "cancelled", "created_at": "1.0", "summary": json.dumps(old)}
    record = JobRecord.from_redis("j", raw)
    assert record.kind is JobKind.eval and record.summary is not None
    assert record.summary.eval == {"greedy_pass@1": 0.5} and record.summary.model_extra == {
        "rounds": {"round-1": {}}
    }
