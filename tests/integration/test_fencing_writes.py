"""Fenced writes beside the online loop's, against a real Redis: two runs of one job, the first
superseded when the reaper re-queues the job and a second run starts it.

* evaluation reports (`eval/<label>/`, `before_after/`): written under a name of the run's own and
  put in place after the gate, so the superseded run's never replaces the live run's;
* TRL's output folders (SFT / DPO, pipelines): one per run, the checkpoint to resume from named by
  the job's record, a late checkpoint of the superseded run never resumed from;
* W&B: one W&B run per run of the job, grouped under the job id.
"""

from __future__ import annotations

import json
import sys
import time
import types
from pathlib import Path
from typing import Any

import pytest
from crucible_shared import keys
from crucible_shared.lifecycle import JobRecord, JobStatus, encode_fields, transition_command
from redis import Redis


def queued_job(redis: Redis, kind: str) -> str:
    job_id = f"{kind}-fencing-{time.time_ns()}"
    record = JobRecord(id=job_id, kind=kind, status=JobStatus.queued, created_at=time.time(), max_attempts=2)
    redis.hset(keys.job(job_id), mapping=encode_fields(record.model_dump(exclude={"id"})))  # type: ignore[arg-type]
    return job_id


def two_runs(redis_url: str, kind: str = "train") -> tuple[Any, Any]:
    """The job's first run, and the second that took it over (the first does not know yet)."""
    from crucible_trainer.runtime.channel import RedisChannel
    from crucible_trainer.runtime.entry import channel_redis

    redis = Redis.from_url(redis_url)
    job_id = queued_job(redis, kind)
    first = RedisChannel(channel_redis(redis_url), job_id, outage_wait_s=5)
    assert first.start() and first.tag == ""
    return first, job_id


def take_over(redis_url: str, job_id: str, first: Any) -> Any:
    """The reaper re-queues the job (the first run has been silent past its lease, which lapsed)
    and a second run starts it."""
    from crucible_trainer.runtime.channel import RedisChannel
    from crucible_trainer.runtime.entry import channel_redis

    first.lease_s = 0.05
    time.sleep(0.1)

    redis = Redis.from_url(redis_url)
    redis.eval(*transition_command(job_id, JobStatus.queued, allowed_from={JobStatus.running}, attempts=2))
    second = RedisChannel(channel_redis(redis_url), job_id, outage_wait_s=5)
    assert second.start() and second.tag == "-r2"
    return second


def write_report(text: str):
    def write(folder: Path) -> Path:
        folder.mkdir(parents=True)
        (folder / "report.json").write_text(text)
        return folder

    return write


def test_fencing_a_superseded_run_s_report_never_replaces_the_live_run_s(redis_url, tmp_path) -> None:
    from crucible_trainer.runtime.cancel import Superseded
    from crucible_trainer.runtime.sink import EventSink

    first, job_id = two_runs(redis_url)
    run_dir = tmp_path / job_id
    old = EventSink(first, run_dir)
    out = run_dir / "eval" / "step-2"
    old.folder(out, write_report("first, before it lost the job"))
    live = EventSink(take_over(redis_url, job_id, first), run_dir)
    live.folder(out, write_report("live"))
    with pytest.raises(Superseded):
        old.folder(out, write_report("first, superseded"))
    assert (out / "report.json").read_text() == "live"
    assert sorted(p.name for p in out.parent.iterdir()) == ["step-2"]  # nothing of its own left


def test_fencing_trl_folders_are_per_run_and_resumed_from_the_committed_checkpoint(
    redis_url, tmp_path
) -> None:
    from crucible_trainer.offline import attempts
    from crucible_trainer.runtime.cancel import Superseded

    def saved(folder: Path, step: int) -> Path:
        checkpoint = folder / f"checkpoint-{step}"
        checkpoint.mkdir(parents=True)
        (checkpoint / "trainer_state.json").write_text(json.dumps({"global_step": step}))
        return checkpoint

    first, job_id = two_runs(redis_url, "pipeline")
    run_dir = tmp_path / job_id
    base = run_dir / "round-1" / "trainer"
    own, resume = attempts.work_dir(run_dir, base, first)
    assert (own, resume) == (base, None)
    attempts.commit(run_dir, base, saved(own, 10), first)
    second = take_over(redis_url, job_id, first)
    late = saved(own, 20)  # the superseded run saves once more: never resumed from
    with pytest.raises(Superseded):
        attempts.commit(run_dir, base, late, first)
    own2, resume2 = attempts.work_dir(run_dir, base, second)
    assert (own2, resume2) == (run_dir / "round-1" / "trainer-r2", base / "checkpoint-10")
    # Another round's folder or a path out of the run dir is not resumed from.
    second.commit(checkpoint="round-2/trainer/checkpoint-10")
    assert attempts.work_dir(run_dir, base, second)[1] is None
    second.commit(checkpoint="../elsewhere/checkpoint-10")
    assert attempts.work_dir(run_dir, base, second)[1] is None
    # The live run's first commit: the superseded run's folder goes.
    attempts.commit(run_dir, base, saved(own2, 30), second)
    assert sorted(p.name for p in base.parent.iterdir()) == ["trainer-r2"]
    assert attempts.work_dir(run_dir, base, second)[1] == own2 / "checkpoint-30"


def test_fencing_trl_saves_and_the_final_adapter_pass_the_gate_first() -> None:
    from crucible_trainer.offline.trl_train import Hooks, JobCallback

    gates: list[str] = []
    callback = JobCallback(Hooks(gate=lambda: gates.append("gate")))
    control = types.SimpleNamespace(should_save=False, should_training_stop=False)
    callback.on_step_end(None, None, control)
    assert gates == []
    control.should_save = True  # TRL saves a checkpoint after this step
    callback.on_step_end(None, None, control)
    assert gates == ["gate"]


def test_fencing_each_run_of_a_job_logs_to_a_w_and_b_run_of_its_own(monkeypatch, tmp_path) -> None:
    from crucible_trainer.runtime.sink import start_wandb

    calls: list[dict[str, Any]] = []
    fake = types.ModuleType("wandb")
    fake.init = lambda **kwargs: calls.append(kwargs) or types.SimpleNamespace(id=kwargs["id"])  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "wandb", fake)
    first = start_wandb("train-x", "offline", "crucible", None, tmp_path, {})
    second = start_wandb("train-x", "offline", "crucible", None, tmp_path, {}, tag="-r2")
    assert (first.id, second.id) == ("train-x", "train-x-r2")
    assert {c["group"] for c in calls} == {"train-x"}
