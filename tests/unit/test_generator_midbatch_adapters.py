"""Adapters loaded and unloaded while a batch decodes (overlapped rollouts publish a version while
the generator samples the next step's): later loads still work, and a row keeps its adapter."""

from __future__ import annotations

import asyncio

import torch
from crucible_generator.engine import Engine, SamplingParams
from peft import LoraConfig, get_peft_model

from tests.unit.test_generator_engine import DigitsTokenizer, tiny_model


def _adapter(path, seed: int):
    torch.manual_seed(seed)
    config = LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    get_peft_model(tiny_model(), config).save_pretrained(path)
    return str(path)


def test_adapters_swapped_mid_batch_leave_later_loads_and_the_row_intact(tmp_path) -> None:
    paths = [_adapter(tmp_path / f"a{i}", i) for i in range(4)]
    params = SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True)

    async def go() -> tuple[list[int], list[int]]:
        engine = Engine(tiny_model(), DigitsTokenizer(), max_batch_size=8, batch_wait_s=0.01, seed=0)
        engine.start()
        try:
            await engine.load_adapter("a0", paths[0])
            decoding = asyncio.create_task(engine.generate([[2, 3, 4]], params, adapter="a0"))
            await asyncio.sleep(0.05)
            # Between two decode steps, inside the batch's inference mode.
            await engine.load_adapter("a1", paths[1])
            await engine.unload_adapter("a0")
            await engine.load_adapter("a2", paths[2])
            (during,) = await decoding
            # Outside any batch: these failed on the inference tensors the loads above left.
            await engine.load_adapter("a3", paths[3])
            await engine.unload_adapter("a1")
            await engine.load_adapter("a0", paths[0])
            (alone,) = await engine.generate([[2, 3, 4]], params, adapter="a0")
            return during.token_ids, alone.token_ids
        finally:
            engine.stop()

    during, alone = asyncio.run(go())
    assert len(during) == 100 and during == alone
