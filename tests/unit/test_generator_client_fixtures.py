"""The shared generator client against recorded vLLM bodies (tests/fixtures/vllm), through a mock transport."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx
import openai
import pytest
from crucible_shared.generator_client import (
    AdapterBroadcastError,
    GeneratorAPIError,
    GeneratorClient,
    GeneratorPool,
    parse_error,
    samples,
)
from crucible_shared.openai_protocol import ChatCompletionResponse, CompletionResponse, ModelList

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "vllm"


def fixture(name: str) -> dict:
    return json.loads((FIXTURES / name).read_text())


def reply(name: str) -> httpx.Response:
    data = fixture(name)
    if data.get("content_type") == "text/plain":
        return httpx.Response(data["status"], text=data["body"])
    return httpx.Response(data["status"], json=data["body"])


def client_with(handler, **kw) -> GeneratorClient:
    return GeneratorClient("http://vllm:8000", transport=httpx.MockTransport(handler), backoff=0.0, **kw)


def run(coro):
    return asyncio.run(coro)


@pytest.mark.parametrize(
    ("name", "model"),
    [
        ("completion_n2_logprobs_token_ids.json", CompletionResponse),
        ("chat_completion_logprobs_token_ids.json", ChatCompletionResponse),
        ("models_with_lora.json", ModelList),
    ],
)
def test_recorded_bodies_parse_with_our_models_and_openais(name, model):
    body = fixture(name)["body"]
    parsed = model.model_validate(body)
    assert parsed.model_dump(exclude_unset=True) == body  # nothing lost, unknown fields kept
    openai_type = {
        CompletionResponse: openai.types.Completion,
        ChatCompletionResponse: openai.types.chat.ChatCompletion,
        ModelList: None,
    }[model]
    if openai_type is not None:
        openai_type.model_validate(body)


def test_complete_sends_vllm_fields_and_flattens_samples():
    seen = {}

    def handler(request: httpx.Request) -> httpx.Response:
        seen.update(json.loads(request.content))
        return reply("completion_n2_logprobs_token_ids.json")

    async def go():
        async with client_with(handler) as gen:
            return await gen.complete(
                "def add(a, b):", model="job42-v10", n=2, max_tokens=32, seed=7, logprobs=0
            )

    out = run(go())
    assert seen["return_token_ids"] is True and seen["logprobs"] == 0 and "top_p" not in seen
    flat = samples(out, n=2)
    assert [s.index for s in flat] == [0, 1]
    for s in flat:
        assert len(s.token_ids) == len(s.logprobs)
        assert s.prompt_token_ids == [1604, 803, 24, 81, 28, 278, 727]
    assert all(len(s.token_ids) == 32 and s.finish_reason == "length" for s in flat)
    assert flat[0].token_ids != flat[1].token_ids  # two samples, not one answer twice


def test_chat_samples_carry_prompt_ids_and_logprobs():
    async def go():
        async with client_with(lambda r: reply("chat_completion_logprobs_token_ids.json")) as gen:
            return await gen.chat([{"role": "user", "content": "hi"}], logprobs=True, top_logprobs=2)

    (s,) = samples(run(go()))
    assert s.text.startswith("```python\nadd(a, b)") and len(s.logprobs) == len(s.token_ids) == 24
    assert s.prompt_token_ids and s.prompt_token_ids[0] == 1


@pytest.mark.parametrize(
    ("name", "status", "type_"),
    [
        ("error_model_not_found.json", 404, "NotFoundError"),
        ("error_lora_already_loaded.json", 400, "InvalidUserInput"),
        ("error_lora_path_not_found.json", 404, "NotFoundError"),
        ("error_unload_not_found.json", 404, "NotFoundError"),
        ("error_validation.json", 400, "Bad Request"),
        ("error_bad_sampling_param.json", 400, "BadRequestError"),
        ("error_legacy_object_shape.json", 404, "NotFoundError"),
    ],
)
def test_error_bodies_parse(name, status, type_):
    data = fixture(name)
    err = parse_error(data["status"], json.dumps(data["body"]))
    assert (err.status, err.type) == (status, type_)
    assert err.message == (data["body"].get("error") or data["body"])["message"]


def test_plain_text_error_body():
    err = parse_error(502, b"Bad Gateway")
    assert err.status == 502 and err.message == "Bad Gateway" and err.retryable


def test_unknown_model_raises_api_error():
    async def go():
        async with client_with(lambda r: reply("error_model_not_found.json")) as gen:
            await gen.complete("x", model="job42-v9")

    with pytest.raises(GeneratorAPIError) as err:
        run(go())
    assert err.value.status == 404 and err.value.param == "model"


def test_load_is_retried_and_already_loaded_after_a_retry_is_success():
    calls = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(request.url.path)
        if len(calls) == 1:
            return httpx.Response(503, text="upstream restarting")
        return reply("error_lora_already_loaded.json")  # the first attempt had landed

    async def go():
        async with client_with(handler) as gen:
            await gen.load_adapter("job42-v10", "/adapters/job42/v10")

    run(go())
    assert calls == ["/v1/load_lora_adapter"] * 2


def test_load_of_a_loaded_name_on_first_attempt_raises():
    async def go():
        async with client_with(lambda r: reply("error_lora_already_loaded.json")) as gen:
            await gen.load_adapter("job42-v10", "/adapters/job42/v10")

    with pytest.raises(GeneratorAPIError, match="already been loaded"):
        run(go())


def test_load_retries_connection_errors_then_succeeds():
    calls = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(1)
        if len(calls) < 3:
            raise httpx.ConnectError("refused", request=request)
        return reply("load_lora_adapter_ok.json")

    async def go():
        async with client_with(handler, retries=3) as gen:
            await gen.load_adapter("job42-v10", "/adapters/job42/v10")

    run(go())
    assert len(calls) == 3


def test_unload_missing_ok():
    async def go():
        async with client_with(lambda r: reply("error_unload_not_found.json")) as gen:
            await gen.unload_adapter("job42-v3", missing_ok=True)
            await gen.unload_adapter("job42-v3")

    with pytest.raises(GeneratorAPIError) as err:
        run(go())
    assert err.value.status == 404


def test_pool_broadcast_rolls_back_on_partial_failure():
    log: list[tuple[str, str]] = []

    def replica(name: str, fail: bool):
        def handler(request: httpx.Request) -> httpx.Response:
            log.append((name, request.url.path))
            if request.url.path == "/v1/load_lora_adapter":
                return reply("error_lora_path_not_found.json" if fail else "load_lora_adapter_ok.json")
            return reply("unload_lora_adapter_ok.json")

        return GeneratorClient(f"http://{name}", transport=httpx.MockTransport(handler), backoff=0.0)

    async def go():
        async with GeneratorPool([replica("a", False), replica("b", True), replica("c", False)]) as pool:
            await pool.load_adapter("job42-v11", "/adapters/job42/v11")

    with pytest.raises(AdapterBroadcastError) as err:
        run(go())
    assert set(err.value.failures) == {"http://b"}
    assert sorted(err.value.rolled_back) == ["http://a", "http://c"]
    assert ("a", "/v1/unload_lora_adapter") in log and ("c", "/v1/unload_lora_adapter") in log
    assert ("b", "/v1/unload_lora_adapter") not in log


def test_pool_broadcast_success_loads_everywhere():
    loaded = []

    def handler(request: httpx.Request) -> httpx.Response:
        loaded.append(str(request.url.host))
        return reply("load_lora_adapter_ok.json")

    async def go():
        clients = [GeneratorClient(f"http://r{i}", transport=httpx.MockTransport(handler)) for i in range(3)]
        async with GeneratorPool(clients) as pool:
            await pool.load_adapter("job42-v10", "/adapters/job42/v10")

    run(go())
    assert sorted(loaded) == ["r0", "r1", "r2"]


def echo_replica(name: str, seen: list) -> GeneratorClient:
    """A replica whose completions name it, the prompt and the sample: `<replica>:<prompt>:<j>`."""

    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        prompts, n = body["prompt"], body["n"]
        seen.append((name, prompts))
        choices = [
            {"index": p * n + j, "text": f"{name}:{prompt}:{j}", "finish_reason": "length"}
            for p, prompt in enumerate(prompts)
            for j in range(n)
        ]
        usage = {"prompt_tokens": len(prompts), "completion_tokens": 2 * len(choices), "total_tokens": 0}
        return httpx.Response(200, json={"model": body["model"], "choices": choices, "usage": usage})

    return GeneratorClient(f"http://{name}", transport=httpx.MockTransport(handler))


def test_pool_splits_a_request_of_several_prompts_over_its_replicas():
    seen: list = []

    async def go():
        async with GeneratorPool([echo_replica(r, seen) for r in ("r0", "r1", "r2")]) as pool:
            return await pool.complete(["a", "b", "c", "d", "e"], model="m", n=2, seed=7)

    out = run(go())
    assert sorted(prompts for _, prompts in seen) == [["a", "b"], ["c", "d"], ["e"]]
    assert sorted(name for name, _ in seen) == ["r0", "r1", "r2"]  # one share each
    got = samples(out, 2)
    assert [(s.prompt_index, s.index) for s in got] == [(i // 2, i) for i in range(10)]
    assert [s.text.split(":", 1)[1] for s in got] == [f"{p}:{j}" for p in "abcde" for j in range(2)]
    assert out.usage.prompt_tokens == 5 and out.usage.completion_tokens == 20


def test_pool_sends_one_prompt_or_one_replica_whole():
    seen: list = []

    async def go():
        async with GeneratorPool([echo_replica("r0", seen), echo_replica("r1", seen)]) as pool:
            await pool.complete(["only"], model="m", n=3)
        async with GeneratorPool([echo_replica("solo", seen)]) as pool:
            await pool.complete(["a", "b", "c"], model="m", n=1)

    run(go())
    assert [prompts for _, prompts in seen] == [["only"], ["a", "b", "c"]]


def test_wait_ready_times_out():
    async def go():
        async with client_with(lambda r: httpx.Response(503)) as gen:
            await gen.wait_ready(timeout=0.2, interval=0.05)

    with pytest.raises(TimeoutError):
        run(go())
