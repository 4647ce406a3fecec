"""The fast path's paged key/value cache (`crucible_generator/paged.py`): rows take blocks as they
grow and give them back when they end, admission waits for free blocks, a step short of blocks
preempts the newest sequences (queued again with their tokens so far), and rows prefilled from one
prompt share its full blocks. None of it changes what a sequence generates.

A fast engine whose cache holds 48 blocks of 16 tokens (768 slots: 16 rows at the full 512 would
need 512 blocks) is compared with an eager engine serving the same tiny random Llama.
"""

from __future__ import annotations

import asyncio
import copy
import time

import pytest
from crucible_generator.continuous import ContinuousDecoder
from crucible_generator.engine import Engine, SamplingParams

from tests.unit.test_generator_engine import DigitsTokenizer
from tests.unit.test_generator_engine import tiny_model as tiny_llama
from tests.unit.test_generator_fastpath import save_adapter

ROWS, BLOCKS, BLOCK = 16, 48, 16


def counter(engine: Engine, name: str, labels: dict[str, str] | None = None) -> float:
    return engine.metrics.registry.get_sample_value(name, labels) or 0.0


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    root = tmp_path_factory.mktemp("paged")
    model = tiny_llama(max_positions=512)
    return {v: save_adapter(model, root / f"v{v}", v, ["q_proj", "v_proj"]) for v in (1, 2)}


@pytest.fixture(scope="module")
def engines(adapters):
    model = tiny_llama(max_positions=512)
    eager = Engine(
        copy.deepcopy(model), DigitsTokenizer(), max_batch_size=8, batch_wait_s=0.02, fast_decode="off"
    )
    small = Engine(
        model,
        DigitsTokenizer(),
        max_batch_size=ROWS,
        batch_wait_s=0.02,
        fast_decode="on",
        join_wait_s=0.0,
        kv_blocks=BLOCKS,
        block_size=BLOCK,
    )
    for engine in (eager, small):
        engine.start()
        for v, path in adapters.items():
            asyncio.run(engine.load_adapter(f"v{v}", path))
    assert small.fast is not None and small.fast.pool.count == BLOCKS
    yield eager, small
    for engine in (eager, small):
        engine.stop()


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=0)


def all_at_once(engine: Engine, requests, adapter: str | None = None):
    async def go():
        return await asyncio.gather(
            *(engine.generate([p], params, adapter=adapter) for p, params in requests)
        )

    return [r[0] for r in asyncio.run(go())]


def wait_all_free(engine: Engine, timeout: float = 10.0) -> None:
    """Blocks are given back on the engine thread, right after the step that ended their rows."""
    assert engine.fast is not None
    left = time.monotonic() + timeout
    while engine.fast.pool.available < engine.fast.pool.count and time.monotonic() < left:
        time.sleep(0.01)
    assert engine.fast.pool.available == engine.fast.pool.count, "blocks were not given back"
    assert all(not held for held in engine.fast.row_blocks)


def assert_same(got, want) -> None:
    assert [c.token_ids for c in got] == [c.token_ids for c in want]
    for g, w in zip(got, want, strict=True):
        assert g.logprobs == pytest.approx(w.logprobs, abs=1e-4)


def test_rows_of_very_different_lengths_share_fewer_blocks_than_rows_times_context(engines):
    eager, small = engines
    prompts = [[3 + i % 11] * (1 + (7 * i) % 37) + [20 + i] for i in range(ROWS)]
    lengths = [2 + (13 * i) % 29 for i in range(ROWS)]
    lengths[5] = 200  # one long row among short ones
    requests = [(p, greedy(n)) for p, n in zip(prompts, lengths, strict=True)]
    wide_steps = lambda: (  # noqa: E731  steps that decoded more than 8 rows
        counter(small, "crucible_generator_batch_size_count")
        - counter(small, "crucible_generator_batch_size_bucket", {"le": "8.0"})
    )
    before, preempted = wide_steps(), counter(small, "crucible_generator_preempted_sequences_total")
    got = all_at_once(small, requests)
    assert_same(got, all_at_once(eager, requests))
    assert [len(c.token_ids) for c in got] == lengths
    # All 16 decoded side by side in 48 blocks (16 rows at full length: 512), none preempted.
    assert wide_steps() > before
    assert counter(small, "crucible_generator_preempted_sequences_total") == preempted
    wait_all_free(small)


