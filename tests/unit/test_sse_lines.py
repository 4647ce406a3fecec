"""Server-sent event streams split at the format's line ends only (crucible_shared/sse.py).

A completion may hold U+2028, U+2029 or U+0085, which JSON encoders (pydantic's: vLLM's and the
generator's) leave raw, and which `str.splitlines` (httpx's `iter_lines`) takes for line ends. The
streams here carry exactly the bytes such a server writes (`model_dump_json`), to the shared
generator client (streamed completions) and the gateway client (job events)."""

from __future__ import annotations

import asyncio
import json

import httpx
from crucible_shared.generator_client import GeneratorClient
from crucible_shared.openai_protocol import CompletionResponse
from crucible_shared.sse import Lines, lines

ODD = "x = 1\u2028y = 2\u2029z\x85 = 3\x1c\x0b\x0c"  # splitlines breaks at each of these


def test_every_way_of_cutting_a_stream_gives_the_same_lines():
    """Lines end at CR LF, LF or CR only; a chunk boundary anywhere (inside a UTF-8 character,
    between CR and LF) changes nothing."""
    stream = f'data: {{"text": "{ODD}é"}}\r\n\r\ndata: two\rdata: three\n\ndata: [DONE]'.encode()
    want = [f'data: {{"text": "{ODD}é"}}', "", "data: two", "data: three", "", "data: [DONE]"]
    assert list(lines([stream])) == want
    for cut in range(len(stream) + 1):
        assert list(lines([stream[:cut], stream[cut:]])) == want, cut
    assert list(lines([bytes([b]) for b in stream])) == want  # a byte at a time
    split = Lines()
    assert split.feed(b"a\r") == ["a"] and split.feed(b"\n") == [] and split.feed(b"\nb") == [""]
    assert split.flush() == ["b"] and split.flush() == []


def served(text: str) -> bytes:
    """A one-choice completion streamed as the generator writes it (`data: <model_dump_json>`)."""
    event = CompletionResponse.model_validate(
        {
            "id": "cmpl-1",
            "created": 1,
            "model": "m",
            "choices": [{"index": 0, "text": text, "token_ids": [5, 6], "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3},
        }
    )
    body = event.model_dump_json(exclude_unset=True)
    assert all(c in body for c in "\u2028\u2029\x85")  # raw, as they travel from the services
    return f"data: {body}\n\ndata: [DONE]\n\n".encode()


def test_an_empty_chunk_between_cr_and_lf_ends_no_second_line():
    """A CR, an empty chunk, then the LF of the same line end: one line end, not two (an empty line
    would end the event and drop its fields)."""
    assert list(lines([b"data: x\r", b"", b"\n", b"\n"])) == ["data: x", ""]


def test_a_streamed_completion_holding_line_separators_arrives_whole():
    def handler(request):
        return httpx.Response(200, content=served(ODD), headers={"content-type": "text/event-stream"})

    client = GeneratorClient("http://gen:8000", transport=httpx.MockTransport(handler), backoff=0.0)

    async def go():
        return [c async for c in client.complete_stream("p", max_tokens=4)]

    (choice,) = asyncio.run(go())
    assert choice.text == ODD and choice.token_ids == [5, 6] and choice.finish_reason == "stop"


def test_a_job_event_holding_line_separators_arrives_whole():
    from crucible_shared.gateway_client import GatewayClient

    data = json.dumps({"message": ODD}, ensure_ascii=False)
    body = f"id: 1-0\nevent: log\ndata: {data}\n\nid: 2-0\nevent: end\ndata: {{}}\n\n".encode()

    def handler(request):
        return httpx.Response(200, content=body, headers={"content-type": "text/event-stream"})

    client = GatewayClient("http://gw:8080")
    client.http = httpx.Client(base_url=client.url, transport=httpx.MockTransport(handler))
    got = list(client.events("job-1"))
    assert got == [("1-0", "log", {"message": ODD}), ("2-0", "end", {})]
