"""Start a Crucible service as a process and wait until it answers `/health`: the one helper the
local stack, the tests and the benchmarks all use."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def port_free(port: int) -> bool:
    """Whether a server can listen on `port`. Checked as servers bind (uvicorn and Redis set
    SO_REUSEADDR), so connections of a stopped server still in TIME_WAIT do not count."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


@dataclass
class Service:
    url: str
    proc: subprocess.Popen
    log: Path | None = None

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, grace_s: float = 10) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
        try:
            self.proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def wait_healthy(
    proc: subprocess.Popen,
    url: str,
    timeout: float,
    *,
    name: str = "service",
    path: str = "/health",
    log: Path | None = None,
) -> None:
    """Poll `url + path` until it answers 200; raise if the process exits or time runs out."""
    where = f"; see {log}" if log else ""
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise RuntimeError(
                f"the {name} exited with status {proc.returncode} before becoming ready{where}"
            )
        try:
            if httpx.get(url + path, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"the {name} did not answer {path} within {timeout:.0f} s{where}")
        time.sleep(0.1)


def start(
    module: str,
    env: dict[str, str],
    port_var: str,
    *,
    port: int | None = None,
    ready_path: str = "/health",
    timeout: float = 120,
    log: Path | None = None,
    new_session: bool = False,
) -> Service:
    """Run `python -m module` with `env` added on a free port (in `port_var`) and wait for it."""
    port = port or free_port()
    out = log.open("ab") if log else None
    proc = subprocess.Popen(
        [sys.executable, "-m", module],
        env={**os.environ, **env, port_var: str(port)},
        stdout=out,
        stderr=subprocess.STDOUT if out else None,
        start_new_session=new_session,
    )
    service = Service(f"http://127.0.0.1:{port}", proc, log)
    try:
        wait_healthy(proc, service.url, timeout, name=module, path=ready_path, log=log)
    except BaseException:
        service.stop()
        raise
    return service


@contextmanager
def spawn(
    module: str,
    env: dict[str, str],
    port_var: str,
    ready_path: str = "/health",
    timeout: float = 120,
    log: Path | None = None,
) -> Iterator[Service]:
    """`start` as a context manager: the service is stopped on exit."""
    service = start(module, env, port_var, ready_path=ready_path, timeout=timeout, log=log)
    try:
        yield service
    finally:
        service.stop()
