"""Length-prefixed frames over a file descriptor.

JSON frames between the server and its workers and from a run's process to its worker; a
marshalled spec from a worker to a run's process (marshal carries compiled code, and only the
run's process, which trusts its worker, ever loads it).
"""

from __future__ import annotations

import json
import marshal
import os
import struct
from typing import Any

_HEADER = struct.Struct(">I")
_SPEC = struct.Struct(">II")
MAX_FRAME = 256 << 20


def encode_frame(message: Any) -> bytes:
    body = json.dumps(message, separators=(",", ":"), ensure_ascii=False).encode()
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


def read_frame(fd: int) -> Any:
    """Block until one frame arrives; None at end of stream."""
    header = _read_exact(fd, _HEADER.size)
    if header is None:
        return None
    (size,) = _HEADER.unpack(header)
    if size > MAX_FRAME:
        raise ValueError(f"frame of {size} bytes exceeds the limit")
    body = _read_exact(fd, size)
    if body is None:
        return None
    return json.loads(body)


def encode_spec(run: dict[str, Any], program: bytes = b"") -> bytes:
    """A run's spec: the run itself (code, limits, form) and its marshalled compiled tests."""
    head = marshal.dumps(run)
    return _SPEC.pack(len(head), len(program)) + head + program


def read_spec(fd: int) -> tuple[dict[str, Any], Any] | None:
    """Read what `encode_spec` wrote: (run, compiled tests or None); None at end of stream."""
    header = _read_exact(fd, _SPEC.size)
    if header is None:
        return None
    head_size, program_size = _SPEC.unpack(header)
    body = _read_exact(fd, head_size + program_size)
    if body is None:
        return None
    view = memoryview(body)
    program = marshal.loads(view[head_size:]) if program_size else None
    return marshal.loads(view[:head_size]), program


def split_frames(buffer: bytearray) -> list[Any]:
    """Pop every complete frame from `buffer` (bytes read so far from an untrusted writer).

    Malformed frames raise ValueError; the caller treats the writer as misbehaving.
    """
    out = []
    while len(buffer) >= _HEADER.size:
        (size,) = _HEADER.unpack_from(buffer)
        if size > MAX_FRAME:
            raise ValueError("oversized frame")
        if len(buffer) < _HEADER.size + size:
            break
        body = bytes(buffer[_HEADER.size : _HEADER.size + size])
        del buffer[: _HEADER.size + size]
        out.append(json.loads(body))
    return out
