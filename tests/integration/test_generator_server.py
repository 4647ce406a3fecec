"""The generator server, spawned with the real SmolLM2, through the official `openai` client."""

from __future__ import annotations

import threading
import time

import httpx
import openai
import pytest
import torch
from crucible_generator.metrics import START_PARTS, process_age_s
from prometheus_client.parser import text_string_to_metric_families

from tests.integration.generator_fixtures import BASE

PROMPT = "def fibonacci(n):"


def test_models_lists_the_base_model(client):
    (card,) = [m for m in client.models.list().data if m.id == BASE]
    assert card.model_extra["max_model_len"] == 8192
    assert card.model_extra["parent"] is None


def test_completion_token_ids_round_trip(client, tokenizer):
    out = client.completions.create(
        model=BASE,
        prompt=PROMPT,
        max_tokens=16,
        temperature=0,
        logprobs=0,
        extra_body={"return_token_ids": True},
    )
    (choice,) = out.choices
    token_ids = choice.model_extra["token_ids"]
    assert choice.text and choice.finish_reason in {"stop", "length"}
    assert choice.model_extra["prompt_token_ids"] == tokenizer(PROMPT).input_ids
    assert tokenizer.decode(token_ids, skip_special_tokens=True) == choice.text
    assert len(token_ids) == out.usage.completion_tokens
    assert out.usage.prompt_tokens == len(tokenizer(PROMPT).input_ids)
    assert len(choice.logprobs.token_logprobs) == len(token_ids)
    assert "".join(choice.logprobs.tokens) == tokenizer.decode(token_ids, skip_special_tokens=False)


@pytest.mark.slow
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_logprobs_are_the_models_raw_logprobs(client, tokenizer, temperature):
    """What the trainer relies on: the returned logprob of each sampled token is log_softmax of the
    model's own logits (temperature 1), whatever the sampling temperature."""
    from crucible_models import load_model

    out = client.completions.create(
        model=BASE, prompt=PROMPT, max_tokens=12, temperature=temperature, seed=5, logprobs=0,
        extra_body={"return_token_ids": True},
    )  # fmt: skip
    choice = out.choices[0]
    prompt_ids, token_ids = choice.model_extra["prompt_token_ids"], choice.model_extra["token_ids"]
    model, _ = load_model(BASE, device="cpu", dtype="float32")
    with torch.no_grad():
        logits = model(torch.tensor([prompt_ids + token_ids])).logits[0, len(prompt_ids) - 1 : -1]
    expected = torch.log_softmax(logits.float(), -1).gather(1, torch.tensor(token_ids)[:, None])[:, 0]
    assert torch.allclose(torch.tensor(choice.logprobs.token_logprobs), expected, atol=1e-3)


def test_chat_completion_uses_the_chat_template(client, tokenizer):
    messages = [{"role": "user", "content": "Write a Python function that reverses a string."}]
    out = client.chat.completions.create(
        model=BASE, messages=messages, max_tokens=24, temperature=0, logprobs=True, top_logprobs=2,
        extra_body={"return_token_ids": True},
    )  # fmt: skip
    choice = out.choices[0]
    expected_prompt = tokenizer(
        tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
        add_special_tokens=False,
    ).input_ids
    assert out.model_extra["prompt_token_ids"] == expected_prompt
    assert choice.message.role == "assistant" and choice.message.content
    assert len(choice.logprobs.content) == len(choice.model_extra["token_ids"]) == out.usage.completion_tokens
    assert all(len(c.top_logprobs) == 2 for c in choice.logprobs.content)


def test_n_samples_expand_in_one_request(client):
    out = client.completions.create(
        model=BASE,
        prompt=PROMPT,
        n=4,
        max_tokens=12,
        temperature=1.0,
        seed=11,
        extra_body={"return_token_ids": True},
    )
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    assert len({c.text for c in out.choices}) > 1
    assert out.usage.completion_tokens == sum(len(c.model_extra["token_ids"]) for c in out.choices)


