"""Jobs across a Redis outage: a real Redis stopped and started again under a real gateway.

The trainer's side is its real `RedisChannel` (the one `run_job` builds) driven from the test, so
the outage lands exactly where it should: between two events, for longer than the gateway's
heartbeat timeout.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
from crucible_shared import keys
from crucible_shared.gateway_client import GatewayClient
from crucible_shared.lifecycle import JobRecord, JobStatus, encode_fields, transition_command
from redis import Redis

from tests.integration.endless_job import as_runner
from tests.servers import RedisServer, Service, spawn

TINY_EVAL = {"kind": "eval", "name": "outage", "data": {"dataset": "mbpp", "ids": [11, 12]}, "max_tokens": 64}


@contextmanager
def gateway_on(redis_url: str, dirs: dict[str, Path], heartbeat_timeout_s: float) -> Iterator[Service]:
    env = {
        "REDIS_URL": redis_url,
        "CRUCIBLE_GATEWAY_RUNS_DIR": str(dirs["runs"]),
        "CRUCIBLE_GATEWAY_ADAPTER_DIR": str(dirs["adapters"]),
        "CRUCIBLE_GATEWAY_HEARTBEAT_TIMEOUT_S": str(heartbeat_timeout_s),
        "CRUCIBLE_GATEWAY_REAP_INTERVAL_S": "0.2",
    }
    with spawn("crucible_gateway", env, "CRUCIBLE_GATEWAY_PORT") as service:
        yield service


def channel_for(redis_url: str, job_id: str) -> Any:
    from crucible_trainer.runtime.channel import RedisChannel
    from crucible_trainer.runtime.entry import channel_redis

    return RedisChannel(channel_redis(redis_url), job_id, outage_wait_s=30)


def stream(redis_url: str, job_id: str) -> list[dict[str, Any]]:
    entries = Redis.from_url(redis_url).xrange(keys.events(job_id))
    return [json.loads(fields[b"data"]) for _, fields in entries]


@pytest.mark.slow
def test_a_redis_outage_neither_requeues_a_live_job_nor_loses_its_events(tmp_path, stack_dirs) -> None:
    """The issue's 95-second outage, shortened: heartbeats fail for longer than the heartbeat
    timeout; when Redis is back the job is still attempt 1, running, its events of the outage are
    in the stream in order, and its `finished` is accepted."""
    with RedisServer(tmp_path / "redis") as redis, gateway_on(redis.url, stack_dirs, 3) as gw:
        client = GatewayClient(gw.url)
        job_id = client.submit(TINY_EVAL).id
        channel = channel_for(redis.url, job_id)
        assert channel.start()
        with channel.heartbeat(every_s=1.0):
            for step in range(1, 4):
                channel.emit("metrics", step=step, metrics={})
            time.sleep(4)  # Redis up a heartbeat timeout: the reaper trusts silence from now on
            redis.stop()
            for step in range(4, 8):
                channel.emit("metrics", step=step, metrics={})
                channel.progress(step, 10, {"reward_mean": step / 10}, "m")
                time.sleep(1.5)  # 6 s down: twice the heartbeat timeout
            redis.start()
            channel.emit("metrics", step=8, metrics={})
            time.sleep(5)  # many reaper passes, a few heartbeats
            record = client.job(job_id)
            assert (record.status, record.attempts) == (JobStatus.running, 1), record.error
            assert not channel.superseded()
        channel.finish(JobStatus.finished, summary={"steps": 8})
        record = client.job(job_id)
        assert record.status == JobStatus.finished and record.step == 7
        events = stream(redis.url, job_id)
        assert [e["step"] for e in events if e["type"] == "metrics"] == list(range(1, 9))
        assert not [e for e in events if e["type"] == "requeued"]


def test_a_run_whose_job_was_requeued_is_fenced(tmp_path, stack_dirs) -> None:
    """A worker cut off from Redis alone (Redis stays up): the reaper re-queues its job, another
    run takes it; the old run's events, progress and `finish` are refused and it knows it."""
    with RedisServer(tmp_path / "redis") as redis, gateway_on(redis.url, stack_dirs, 1) as gw:
        client = GatewayClient(gw.url)
        job_id = client.submit({**TINY_EVAL, "max_attempts": 2}).id
        old = channel_for(redis.url, job_id)
        assert old.start()  # and then silence: no heartbeat reaches Redis
        deadline = time.monotonic() + 20
        while client.job(job_id).status != JobStatus.queued:
            assert time.monotonic() < deadline, "the reaper never re-queued the silent job"
            time.sleep(0.2)
        assert client.job(job_id).attempts == 2
        new = channel_for(redis.url, job_id)
        assert new.start()
        old.emit("metrics", step=99, metrics={})
        old.progress(99, 100, {"reward_mean": 1.0}, "old")
        assert old.superseded() and not new.superseded()
        old.finish(JobStatus.failed, error="the old run's late failure")
        new.emit("metrics", step=1, metrics={})
        assert client.job(job_id).status == JobStatus.running
        new.finish(JobStatus.finished, summary={"steps": 1})
        record = client.job(job_id)
        assert record.status == JobStatus.finished and record.step != 99 and record.error is None
        steps = [e["step"] for e in stream(redis.url, job_id) if e["type"] == "metrics"]
        assert steps == [1]


