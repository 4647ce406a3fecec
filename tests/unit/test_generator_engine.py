"""The engine's decode loop on a tiny random Llama: batching must not change what a row generates."""

from __future__ import annotations

import asyncio

import pytest
import torch
from crucible_generator.engine import Engine, SamplingParams
from transformers import LlamaConfig, LlamaForCausalLM

EOS = 1


class DigitsTokenizer:
    """Just enough tokenizer for the engine: ids print as numbers."""

    pad_token_id = 0
    eos_token_id = EOS

    def decode(self, ids, skip_special_tokens=True):
        return "".join(f"<{i}>" for i in ids if not (skip_special_tokens and i == EOS))


def tiny_model(max_positions: int = 128) -> LlamaForCausalLM:
    """A seeded random two-layer Llama with a 64-token vocabulary (GQA: 4 heads, 2 KV heads)."""
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=max_positions, eos_token_id=EOS, pad_token_id=0,
    )  # fmt: skip
    model = LlamaForCausalLM(config).eval()
    model.generation_config.eos_token_id = EOS
    return model


@pytest.fixture(scope="module")
def engine():
    eng = Engine(tiny_model(), DigitsTokenizer(), max_batch_size=8, batch_wait_s=0.05, seed=0)
    eng.start()
    yield eng
    eng.stop()


def run(coro):
    return asyncio.run(coro)


def greedy(max_tokens=12, **kw):
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kw)


def test_batched_rows_match_solo_rows(engine):
    prompts = [[5, 6, 7], [9], [3, 4, 5, 6, 7, 8, 9, 10], [11, 12]]
    solo = [run(engine.generate([p], greedy()))[0].token_ids for p in prompts]

    async def together():
        return await asyncio.gather(*(engine.generate([p], greedy()) for p in prompts))

    batched = [r[0].token_ids for r in run(together())]
    assert batched == solo


def test_rows_that_finish_early_leave_the_others_intact(engine):
    prompt = [5, 6, 7]
    full = run(engine.generate([prompt], greedy(max_tokens=10)))[0].token_ids

    async def mixed():
        return await asyncio.gather(
            engine.generate([prompt], greedy(max_tokens=10)), engine.generate([[9, 9]], greedy(max_tokens=2))
        )

    long, short = run(mixed())
    assert long[0].token_ids == full
    assert len(short[0].token_ids) == 2 and short[0].finish_reason == "length"


def test_n_expands_prompt_major_and_seeds_are_reproducible(engine):
    params = SamplingParams(max_tokens=8, temperature=1.0, seed=123, ignore_eos=True)
    first = run(engine.generate([[5, 6], [7, 8]], params, n=3))
    again = run(engine.generate([[5, 6], [7, 8]], params, n=3))
    assert len(first) == 6
    assert [c.token_ids for c in first] == [c.token_ids for c in again]
    # Sample j of every prompt uses seed + j; samples of one prompt differ from each other.
    assert len({tuple(c.token_ids) for c in first[:3]}) > 1


def test_stop_token_ids_and_logprobs(engine):
    out = run(engine.generate([[5, 6, 7]], greedy(max_tokens=12, logprobs=2)))[0]
    stop_at = out.token_ids[3]
    stopped = run(engine.generate([[5, 6, 7]], greedy(max_tokens=12, stop_token_ids=(stop_at,))))[0]
    first = out.token_ids.index(stop_at)
    assert stopped.token_ids == out.token_ids[: first + 1]
    assert stopped.finish_reason == "stop" and stopped.stop_reason == stop_at
    assert len(out.logprobs) == len(out.token_ids) and all(lp <= 0 for lp in out.logprobs)
    assert all(len(top) == 2 for top in out.top_logprobs)


def test_stop_strings_truncate_the_text(engine):
    out = run(engine.generate([[5, 6, 7]], greedy(max_tokens=12)))[0]
    stop = f"<{out.token_ids[2]}>"
    stopped = run(engine.generate([[5, 6, 7]], greedy(max_tokens=12, stop=(stop,))))[0]
    assert stopped.text == out.text[: out.text.index(stop)]
    assert stopped.stop_reason == stop
