"""Every job event type round-trips: written by the trainer's channel (and the gateway's reaper
emitter) into a real Redis, streamed by a real gateway as Server-Sent Events, read back by the
CLI's client and rendered by type. A stream entry that is not JSON arrives as a `raw` event."""

from __future__ import annotations

import asyncio

from crucible_cli.render import describe
from crucible_gateway.store import JobStore
from crucible_shared import events, keys
from crucible_shared.gateway_client import GatewayClient
from crucible_shared.lifecycle import JobStatus
from crucible_trainer.runtime.channel import RedisChannel
from crucible_trainer.runtime.sink import EventSink
from redis import Redis
from redis.asyncio import Redis as AsyncRedis

from tests.event_examples import EXAMPLES

TINY_EVAL = {"kind": "eval", "data": {"dataset": "mbpp", "ids": [11]}, "max_tokens": 16}


def test_every_event_type_streams_through_the_gateway_to_the_cli(gateway, redis_url, tmp_path) -> None:
    client = GatewayClient(gateway.url)
    job_id = client.submit(TINY_EVAL).id  # no worker runs: this test's channel plays its run
    redis = Redis.from_url(redis_url)
    channel = RedisChannel(redis, job_id)
    assert channel.start()  # a run's writes are fenced by the lease its start took
    sink = EventSink(channel, tmp_path)
    for kind, fields, _ in EXAMPLES:
        if kind == "requeued" and "attempt" in fields:
            continue  # the gateway's reaper writes this one, below
        sink.emit(kind, **fields)

    async def reaper_emits() -> None:
        store = JobStore(AsyncRedis.from_url(redis_url), Redis.from_url(redis_url), {})
        await store.emit(job_id, "requeued", reason="the worker was lost", attempt=2)
        await store.close()

    asyncio.run(reaper_emits())
    redis.xadd(keys.events(job_id), {"data": "not json"})
    channel.finish(JobStatus.cancelled)

    received = list(client.events(job_id, timeout=60))
    assert received[-1][1] == "end" and received[-1][2] == {"status": "cancelled"}
    typed = {(e, events.parse(e, d).model_dump_json(exclude={"time"})): d for _, e, d in received[:-1]}
    for kind, fields, phrase in EXAMPLES:
        sent = events.parse(kind, fields).model_dump_json(exclude={"time"})
        assert (kind, sent) in typed, (kind, fields)
        line = describe(kind, typed[kind, sent], samples=True)
        assert (line is None) if phrase is None else (phrase in (line or "")), line
    raw = [d for _, e, d in received if e == "raw"]
    assert raw == [{"type": "raw", "data": "not json"}]
    assert describe("raw", raw[0]) == "raw        not json"