def put_queued_record(redis: Redis, job_id: str) -> None:
    record = JobRecord(
        id=job_id, kind="eval", status=JobStatus.queued, created_at=time.time(), max_attempts=2
    )
    redis.hset(keys.job(job_id), mapping=encode_fields(record.model_dump(exclude={"id"})))  # type: ignore[arg-type]
    redis.zadd(keys.status_index("queued"), {job_id: time.time()})


def test_a_superseded_run_stops_without_writing(redis_url, monkeypatch, tmp_path) -> None:
    """`execute` with a job loop that would run for a minute: once the job is re-queued under it,
    the loop stops within a heartbeat and the run writes neither a status nor an event."""
    import crucible_trainer.runtime.entry as jobs
    from crucible_trainer.runtime.cancel import CancelToken
    from crucible_trainer.settings import Settings

    async def endless(spec, job_id, settings, channel) -> dict:
        token = CancelToken(channel, poll_s=0.05)
        token.start()
        try:
            for step in range(600):
                channel.emit("metrics", step=step, metrics={})
                await token.guard(asyncio.sleep(0.1))
        finally:
            token.stop()
        return {"status": "finished"}

    monkeypatch.setattr(jobs, "runner_for", lambda spec: as_runner(endless))
    job_id = f"eval-fenced-{time.time_ns()}"
    redis = Redis.from_url(redis_url)
    put_queued_record(redis, job_id)
    channel = channel_for(redis_url, job_id)
    settings = Settings(redis_url=redis_url, heartbeat_s=0.2, runs_dir=tmp_path)
    result: dict[str, Any] = {}
    spec = jobs._SPEC.validate_python(TINY_EVAL)
    run = lambda: result.update(jobs.execute(spec, job_id, settings, channel))  # noqa: E731
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    time.sleep(1.0)
    # What the reaper does to a job it believes lost.
    redis.eval(*transition_command(job_id, JobStatus.queued, allowed_from={JobStatus.running}, attempts=2))
    requeued_at = len(stream(redis_url, job_id))
    thread.join(timeout=5)
    assert not thread.is_alive(), "the superseded run went on"
    assert result["status"] == "superseded"
    record = JobRecord.from_redis(job_id, redis.hgetall(keys.job(job_id)))
    assert (record.status, record.attempts, record.finished_at) == (JobStatus.queued, 2, None)
    assert len(stream(redis_url, job_id)) == requeued_at  # nothing delivered after the re-queue


@pytest.mark.parametrize("concurrency", [80])
def test_gets_after_a_redis_restart_all_answer(tmp_path, stack_dirs, concurrency) -> None:
    """Pooled connections that a Redis restart closed are retried once, not answered with 503."""
    with RedisServer(tmp_path / "redis") as redis, gateway_on(redis.url, stack_dirs, 60) as gw:
        job_id = GatewayClient(gw.url).submit(TINY_EVAL).id

        async def burst() -> list[int]:
            async with httpx.AsyncClient(base_url=gw.url, timeout=30) as http:
                replies = await asyncio.gather(*(http.get(f"/v1/jobs/{job_id}") for _ in range(concurrency)))
            return [r.status_code for r in replies]

        assert set(asyncio.run(burst())) == {200}  # the pool now holds many connections
        redis.stop()
        redis.start()
        codes = asyncio.run(burst())
        assert codes.count(200) == concurrency, f"{concurrency - codes.count(200)} GETs failed: {set(codes)}"


