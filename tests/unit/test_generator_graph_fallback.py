"""A CUDA graph the fast path cannot capture sends the model to the eager path: one warning line
that names the reason, and transformers' greedy tokens all the same.

On a GPU, gpt-oss fails to capture (its expert routing syncs with the host: `nonzero`, a loop over
the experts hit). Here, on a CPU, the capture step is injected (`ContinuousDecoder(capture=...)`):
one that raises as CUDA does, and one that stands in for a graph by running the captured step again
at every replay, so that the fast path with "graphs" runs before a capture fails mid-serving.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import time
from typing import Literal

import pytest
import torch
from crucible_generator.engine import Engine, SamplingParams

from tests.families import family_config, hf_greedy
from tests.unit.test_generator_engine import DigitsTokenizer

PROMPTS = [[5, 6, 7, 8], [9, 10, 11]]
TOKENS = 10
CUDA_ERROR = "operation not permitted when stream is capturing\nCUDA kernel errors might be reported later"


@pytest.fixture(scope="module")
def gpt_oss():
    """A seeded tiny random gpt-oss (attention sinks, experts, sliding and full layers)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(family_config("gpt-oss"), dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def want(gpt_oss):
    return [hf_greedy(gpt_oss, p, TOKENS) for p in PROMPTS]


def failing_capture(fn, warm_up, pool):
    raise RuntimeError(CUDA_ERROR)


class Replayed:
    """A CPU stand-in for a CUDA graph: `replay` runs the captured function again into its output."""

    def __init__(self, fn, out: torch.Tensor) -> None:
        self.fn, self.out = fn, out

    def replay(self) -> None:
        self.out.copy_(self.fn())


def replaying_capture(fn, warm_up, pool):
    warm_up()
    out = fn()
    return Replayed(fn, out), out


def engine_with(
    model, capture, graph_capture: Literal["idle", "start"] = "idle", max_model_len: int = 256
) -> Engine:
    engine = Engine(
        copy.deepcopy(model),
        DigitsTokenizer(),
        max_batch_size=4,
        max_model_len=max_model_len,
        fast_decode="on",
        seed=0,
        graph_capture=graph_capture,
    )
    assert engine.fast is not None
    engine.fast.use_graphs = engine.fast.bucket_prefill = True  # as on CUDA
    engine.fast._capture_graph = capture
    return engine


def generate(engine: Engine) -> list[list[int]]:
    params = SamplingParams(max_tokens=TOKENS, temperature=0.0, ignore_eos=True, logprobs=0)
    return [c.token_ids for c in asyncio.run(engine.generate(PROMPTS, params))]


def warnings(caplog) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name.startswith("crucible") and r.levelno >= logging.WARNING]


def left_the_fast_path(engine: Engine, timeout: float = 10.0) -> bool:
    left = time.monotonic() + timeout
    while engine.fast is not None and time.monotonic() < left:
        time.sleep(0.01)
    return engine.fast is None


@pytest.mark.parametrize("graph_capture", ["start", "idle"])
def test_a_capture_failing_at_start_up_serves_the_model_on_the_eager_path(
    gpt_oss, want, caplog, graph_capture
):
    # `idle`: the first capture runs as soon as the engine is idle, before or after this request
    # (which then decodes on the fast path, uncaptured): either way the same tokens, then eager.
    engine = engine_with(gpt_oss, failing_capture, graph_capture)
    with caplog.at_level(logging.INFO):
        engine.start()
        try:
            assert generate(engine) == want
            if graph_capture == "start":
                assert engine.fast is None  # the merged copy and its caches are gone
            assert left_the_fast_path(engine)
            assert generate(engine) == want
        finally:
            engine.stop()
    (line,) = warnings(caplog)
    assert line.getMessage() == (
        "CUDA graph capture failed (RuntimeError: operation not permitted when stream is capturing); "
        "this model decodes on the eager path"
    )


def test_a_capture_failing_mid_serving_completes_the_batch_then_leaves_the_fast_path(gpt_oss, want, caplog):
    # `start` alone captures on the serving path: a window missing when a step needs it.
    engine = engine_with(gpt_oss, replaying_capture, "start")
    with caplog.at_level(logging.INFO):
        engine.start()
        try:
            assert generate(engine) == want  # decoded with "graphs" on the fast path
            fast = engine.fast
            assert fast is not None and fast.use_graphs and fast.captures > 0 and fast.failure is None
            fast._capture_graph = failing_capture  # the next window needs a new capture, which fails
            fast._graphs.clear()
            assert generate(engine) == want
            assert fast.failure is not None and not fast.use_graphs
            assert left_the_fast_path(engine)  # once the batch has ended
            assert generate(engine) == want  # and now on the eager path
        finally:
            engine.stop()
    (line,) = warnings(caplog)
    assert "CUDA graph capture failed (RuntimeError: operation not" in line.getMessage()


def test_a_capture_failing_in_idle_time_after_serving_leaves_the_fast_path(gpt_oss, want, caplog):
    # Served on the fast path (its graphs replayed), then one missing graph fails in the idle time.
    engine = engine_with(gpt_oss, replaying_capture)
    fast = engine.fast
    assert fast is not None
    with caplog.at_level(logging.INFO):
        engine.start()
        try:
            left = time.monotonic() + 30
            while fast.uncaptured() and time.monotonic() < left:
                time.sleep(0.01)
            assert fast.uncaptured() == [] and fast.failure is None
            assert generate(engine) == want
            with engine._cond:  # the engine thread sleeps, holding no graph in the making
                fast._capture_graph = failing_capture
                del fast._graphs[(1, 256)]
                engine._cond.notify_all()  # as a request would wake it: it captures before sleeping again
            assert left_the_fast_path(engine)
            assert generate(engine) == want  # and now on the eager path
        finally:
            engine.stop()
    (line,) = warnings(caplog)
    assert "CUDA graph capture failed (RuntimeError: operation not" in line.getMessage()
