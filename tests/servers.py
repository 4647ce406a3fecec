"""Spawn Crucible services as real subprocesses on free ports for tests (`crucible_cli.spawn`), or
serve the generator's real app from a thread of the test process (`generator_in_thread`: the same
routes, settings and engine over real HTTP, without a second Python starting up, where a test
serves many models one after the other)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx
from crucible_cli.spawn import Service, free_port, spawn

__all__ = ["Service", "free_port", "generator_in_thread", "spawn"]


@contextmanager
def generator_in_thread(timeout: float = 300, **settings: Any) -> Iterator[str]:
    """The generator app with `settings` (its `Settings` fields) on a free port; yields its URL once
    `/health` answers, and stops the server and its engine on exit."""
    import uvicorn
    from crucible_generator.api import create_app
    from crucible_generator.settings import Settings

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
