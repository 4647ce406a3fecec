"""Continuous batching: sequences join and leave a running batch between steps, in rows of their own,
and none of it changes what a sequence generates.

A fast engine (rows of a static cache, merged weights; on CPU its steps run without CUDA graphs,
which are the same steps captured) is compared with an eager engine serving the same tiny random
Llama, whose batches are the reference.
"""

from __future__ import annotations

import asyncio
import copy
import time

import pytest
from crucible_generator.engine import Engine, SamplingParams

from tests.unit.test_generator_engine import DigitsTokenizer
from tests.unit.test_generator_engine import tiny_model as tiny_llama
from tests.unit.test_generator_fastpath import save_adapter

ROWS = 4


def counter(engine: Engine, name: str) -> float:
    return engine.metrics.registry.get_sample_value(name) or 0.0


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    model = tiny_llama(max_positions=512)
    path = save_adapter(model, tmp_path_factory.mktemp("continuous") / "a1", 1, ["q_proj", "v_proj"])
    eager = Engine(
        copy.deepcopy(model), DigitsTokenizer(), max_batch_size=8, batch_wait_s=0.02, fast_decode="off"
    )
    fast = Engine(
        model, DigitsTokenizer(), max_batch_size=ROWS, batch_wait_s=0.02, fast_decode="on", join_wait_s=0.0
    )
    for engine in (eager, fast):
        engine.start()
        asyncio.run(engine.load_adapter("a1", path))
    yield eager, fast
    for engine in (eager, fast):
        engine.stop()


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=0, **kw)


def solo(engine: Engine, prompt: list[int], params: SamplingParams, adapter: str | None = None):
    return asyncio.run(engine.generate([prompt], params, adapter=adapter))[0]


async def after_tokens(engine: Engine, count: float) -> None:
    """Wait until the engine generated `count` more tokens than now."""
    start = counter(engine, "crucible_generator_generation_tokens_total")
    while counter(engine, "crucible_generator_generation_tokens_total") < start + count:
        await asyncio.sleep(0.002)


def test_a_request_joins_a_running_batch_and_generates_what_it_would_alone(engines):
    eager, fast = engines
    assert fast.fast.packed_attention  # decode steps use the packed GQA attention (attention.py)
    long_prompt, short_prompt = [5, 6, 7, 8], [9, 10]
    joined_before = counter(fast, "crucible_generator_joined_sequences_total")
    admitted_before = counter(fast, "crucible_generator_admissions_total")
    admission_s_before = counter(fast, "crucible_generator_admission_seconds_total")

    async def scenario():
        long = asyncio.ensure_future(fast.generate([long_prompt], greedy(300)))
        await after_tokens(fast, 20)
        short = await fast.generate([short_prompt], greedy(12))
        assert not long.done(), "the short request waited for the long batch to end"
        return (await long)[0], short[0]

    long, short = asyncio.run(scenario())
    assert counter(fast, "crucible_generator_joined_sequences_total") == joined_before + 1
    # Two admissions, the long request's start and the short one's join, each a prefill that took time.
    assert counter(fast, "crucible_generator_admissions_total") == admitted_before + 2
    assert counter(fast, "crucible_generator_admission_seconds_total") > admission_s_before
    # 300 tokens cross a window boundary (256 slots): the window grows under the running rows.
    for got, (prompt, params) in ((long, (long_prompt, greedy(300))), (short, (short_prompt, greedy(12)))):
        want = solo(eager, prompt, params)
        assert got.token_ids == want.token_ids
        assert got.logprobs == pytest.approx(want.logprobs, abs=1e-4)


def test_more_sequences_than_rows_take_the_rows_others_freed(engines):
    eager, fast = engines
    prompts = [[3 + i % 7] * (1 + i % 5) + [20 + i] for i in range(11)]
    lengths = [3 + (7 * i) % 17 for i in range(11)]

    async def all_at_once(engine):
        return await asyncio.gather(
            *(engine.generate([p], greedy(n)) for p, n in zip(prompts, lengths, strict=True))
        )

    got, want = asyncio.run(all_at_once(fast)), asyncio.run(all_at_once(eager))
    assert [r[0].token_ids for r in got] == [r[0].token_ids for r in want]
    assert [len(r[0].token_ids) for r in got] == lengths


