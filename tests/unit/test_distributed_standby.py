"""Standby ranks (`distributed.standby`): a waiting rank takes the job's settings in place of its own
and keeps torchrun's; the launcher runs a job on the waiting group of its size, leaves one of
another size waiting and replaces one that exited. Here the ranks are a stand-in process that
answers the job file at once (the real ones: tests/integration/test_distributed_job.py)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from crucible_shared.jobs import TrainJob
from crucible_trainer.distributed import launch, standby
from crucible_trainer.runtime.channel import LocalChannel
from crucible_trainer.settings import Settings

# torchrun's stand-in: one process that prints, waits for the job file and writes rank 0's outcome.
FAKE_RANKS = r"""
import json, os, pathlib, sys, time
if "--standby" in sys.argv:  # waiting: for the job file, then its settings
    folder = pathlib.Path(sys.argv[sys.argv.index("--standby") + 1])
    owner = int(sys.argv[sys.argv.index("--owner") + 1])
    print("cold start done", flush=True)
    while not (folder / "job.json").exists():
        os.kill(owner, 0)  # raises once the test process is gone
        time.sleep(0.02)
    job = json.loads((folder / "job.json").read_text())
    job_id, env = job["job_id"], job["env"]
    if os.environ.get("FAKE_RANKS_FAIL_AFTER_TAKING"):  # a rank that read the job, then died
        ranks = pathlib.Path(env["CRUCIBLE_TRAINER_RUNS_DIR"]) / job_id / "ranks"
        (ranks / "rank-0.pid").write_text(str(os.getpid()))
        sys.exit(3)
else:  # started for its job: the settings in the environment
    job_id, env = sys.argv[sys.argv.index("--job-id") + 1], os.environ
ranks = pathlib.Path(env["CRUCIBLE_TRAINER_RUNS_DIR"]) / job_id / "ranks"
summary = {"pid": os.getpid(), "ranks": int(sys.argv[1]), "lease": env["CRUCIBLE_JOB_LEASE"],
           "waited": "--standby" in sys.argv}
