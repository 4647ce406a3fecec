"""Length-prefixed frames over file descriptors, and the spec a worker sends to a run's process.

JSON frames flow between the server and its workers, from a run's processes to their worker, and
between a run's judge and its program. They are written with `ensure_ascii`, so any string,
lone surrogates included, can be framed. Frames from a program's process are untrusted: they are
parsed with `split_frames`, which keeps what parsed before anything malformed.

A spec travels from a worker to a run's process over a Unix stream socket: the run itself
(marshalled: it carries compiled code, and only the run's process, which trusts its worker, loads
it) and, attached to its first bytes, any file descriptors the run needs (the judge's link to its
program).
"""

from __future__ import annotations

import json
import marshal
import os
import socket
import struct
from typing import TYPE_CHECKING, Any, cast

if TYPE_CHECKING:  # not at run time: a run's processes load no more than they use
    from crucible_sandbox.wire.messages import JudgeSpec, ProgramSpec

_HEADER = struct.Struct(">I")
_SPEC = struct.Struct(">II")
MAX_FRAME = 256 << 20


def encode_frame(message: Any) -> bytes:
    body = json.dumps(message, separators=(",", ":")).encode()
    return _HEADER.pack(len(body)) + body


def write_frame(fd: int, message: Any) -> None:
    data = memoryview(encode_frame(message))
    while data:
        written = os.write(fd, data)
        data = data[written:]


def _read_exact(fd: int, n: int) -> bytes | None:
    chunks, got = [], 0
    while got < n:
        chunk = os.read(fd, min(n - got, 1 << 20))
        if not chunk:
            return None
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def read_frame(fd: int, limit: int = MAX_FRAME) -> Any:
    """Block until one frame arrives; None at end of stream. ValueError past `limit` bytes."""
    header = _read_exact(fd, _HEADER.size)
    if header is None:
        return None
    (size,) = _HEADER.unpack(header)
    if size > limit:
        raise ValueError(f"frame of {size} bytes exceeds the limit of {limit}")
    body = _read_exact(fd, size)
    if body is None:
        return None
    return json.loads(body)


def split_frames(buffer: bytearray, limit: int = 1 << 20) -> tuple[list[Any], bool]:
    """Pop every complete frame from `buffer` (bytes read so far from an untrusted writer).

    Returns (frames, malformed): parsing stops at the first frame that is oversized or not JSON,
    keeping the frames before it, and after `limit` frames (more is malformed too: a run's
    processes write a known number of frames).
    """
    out: list[Any] = []
    while len(buffer) >= _HEADER.size:
        if len(out) >= limit:
            return out, True
        (size,) = _HEADER.unpack_from(buffer)
        if size > MAX_FRAME:
            return out, True
        if len(buffer) < _HEADER.size + size:
            break
        body = bytes(buffer[_HEADER.size : _HEADER.size + size])
        del buffer[: _HEADER.size + size]
        try:
            out.append(json.loads(body))
        except (ValueError, RecursionError):  # UnicodeDecodeError is a ValueError
            return out, True
    return out, False


def send_spec(fd: int, run: ProgramSpec | JudgeSpec, program: bytes = b"", fds: tuple[int, ...] = ()) -> None:
    """Send a run's spec (and `fds`, attached to its first bytes) on a Unix stream socket."""
    head = marshal.dumps(cast("dict[str, Any]", run))
    data = memoryview(_SPEC.pack(len(head), len(program)) + head + program)
    sock = socket.socket(fileno=fd)
    try:
        sent = socket.send_fds(sock, [data[: 1 << 16]], list(fds)) if fds else 0
        sock.sendall(data[sent:])
    finally:
        sock.detach()


def read_spec(fd: int) -> tuple[dict[str, Any], Any, list[int]] | None:
    """Read what `send_spec` sent: (run, compiled tests or None, fds); None at end of stream."""
    sock = socket.socket(fileno=fd)
    try:
        data, fds, _, _ = socket.recv_fds(sock, 1 << 16, 4)
        if len(data) < _SPEC.size:
            rest = _read_exact(fd, _SPEC.size - len(data)) if data else None
            if rest is None:
                return None
            data += rest
        head_size, program_size = _SPEC.unpack_from(data)
        missing = _SPEC.size + head_size + program_size - len(data)
        if missing > 0:
            rest = _read_exact(fd, missing)
            if rest is None:
                return None
            data += rest
    finally:
        sock.detach()
    view = memoryview(data)[_SPEC.size :]
    program = marshal.loads(view[head_size:]) if program_size else None
    return marshal.loads(view[:head_size]), program, fds