def test_running_out_of_blocks_preempts_and_every_sequence_completes_as_it_would_have(engines):
    eager, small = engines
    # 4 x (10 + 250) slots need 68 blocks of 16: the cache has 48.
    requests = [([4 + i, 5, 6, 7, 8, 9, 10, 11, 12, 13], greedy(250)) for i in range(4)]
    seeded = SamplingParams(max_tokens=250, temperature=1.0, top_p=0.9, seed=5, ignore_eos=True, logprobs=0)
    requests.append(([30, 31, 32], seeded))
    preempted = counter(small, "crucible_generator_preempted_sequences_total")
    got = all_at_once(small, requests)
    assert counter(small, "crucible_generator_preempted_sequences_total") > preempted
    assert_same(got, all_at_once(eager, requests))  # greedy and seeded draws alike
    assert all(len(c.token_ids) == 250 for c in got)
    wait_all_free(small)


def test_cancelled_requests_give_their_blocks_back(engines):
    _, small = engines
    tokens = "crucible_generator_generation_tokens_total"

    async def scenario():
        hogs = [asyncio.ensure_future(small.generate([[3 + i] * 20], greedy(400))) for i in range(3)]
        start = counter(small, tokens)
        while counter(small, tokens) < start + 30:
            await asyncio.sleep(0.002)
        assert small.fast.pool.available < BLOCKS
        for hog in hogs:
            hog.cancel()
        await asyncio.gather(*hogs, return_exceptions=True)

    asyncio.run(scenario())
    wait_all_free(small)
    # And the blocks serve the next request.
    assert len(asyncio.run(small.generate([[9, 9]], greedy(5)))[0].token_ids) == 5


def test_an_adapter_swapped_mid_stream_while_rows_are_preempted(engines, adapters):
    eager, small = engines
    requests = [([6 + i, 7, 8, 9], greedy(220)) for i in range(4)]  # 4 x 224 slots: 56 blocks
    later = [([11, 12, 13], greedy(30))]
    tokens = "crucible_generator_generation_tokens_total"

    async def scenario():
        await small.load_adapter("old", adapters[1])
        running = [
            asyncio.ensure_future(small.generate([p], params, adapter="old")) for p, params in requests
        ]
        start = counter(small, tokens)
        while counter(small, tokens) < start + 40:
            await asyncio.sleep(0.002)
        # The next version arrives under a new name and the old one leaves while its rows decode.
        await small.load_adapter("new", adapters[2])
        await small.unload_adapter("old")
        new = await small.generate(later[0][:1], later[0][1], adapter="new")
        return [r[0] for r in await asyncio.gather(*running)], new

    old, new = asyncio.run(scenario())
    assert_same(old, all_at_once(eager, requests, "v1"))
    assert_same(new, all_at_once(eager, later, "v2"))
    assert new[0].token_ids != all_at_once(eager, later)[0].token_ids  # the adapter was merged
    assert "old" not in {a.name for a in small.adapters.served()}
    asyncio.run(small.unload_adapter("new"))
    wait_all_free(small)


def test_samples_of_one_prompt_share_its_full_blocks_and_generate_what_they_would_alone(engines):
    eager, small = engines
    prompt = [3 + i % 17 for i in range(40)]  # two full blocks and 8 slots of a third
    params = SamplingParams(max_tokens=20, temperature=1.0, seed=9, ignore_eos=True, logprobs=0)
    reused = counter(small, "crucible_generator_prefix_reused_tokens_total")
    got = asyncio.run(small.generate([prompt], params, n=4))
    assert counter(small, "crucible_generator_prefix_reused_tokens_total") == reused + 3 * 40
    assert_same(got, asyncio.run(eager.generate([prompt], params, n=4)))
    assert len({tuple(c.token_ids) for c in got}) > 1  # the samples went their own ways
    wait_all_free(small)


