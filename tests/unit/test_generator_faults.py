"""Non-finite logits are a server fault (`crucible_generator/faults.py`): answered with the error
envelope and a message that says what happened, logged with the request's details, and cleared from
the continuous batch's cache so that the next sequence placed in the row is not poisoned too.

The fault is injected as a transient one leaves it: NaN in slots of a cache block that the next
sequence's mask hides (SDPA multiplies a masked slot's value by a weight of 0, and 0 * NaN is NaN).
Also here: the fixed-shape prefill, which may replay a captured graph, captures no graph for other
shapes and keeps each chunk's logits its own.
"""

from __future__ import annotations

import asyncio
import math
import time

import pytest
import torch
from crucible_generator import continuous
from crucible_generator.api import create_app
from crucible_generator.engine import Completion, Engine, SamplingParams
from crucible_generator.errors import ServerError
from crucible_generator.fastpath import StaticKVCache
from crucible_generator.paged import RESERVED
from crucible_generator.service import GeneratorService
from starlette.testclient import TestClient

from tests.unit.test_generator_engine import DigitsTokenizer, tiny_model

PROMPT = [5, 6, 7, 8]
SAMPLED = SamplingParams(max_tokens=8, temperature=1.0, seed=1, logprobs=0, ignore_eos=True)


@pytest.fixture
def engine():
    eng = Engine(
        tiny_model(max_positions=512),
        DigitsTokenizer(),
        max_batch_size=2,
        batch_wait_s=0.0,
        fast_decode="on",
        join_wait_s=0.0,
    )
    eng.start()
    yield eng
    eng.stop()


def poison(engine: Engine) -> None:
    """NaN values in the last slots of the first free cache block (the next sequence takes it, and
    its 4 + 8 tokens leave those slots masked)."""
    assert engine.fast is not None
    with torch.no_grad():
        engine.fast.cache.values[0][RESERVED, 13:] = float("nan")


def test_a_row_left_with_nan_fails_its_request_once_then_serves_again(engine, caplog) -> None:
    poison(engine)
    with pytest.raises(ServerError, match="were not finite") as failed:
        asyncio.run(engine.generate([PROMPT], SAMPLED, n=2))
    assert failed.value.status == 500
    assert "cache_row=0" in caplog.text and "seed=1" in caplog.text and "prompt_tokens=4" in caplog.text
    # The block was cleared: the retry takes the same block (lowest first) and generates as normal.
    left = time.monotonic() + 10  # the request failed at once; its rows leave at the step's end
    while not engine.fast.cache.values[0][RESERVED].isfinite().all() and time.monotonic() < left:
        time.sleep(0.01)
    assert engine.fast.cache.values[0][RESERVED].isfinite().all()
    for out in asyncio.run(engine.generate([PROMPT], SAMPLED, n=2)):
        assert len(out.token_ids) == 8 and all(math.isfinite(lp) for lp in out.logprobs)


def test_a_greedy_request_that_asked_for_no_logprobs_fails_too(engine) -> None:
    # The greedy "before" evaluation asks for no log-probabilities: its NaN rows must not pass silently.
    poison(engine)
    with pytest.raises(ServerError, match="were not finite"):
        asyncio.run(engine.generate([PROMPT], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)))


def test_the_http_answer_is_the_error_envelope_saying_what_happened(engine) -> None:
    poison(engine)
    service = GeneratorService(engine, model_name="tiny", model_root="tiny")
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 8, "temperature": 1.0, "seed": 1, "logprobs": 0}
    with TestClient(create_app(service=service)) as client:
        failed = client.post("/v1/completions", json=body)
        assert failed.status_code == 500
        error = failed.json()["error"]
        assert error["type"] == "InternalServerError" and error["code"] == 500
        assert "logits for request" in error["message"] and "not finite" in error["message"]
        assert "JSON" not in error["message"]
        retried = client.post("/v1/completions", json=body)
        assert retried.status_code == 200
        assert all(math.isfinite(lp) for lp in retried.json()["choices"][0]["logprobs"]["token_logprobs"])


