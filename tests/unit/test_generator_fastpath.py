"""The fast decode path (merged weights, static KV cache) must generate what the eager PEFT path does.

Both engines serve the same tiny random Llama and the same LoRA adapters; on CPU the fast path runs
its static-cache steps without CUDA graphs, which are the same steps captured.
"""

from __future__ import annotations

import asyncio
import copy

import pytest
import torch
from crucible_generator.engine import Engine, SamplingParams
from crucible_generator.fastpath import LENGTH_BUCKET, MergedModel, bucket, prefill_mask
from crucible_generator.features import config_gap
from peft import LoraConfig, get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig

from tests.unit.test_generator_engine import DigitsTokenizer
from tests.unit.test_generator_engine import tiny_model as tiny_llama

PROMPTS = [[5, 6, 7], [9], [3, 4, 5, 6, 7, 8, 9, 10], [11, 12], [13, 14, 15, 16, 17]]


def tiny_model() -> LlamaForCausalLM:
    return tiny_llama(max_positions=512)


def save_adapter(base, path, seed: int, targets: list[str]) -> str:
    torch.manual_seed(seed)
    peft_model = get_peft_model(copy.deepcopy(base), LoraConfig(r=4, lora_alpha=8, target_modules=targets))
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.5)  # non-zero: the adapter changes what the model writes
    peft_model.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    model = tiny_model()
    root = tmp_path_factory.mktemp("fastpath")
    adapters = {
        "a1": save_adapter(model, root / "a1", 1, ["q_proj", "v_proj"]),
        "a3": save_adapter(model, root / "a3", 3, ["q_proj", "v_proj"]),  # a1's config, other weights
        "a2": save_adapter(model, root / "a2", 2, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                   "up_proj", "down_proj"]),
    }  # fmt: skip
    eager = Engine(
        copy.deepcopy(model), DigitsTokenizer(), max_batch_size=8, batch_wait_s=0.05, fast_decode="off"
    )
    fast = Engine(model, DigitsTokenizer(), max_batch_size=8, batch_wait_s=0.05, fast_decode="on")
    assert eager.fast is None and fast.fast is not None
    for eng in (eager, fast):
        eng.start()
        for name, path in adapters.items():
            asyncio.run(eng.load_adapter(name, path))
    yield eager, fast
    for eng in (eager, fast):
        eng.stop()


def greedy(max_tokens=14):
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=0)


def generate(engine, adapter):
    return asyncio.run(engine.generate(PROMPTS, greedy(), adapter=adapter))


@pytest.mark.parametrize("adapter", [None, "a1", "a2", "a1", None])
def test_fast_path_matches_eager_path(engines, adapter):
    eager, fast = engines
    want, got = generate(eager, adapter), generate(fast, adapter)
    assert [c.token_ids for c in got] == [c.token_ids for c in want]
    for g, w in zip(got, want, strict=True):
        assert g.logprobs == pytest.approx(w.logprobs, abs=1e-4)
    assert fast.fast.merged.current == (fast.adapters.slot(adapter) if adapter else None)


def test_adapters_change_the_output(engines):
    _, fast = engines
    outputs = {a: [c.token_ids for c in generate(fast, a)] for a in (None, "a1", "a2")}
    assert outputs[None] != outputs["a1"] != outputs["a2"] != outputs[None]


def test_mixed_batch_takes_the_eager_path_and_agrees(engines):
    eager, fast = engines

    async def mixed(engine):
        return await asyncio.gather(
            engine.generate(PROMPTS[:2], greedy(), adapter="a1"), engine.generate(PROMPTS[2:], greedy())
        )

    want, got = asyncio.run(mixed(eager)), asyncio.run(mixed(fast))
    assert [[c.token_ids for c in r] for r in got] == [[c.token_ids for c in r] for r in want]


