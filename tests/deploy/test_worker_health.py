"""The trainer image's health check against a real Redis: healthy only while this host's worker is registered."""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.deploy import docker
from tests.deploy.stack import ROOT
from tests.servers import free_port

pytestmark = pytest.mark.skipif(shutil.which("redis-server") is None, reason="needs redis-server")


def health_script() -> str:
    """The script the trainer image installs as its health check (as its Dockerfile copies it)."""
    instructions = docker.parse((ROOT / "services/trainer/Dockerfile").read_text())
    (copy,) = [i for i in instructions if i.keyword == "COPY" and "crucible-worker-health" in i.args]
    (source,) = docker.copy_sources(copy)
    return (ROOT / source).read_text()


@pytest.fixture
def redis_url(tmp_path: Path):
    port = free_port()
    proc = subprocess.Popen(
        ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--dir", str(tmp_path)],
        stdout=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def run_check(script: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=30, check=False
    )


def test_health_follows_worker_registration(tmp_path: Path, redis_url: str) -> None:
    from redis import Redis
    from rq import Queue, SimpleWorker
    from rq.serializers import JSONSerializer

    script = tmp_path / "crucible-worker-health"
    script.write_text(health_script())
    env = {"PATH": "/usr/bin:/bin", "REDIS_URL": redis_url}

    unregistered = run_check(script, env)
    assert unregistered.returncode == 1
    assert "no RQ worker registered" in unregistered.stderr

    redis = Redis.from_url(redis_url)
    queue = Queue("train", connection=redis, serializer=JSONSerializer)
    worker = SimpleWorker([queue], connection=redis, serializer=JSONSerializer)
    worker.register_birth()
    try:
        assert run_check(script, env).returncode == 0
    finally:
        worker.register_death()
    assert run_check(script, env).returncode == 1


def test_health_fails_without_redis(tmp_path: Path) -> None:
    script = tmp_path / "crucible-worker-health"
    script.write_text(health_script())
    closed = run_check(script, {"PATH": "/usr/bin:/bin", "REDIS_URL": f"redis://127.0.0.1:{free_port()}/0"})
    assert closed.returncode != 0
    unset = run_check(script, {"PATH": "/usr/bin:/bin"})
    assert unset.returncode == 1
    assert "REDIS_URL is not set" in unset.stderr
