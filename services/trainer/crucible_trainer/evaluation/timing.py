"""Wall-clock accounting: when generation and execution were busy, and how much they overlapped."""

from __future__ import annotations

import time
from types import TracebackType


class ActivityClock:
    """Records the intervals during which at least one activity (a request in flight) was running.

    clock = ActivityClock()
    with clock:
        await request()
    clock.busy_s
    """

    def __init__(self) -> None:
        self.intervals: list[tuple[float, float]] = []
        self._active = 0
        self._since = 0.0

    def __enter__(self) -> ActivityClock:
        if self._active == 0:
            self._since = time.perf_counter()
        self._active += 1
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._active -= 1
        if self._active == 0:
            self.intervals.append((self._since, time.perf_counter()))

    @property
    def busy_s(self) -> float:
        return sum(end - start for start, end in self.intervals)


def overlap_s(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """Total time covered by both interval lists (each sorted and disjoint).

    >>> overlap_s([(0, 4), (6, 8)], [(3, 7)])
    2
    """
    total, i, j = 0, 0, 0
    while i < len(a) and j < len(b):
        start, end = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if end > start:
            total += end - start
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total
