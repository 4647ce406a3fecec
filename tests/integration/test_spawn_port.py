"""`spawn.start` keeps the service it spawned, not whichever server answers on its port: two starts
that pick the same free port (benchmarks starting together) once shared one generator."""

from __future__ import annotations

import http.server
import os
import subprocess
import threading
from collections.abc import Iterator

import pytest
from crucible_cli import spawn

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/net/tcp"), reason="needs Linux's /proc")


class _Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self.send_response(200)
        self.end_headers()
        self.wfile.write(b"squatter")

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def squatter() -> Iterator[int]:
    """Another process's server (here: a thread of this one) answering /health on a port."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Health)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server.server_address[1]
    server.shutdown()
    server.server_close()


def test_listens_on_tells_owner_from_others(squatter: int) -> None:
    assert spawn.listens_on(os.getpid(), squatter) is True
    other = subprocess.Popen(["sleep", "30"])
    try:
        assert spawn.listens_on(other.pid, squatter) is False
    finally:
        other.kill()
        other.wait()


def test_start_moves_off_a_port_another_server_took(squatter: int, monkeypatch: pytest.MonkeyPatch) -> None:
    picks = iter([squatter])
    real = spawn.free_port
    monkeypatch.setattr(spawn, "free_port", lambda: next(picks, None) or real())
    service = spawn.start("tests.health_server", {}, "HEALTH_SERVER_PORT", timeout=20)
    try:
        assert service.port != squatter
        assert spawn.listens_on(service.proc.pid, service.port)
    finally:
        service.stop()


def test_start_refuses_a_named_port_another_server_holds(squatter: int) -> None:
    with pytest.raises(RuntimeError, match="another process holds that port"):
        spawn.start("tests.health_server", {}, "HEALTH_SERVER_PORT", port=squatter, timeout=20)
