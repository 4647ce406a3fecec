"""The shared async client against the real generator (the same client talks to vLLM)."""

from __future__ import annotations

import asyncio

import pytest
from crucible_shared.generator_client import (
    AdapterBroadcastError,
    GeneratorAPIError,
    GeneratorClient,
    GeneratorPool,
    samples,
)

from tests.integration.generator_fixtures import BASE
from tests.servers import free_port


def run(coro):
    return asyncio.run(coro)


def test_completions_with_token_ids_and_logprobs(generator, tokenizer):
    async def go():
        async with GeneratorClient(generator.url) as gen:
            await gen.wait_ready(timeout=10)
            return await gen.complete(
                ["def add(a, b):", "def mul(a, b):"], model=BASE, n=2, max_tokens=8, logprobs=0
            )

    flat = samples(run(go()), n=2)
    assert [s.prompt_index for s in flat] == [0, 0, 1, 1]
    for s in flat:
        assert len(s.token_ids) == len(s.logprobs) and all(lp <= 0 for lp in s.logprobs)
        assert tokenizer.decode(s.token_ids, skip_special_tokens=True) == s.text
    assert flat[2].prompt_token_ids == tokenizer("def mul(a, b):").input_ids


def test_chat_through_the_client(generator):
    async def go():
        async with GeneratorClient(generator.url) as gen:
            return await gen.chat([{"role": "user", "content": "Say hi."}], max_tokens=6, logprobs=True)

    (s,) = samples(run(go()))
    assert s.prompt_token_ids and len(s.logprobs) == len(s.token_ids)


def test_adapter_load_unload_round_trip(generator, lora_dirs):
    async def go():
        async with GeneratorClient(generator.url) as gen:
            await gen.load_adapter("client-v1", lora_dirs["v1"])
            with pytest.raises(GeneratorAPIError) as twice:
                await gen.load_adapter("client-v1", lora_dirs["v1"])
            out = await gen.complete("def f(x):", model="client-v1", max_tokens=4)
            await gen.unload_adapter("client-v1")
            await gen.unload_adapter("client-v1", missing_ok=True)
            names = {m.id for m in (await gen.models()).data}
            return twice.value, out, names

    twice, out, names = run(go())
    assert twice.status == 400 and twice.already_loaded
    assert out.model == "client-v1" and "client-v1" not in names


def test_broadcast_rolls_back_when_a_replica_is_down(generator, lora_dirs):
    dead = f"http://127.0.0.1:{free_port()}"

    async def go():
        clients = [
            GeneratorClient(generator.url, retries=1, backoff=0.01),
            GeneratorClient(dead, retries=1, backoff=0.01),
        ]
        async with GeneratorPool(clients) as pool:
            with pytest.raises(AdapterBroadcastError) as err:
                await pool.load_adapter("bcast-v1", lora_dirs["v1"])
            names = {m.id for m in (await clients[0].models()).data}
            return err.value, names

    err, names = run(go())
    assert list(err.failures) == [dead] and err.rolled_back == [generator.url]
    assert "bcast-v1" not in names
