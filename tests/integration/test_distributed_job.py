"""A GRPO job over two ranks (`gloo`, CPU) through the worker's launcher, against the spawned
generator and sandbox: it finishes and publishes, also on standby ranks started before it (and a
job after those were killed starts its own); a rank killed mid-job fails it with the rank named
(no hang), and running it again resumes from its checkpoint."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest

from tests.integration.test_trainer import NO_STALE_CHECK, SHORT_STEPS, settings_for, tiny_job

pytestmark = pytest.mark.slow


def run(spec, job_id: str, settings) -> dict:
    from crucible_trainer.runtime.channel import LocalChannel
    from crucible_trainer.runtime.entry import execute

    return execute(spec, job_id, settings, LocalChannel(job_id))


def two_ranks(stack_generator, sandbox, stack_dirs):
    return settings_for(stack_generator, sandbox, stack_dirs).model_copy(update={"max_ranks": 2})


def test_two_rank_job_finishes_and_publishes(stack_generator, sandbox, stack_dirs) -> None:
    settings = two_ranks(stack_generator, sandbox, stack_dirs)
    # Completions of 32 tokens (tiny_job's 64 took half the test): eight samples a step still
    # split four to a rank, and the update of every step runs over both.
    spec = tiny_job(rollout={"max_tokens": 32}, distributed={"train_gpus": 2})
    summary = run(spec, "dist-ok", settings)
    assert summary["status"] == "finished" and "ranks_ready_s" not in summary  # ranks started for it
    assert (Path(summary["adapter"]) / "adapter_model.safetensors").exists()
    rows = [
        json.loads(line) for line in (Path(summary["run_dir"]) / "metrics.jsonl").read_text().splitlines()
    ]
    assert [r["update/ranks"] for r in rows if "update/ranks" in r] == [2.0, 2.0]


def test_a_job_on_standby_ranks_finishes_and_publishes(stack_generator, sandbox, stack_dirs) -> None:
    from crucible_trainer.distributed import launch

    settings = two_ranks(stack_generator, sandbox, stack_dirs)
    # What is checked is where the ranks come from, not the update: one short step.
    spec = tiny_job(**SHORT_STEPS, optim={"steps": 1}, distributed={"train_gpus": 2}, publish=NO_STALE_CHECK)
    try:
        waiting = launch.keep_standby(2)  # started before the job, with this process's environment
        deadline = time.monotonic() + 300
        while not waiting.ready():
            assert waiting.alive() and time.monotonic() < deadline
            time.sleep(0.2)
        summary = run(spec, "dist-standby", settings)
        assert summary["status"] == "finished" and summary["ranks_ready_s"] > 0
        assert (Path(summary["adapter"]) / "adapter_model.safetensors").exists()
        assert (Path(settings.adapter_dir) / "dist-standby" / "v1").is_dir()  # published
        # A job on ranks started for it (`test_two_rank_job_finishes_and_publishes`) and one after
        # its standby died (tests/unit/test_distributed_standby.py) are checked elsewhere.
    finally:
        launch.release_standby()


def test_a_worker_keeps_standby_ranks_and_stops_them_when_it_exits(redis_url, tmp_path) -> None:
    import subprocess
    import sys

    env = {**os.environ, "REDIS_URL": redis_url, "TMPDIR": str(tmp_path)}  # the ranks' folder: here
    env |= {"CRUCIBLE_TRAINER_MAX_RANKS": "2", "CRUCIBLE_TRAINER_STANDBY_RANKS": "true"}
    worker = subprocess.Popen(
        [sys.executable, "-m", "crucible_trainer.worker", "--queues", "nothing"], env=env
    )
    try:
        deadline = time.monotonic() + 300
        while len(list(tmp_path.glob("crucible-ranks-*/ready-*"))) < 2:
            assert worker.poll() is None and time.monotonic() < deadline
            time.sleep(0.2)
        worker.send_signal(signal.SIGTERM)
        assert worker.wait(60) == 0
        assert not list(tmp_path.glob("crucible-ranks-*"))  # stopped with the worker
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait()


def test_more_ranks_than_the_worker_has_fail_at_start(stack_generator, sandbox, stack_dirs) -> None:
    settings = two_ranks(stack_generator, sandbox, stack_dirs)
    with pytest.raises(ValueError, match=r"distributed\.train_gpus: the job asks for 4 ranks"):
        run(tiny_job(distributed={"train_gpus": 4}), "dist-four", settings)


@pytest.mark.timeout(1800)  # two jobs of two ranks each, on a CPU
def test_a_killed_rank_fails_the_job_and_a_retry_resumes(stack_generator, sandbox, stack_dirs) -> None:
    from crucible_trainer.distributed.launch import RankFailed

    settings = two_ranks(stack_generator, sandbox, stack_dirs)
    spec = tiny_job(
        # What is checked is the failure and the resume, not the update: groups of two samples of
        # 24 tokens (two to a rank), a few seconds a step.
        method={"name": "grpo", "group_size": 2},
        optim={"steps": 2},
        rollout={"max_tokens": 24},
        distributed={"train_gpus": 2, "timeout_s": 60},
        publish=NO_STALE_CHECK,  # rank 0's probe is the first test's
    )
    run_dir = Path(settings.runs_dir) / "dist-kill"

    def kill_rank_one_after_a_checkpoint() -> None:
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            if list((run_dir / "checkpoints").glob("step-*")):
                os.kill(int((run_dir / "ranks" / "rank-1.pid").read_text()), signal.SIGKILL)
                return
            time.sleep(0.2)

    killer = threading.Thread(target=kill_rank_one_after_a_checkpoint, daemon=True)
    killer.start()
    started = time.monotonic()
    with pytest.raises(RankFailed, match=r"rank 1 of 2 failed: .*(Signal 9|SIGKILL|-9)"):
        run(spec, "dist-kill", settings)
    assert time.monotonic() - started < 600
    killer.join(timeout=1)

    summary = run(spec, "dist-kill", settings)
    assert summary["status"] == "finished" and summary["steps"] == 2
    events = [
        json.loads(line)
        for line in (run_dir / "ranks" / "torchrun.log").read_text().splitlines()
        if line.startswith("{")
    ]
    assert any(e["type"] == "resumed" for e in events)
