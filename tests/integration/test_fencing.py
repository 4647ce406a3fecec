"""One live run per job: a real Redis, a real gateway and real trainer workers training the tiny
model, with the run that first held the job taken out of play in the two ways a lease is lost:

* **paused**: its worker is frozen (SIGSTOP) past the heartbeat timeout, the reaper re-queues the
  job, a second worker resumes it from the checkpoint, and the first is thawed (SIGCONT) while the
  second still trains;
* **partitioned**: its worker's Redis connection goes through a proxy (`tests/proxy.py`) the test
  cuts at step 2 while the gateway still reaches Redis, and heals once the second worker runs.

Either way the job finishes once, every step's `metrics` event is in the stream once and in
order, `metrics.jsonl` has one row per step, the adapters the generator served at the end and
every version after the lease ended come from the live run (their names carry its token, `-r2`),
and nothing the first run wrote (adapter versions, rollouts files, checkpoints) is newer than the
moment its lease ended. The cut-off run stops writing before the reaper re-queues its job: its
lease lapses at half the reaper's heartbeat timeout.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import httpx
import pytest
from crucible_shared import keys
from crucible_shared.gateway_client import GatewayClient
from crucible_shared.lifecycle import JobStatus
from redis import Redis

from tests.integration.stack_fixtures import clean_slate, trainer_env
from tests.proxy import TcpProxy
from tests.servers import RedisServer, Service, spawn

pytestmark = pytest.mark.slow

HEARTBEAT_TIMEOUT_S = 6.0  # the reaper's; the trainer's lease lapses at half of it
STEPS = 4
SPEC = {
    "kind": "train",
    "name": "fencing",
    "method": {"name": "grpo", "group_size": 2},
    "data": {"dataset": "mbpp", "ids": [601, 602]},
    "rollout": {"max_tokens": 24},
    "reward": {"kind": "graded"},
    "optim": {"lr": 5e-4, "steps": STEPS, "problems_per_step": 1, "micro_batch": 8},
    "eval": None,
    "checkpoint": {"every": 1},
    "publish": {"stale_check": False},
    "logging": {"wandb_mode": "disabled"},
    "max_attempts": 2,
}


class Stack:
    def __init__(self, redis: RedisServer, gateway: Service, env: dict[str, str], logs: Path) -> None:
        self.redis, self.gateway, self.env, self.logs = redis, gateway, env, logs
        self.client = GatewayClient(gateway.url)
        self.procs: list[subprocess.Popen] = []

    def worker(self, name: str, redis_url: str | None = None) -> subprocess.Popen:
        env = {**os.environ, **self.env, **({"REDIS_URL": redis_url} if redis_url else {})}
        log = (self.logs / f"{name}.log").open("wb")
        cmd = [sys.executable, "-m", "crucible_trainer.worker", "--queues", "train", "--name", name]
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
        self.procs.append(proc)
        return proc

    def log(self, name: str) -> str:
        return (self.logs / f"{name}.log").read_text(errors="replace")


@pytest.fixture
def stack(tmp_path, stack_generator, sandbox, stack_dirs) -> Iterator[Stack]:
    """A Redis and a gateway of the test's own (its short heartbeat timeout is what the workers'
    leases are cut to), the session's generator and sandbox."""
    with ExitStack() as exits:
        redis = exits.enter_context(RedisServer(tmp_path / "redis"))
        clean_slate(redis.url, stack_generator)
        gateway_env = {
            "REDIS_URL": redis.url,
            "CRUCIBLE_GATEWAY_RUNS_DIR": str(stack_dirs["runs"]),
            "CRUCIBLE_GATEWAY_ADAPTER_DIR": str(stack_dirs["adapters"]),
            "CRUCIBLE_GATEWAY_HEARTBEAT_TIMEOUT_S": str(HEARTBEAT_TIMEOUT_S),
            "CRUCIBLE_GATEWAY_REAP_INTERVAL_S": "0.5",
        }
        gateway = exits.enter_context(spawn("crucible_gateway", gateway_env, "CRUCIBLE_GATEWAY_PORT"))
        env = {
            **trainer_env(redis.url, stack_generator, sandbox, stack_dirs),
            "CRUCIBLE_TRAINER_HEARTBEAT_S": "0.5",
        }
        logs = tmp_path / "logs"
        logs.mkdir()
        s = Stack(redis, gateway, env, logs)
        try:
            yield s
        finally:
            for proc in s.procs:
                if proc.poll() is None:
                    proc.send_signal(signal.SIGCONT)
                    proc.kill()
                    proc.wait()


