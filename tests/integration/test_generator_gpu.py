"""On CUDA: the fast path (merged weights, static cache, CUDA graphs) decodes what the eager path does.

Run on a GPU machine: `pytest -m gpu tests/integration/test_generator_gpu.py`.
"""

from __future__ import annotations

import asyncio
import copy

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_graph_decoding_matches_eager_decoding_on_smollm2():
    import crucible_models as models
    from crucible_generator.engine import Engine, SamplingParams

    from tests.unit.test_generator_idle_capture import wait_for_graphs

    model, tokenizer = models.load_model(device="cuda")
    texts = [f"Write a Python function that returns the {w} of a list." for w in ("sum", "maximum", "length")]
    prompts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": t}], add_generation_prompt=True, tokenize=True
        )
        for t in texts
    ]
    prompts = [p["input_ids"] if isinstance(p, dict) or hasattr(p, "keys") else p for p in prompts]
    params = SamplingParams(max_tokens=64, temperature=0.0, logprobs=0)
    outputs = {}
    for mode in ("off", "on"):
        engine = Engine(copy.deepcopy(model), tokenizer, max_batch_size=8, fast_decode=mode)
        assert (engine.fast is not None) == (mode == "on")
        engine.start()
        try:
            outputs[mode] = asyncio.run(engine.generate(prompts, params))
            if mode == "on":
                wait_for_graphs(engine)  # captured in the idle time after (or before) the request
                assert engine.fast.use_graphs and engine.fast.captures > 0
        finally:
            engine.stop()
    # bf16: allow an occasional late divergence, but the start of every answer must agree.
    for eager, fast in zip(outputs["off"], outputs["on"], strict=True):
        assert fast.token_ids[:16] == eager.token_ids[:16]


def test_left_padding_never_produces_nan_in_a_large_batch():
    # Prompts from 3 to ~400 tokens in one bucket: padding positions must not poison real rows.
    import crucible_models as models
    from crucible_generator.engine import Engine, SamplingParams

    model, tokenizer = models.load_model(device="cuda")
    prompts = [tokenizer.encode("def f(x):\n    return x" + " + x" * (i * 7)) for i in range(100)]
    engine = Engine(model, tokenizer, max_batch_size=128, fast_decode="on")
    engine.start()
    try:
        out = asyncio.run(engine.generate(prompts, SamplingParams(max_tokens=8, temperature=0.0, logprobs=0)))
    finally:
        engine.stop()
    assert all(lp == lp for c in out for lp in c.logprobs)  # NaN != NaN


def test_steady_state_decoding_captures_no_graph_and_joins_running_batches():
    # Closed-loop clients on SmolLM2 with graphs: every window is captured (in the engine's idle
    # time), serving captures nothing, sequences join running batches, and answers match the eager
    # path's start.
    import crucible_models as models
    from crucible_generator.engine import Engine, SamplingParams

    from tests.unit.test_generator_idle_capture import wait_for_graphs

    model, tokenizer = models.load_model(device="cuda")
    prompts = [tokenizer.encode(f"def f{i}(x):\n    return x" + " + x" * i) for i in range(24)]

    def params(k):  # clients of different lengths finish at different steps: the others run on
        return SamplingParams(max_tokens=24 + 8 * k, temperature=0.0, ignore_eos=True, logprobs=0)

    async def clients(engine, count=8, each=3):
        async def client(k):
            return [
                (await engine.generate([prompts[(k * each + j) % len(prompts)]], params(k)))[0]
                for j in range(each)
            ]

        return [c for out in await asyncio.gather(*(client(k) for k in range(count))) for c in out]

    eager = Engine(copy.deepcopy(model), tokenizer, max_batch_size=16, fast_decode="off")
    fast = Engine(model, tokenizer, max_batch_size=16, fast_decode="on", join_wait_s=0.0)
    for engine in (eager, fast):
        engine.start()
    try:
        want = asyncio.run(clients(eager))
        got = asyncio.run(clients(fast))
        wait_for_graphs(fast)
        captured = fast.fast.captures
        assert captured == 5 * 8 + 5 * 8  # decode: 5 row sizes x 8 lengths; prefill: 5 counts x 8 widths
        asyncio.run(clients(fast))
        assert fast.fast.captures == captured
        assert fast.metrics.registry.get_sample_value("crucible_generator_joined_sequences_total") > 0
    finally:
        for engine in (eager, fast):
            engine.stop()
    # bf16: different kernels (static masked cache vs dynamic cache) may flip a near-tie argmax in
    # an answer or two; a broken row layout would change most of them.
    agree = sum(f.token_ids[:16] == e.token_ids[:16] for e, f in zip(want, got, strict=True))
    assert agree >= 0.9 * len(want), f"{agree} of {len(want)} answers start as the eager path's do"