def test_the_outbox_keeps_order_says_what_it_dropped_and_delivers_once(redis_url) -> None:
    """Beyond its limit the oldest events go and one note says how many; a delivery repeated
    after a lost reply adds nothing."""
    from crucible_trainer.runtime.outbox import Outbox

    from tests.servers import free_port

    job_id = f"eval-outbox-{time.time_ns()}"
    redis = Redis.from_url(redis_url)
    put_queued_record(redis, job_id)
    redis.eval(*transition_command(job_id, JobStatus.running, lease="L1", delivered=0))
    outbox = Outbox(Redis.from_url(f"redis://127.0.0.1:{free_port()}/0"), job_id, "L1", limit=5)
    for step in range(1, 9):
        outbox.event({"type": "metrics", "step": step})
    assert not outbox.deliver() and outbox.down_since is not None  # nobody listens on that port
    outbox.redis = redis  # Redis is back
    assert outbox.deliver() and outbox.down_since is None
    events = stream(redis_url, job_id)
    assert "3 events were dropped" in events[0]["message"]
    assert [e["step"] for e in events[1:]] == [4, 5, 6, 7, 8]
    # The reply of that delivery lost: the same events again change nothing.
    outbox._events.extend((seq, json.dumps({"type": "metrics", "step": seq})) for seq in (7, 8))
    outbox.event({"type": "metrics", "step": 9})
    assert outbox.deliver()
    assert [e.get("step") for e in stream(redis_url, job_id)[1:]] == [4, 5, 6, 7, 8, 9]


def test_events_a_dead_run_never_delivered_are_recovered_by_the_next_run(redis_url, tmp_path) -> None:
    """Redis away at step 3: the run writes step 3's row (and its checkpoint) and dies before
    delivering its event. The next run, resumed from step 3, sends it from `metrics.jsonl` before
    anything of its own, so the stream has every step once and in order; doing it again adds
    nothing."""
    from crucible_trainer.runtime.sink import EventSink, recover_events

    from tests.servers import free_port

    job_id = f"train-recover-{time.time_ns()}"
    redis = Redis.from_url(redis_url)
    put_queued_record(redis, job_id)
    first = channel_for(redis_url, job_id)
    assert first.start() and first.token == 1
    sink = EventSink(first, tmp_path / job_id)
    for step in (1, 2):
        sink.metrics(step, {"reward_mean": step / 10})
    first.outbox.redis = Redis.from_url(f"redis://127.0.0.1:{free_port()}/0")  # Redis away
    sink.metrics(3, {"reward_mean": 0.3})  # the row is written; the event waits in memory
    assert first.outbox.pending == 1
    del first, sink  # the worker dies (SIGKILL): its outbox is gone
    # The reaper re-queues the job; the next run starts with a newer token and resumes.
    redis.eval(*transition_command(job_id, JobStatus.queued, allowed_from={JobStatus.running}, attempts=2))
    second = channel_for(redis_url, job_id)
    assert second.start() and second.token == 2 and second.tag == "-r2"
    sink = EventSink(second, tmp_path / job_id)
    assert recover_events(sink, upto=3) == 1
    assert recover_events(sink, upto=3) == 0
    sink.metrics(4, {"reward_mean": 0.4})
    metrics = [e for e in stream(redis_url, job_id) if e["type"] == "metrics"]
    assert [e["step"] for e in metrics] == [1, 2, 3, 4]
    assert metrics[2]["metrics"] == {"reward_mean": 0.3}


def test_a_run_s_lease_lapses_before_the_reaper_may_take_its_job(redis_url, tmp_path) -> None:
    """By design: the lease is at most half the reaper's heartbeat timeout (published by the
    gateway), counted from when the last accepted write was sent; a run cut off from Redis for
    longer writes nothing more (`gate` refuses) until Redis confirms the lease, or says the job is
    another run's."""
    from crucible_trainer.runtime.cancel import Superseded

    job_id = f"train-lapse-{time.time_ns()}"
    redis = Redis.from_url(redis_url)
    redis.set(keys.heartbeat_timeout(), "2.0")
    put_queued_record(redis, job_id)
    channel = channel_for(redis_url, job_id)
    channel.outage_wait_s = 1.0
    try:
        assert channel.start()
    finally:
        redis.delete(keys.heartbeat_timeout())  # read at the start only
    assert channel.lease_s == 1.0  # half of the reaper's 2 s
    channel.gate()  # held: no wait
    live = channel.outbox.redis
    channel.outbox.redis = channel.redis = Redis.from_url("redis://127.0.0.1:1/0", socket_connect_timeout=0.2)
    time.sleep(1.1)
    assert not channel.holds_lease()
    started = time.monotonic()
    with pytest.raises(Superseded):
        channel.gate()  # Redis never answers within outage_wait_s: the run gives the job up
    assert time.monotonic() - started >= 1.0 and channel.superseded()
    # A run whose Redis comes back while it still holds the job goes on.
    put_queued_record(redis, job_id + "-2")
    other = channel_for(redis_url, job_id + "-2")
    assert other.start()
    other.lease_s = 1.0
    other.outbox.redis = Redis.from_url("redis://127.0.0.1:1/0", socket_connect_timeout=0.2)
    time.sleep(1.1)
    assert not other.holds_lease()
    other.outbox.redis = live
    other.gate()
    assert other.holds_lease() and not other.superseded()


