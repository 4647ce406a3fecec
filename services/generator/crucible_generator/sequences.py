"""What the engine thread works on: a request's settings, its sequences (one per prompt and sample),
their finished completions, a sampled step on its way from the device to the host, and where
a stop string ends one (`hit_stop_string`)."""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from .sampling import RowParams, SampleOutput

REQUEST_IDS = itertools.count(1)  # request numbers in the log and in fault messages


@dataclass(frozen=True)
class SamplingParams:
    """Per-request generation settings (already validated)."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    logprobs: int | None = None  # None: no logprobs; k >= 0: the sampled token's plus the top k


@dataclass
class Completion:
    """One finished sample: what vLLM calls a `CompletionOutput`."""

    token_ids: list[int]
    text: str
    finish_reason: str
    stop_reason: int | str | None
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None


@dataclass
class Request:
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future
    results: list[Completion | None]
    remaining: int
    cancelled: bool = False
    id: int = field(default_factory=lambda: next(REQUEST_IDS))
    # Called on the event loop with (index, completion) as each sample finishes (a streamed request);
    # every call is scheduled before the future resolves.
    on_done: Callable[[int, Completion], None] | None = None


@dataclass
class Sequence:
    request: Request
    index: int
    prompt_ids: list[int]
    params: SamplingParams
    adapter: str | None  # the name clients use
    slot: str | None  # the adapter's name inside PEFT
    row: RowParams
    enqueued: float = field(default_factory=time.monotonic)
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top: list[list[tuple[int, float]]] = field(default_factory=list)
    text: str | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    cache_row: int | None = None  # its row of the continuous batch's cache
    faulted: bool = False  # its logits were not finite (`faults.py`)


class Readback:
    """A sampling result on its way to the host: copies queued right after the sampling (so they
    do not wait for later steps queued behind them), read once they have landed."""

    def __init__(self, picked: SampleOutput) -> None:
        parts = [picked.tokens, picked.logprobs]
        if picked.top_ids is not None and picked.top_logprobs is not None:
            parts += [picked.top_ids, picked.top_logprobs]
        self._host = [t.to("cpu", non_blocking=True) for t in parts]  # pinned when from CUDA
        self._event: Any = None
        if picked.tokens.is_cuda:
            self._event = torch.cuda.Event()
            self._event.record()

    def lists(self) -> list[list]:
        """tokens, logprobs and, when asked, top ids and top logprobs, as lists."""
        if self._event is not None:
            self._event.synchronize()
        return [t.tolist() for t in self._host]


@dataclass
class Launched:
    """A decode step queued on the device: its rows (and their sequences), its sampled tokens on
    the device (the next step's input) and their copy on the way to the host."""

    rows: list[tuple[int, Sequence]]
    picked: SampleOutput
    readback: Readback = field(init=False)

    def __post_init__(self) -> None:
        self.readback = Readback(self.picked)


def resolve(future: asyncio.Future, result: Any = None, error: BaseException | None = None) -> None:
    """Complete `future` unless its awaiter is gone (runs on the event loop)."""
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


def eos_ids(model: Any, tokenizer: Any) -> frozenset[int]:
    """Every token id that ends a sequence: the generation config's (one or several) and the tokenizer's."""
    ids: set[int] = set()
    for value in (getattr(model.generation_config, "eos_token_id", None), tokenizer.eos_token_id):
        if isinstance(value, int):
            ids.add(value)
        elif value:
            ids.update(int(v) for v in value)
    return frozenset(ids)


def hit_stop_string(seq: Sequence, tokenizer: Any) -> bool:
    """Whether `seq` has just produced one of its stop strings: then its text is cut there and it
    finishes with `stop` (the string in `stop_reason`)."""
    skip = seq.params.skip_special_tokens
    # A new stop string must end in the newest token: decoding a short tail first keeps this
    # check O(1) per token (decoding the whole output at every step is quadratic).
    tail = 2 * max(len(s) for s in seq.params.stop) + 8
    if len(seq.output_ids) > tail:
        recent = tokenizer.decode(seq.output_ids[-tail:], skip_special_tokens=skip)
        if not any(s in recent for s in seq.params.stop):
            return False
    text = tokenizer.decode(seq.output_ids, skip_special_tokens=skip)
    hits = [(text.find(s), s) for s in seq.params.stop if s in text]
    if not hits:
        return False
    at, stop = min(hits)
    seq.text = text[: at + len(stop)] if seq.params.include_stop_str_in_output else text[:at]
    seq.finish_reason, seq.stop_reason = "stop", stop
    return True