def test_sampled_rows_are_drawn_without_a_host_sync():
    # A host sync in sampling makes the decode loop wait for the step in flight (no lookahead).
    from crucible_generator.sampling import RowParams, make_generator, sample

    shared = make_generator(7, "cuda")  # rows 1 and 5 share one: the non-contiguous fill
    rows = [
        RowParams(
            temperature=0.0 if i % 4 == 0 else 1.0,
            top_p=0.9 if i % 3 == 0 else 1.0,
            top_k=50 if i % 5 == 0 else 0,
            generator=shared if i in (1, 5) else make_generator(i, "cuda"),
        )
        for i in range(64)
    ]
    logits = torch.randn(64, 49152, device="cuda", dtype=torch.bfloat16)
    sample(logits, rows, num_top=2)  # warms the pinned-memory cache
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = sample(logits, rows, num_top=2)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    tokens = out.tokens.cpu()
    assert tokens.shape == (64,) and bool(((tokens >= 0) & (tokens < 49152)).all())
    greedy = torch.argmax(logits.float(), dim=-1).cpu()
    assert all(tokens[i] == greedy[i] for i in range(0, 64, 4))


def test_the_fast_path_streams_what_it_generates_as_rows_finish():
    """`Engine.stream` on the continuous path: the same greedy completions as `generate`, each
    yielded when its row finishes: rows that stop at their first token come before rows that run
    to `max_tokens`, whatever their order in the request."""
    import crucible_models as models
    from crucible_generator.engine import Engine, SamplingParams

    from tests.unit.test_generator_idle_capture import wait_for_graphs

    model, tokenizer = models.load_model(device="cuda")
    texts = ["def add(a, b):", "# A list of primes\nprimes = [", "class Stack:\n    def", "import os\nimport"]
    prompts = [tokenizer.encode(t) for t in texts * 2]
    engine = Engine(model, tokenizer, max_batch_size=16, fast_decode="on")
    engine.start()
    try:
        params = SamplingParams(max_tokens=48, temperature=0.0, logprobs=0, ignore_eos=True)
        whole = asyncio.run(engine.generate(prompts, params))
        stop = whole[-1].token_ids[0]  # the last row (and its twin) stop at their first token
        stopped = SamplingParams(
            max_tokens=48, temperature=0.0, logprobs=0, ignore_eos=True, stop_token_ids=(stop,)
        )

        async def streamed():
            return [pair async for pair in engine.stream(prompts, stopped)]

        got = asyncio.run(streamed())
        wait_for_graphs(engine)
        assert engine.fast is not None and engine.fast.captures > 0
    finally:
        engine.stop()
    first = [i for i, w in enumerate(whole) if w.token_ids[0] == stop]
    running = [i for i, w in enumerate(whole) if stop not in w.token_ids]
    assert first and running, "the prompts must give both kinds of rows"
    order = [i for i, _ in got]
    assert sorted(order) == list(range(len(prompts)))
    assert set(order[: len(first)]) == set(first)  # before every running row, though last in the request
    by_index = dict(got)
    assert all(by_index[i].token_ids == [stop] and by_index[i].finish_reason == "stop" for i in first)
    for i in running:
        assert by_index[i].token_ids == whole[i].token_ids and by_index[i].finish_reason == "length"