(ranks / "result.json").write_text(json.dumps({"status": "finished", "summary": summary}))
"""


def test_a_waiting_rank_takes_the_jobs_settings_and_keeps_torchruns() -> None:
    env = {
        "RANK": "1",
        "LOCAL_RANK": "1",
        "MASTER_ADDR": "127.0.0.1",
        "CUDA_VISIBLE_DEVICES": "2,3",
        "CRUCIBLE_TRAINER_RUNS_DIR": "/stale/runs",
        "CRUCIBLE_TRAINER_MAX_RANKS": "8",  # the worker's when the ranks started, not the job's
        "CRUCIBLE_JOB_LEASE": "3",
        "REDIS_URL": "redis://stale:6379/0",
    }
    job = {"CRUCIBLE_TRAINER_RUNS_DIR": "/runs", "CRUCIBLE_JOB_LEASE": "7"}
    standby.use_job_env(env, job)
    assert env == {
        "RANK": "1",
        "LOCAL_RANK": "1",
        "MASTER_ADDR": "127.0.0.1",
        "CUDA_VISIBLE_DEVICES": "2,3",
        "CRUCIBLE_TRAINER_RUNS_DIR": "/runs",
        "CRUCIBLE_JOB_LEASE": "7",
    }


def test_a_rank_waits_for_the_job_file_then_runs_with_its_environment(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(standby, "cold_start", lambda: None)
    monkeypatch.setattr(
        os, "environ", {**os.environ, "CRUCIBLE_TRAINER_SANDBOX_API_KEY": "stale", "RANK": "0"}
    )

    def hand_over() -> None:
        time.sleep(0.3)
        job = {"job_id": "j", "spec": "/runs/j/ranks/spec.json", "env": {"CRUCIBLE_JOB_LEASE": "5"}}
        (tmp_path / ".job.json").write_text(json.dumps(job))
        os.replace(tmp_path / ".job.json", tmp_path / "job.json")

    threading.Thread(target=hand_over).start()
    job_id, spec, ready_s = standby.await_job(tmp_path, os.getpid())
    assert (job_id, spec) == ("j", Path("/runs/j/ranks/spec.json"))
    assert (tmp_path / "ready-0").exists() and 0.2 < ready_s < 5
    assert os.environ["CRUCIBLE_JOB_LEASE"] == "5" and "CRUCIBLE_TRAINER_SANDBOX_API_KEY" not in os.environ
    assert os.environ["RANK"] == "0"


def test_a_waiting_rank_whose_worker_is_gone_exits(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(standby, "cold_start", lambda: None)
    gone = subprocess.Popen([sys.executable, "-c", ""])
    gone.wait()
    with pytest.raises(SystemExit) as stopped:
        standby.await_job(tmp_path, gone.pid)
    assert stopped.value.code == 0


@pytest.fixture
def fake_ranks(tmp_path, monkeypatch):
    monkeypatch.delenv("REDIS_URL", raising=False)
    monkeypatch.setattr(
        standby, "torchrun_command", lambda n, *args: [sys.executable, "-c", FAKE_RANKS, str(n), *args]
    )
    monkeypatch.setattr(launch, "POLL_S", 0.05)
    yield Settings(runs_dir=tmp_path / "runs", max_ranks=4)
    launch.release_standby()


def run(settings: Settings, job_id: str, ranks: int = 2) -> dict:
    spec = TrainJob(distributed={"train_gpus": ranks})
    channel = LocalChannel(job_id)
    channel.token = 9
    return asyncio.run(launch.run_distributed_job(spec, job_id, settings, channel))


def test_a_job_runs_on_the_waiting_ranks_of_its_size(fake_ranks) -> None:
    waiting = launch.keep_standby(2)
    assert launch.keep_standby(2) is waiting  # one group kept, not one per call
    assert stat.S_IMODE(waiting.dir.stat().st_mode) == 0o700  # the job file will hold the sandbox key
    summary = run(fake_ranks, "j1")
    assert summary == {"pid": waiting.proc.pid, "ranks": 2, "lease": "9", "waited": True}
    assert launch.take_standby(2) is None  # the job took it
    assert not waiting.dir.exists()  # the job file (the sandbox key) is gone with it
    log = (fake_ranks.runs_dir / "j1" / "ranks" / "torchrun.log").read_text()
    assert log.startswith("cold start done")  # its lines from before the job, kept


def test_waiting_ranks_of_another_size_are_left_waiting(fake_ranks) -> None:
    four = launch.keep_standby(4)
    summary = run(fake_ranks, "j2", ranks=2)
    assert summary["ranks"] == 2 and summary["pid"] != four.proc.pid
    assert four.alive() and launch.keep_standby(4) is four  # still the one kept


def test_ranks_that_exited_are_dropped_and_the_job_starts_its_own(fake_ranks) -> None:
    dead = launch.keep_standby(2)
    os.killpg(dead.proc.pid, signal.SIGKILL)
    dead.proc.wait()
    summary = run(fake_ranks, "j3")
    assert summary["ranks"] == 2 and summary["pid"] != dead.proc.pid
    assert summary["waited"] is False and summary["lease"] == "9"  # started for the job, as before
    assert launch.take_standby(2) is None and not dead.dir.exists()


def test_ranks_that_die_once_taken_leave_the_job_to_ranks_started_for_it(fake_ranks, monkeypatch) -> None:
    kept = launch.keep_standby(2)
    take = launch.take_standby

    def take_then_die(ranks: int):  # the race: alive when taken, killed before reading the job
        group = take(ranks)
        os.killpg(group.proc.pid, signal.SIGKILL)
        group.proc.wait()
        return group

    monkeypatch.setattr(launch, "take_standby", take_then_die)
    summary = run(fake_ranks, "j4")
    assert summary["ranks"] == 2 and summary["pid"] != kept.proc.pid
    assert summary["waited"] is False and summary["lease"] == "9"  # ranks started for the job
    log = (fake_ranks.runs_dir / "j4" / "ranks" / "torchrun.log").read_text()
    assert "standby ranks exited (code -9) before taking the job: starting ranks for it" in log
    assert not kept.dir.exists()


def test_ranks_that_die_after_taking_the_job_fail_it(fake_ranks, monkeypatch) -> None:
    monkeypatch.setenv("FAKE_RANKS_FAIL_AFTER_TAKING", "1")  # in the kept group's environment only
    kept = launch.keep_standby(2)
    monkeypatch.delenv("FAKE_RANKS_FAIL_AFTER_TAKING")
    with pytest.raises(launch.RankFailed, match="exited with 3"):
        run(fake_ranks, "j5")  # part of the job may have run: a retry resumes it, not a silent rerun
    log = (fake_ranks.runs_dir / "j5" / "ranks" / "torchrun.log").read_text()
    assert "starting ranks for it" not in log and not kept.alive()


def test_standby_ranks_are_kept_only_where_several_can_be_launched(monkeypatch) -> None:
    assert launch.standby_size(Settings(max_ranks=2, standby_ranks=True)) == 2
    assert launch.standby_size(Settings(max_ranks=1, standby_ranks=True)) == 0
    assert launch.standby_size(Settings(max_ranks=4, standby_ranks=False)) == 0
    import torch
    from crucible_trainer.runtime import warm

    monkeypatch.setattr(warm, "MIN_CORES", 1)  # the cores are there: CUDA decides
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert launch.standby_size(Settings(max_ranks=4)) == 4
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert launch.standby_size(Settings(max_ranks=4)) == 0  # by default, only with CUDA
