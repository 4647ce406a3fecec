"""Streamed completions in the shared generator client: vLLM's token-by-token events folded into
whole choices, yielded as each finishes; broken streams retried without repeating a choice;
servers that will not stream asked once without; error events raised."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx
import pytest
from crucible_shared.generator_client import GeneratorAPIError, GeneratorClient, GeneratorPool

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "vllm"
RECORDED = json.loads((FIXTURES / "completion_n2_logprobs_token_ids.json").read_text())["body"]


def vllm_events(body: dict, *, upto: int | None = None) -> list[dict]:
    """A recorded completion as vLLM 0.22 streams it (`completion_stream_generator`): an event per
    token and choice, the choices interleaved, `prompt_token_ids` in a choice's first event only,
    `finish_reason` on its last; then the usage event. `upto`: only the first `upto` events."""
    events, longest = [], max(len(c["token_ids"]) for c in body["choices"])
    head = {k: body[k] for k in ("id", "object", "created", "model")}
    for t in range(longest):
        for c in body["choices"]:
            if t >= len(c["token_ids"]):
                continue
            lp = c["logprobs"]
            last = t == len(c["token_ids"]) - 1
            delta = {
                "index": c["index"],
                "text": lp["tokens"][t],
                "logprobs": {
                    key: [lp[key][t]] for key in ("text_offset", "token_logprobs", "tokens", "top_logprobs")
                },
                "finish_reason": c["finish_reason"] if last else None,
                "stop_reason": c["stop_reason"] if last else None,
                "prompt_token_ids": c["prompt_token_ids"] if t == 0 else None,
                "token_ids": [c["token_ids"][t]],
            }
            events.append(head | {"choices": [delta]})
    events.append(head | {"choices": [], "usage": body["usage"]})
    return events[:upto]


def sse(events: list[dict], done: bool = True) -> bytes:
    lines = [f"data: {json.dumps(e)}\n\n" for e in events] + (["data: [DONE]\n\n"] if done else [])
    return "".join(lines).encode()


def client_with(handler) -> GeneratorClient:
    return GeneratorClient("http://vllm:8000", transport=httpx.MockTransport(handler), backoff=0.0)


def streamed(client, prompt="def add(a, b):", **kw) -> list:
    async def go():
        return [c async for c in client.complete_stream(prompt, n=2, max_tokens=32, seed=7, logprobs=0, **kw)]

    return asyncio.run(go())


def assert_the_recorded_choices(got: list) -> None:
    """`got` are the two choices of the recorded whole answer: text, ids, reasons and logprobs."""
    assert sorted(c.index for c in got) == [0, 1]
    for c in got:
        want = RECORDED["choices"][c.index]
        assert c.text == want["text"] and c.token_ids == want["token_ids"]
        assert c.prompt_token_ids == want["prompt_token_ids"] and c.finish_reason == want["finish_reason"]
        for key in ("token_logprobs", "tokens", "text_offset"):
            assert getattr(c.logprobs, key) == want["logprobs"][key]


def test_vllms_token_events_fold_into_the_recorded_choices():
    sent = []

    def handler(request):
        sent.append(json.loads(request.content))
        return httpx.Response(
            200, content=sse(vllm_events(RECORDED)), headers={"content-type": "text/event-stream"}
        )

    got = streamed(client_with(handler))
    assert sent[0]["stream"] is True and sent[0]["return_token_ids"] is True and sent[0]["n"] == 2
    assert_the_recorded_choices(got)


def test_a_choice_is_yielded_when_it_finishes_not_at_the_end():
    """The shorter choice's last event comes before the longer one's: it is yielded first."""
    body = json.loads(json.dumps(RECORDED))
    short = body["choices"][1]
    for key in ("token_ids",):
        short[key] = short[key][:3]
    for key in ("text_offset", "token_logprobs", "tokens", "top_logprobs"):
        short["logprobs"][key] = short["logprobs"][key][:3]
    short["text"], short["finish_reason"] = "".join(short["logprobs"]["tokens"]), "stop"
    got = streamed(client_with(lambda r: httpx.Response(200, content=sse(vllm_events(body)))))
    assert [c.index for c in got] == [1, 0]
    assert got[0].token_ids == short["token_ids"] and got[0].finish_reason == "stop"


def test_a_broken_stream_is_asked_again_and_each_choice_comes_once():
    """The first answer ends mid-stream (no [DONE]) after choice 1 finished; the retry's choice 1
    is not yielded again."""
    body = json.loads(json.dumps(RECORDED))
    body["choices"][1]["token_ids"] = body["choices"][1]["token_ids"][:2]
    for key in ("text_offset", "token_logprobs", "tokens", "top_logprobs"):
        body["choices"][1]["logprobs"][key] = body["choices"][1]["logprobs"][key][:2]
    body["choices"][1]["text"] = "".join(body["choices"][1]["logprobs"]["tokens"])
    answers = [sse(vllm_events(body, upto=10), done=False), sse(vllm_events(body))]
    calls = []

    def handler(request):
        calls.append(1)
        return httpx.Response(200, content=answers[len(calls) - 1])

    got = streamed(client_with(handler))
    assert len(calls) == 2
    assert [c.index for c in got] == [1, 0]
    assert got[1].token_ids == RECORDED["choices"][0]["token_ids"]


def test_a_server_that_will_not_stream_is_asked_without():
    bodies = []

    def handler(request):
        body = json.loads(request.content)
        bodies.append(body)
        if body.get("stream"):
            error = {
                "message": "stream=true is not supported",
                "type": "BadRequestError",
                "param": "stream",
                "code": 400,
            }
            return httpx.Response(400, json={"error": error})
        return httpx.Response(200, json=RECORDED)

    got = streamed(client_with(handler))
    assert [b.get("stream") for b in bodies] == [True, None]
    assert [c.token_ids for c in got] == [c["token_ids"] for c in RECORDED["choices"]]


@pytest.mark.parametrize(("code", "calls"), [(400, 1), (500, 4)])
def test_an_error_event_after_the_200_raises_it(code, calls):
    """vLLM reports a failure while decoding as a `data: {"error": ...}` event: a 4xx raises at
    once, a 5xx is retried like a failed request."""
    error = {"error": {"message": "boom", "type": "BadRequestError" if code == 400 else "InternalServerError",
                       "param": None, "code": code}}  # fmt: skip
    seen = []

    def handler(request):
        seen.append(1)
        return httpx.Response(200, content=sse([error]))

    with pytest.raises(GeneratorAPIError) as caught:
        streamed(client_with(handler))
    assert caught.value.status == code and "boom" in str(caught.value)
    assert len(seen) == calls


def test_a_pool_streams_its_replicas_shares_numbered_as_one_request():
    def replica(offset):
        def handler(request):
            body = json.loads(request.content)
            assert body["prompt"] == [f"p{offset}"]
            return httpx.Response(200, content=sse(vllm_events(RECORDED)))

        return GeneratorClient(f"http://r{offset}", transport=httpx.MockTransport(handler), backoff=0.0)

    pool = GeneratorPool([replica(0), replica(1)])

    async def go():
        return [c async for c in pool.complete_stream(["p0", "p1"], n=2, max_tokens=32)]

    got = asyncio.run(go())
    assert sorted(c.index for c in got) == [0, 1, 2, 3]
    by_index = {c.index: c for c in got}
    assert by_index[3].token_ids == RECORDED["choices"][1]["token_ids"]


def test_a_recorded_vllm_stream_folds_into_the_same_seeds_whole_answer():
    """vLLM 0.22's own events (recorded on a GPU: the seeded request of the non-streamed fixture,
    streamed) fold into the choices it answers at once."""
    recorded = json.loads((FIXTURES / "completion_stream_n2_logprobs_token_ids.json").read_text())
    assert recorded["content_type"] == "text/event-stream"
    got = streamed(client_with(lambda r: httpx.Response(200, content=recorded["body"].encode())))
    assert_the_recorded_choices(got)