def wait_for(predicate: Any, timeout: float, what: str, interval: float = 0.2) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(interval)


def step_rows(run_dir: Path) -> list[int]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line)["step"] for line in path.read_text().splitlines() if line.strip()]


def stream(redis_url: str, job_id: str) -> list[dict[str, Any]]:
    return [json.loads(f[b"data"]) for _, f in Redis.from_url(redis_url).xrange(keys.events(job_id))]


def resumed_by_second_run(stack: Stack, job_id: str) -> bool:
    record = stack.client.job(job_id)
    kinds = [e["type"] for e in stream(stack.redis.url, job_id)]
    return record.attempts == 2 and record.status == JobStatus.running and "resumed" in kinds


def assert_one_live_run(
    stack: Stack, dirs: dict[str, Path], generator: Service, job_id: str, lease_end: float
) -> None:
    """The job's story and files are the live run's; the first run wrote nothing after `lease_end`."""
    record = stack.client.job(job_id)
    assert (record.status, record.attempts, record.step) == (JobStatus.finished, 2, STEPS), record.error
    events = stream(stack.redis.url, job_id)
    assert [e["step"] for e in events if e["type"] == "metrics"] == list(range(1, STEPS + 1))
    assert [e.get("status") for e in events if e["type"] == "status"].count("finished") == 1
    run_dir = dirs["runs"] / job_id
    assert step_rows(run_dir) == list(range(1, STEPS + 1))
    # Adapter versions: the first run's (no tag) all saved before its lease ended; the rest, and
    # the version the job ends on, the live run's.
    versions = [p for p in (dirs["adapters"] / job_id).iterdir() if not p.name.startswith(".")]
    for path in versions:
        if path.name.endswith("-r2"):
            continue
        assert "-r" not in path.name, path.name
        assert path.stat().st_mtime < lease_end, f"{path.name} saved after the first run's lease ended"
    assert record.policy_version == f"{job_id}-v{STEPS}-r2"
    # Rollouts: one file per step; those of the first run written before its lease ended.
    rollouts = sorted((run_dir / "rollouts").glob("step-*.jsonl"))
    assert [int(p.stem.split("-")[1]) for p in rollouts] == list(range(1, STEPS + 1))
    for path in rollouts:
        runs = {json.loads(line)["run"] for line in path.read_text().splitlines()}
        assert len(runs) == 1 and runs <= {1, 2}, runs
        if runs == {1}:
            assert path.stat().st_mtime < lease_end, f"{path.name} written after the first run's lease ended"
    # Checkpoints: only the live run's remain (the first run's were removed when it resumed).
    assert all(p.name.endswith("-r2") for p in (run_dir / "checkpoints").glob("step-*"))
    # The generator serves nothing of the job now: both runs retired their versions.
    served = {m["id"] for m in httpx.get(f"{generator.url}/v1/models", timeout=30).json()["data"]}
    assert not {name for name in served if name.startswith(job_id)}, served


