"""Length-prefixed JSON frames over a file descriptor (zygote <-> server, run <-> zygote)."""

from __future__ import annotations

import json
import os
import struct
from typing import Any

_HEADER = struct.Struct(">I")
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
