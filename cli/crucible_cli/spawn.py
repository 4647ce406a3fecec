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
    """A port no one listens on right now. Another process may take it before ours binds it:
    `start` checks that the process it spawned is the one listening."""
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


def _listening_inodes(port: int) -> set[str]:
    """Socket inodes listening on TCP `port` (Linux's /proc/net/tcp and tcp6; state 0A)."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            rows = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()
            if len(fields) > 9 and fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(fields[9])
    return inodes


def _family(pid: int) -> list[int]:
    """`pid` and its descendants (a server may listen from a child process)."""
    found, todo = [], [pid]
    while todo:
        found.append(todo.pop())
        for children in Path(f"/proc/{found[-1]}/task").glob("*/children"):
            try:
                todo += [int(child) for child in children.read_text().split()]
            except OSError:
                continue
    return found


def listens_on(pid: int, port: int) -> bool | None:
    """Whether process `pid` (or a descendant) holds a socket listening on `port`; None where the
    system cannot tell (no /proc: macOS), so callers trust the health check alone there."""
    if not Path("/proc/net/tcp").exists() or not Path(f"/proc/{pid}/fd").is_dir():
        return None
    wanted = {f"socket:[{inode}]" for inode in _listening_inodes(port)}
    for member in _family(pid):
        for fd in Path(f"/proc/{member}/fd").glob("*"):
            try:
                if os.readlink(fd) in wanted:
                    return True
            except OSError:
                continue
    return False


@dataclass
class Service:
    url: str
    proc: subprocess.Popen
    log: Path | None = None

    @property
    def port(self) -> int:
        return int(self.url.rsplit(":", 1)[1])

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
    """Run `python -m module` with `env` added on a free port (in `port_var`) and wait for it.

    A port picked here can be taken by another process between the pick and our server's bind (two
    benchmarks starting at once): the other server then answers our health check while ours fails
    to bind. So once healthy, the spawned process must be the one listening; if not, it is stopped
    and started again on another port (a port the caller named is not retried)."""
    for _ in range(3):
        service = _start_once(
            module, env, port_var, port or free_port(), ready_path, timeout, log, new_session
        )
        if listens_on(service.proc.pid, service.port) is not False:
            return service
        service.stop()
        if port is not None:
            break
    raise RuntimeError(f"the {module} answered on {service.url}, but another process holds that port")


def _start_once(
    module: str,
    env: dict[str, str],
    port_var: str,
    port: int,
    ready_path: str,
    timeout: float,
    log: Path | None,
    new_session: bool,
) -> Service:
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
