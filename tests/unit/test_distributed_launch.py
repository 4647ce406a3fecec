"""The worker's account of a failed multi-rank job names the rank that failed first and why,
from torchrun's summary (a rank killed by a signal writes nothing itself) and the ranks' own
error files; the ranks get the worker's settings through the environment only."""

from __future__ import annotations

from pathlib import Path

from crucible_trainer.distributed.launch import describe_failure, rank_env
from crucible_trainer.distributed.standby import torchrun_command
from crucible_trainer.settings import Settings

# torchrun 2.13's summary when rank 1 was SIGKILLed and torchrun stopped rank 0 (a real run's).
KILLED = """\
[W1127 11:55:09] rank: 1 local_rank: 1 starting
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
=======================================================
/tmp/killme.py FAILED
-------------------------------------------------------
Failures:
[1]:
  time      : 2026-11-27_11:55:10
  host      : localhost
  rank      : 0 (local_rank: 0)
  exitcode  : -15 (pid: 31177)  (SIGTERM)
  error_file: <N/A>
  traceback : Signal 15 (SIGTERM) received by PID 31177
-------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-11-27_11:55:10
  host      : localhost
  rank      : 1 (local_rank: 1)
  exitcode  : -9 (pid: 31178)  (SIGKILL)
  error_file: <N/A>
  traceback : Signal 9 (SIGKILL) received by PID 31178
=======================================================
"""

RAISED = """\
Root Cause (first observed failure):
[0]:
  time      : 2026-11-27_11:58:00
  host      : localhost
  rank      : 0 (local_rank: 0)
  exitcode  : 1 (pid: 4242)
  error_file: <N/A>
  traceback : To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html
=======================================================
"""


def test_a_killed_rank_is_named_even_when_its_peer_wrote_an_error(tmp_path: Path) -> None:
    (tmp_path / "torchrun.log").write_text(KILLED)
    (tmp_path / "rank-0.error").write_text("RuntimeError: Connection closed by peer\n\ntraceback")
    message = describe_failure(tmp_path, 2, 1)
    assert message.startswith("rank 1 of 2 failed: exit code -9; traceback : Signal 9 (SIGKILL)")
    assert str(tmp_path / "torchrun.log") in message


def test_a_rank_that_raised_is_named_with_its_error(tmp_path: Path) -> None:
    (tmp_path / "torchrun.log").write_text(RAISED)
    (tmp_path / "rank-0.error").write_text("StalePolicyError: the generator's log-probs differ\n\n...")
    assert describe_failure(tmp_path, 4, 1).startswith(
        "rank 0 of 4 failed: StalePolicyError: the generator's log-probs differ"
    )


def test_without_a_summary_the_exit_code_is_told(tmp_path: Path) -> None:
    assert describe_failure(tmp_path, 2, 137).startswith("a rank of 2 failed: torchrun exited with 137")


def test_ranks_get_the_settings_in_their_environment(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.delenv("REDIS_URL", raising=False)
    settings = Settings(
        generator_urls=["http://a:1", "http://b:2"], runs_dir=tmp_path, sandbox_api_key="k" * 20, max_ranks=2
    )
    monkeypatch.setenv("REDIS_URL", "redis://elsewhere:6379/0")  # the worker's env, not its settings
    env = rank_env(settings)
    assert env["CRUCIBLE_TRAINER_GENERATOR_URLS"] == "http://a:1,http://b:2"
    assert env["CRUCIBLE_TRAINER_RUNS_DIR"] == str(tmp_path)
    assert env["CRUCIBLE_TRAINER_SANDBOX_API_KEY"] == "k" * 20
    assert "REDIS_URL" not in env and "CRUCIBLE_TRAINER_REDIS_URL" not in env  # the worker had none
    assert env["NCCL_NVLS_ENABLE"] == "0"
    command = torchrun_command(2, "--standby", str(tmp_path))
    assert command[1:3] == ["-m", "torch.distributed.run"] and "--nproc-per-node=2" in command
    assert command[-3:] == ["crucible_trainer.distributed.rank", "--standby", str(tmp_path)]


def test_crucible_up_shows_each_service_only_its_gpus() -> None:
    from crucible_cli.stack import Stack, gpu_env

    assert gpu_env("1,2,3") == {"CUDA_VISIBLE_DEVICES": "1,2,3"} and gpu_env(None) == {}
    stack = Stack(generator_gpus="0", trainer_gpus="1,2,3")
    assert (stack.generator_gpus, stack.trainer_gpus) == ("0", "1,2,3")


def test_a_train_job_of_several_ranks_is_launched_by_the_worker() -> None:
    from crucible_shared.jobs import TrainJob
    from crucible_trainer.runtime.runners import runner_for

    assert runner_for(TrainJob(distributed={"train_gpus": 2})).__name__ == "DistributedLaunch"
    assert runner_for(TrainJob()).__name__ == "TrainRun"


def test_rank_zeros_event_lines_reach_the_jobs_channel(tmp_path: Path) -> None:
    """Without Redis (`crucible train --local`) rank 0 prints its events; the worker shows them
    as the job's and keeps every line in torchrun.log."""
    import io

    from crucible_trainer.distributed.launch import relay
    from crucible_trainer.runtime.channel import LocalChannel

    received: list[tuple[str, dict]] = []
    channel = LocalChannel("job-1", lambda kind, data: received.append((kind, data)))
    lines = [
        b"Loading weights: 100%\n",
        b'{"time": 1.0, "type": "resumed", "step": 3, "checkpoint": "/runs/job-1/checkpoints/step-000003"}\n',
        b'{"type": "resumed", "bad": true}\n',  # refused by the event union: logged, not fatal
        b"{not json\n",
        # a progress bar on stderr (the policy loading beside the pre-filter) left mid-line
        b'\rLoading weights:  51%|##   | 174/339\r{"type": "difficulty_filter", "kept": 171, "of": 374}\n',
    ]

    log = io.BytesIO()
    relay(lines, log, channel)
    assert log.getvalue() == b"".join(lines)
    assert [(kind, data.get("step")) for kind, data in received] == [
        ("resumed", 3),
        ("difficulty_filter", None),
    ]
    assert received[1][1]["kept"] == 171
