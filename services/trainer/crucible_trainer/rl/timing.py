"""Seconds spent in each part of the update, without waiting for the device inside the loop.

On a GPU each span is a pair of CUDA events recorded on the current stream, read after one
synchronisation when the update ends: the time the device spent between them, including any time
it sat waiting for the host. On a CPU the work is done when the call returns, so the host's clock
is the device's.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch


class PartTimer:
    def __init__(self, device: str) -> None:
        self.cuda = str(device).startswith("cuda") and torch.cuda.is_available()
        self.device = torch.device(device)
        self.spans: dict[str, list[tuple[Any, Any]]] = defaultdict(list)
        self.host: dict[str, float] = defaultdict(float)

    @contextmanager
    def part(self, name: str) -> Iterator[None]:
        if not self.cuda:
            started = time.perf_counter()
            try:
                yield
            finally:
                self.host[name] += time.perf_counter() - started
            return
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        stream = torch.cuda.current_stream(self.device)  # the policy's card, whichever is current
        start.record(stream)
        try:
            yield
        finally:
            end.record(stream)
            self.spans[name].append((start, end))

    def seconds(self) -> dict[str, float]:
        """Every part's total (one synchronisation on a GPU)."""
        out = dict(self.host)
        if self.spans:
            torch.cuda.synchronize(self.device)
            for name, spans in self.spans.items():
                out[name] = out.get(name, 0.0) + sum(s.elapsed_time(e) for s, e in spans) / 1000
        return out
