"""A TCP proxy a test can cut and heal: one process's connections to a server (a worker's to
Redis) go through it, so a test partitions that process alone while everything else still reaches
the server.

`cut()` closes every connection through the proxy and refuses new ones (each is accepted and
closed at once), as a network partition looks to a client with a socket timeout; `heal()` lets
connections through again.
"""

from __future__ import annotations

import socket
import threading
from typing import Any

from tests.servers import free_port

__all__ = ["TcpProxy"]


class TcpProxy:
    def __init__(self, target_host: str, target_port: int) -> None:
        self.target = (target_host, target_port)
        self.port = free_port()
        self.cut_now = threading.Event()
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._listener = socket.create_server(("127.0.0.1", self.port))
        self._closed = False
        threading.Thread(target=self._accept, name="proxy-accept", daemon=True).start()

    def url(self, db: int = 0) -> str:
        return f"redis://127.0.0.1:{self.port}/{db}"

    def cut(self) -> None:
        self.cut_now.set()
        with self._lock:
            conns, self._conns = self._conns, set()
        for conn in conns:
            _close(conn)

    def heal(self) -> None:
        self.cut_now.clear()

    def close(self) -> None:
        self._closed = True
        self.cut()
        _close(self._listener)

    def __enter__(self) -> TcpProxy:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            if self.cut_now.is_set():
                _close(client)
                continue
            try:
                upstream = socket.create_connection(self.target, timeout=5)
            except OSError:
                _close(client)
                continue
            upstream.settimeout(None)
            with self._lock:
                self._conns |= {client, upstream}
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while not self.cut_now.is_set():
                data = src.recv(65536)
                if not data or self.cut_now.is_set():
                    break
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with self._lock:
                    self._conns.discard(s)
                _close(s)


def _close(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    sock.close()