def test_fencing_a_paused_worker_writes_nothing_once_superseded(stack, stack_dirs, stack_generator) -> None:
    first = stack.worker("paused")
    job_id = stack.client.submit(SPEC).id
    run_dir = stack_dirs["runs"] / job_id
    wait_for(lambda: len(step_rows(run_dir)) >= 2, 600, "step 2")
    os.kill(first.pid, signal.SIGSTOP)  # in step 3 (its rollouts or its update)
    stack.worker("live")
    wait_for(lambda: resumed_by_second_run(stack, job_id), 300, "the second run to resume the job")
    lease_end = stack.client.job(job_id).queued_at
    assert lease_end is not None
    os.kill(first.pid, signal.SIGCONT)  # thawed while the live run trains
    wait_for(lambda: stack.client.job(job_id).status == JobStatus.finished, 600, "the job to finish")
    wait_for(lambda: "no longer" in stack.log("paused"), 60, "the paused run to find out")
    # Its job function returned (RQ's line): anything the run still wrote is there now.
    wait_for(lambda: "Job OK" in stack.log("paused"), 60, "the paused run to end")
    assert_one_live_run(stack, stack_dirs, stack_generator, job_id, lease_end)
    assert first.poll() is None, "the paused worker died instead of going back to its queue"


def test_partition_a_worker_cut_off_from_redis_stops_before_the_reaper(
    stack, stack_dirs, stack_generator
) -> None:
    port = urlparse(stack.redis.url).port
    assert port is not None
    with TcpProxy("127.0.0.1", port) as proxy:
        first = stack.worker("partitioned", redis_url=proxy.url())
        job_id = stack.client.submit(SPEC).id
        run_dir = stack_dirs["runs"] / job_id
        wait_for(lambda: len(step_rows(run_dir)) >= 2, 600, "step 2")
        proxy.cut()
        cut_at = time.time()
        stack.worker("live")
        wait_for(lambda: resumed_by_second_run(stack, job_id), 300, "the second run to resume the job")
        requeued_at = stack.client.job(job_id).queued_at
        assert requeued_at is not None and requeued_at - cut_at >= HEARTBEAT_TIMEOUT_S - 1
        # By design and in fact: the cut-off run's lease lapsed, and it stopped writing, before
        # the reaper re-queued its job.
        lapsed = [line for line in stack.log("partitioned").splitlines() if "lease lapsed" in line]
        assert lapsed, stack.log("partitioned")[-3000:]
        lapsed_at = time.mktime(time.strptime(lapsed[0][:19], "%Y-%m-%d %H:%M:%S"))
        assert lapsed_at <= requeued_at
        lease_end = cut_at + HEARTBEAT_TIMEOUT_S / 2 + 0.5  # its last accepted write was before the cut
        proxy.heal()
        wait_for(lambda: stack.client.job(job_id).status == JobStatus.finished, 600, "the job to finish")
        wait_for(lambda: "no longer" in stack.log("partitioned"), 60, "the cut-off run to find out")
        wait_for(lambda: "Job OK" in stack.log("partitioned"), 60, "the cut-off run to end")
        assert_one_live_run(stack, stack_dirs, stack_generator, job_id, min(lease_end, requeued_at))
        assert first.poll() is None


def test_fencing_steps_run_again_after_a_resume_are_sent_once(stack, stack_dirs) -> None:
    """`checkpoint.every: 2`: the first worker is killed after step 3 (its checkpoint is step 2's);
    the second resumes from step 2 and runs step 3 again. The stream and `metrics.jsonl` still
    have every step once, in order."""
    first = stack.worker("killed")
    job_id = stack.client.submit({**SPEC, "checkpoint": {"every": 2}}).id
    run_dir = stack_dirs["runs"] / job_id

    def step_events() -> list[int]:
        return [e["step"] for e in stream(stack.redis.url, job_id) if e["type"] == "metrics"]

    wait_for(lambda: 3 in step_events(), 600, "step 3's event")
    first.kill()
    first.wait()
    stack.worker("live")
    wait_for(
        lambda: stack.client.job(job_id).status in {JobStatus.finished, JobStatus.failed}, 600, "the end"
    )
    record = stack.client.job(job_id)
    assert (record.status, record.attempts) == (JobStatus.finished, 2), record.error
    resumed = [e["step"] for e in stream(stack.redis.url, job_id) if e["type"] == "resumed"]
    assert resumed == [2], resumed  # step 3 ran twice
    assert step_events() == list(range(1, STEPS + 1))
    assert step_rows(run_dir) == list(range(1, STEPS + 1))