def test_batched_prompts_give_prompt_major_choices(client):
    out = client.completions.create(
        model=BASE, prompt=["def add(a, b):", "def sub(a, b):"], n=2, max_tokens=4
    )
    assert [c.index for c in out.choices] == [0, 1, 2, 3]


def test_stop_sequences_truncate_and_report_the_stop(client):
    free = client.completions.create(model=BASE, prompt=PROMPT, max_tokens=24, temperature=0).choices[0]
    stop = free.text.strip()[3:6]  # a string that occurs in the greedy continuation
    cut = client.completions.create(
        model=BASE, prompt=PROMPT, max_tokens=24, temperature=0, stop=[stop]
    ).choices[0]
    assert cut.text == free.text[: free.text.index(stop)]
    assert cut.finish_reason == "stop" and cut.model_extra["stop_reason"] == stop


def test_seeded_sampling_is_deterministic(client):
    def draw(seed):
        out = client.completions.create(
            model=BASE, prompt=PROMPT, n=2, max_tokens=16, temperature=1.0, seed=seed
        )
        return [c.text for c in out.choices]

    first = draw(1234)
    assert draw(1234) == first
    assert draw(4321) != first


def test_seeded_sampling_does_not_depend_on_the_batch(client):
    alone = client.completions.create(model=BASE, prompt=PROMPT, max_tokens=16, temperature=1.0, seed=99)
    results = {}

    def other(i):
        results[i] = client.completions.create(
            model=BASE, prompt="x" * (i + 1) + " = [", max_tokens=8, temperature=1.0
        )

    threads = [threading.Thread(target=other, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    batched = client.completions.create(model=BASE, prompt=PROMPT, max_tokens=16, temperature=1.0, seed=99)
    for t in threads:
        t.join()
    assert batched.choices[0].text == alone.choices[0].text


@pytest.mark.parametrize(
    ("kwargs", "error", "param"),
    [
        ({"model": "no-such-model"}, openai.NotFoundError, "model"),
        ({"temperature": -1.0}, openai.BadRequestError, "temperature"),
        ({"top_p": 0.0}, openai.BadRequestError, "top_p"),
        ({"n": 0}, openai.BadRequestError, "n"),
        ({"max_tokens": 100_000}, openai.BadRequestError, "max_tokens"),
        ({"logprobs": 50}, openai.BadRequestError, "logprobs"),
        ({"extra_body": {"n": "two"}}, openai.BadRequestError, "n"),
        ({"extra_body": {"prompt_logprobs": 1}}, openai.BadRequestError, "prompt_logprobs"),
    ],
)
def test_bad_requests_get_vllm_shaped_errors(client, kwargs, error, param):
    request = {"model": BASE, "prompt": PROMPT, "max_tokens": 4, **kwargs}
    with pytest.raises(error) as caught:
        client.completions.create(**request)
    body = caught.value.body
    assert set(body) >= {"message", "type", "param", "code"}  # the client unwraps {"error": {...}}
    assert body["code"] == caught.value.status_code and body["param"] == param


def test_error_envelope_on_the_wire(generator):
    response = httpx.post(f"{generator.url}/v1/completions", json={"model": "nope", "prompt": "x"})
    assert response.status_code == 404
    assert response.json() == {
        "error": {
            "message": "The model `nope` does not exist.",
            "type": "NotFoundError",
            "param": "model",
            "code": 404,
        }
    }
    invalid = httpx.post(f"{generator.url}/v1/chat/completions", json={"model": BASE})
    assert invalid.status_code == 400 and invalid.json()["error"]["param"] == "messages"


@pytest.mark.slow
def test_health_answers_while_a_long_batch_runs(generator, client):
    done = threading.Event()

    def long_request():
        client.completions.create(
            model=BASE, prompt=PROMPT, max_tokens=160, temperature=0, extra_body={"ignore_eos": True}
        )
        done.set()

    thread = threading.Thread(target=long_request)
    thread.start()
    time.sleep(1.0)  # let the batch start decoding
    latencies = []
    while not done.is_set() and len(latencies) < 10:
        started = time.perf_counter()
        assert httpx.get(f"{generator.url}/health", timeout=5).status_code == 200
        latencies.append(time.perf_counter() - started)
        time.sleep(0.1)
    thread.join()
    assert len(latencies) >= 3, "the long request finished before /health was probed"
    assert max(latencies) < 0.5


def test_metrics_count_tokens(generator, client):
    client.completions.create(model=BASE, prompt=PROMPT, max_tokens=2)
    text = httpx.get(f"{generator.url}/metrics").text
    assert "crucible_generator_generation_tokens_total" in text
    assert 'crucible_generator_requests_total{route="/v1/completions",status="200"}' in text


def test_metrics_say_what_the_start_took(generator):
    """Each part of the server's start is measured, and together they fit in the process's life."""
    text = httpx.get(f"{generator.url}/metrics").text
    age = process_age_s(generator.proc.pid)
    parts = {
        s.name: s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name.startswith("crucible_generator_start_")
    }
    assert set(parts) == {f"crucible_generator_start_{p}_seconds" for p in START_PARTS}
    assert all(value > 0 for value in parts.values()), parts
    assert age is not None and sum(parts.values()) <= age, (parts, age)


@pytest.mark.slow
def test_a_client_that_hangs_up_stops_its_generation(generator):
    body = {"model": BASE, "prompt": PROMPT, "max_tokens": 4000, "temperature": 0, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{generator.url}/v1/completions", json=body, timeout=1.5)
    deadline = time.monotonic() + 5
    while "crucible_generator_running_sequences 0.0" not in httpx.get(f"{generator.url}/metrics").text:
        assert time.monotonic() < deadline, "the abandoned request is still decoding"
        time.sleep(0.2)


def _streamed(events) -> tuple[list[int], dict[int, dict], list]:
    """A streamed completion's events folded per choice: the order choices finished in, each
    choice's text, token ids, logprobs and finish reason, and the usage events."""
    order, choices, usage = [], {}, []
    for event in events:
        if not event.choices:
            usage.append(event.usage)
        for c in event.choices:
            mine = choices.setdefault(c.index, {"text": "", "token_ids": [], "logprobs": [], "finish": None})
            mine["text"] += c.text
            mine["token_ids"] += c.model_extra.get("token_ids") or []
            mine["logprobs"] += c.logprobs.token_logprobs if c.logprobs else []
            if c.finish_reason is not None:
                mine["finish"] = c.finish_reason
                order.append(c.index)
    return order, choices, usage


def test_a_streamed_completion_equals_the_whole_answer(client):
    """`stream: true` (vLLM's server-sent events) carries the same choices as the same seeded
    request answered at once, each finished once, and the usage last when asked for."""
    request = {"model": BASE, "prompt": [PROMPT, "def add(a, b):"], "n": 2, "max_tokens": 12,
               "temperature": 1.0, "seed": 7, "logprobs": 0, "extra_body": {"return_token_ids": True}}  # fmt: skip
    whole = client.completions.create(**request)
    events = list(client.completions.create(**request, stream=True, stream_options={"include_usage": True}))
    assert {e.object for e in events} == {"text_completion"} and len({e.id for e in events}) == 1
    order, choices, usage = _streamed(events)
    assert sorted(order) == [0, 1, 2, 3]
    for c in whole.choices:
        mine = choices[c.index]
        assert mine["text"] == c.text and mine["finish"] == c.finish_reason
        assert mine["token_ids"] == c.model_extra["token_ids"]
        assert mine["logprobs"] == pytest.approx(c.logprobs.token_logprobs)
    assert [u.completion_tokens for u in usage] == [whole.usage.completion_tokens]


def test_streamed_choices_arrive_as_they_finish(client):
    """A choice that stops at its first token is sent before one still decoding: the events come
    in the order the choices finish, not in index order (as the answer sent at once has them)."""
    long_prompt, short_prompt = PROMPT, "x = [1, 2, 3]\nprint("
    long_ids = client.completions.create(
        model=BASE, prompt=long_prompt, max_tokens=40, temperature=0, extra_body={"ignore_eos": True,
        "return_token_ids": True}).choices[0].model_extra["token_ids"]  # fmt: skip
    first = (
        client.completions.create(
            model=BASE,
            prompt=short_prompt,
            max_tokens=1,
            temperature=0,
            extra_body={"return_token_ids": True},
        )
        .choices[0]
        .model_extra["token_ids"][0]
    )
    assert first not in long_ids, "pick prompts whose greedy tokens differ"
    events = client.completions.create(
        model=BASE, prompt=[long_prompt, short_prompt], max_tokens=40, temperature=0, stream=True,
        extra_body={"ignore_eos": True, "stop_token_ids": [first], "return_token_ids": True},
    )  # fmt: skip
    order, choices, _ = _streamed(events)
    assert order == [1, 0]
    assert choices[1]["finish"] == "stop" and choices[0]["finish"] == "length"
    assert choices[0]["token_ids"] == long_ids


def test_stream_errors_are_vllms(generator):
    options = {"model": BASE, "prompt": PROMPT, "stream_options": {"include_usage": True}}
    response = httpx.post(f"{generator.url}/v1/completions", json=options)
    assert response.status_code == 400 and response.json()["error"]["param"] == "stream_options"
    bad = {"model": BASE, "prompt": PROMPT, "stream": True, "temperature": -1}
    response = httpx.post(f"{generator.url}/v1/completions", json=bad)  # checked before the first event
    assert response.status_code == 400 and response.json()["error"]["param"] == "temperature"
    chat = {"model": BASE, "messages": [], "stream": True}
    response = httpx.post(f"{generator.url}/v1/chat/completions", json=chat)
    assert response.status_code == 400 and response.json()["error"]["param"] == "messages"


def test_a_streamed_chat_completion_equals_the_whole_answer(client):
    """Chat with `stream: true`: vLLM's events (the role of every choice first, with the prompt's
    token ids; then the content; `chat.completion.chunk` objects) carry the answer sent at once."""
    messages = [{"role": "user", "content": "Write a Python function that reverses a string."}]
    request = {"model": BASE, "messages": messages, "n": 2, "max_tokens": 16, "temperature": 1.0, "seed": 3,
               "logprobs": True, "extra_body": {"return_token_ids": True}}  # fmt: skip
    whole = client.chat.completions.create(**request)
    events = list(
        client.chat.completions.create(**request, stream=True, stream_options={"include_usage": True})
    )
    assert {e.object for e in events} == {"chat.completion.chunk"}
    roles = events[:2]
    assert [c.delta.role for e in roles for c in e.choices] == ["assistant", "assistant"]
    assert roles[0].model_extra["prompt_token_ids"] == whole.model_extra["prompt_token_ids"]
    content, tokens, finish = {}, {}, {}
    for e in events[2:]:
        for c in e.choices:
            content[c.index] = content.get(c.index, "") + (c.delta.content or "")
            tokens[c.index] = tokens.get(c.index, []) + (c.model_extra.get("token_ids") or [])
            finish[c.index] = c.finish_reason or finish.get(c.index)
    for c in whole.choices:
        assert content[c.index] == c.message.content and finish[c.index] == c.finish_reason
        assert tokens[c.index] == c.model_extra["token_ids"]
    assert events[-1].usage.completion_tokens == whole.usage.completion_tokens


@pytest.mark.slow
def test_a_client_that_hangs_up_stops_its_stream(generator):
    body = {"model": BASE, "prompt": PROMPT, "max_tokens": 4000, "temperature": 0, "ignore_eos": True}
    with httpx.stream(
        "POST", f"{generator.url}/v1/completions", json=body | {"stream": True}, timeout=30
    ) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        time.sleep(1.0)
    deadline = time.monotonic() + 5
    while "crucible_generator_running_sequences 0.0" not in httpx.get(f"{generator.url}/metrics").text:
        assert time.monotonic() < deadline, "the abandoned stream is still decoding"
        time.sleep(0.2)