def test_prefills_in_fixed_shapes_generate_the_same(engines):
    # What CUDA graphs replay: prompts padded to a power-of-two count and a rounded width.
    eager, fast = engines
    prompts = [[3 + i] * (1 + 3 * i) for i in range(5)] + [[9] * 70]
    fast.fast.bucket_prefill = True
    try:
        got = asyncio.run(fast.generate(prompts, greedy(6)))
    finally:
        fast.fast.bucket_prefill = False
    want = asyncio.run(eager.generate(prompts, greedy(6)))
    assert [c.token_ids for c in got] == [c.token_ids for c in want]
    for g, w in zip(got, want, strict=True):
        assert g.logprobs == pytest.approx(w.logprobs, abs=1e-4)


def test_identical_prompts_are_prefilled_once(engines):
    eager, fast = engines
    prompts = [[4, 5, 6, 7, 8, 9], [11, 12, 13]]
    reused = counter(fast, "crucible_generator_prefix_reused_tokens_total")
    params = SamplingParams(max_tokens=8, temperature=1.0, seed=3, ignore_eos=True)
    got = asyncio.run(fast.generate(prompts, params, n=2))
    # n=2 of each prompt, admitted together: each prompt's second sample reuses the first's prefill.
    assert counter(fast, "crucible_generator_prefix_reused_tokens_total") == reused + 6 + 3
    want = asyncio.run(eager.generate(prompts, params, n=2))
    assert [c.token_ids for c in got] == [c.token_ids for c in want]


def test_a_seeded_sample_does_not_depend_on_what_it_joined(engines):
    _, fast = engines
    params = SamplingParams(max_tokens=16, temperature=0.8, top_p=0.9, seed=11, ignore_eos=True)
    alone = solo(fast, [7, 8, 9], params)

    async def joined():
        long = asyncio.ensure_future(fast.generate([[3, 4]], greedy(200)))
        await after_tokens(fast, 10)
        result = await fast.generate([[7, 8, 9]], params)
        await long
        return result[0]

    assert asyncio.run(joined()).token_ids == alone.token_ids


def test_another_adapter_waits_its_turn_and_later_requests_do_not_overtake_it(engines):
    eager, fast = engines
    done: dict[str, float] = {}

    async def timed(name, prompt, params, adapter=None):
        result = await fast.generate([prompt], params, adapter=adapter)
        done[name] = time.monotonic()
        return result[0]

    async def scenario():
        first = asyncio.ensure_future(timed("base-long", [5, 6], greedy(120)))
        await after_tokens(fast, 10)
        adapted = asyncio.ensure_future(timed("a1", [5, 6], greedy(10), "a1"))
        await asyncio.sleep(0.05)
        later = asyncio.ensure_future(timed("base-later", [8, 9], greedy(10)))
        return await asyncio.gather(first, adapted, later)

    _, adapted, later = asyncio.run(scenario())
    # FIFO: the a1 request stops further joins; the later base request runs after it.
    assert done["base-long"] < done["a1"] < done["base-later"]
    assert adapted.token_ids == solo(eager, [5, 6], greedy(10), "a1").token_ids
    assert later.token_ids == solo(eager, [8, 9], greedy(10)).token_ids
    assert adapted.token_ids != solo(eager, [5, 6], greedy(10)).token_ids  # the adapter was merged


def test_a_cancelled_request_frees_its_row(engines):
    _, fast = engines

    async def scenario():
        hogs = [asyncio.ensure_future(fast.generate([[3 + i]], greedy(400))) for i in range(ROWS)]
        await after_tokens(fast, 4 * ROWS)
        hogs[0].cancel()
        # Every row is taken until the cancelled one frees: this finishes only if it does.
        result = await asyncio.wait_for(fast.generate([[9, 9]], greedy(5)), timeout=30)
        assert not any(hog.done() for hog in hogs[1:]), "it waited for the batch to end"
        for hog in hogs[1:]:
            hog.cancel()
        await asyncio.gather(*hogs, return_exceptions=True)
        return result

    assert len(asyncio.run(scenario())[0].token_ids) == 5


def test_a_sequence_may_fill_its_row_to_the_last_slot(engines):
    # The lookahead step after a sequence's last token feeds that token (its keys go to the row's
    # last slot) before the host knows the sequence ended; one token longer goes the eager way.
    eager, fast = engines
    length = fast.fast.length  # 512: the tiny model's context
    prompt = [4, 5, 6, 7, 8, 9]
    for max_tokens in (length - len(prompt) - 1, length - len(prompt)):
        got = solo(fast, prompt, greedy(max_tokens))
        assert got.token_ids == solo(eager, prompt, greedy(max_tokens)).token_ids
        assert len(got.token_ids) == max_tokens