@pytest.mark.parametrize("cut_short", [False, True], ids=["row-whole", "row-cut-short"])
def test_fencing_steps_run_again_after_a_resume_are_sent_and_logged_once(
    redis_url, tmp_path, cut_short: bool
) -> None:
    """`checkpoint.every: 2`: a run delivers steps 1-3 and dies with its checkpoint at step 2 (or,
    `cut_short`, dies while writing step 3's row, leaving half a line in `metrics.jsonl`). The next
    run resumes from step 2 and runs step 3 again: `metrics.jsonl` and the stream each have steps
    1-4 once, in order."""
    from crucible_trainer.runtime.sink import EventSink, resume_events

    job_id = f"train-replay-{time.time_ns()}"
    redis = Redis.from_url(redis_url)
    put_queued_record(redis, job_id)
    first = channel_for(redis_url, job_id)
    assert first.start()
    sink = EventSink(first, tmp_path / job_id)
    for step in (1, 2) if cut_short else (1, 2, 3):
        sink.metrics(step, {"reward_mean": step / 10})
    if cut_short:
        with sink.metrics_path.open("a") as f:
            f.write('{"step": 3, "reward_me')  # killed mid-write
    del first, sink  # killed in step 4 (or 3); its last checkpoint is step 2's
    redis.eval(*transition_command(job_id, JobStatus.queued, allowed_from={JobStatus.running}, attempts=2))
    second = channel_for(redis_url, job_id)
    assert second.start()
    sink = EventSink(second, tmp_path / job_id)
    assert resume_events(sink, upto=2) == 0
    for step in (3, 4):
        sink.metrics(step, {"reward_mean": step / 10})
    assert [e["step"] for e in stream(redis_url, job_id) if e["type"] == "metrics"] == [1, 2, 3, 4]
    rows = (tmp_path / job_id / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(row)["step"] for row in rows] == [1, 2, 3, 4]


def test_fencing_every_event_a_run_killed_in_an_outage_never_delivered_is_recovered_once(
    redis_url, tmp_path
) -> None:
    """Redis stops after step 2; the run goes on through step 3 (its adapter, a sample, its row and
    event, an evaluation) into step 4 and is killed. The next run, resumed from step 3's checkpoint,
    sends every event of steps up to 3 the stream lacks, as they were recorded, in order, once;
    step 4's (it runs again) are not sent."""
    from crucible_trainer.runtime.sink import EventSink, recover_events

    from tests.servers import free_port

    job_id = f"train-journal-{time.time_ns()}"
    redis = Redis.from_url(redis_url)
    put_queued_record(redis, job_id)
    first = channel_for(redis_url, job_id)
    assert first.start()
    sink = EventSink(first, tmp_path / job_id)
    for step in (1, 2):
        sink.metrics(step, {"reward_mean": step / 10})
    first.outbox.redis = Redis.from_url(f"redis://127.0.0.1:{free_port()}/0")  # Redis stops
    sink.emit("adapter_published", step=3, name=f"{job_id}-v3", load_s=0.5)
    sample = {"problem_id": "601", "phase": "c1", "reward": 1.0, "status": "passed", "message": ""}
    sink.emit("sample", step=3, completion="def f(): pass", **sample)
    sink.metrics(3, {"reward_mean": 0.3})
    sink.emit("eval_started", label="step-3", model=f"{job_id}-v3", tasks=2, data="mbpp/test ids=2")
    sink.emit("eval_finished", label="step-3", report="eval/step-3", dataset="mbpp", problems=2)
    sink.emit("adapter_published", step=4, name=f"{job_id}-v4", load_s=0.5)  # step 4 runs again
    waiting = [json.loads(data) for _, data in first.outbox._events]
    del first, sink  # SIGKILL; Redis starts again
    redis.eval(*transition_command(job_id, JobStatus.queued, allowed_from={JobStatus.running}, attempts=2))
    second = channel_for(redis_url, job_id)
    assert second.start()
    sink = EventSink(second, tmp_path / job_id)
    assert recover_events(sink, upto=3) == 5
    assert recover_events(sink, upto=3) == 0
    events = stream(redis_url, job_id)
    assert [(e["type"], e.get("step") or e.get("label")) for e in events] == [
        ("metrics", 1),
        ("metrics", 2),
        ("adapter_published", 3),
        ("sample", 3),
        ("metrics", 3),
        ("eval_started", "step-3"),
        ("eval_finished", "step-3"),
    ]
    assert events[2:] == waiting[:5]  # as they were recorded (their times included)
    assert not list((tmp_path / job_id / ".outbox").iterdir())  # the dead run's journal, consumed
