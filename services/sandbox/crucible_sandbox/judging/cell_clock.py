"""The cells' time limit, kept by the worker from outside the session's process.

A run with cells (`RunOnly.cells`, SandboxFusion's `/run_jupyter`) gives each cell its own time
(`test_time_s`). The session's process arms a timer for each cell itself (see `inrun.cells`): for
cooperative code that interrupts the cell cleanly and the next cell runs. But that process runs
the cells' code, which can turn its own timer off (`signal.signal(signal.SIGALRM,
signal.SIG_IGN)`) and loop. So the worker also keeps a clock from the frames as they arrive: the
`cells` frame says the cells begin (the program before them is done), and a `cell` frame for index
`i` counts cell `i` as reported; the next index then has its cell time, plus a grace for the
process to write its report, from that frame's arrival. When that runs out the worker has the
zygote end the run: the cell in progress is timed out, the cells after it are not run.

The frames are untrusted: a cell can write frames for the cells after it. Nothing here tries to
tell a forged frame from a real one. Only a frame for an index past every one seen moves the
clock, so forged frames can make the outside deadline later by at most the cell times of the cells
they claim, and the session's wall time (`total_timeout`) still ends the run in every case.
"""

from __future__ import annotations

import json
import math
import struct

# What the session's process has, past a cell's own time, to interrupt the cell and report it
# (its own timer fires at the cell time): the worker ends the run only after this too.
GRACE_S = 0.5
_HEADER = struct.Struct(">I")


class CellClock:
    """When the cell in progress must have reported, from the report stream read so far."""

    def __init__(self, count: int, cell_time: float, grace: float = GRACE_S) -> None:
        self.count, self.cell_time, self.grace = count, cell_time, grace
        self.pending = 0  # the first cell not yet reported
        self.deadline = math.inf  # monotonic; none until the cells begin
        self._scanned = 0  # how much of the stream has been read as whole frames
        self._lost = False  # a frame that could not be read: the clock stops moving

    def feed(self, stream: bytes | bytearray, now: float) -> None:
        """Read the frames completed in `stream` (all of the report so far) at time `now`."""
        while not self._lost and len(stream) - self._scanned >= _HEADER.size:
            (size,) = _HEADER.unpack_from(stream, self._scanned)
            end = self._scanned + _HEADER.size + size
            if len(stream) < end:
                return
            try:
                frame = json.loads(bytes(stream[self._scanned + _HEADER.size : end]))
            except (ValueError, RecursionError):
                self._lost = True  # the run's result is malformed; the deadline in force stays
                return
            self._scanned = end
            if isinstance(frame, dict):
                self._saw(frame, now)

    def _saw(self, frame: dict[str, object], now: float) -> None:
        kind, index = frame.get("t"), frame.get("i")
        if kind == "cells" and self.pending == 0 and self.deadline == math.inf:
            self._next(0, now)
        elif kind == "cell" and type(index) is int and self.pending <= index < self.count:
            self._next(index + 1, now)

    def _next(self, index: int, now: float) -> None:
        self.pending = index
        self.deadline = now + self.cell_time + self.grace if index < self.count else math.inf

    def expired(self, now: float) -> bool:
        return now >= self.deadline