def test_seeded_sampling_is_reproducible_on_the_fast_path(engines):
    _, fast = engines
    params = SamplingParams(max_tokens=10, temperature=1.0, top_p=0.9, seed=7, ignore_eos=True)
    first = asyncio.run(fast.generate(PROMPTS, params, n=2, adapter="a2"))
    again = asyncio.run(fast.generate(PROMPTS, params, n=2, adapter="a2"))
    assert [c.token_ids for c in first] == [c.token_ids for c in again]


def test_rows_finishing_early_do_not_disturb_the_others(engines):
    eager, fast = engines

    async def run(engine):
        return await asyncio.gather(
            engine.generate(PROMPTS[:1], greedy(20)), engine.generate(PROMPTS[1:2], greedy(3))
        )

    assert [r[0].token_ids for r in asyncio.run(run(fast))] == [
        r[0].token_ids for r in asyncio.run(run(eager))
    ]


def test_merging_restores_layers_the_next_adapter_does_not_touch(engines):
    _, fast = engines
    generate(fast, "a2")  # touches every linear layer
    generate(fast, "a1")  # only q and v: the others must be back to the base weights
    merged = fast.fast.merged.model
    base = fast.peft.get_base_model() if fast.peft is not None else fast.base
    assert torch.equal(
        merged.model.layers[0].mlp.up_proj.weight, base.model.layers[0].mlp.up_proj.base_layer.weight
    )


def test_unmergeable_and_unsupported_cases():
    llama, mistral = LlamaConfig(), MistralConfig(sliding_window=16)
    llama._attn_implementation = mistral._attn_implementation = "sdpa"
    assert config_gap(llama, LENGTH_BUCKET) is None
    assert "sliding-window" in config_gap(mistral, LENGTH_BUCKET)
    assert bucket(5, 64) == 8 and bucket(64, 64) == 64 and bucket(40, 48) == 48 and bucket(1, 8) == 1
    model = tiny_model()
    peft_model = get_peft_model(
        copy.deepcopy(model), LoraConfig(r=2, target_modules=["q_proj"], use_dora=True)
    )
    assert MergedModel(model).select(peft_model, "default") is False


def test_a_same_shaped_load_reuses_an_unloaded_slot(engines, tmp_path):
    eager, fast = engines
    model = tiny_model()
    for engine in (eager, fast):
        asyncio.run(engine.load_adapter("v1", save_adapter(model, tmp_path / "v1", 11, ["q_proj", "v_proj"])))
        old_slot = engine.adapters.slot("v1")
        before = [c.token_ids for c in generate(engine, "v1")]
        asyncio.run(engine.unload_adapter("v1"))
        assert engine._spare is not None and engine._spare.slot == old_slot
        asyncio.run(engine.load_adapter("v2", save_adapter(model, tmp_path / "v2", 12, ["q_proj", "v_proj"])))
        assert engine.adapters.slot("v2") == old_slot and engine._spare is None
        after = [c.token_ids for c in generate(engine, "v2")]
        assert after != before  # the new weights are served, not the old ones
        asyncio.run(engine.unload_adapter("v2"))
    # Both engines reused their slot and still agree with each other.
    for engine in (eager, fast):
        asyncio.run(engine.load_adapter("v3", str(tmp_path / "v1")))
    assert [c.token_ids for c in generate(fast, "v3")] == [c.token_ids for c in generate(eager, "v3")]
    assert [c.token_ids for c in generate(fast, "v3")] == before


def test_prefill_mask_leaves_no_query_without_a_key():
    mask2d = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1], [0, 0, 0, 0]], dtype=torch.bool)
    mask = prefill_mask(mask2d, 8, torch.bfloat16)
    visible = mask[:, 0] == 0  # [B, q, k]
    assert visible.any(-1).all()  # every query row sees at least one key (no NaN in fused kernels)
    assert not visible[..., 4:].any()  # nothing beyond the prompt
    # Real tokens see exactly the real tokens up to themselves.
    assert visible[0, 3].tolist()[:4] == [False, False, True, True]
    assert visible[1, 2].tolist()[:4] == [True, True, True, False]
    # A padding position sees only itself.
    assert visible[0, 1].tolist()[:4] == [False, True, False, False]
