"""Spawn Crucible services as real subprocesses on free ports for tests."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Service:
    url: str
    proc: subprocess.Popen

    def alive(self) -> bool:
        return self.proc.poll() is None


@contextmanager
def spawn(
    module: str, env: dict[str, str], port_var: str, ready_path: str = "/health", timeout: float = 120
) -> Iterator[Service]:
    """Run `python -m module` with `env` added and wait until `ready_path` answers 200."""
    port = free_port()
    full_env = {**os.environ, **env, port_var: str(port)}
    proc = subprocess.Popen([sys.executable, "-m", module], env=full_env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"{module} exited with {proc.returncode} before becoming ready")
            try:
                if httpx.get(url + ready_path, timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"{module} not ready after {timeout}s")
            time.sleep(0.1)
        yield Service(url, proc)
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
