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
                assert engine.fast.use_graphs and any(
                    e.graph is not None for e in engine.fast.entries.values()
                )
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