def test_logprobs_on_the_wire_are_finite_as_vllm_sends_them(engine) -> None:
    service = GeneratorService(engine, model_name="tiny", model_root="tiny")
    zero = Completion([3, 4], "<3><4>", "length", None, [-0.5, float("-inf")], [[(3, -0.5)], [(9, -1e-3)]])
    completion = service._completion_logprobs(zero)
    assert completion.token_logprobs == [-0.5, -9999.0]  # a token of probability 0: vLLM's -9999.0
    assert completion.top_logprobs[1] == {"<4>": -9999.0, "<9>": -1e-3}
    assert [c.logprob for c in service._chat_logprobs(zero).content] == [-0.5, -9999.0]
    for bad in (float("nan"), float("inf")):
        broken = Completion([3], "<3>", "length", None, [bad], [[(3, bad)]])
        with pytest.raises(ServerError, match="non-finite"):
            service._completion_logprobs(broken)
        with pytest.raises(ServerError, match="non-finite"):
            service._chat_logprobs(broken)


def decoder(rows: int = 32) -> continuous.ContinuousDecoder:
    return continuous.ContinuousDecoder(
        tiny_model(max_positions=512), rows=rows, length=512, use_graphs=False
    )


def test_only_fixed_prefill_shapes_replay_graphs() -> None:
    # A graph per arbitrary shape was captured mid-serving (8-14 during one 500-task evaluation on
    # the H100), each with a scratch cache of its own.
    dec = decoder()
    asked: list[tuple[int, int]] = []
    dec.use_graphs = dec.bucket_prefill = True
    dec._prefill_graph = lambda shape: asked.append(shape)  # type: ignore[assignment,method-assign,func-returns-value]
    dec.prefill(list(range(20)), [[3 + i, 4, 5] for i in range(20)])  # 20 distinct prompts: eager
    assert asked == []
    dec.prefill([20, 21, 22], [[7, 8], [9], [10, 11, 12]])
    assert asked == [(4, 64)]


class ReplayedPrefill:
    """What replaying a captured prefill does: fixed input buffers in, one fixed output buffer out."""

    def __init__(self, shape: tuple[int, int], dec: continuous.ContinuousDecoder) -> None:
        self.dec, self.graph = dec, self
        self.ids = torch.zeros(shape, dtype=torch.long)
        self.mask2d = torch.zeros(shape, dtype=torch.bool)
        self.scratch = StaticKVCache(shape[1], dec.device)
        self.logits = torch.zeros(shape[0], dec.model.config.vocab_size)

    def replay(self) -> None:
        self.logits.copy_(self.dec._prefill_forward(self.scratch, self.ids, self.mask2d))


def test_chunks_replaying_one_prefill_graph_keep_their_own_logits(monkeypatch) -> None:
    monkeypatch.setattr(continuous, "PREFILL_TOKENS", 64)  # 6 prompts of 20 tokens: 2 chunks of 3
    prompts = [[3 + i] * 20 for i in range(6)]
    want, _ = decoder().prefill(list(range(6)), prompts)
    dec = decoder()
    graphs: dict[tuple[int, int], ReplayedPrefill] = {}
    dec.use_graphs = dec.bucket_prefill = True
    dec._prefill_graph = lambda shape: graphs.setdefault(shape, ReplayedPrefill(shape, dec))  # type: ignore[method-assign]
    got, _ = dec.prefill(list(range(6)), prompts)
    assert list(graphs) == [(4, 64)]  # both chunks replayed the same graph
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_no_cudnn_keeps_cudnn_attention_out_of_the_fast_path(monkeypatch) -> None:
    # The lever for issue 24's suspect kernel (`test_generator_gpu_nan.py` checks it on an H100).
    from contextlib import nullcontext

    from crucible_generator.settings import Settings

    assert Settings(attention_kernels="no_cudnn").attention_kernels == "no_cudnn"
    chosen: list[object] = []
    monkeypatch.setattr(continuous, "sdpa_kernel", lambda backends: chosen.append(backends) or nullcontext())
    default = decoder(rows=2)
    default.prefill([0], [[3, 4, 5]])
    assert chosen == []
    dec = continuous.ContinuousDecoder(
        tiny_model(max_positions=512), rows=2, length=512, use_graphs=False, attention_kernels="no_cudnn"
    )
    dec.prefill([0], [[3, 4, 5]])
    dec.step(dec.window(0, 4))
    assert len(chosen) == 2 and all(c == continuous.WITHOUT_CUDNN for c in chosen)
    assert torch.nn.attention.SDPBackend.CUDNN_ATTENTION not in continuous.WITHOUT_CUDNN