def test_the_block_table_shares_full_blocks_and_frees_them_with_their_last_row():
    decoder = ContinuousDecoder(
        tiny_llama(max_positions=512), rows=4, length=512, use_graphs=False, blocks=64
    )
    prompt = list(range(3, 43))  # 40 tokens: blocks 0-1 full, block 2 partial
    decoder.prefill([0, 1, 2], [prompt, prompt, [5, 6]])
    held = decoder.row_blocks
    assert held[0][:2] == held[1][:2] and held[0][2] != held[1][2]  # the partial block is each row's own
    assert len(held[2]) == 1 and decoder.pool.available == 64 - (3 + 1 + 1)
    assert decoder.cache.table[1, :4].tolist() == [*held[1], 0]  # past its blocks: the zero block
    assert decoder.grow({0: 49, 1: 48})  # row 0 crosses into a fourth block, row 1 fills its third
    assert len(held[0]) == 4 and len(held[1]) == 3 and decoder.shortfall({2: 512}) == 0
    assert decoder.shortfall({2: 64 * 16}) > 0
    decoder.release([0])
    assert decoder.pool.available == 64 - 6 + 2  # row 0's own two; the shared two stay with row 1
    decoder.release([1, 2])
    assert decoder.pool.available == 64
    assert decoder.cache.table[:3, 0].tolist() == [1, 1, 1]  # free rows write to the trash block


def test_nan_left_in_a_block_fails_its_request_once_and_the_block_is_zeroed():
    from crucible_generator.errors import ServerError
    from crucible_generator.paged import RESERVED

    engine = Engine(
        tiny_llama(max_positions=512), DigitsTokenizer(), max_batch_size=4, batch_wait_s=0.0,
        fast_decode="on", join_wait_s=0.0, kv_blocks=40,
    )  # fmt: skip
    engine.start()
    try:
        assert engine.fast is not None and engine.fast.paged
        # The first free block: the next prompt of 4 tokens takes it, 8 more leave slots 13-15 masked.
        engine.fast.cache.values[0][RESERVED, 13:] = float("nan")
        params = SamplingParams(max_tokens=8, temperature=1.0, seed=1, logprobs=0, ignore_eos=True)
        with pytest.raises(ServerError, match="were not finite"):
            asyncio.run(engine.generate([[5, 6, 7, 8]], params, n=2))
        left = time.monotonic() + 10  # the block is zeroed right after the step that ended its row
        while not engine.fast.cache.values[0][RESERVED].isfinite().all() and time.monotonic() < left:
            time.sleep(0.01)
        assert engine.fast.cache.values[0][RESERVED].isfinite().all()
        wait_all_free(engine)
        assert all(len(c.token_ids) == 8 for c in asyncio.run(engine.generate([[5, 6, 7, 8]], params, n=2)))
    finally:
        engine.stop()


def test_eager_batches_stay_within_the_rows_full_length_caches_fit():
    # The fast path's blocks leave eager batches (dynamic caches) no more room than rows reserved
    # at full length had: `eager_batch_size` caps them below `max_batch_size`.
    engine = Engine(
        tiny_llama(),
        DigitsTokenizer(),
        max_batch_size=8,
        eager_batch_size=2,
        batch_wait_s=0.05,
        fast_decode="off",
    )
    engine.start()
    try:
        requests = [([5 + i, 6], greedy(4)) for i in range(5)]
        assert [len(c.token_ids) for c in all_at_once(engine, requests)] == [4] * 5
        widest = counter(engine, "crucible_generator_batch_size_bucket", {"le": "2.0"})
        assert widest == counter(engine, "crucible_generator_batch_size_count") > 0
    finally:
        engine.stop()


def test_admission_counts_a_shared_prompt_s_full_blocks_once(engines):
    # 8 samples of a 100-token prompt: 7 blocks each alone (56, more than the cache's 48), 6 full
    # blocks shared + 8 partial ones (14) together: all 8 are admitted in one prefill.
    eager, small = engines
    prompt = [3 + i % 23 for i in range(100)]
    params = SamplingParams(max_tokens=20, temperature=1.0, seed=21, ignore_eos=True, logprobs=0)
    reused = counter(small, "crucible_generator_prefix_reused_tokens_total")
    got = asyncio.run(small.generate([prompt], params, n=8))
    assert counter(small, "crucible_generator_prefix_reused_tokens_total") == reused + 7 * 100
    assert_same(got, asyncio.run(eager.generate([prompt], params, n=8)))
    wait_all_free(small)
