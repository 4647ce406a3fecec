"""Spawn Crucible services as real subprocesses on free ports for tests (`crucible_cli.spawn`), or
serve the generator's real app from a thread of the test process (`generator_in_thread`: the same
routes, settings and engine over real HTTP, without a second Python starting up, where a test
serves many models one after the other), and a real Redis a test can stop and start again
(`RedisServer`)."""

from __future__ import annotations

import subprocess
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
from crucible_cli.spawn import Service, free_port, spawn

__all__ = ["RedisServer", "Service", "free_port", "generator_in_thread", "spawn"]


class RedisServer:
    """A real `redis-server` on a port of its own, with append-only persistence in `data`: `stop`
    (SIGTERM: it saves and exits) and `start` again on the same port bring back the same data,
    as a restart of the stack's Redis does."""

    def __init__(self, data: Path) -> None:
        self.data, self.port = data, free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: subprocess.Popen | None = None

    def args(self) -> list[str]:
        """The server's command line (for a test that starts it some other way, as the stack)."""
        from crucible_cli.stack import redis_server_binary

        self.data.mkdir(parents=True, exist_ok=True)
        return [redis_server_binary(), "--port", str(self.port), "--bind", "127.0.0.1",
                "--dir", str(self.data), "--appendonly", "yes", "--save", ""]  # fmt: skip

    def start(self) -> RedisServer:
        self.proc = subprocess.Popen(self.args(), stdout=subprocess.DEVNULL)
        self.wait(lambda: self.proc is not None and self.proc.poll() is None)
        return self

    def wait(self, alive: Any = lambda: True, timeout: float = 20) -> None:
        """Until the server answers."""
        from redis import Redis

        deadline = time.monotonic() + timeout
        while True:
            try:
                Redis.from_url(self.url, socket_connect_timeout=1).ping()
                return
            except Exception:
                if time.monotonic() > deadline or not alive():
                    raise RuntimeError(f"redis-server on port {self.port} did not start") from None
                time.sleep(0.05)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(20)
        self.proc = None

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


@contextmanager
def generator_in_thread(timeout: float = 300, **settings: Any) -> Iterator[str]:
    """The generator app with `settings` (its `Settings` fields) on a free port; yields its URL once
    `/health` answers, and stops the server and its engine on exit. Its `threads` setting is torch's
    for the whole process: the count this process had comes back on exit."""
    import torch
    import uvicorn
    from crucible_generator.api import create_app
    from crucible_generator.settings import Settings

    threads = torch.get_num_threads()
    port = free_port()
    config = Settings(host="127.0.0.1", port=port, log_level="warning", **settings)
    server = uvicorn.Server(
        uvicorn.Config(create_app(config), host="127.0.0.1", port=port, log_level="warning")
    )
    thread = threading.Thread(target=server.run, name=f"generator-{port}", daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    try:
        while True:
            if not thread.is_alive():
                raise RuntimeError(f"the generator serving {config.model} exited while starting")
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"the generator serving {config.model} did not start in {timeout:.0f} s")
            time.sleep(0.05)
        yield url
    finally:
        server.should_exit = True
        thread.join(timeout=60)
        torch.set_num_threads(threads)
