"""The lines of a server-sent event stream, split where the event-stream format splits them.

A stream's line ends are CR LF, LF or CR, and nothing else. httpx's `iter_lines` splits as
`str.splitlines` does, also at U+2028, U+2029, U+0085 and a few control characters, and JSON
encoders (pydantic's, so vLLM's and the generator's) leave those unescaped inside strings: a
completion holding one of them arrived as two lines, neither of them JSON, and the job reading the
stream failed (`JSONDecodeError: Unterminated string`). `Lines` splits the raw bytes at the
format's line ends only, and decodes each line whole (a UTF-8 character cut between two chunks is
joined first).

>>> lines = Lines()
>>> lines.feed('data: {"text": "a\\u2028b"}\\r'.encode()), lines.feed(b"\\n\\ndata: [DO")
(['data: {"text": "a\\u2028b"}'], [''])
>>> lines.feed(b"NE]\\n"), lines.flush()
(['data: [DONE]'], [])
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterable, AsyncIterator, Iterable, Iterator

_LINE_END = re.compile(rb"\r\n|\r|\n")


class Lines:
    """An incremental splitter: `feed` each chunk of bytes, then `flush` at the end of the stream."""

    def __init__(self) -> None:
        self._rest = b""
        self._after_cr = False  # the last chunk ended in CR: a LF opening the next one ends no line

    def feed(self, chunk: bytes) -> list[str]:
        """The lines this chunk completes, without their line ends."""
        if not chunk:  # nothing between a CR and the LF that pairs with it
            return []
        if self._after_cr and chunk.startswith(b"\n"):
            chunk = chunk[1:]
        self._after_cr = False
        if not chunk:
            return []
        self._after_cr = chunk.endswith(b"\r")
        *done, self._rest = _LINE_END.split(self._rest + chunk)
        return [line.decode("utf-8", errors="replace") for line in done]

    def flush(self) -> list[str]:
        """The last line, where the stream ended without a line end."""
        rest, self._rest = self._rest, b""
        return [rest.decode("utf-8", errors="replace")] if rest else []


def lines(chunks: Iterable[bytes]) -> Iterator[str]:
    """The lines of a stream of byte chunks (httpx's `iter_bytes()`)."""
    split = Lines()
    for chunk in chunks:
        yield from split.feed(chunk)
    yield from split.flush()


async def alines(chunks: AsyncIterable[bytes]) -> AsyncIterator[str]:
    """The lines of an asynchronous stream of byte chunks (httpx's `aiter_bytes()`)."""
    split = Lines()
    async for chunk in chunks:
        for line in split.feed(chunk):
            yield line
    for line in split.flush():
        yield line
