"""The trainer's half of the job lifecycle (`crucible_shared.lifecycle`): one channel per job.

A channel is the only way a running job touches its record, its event stream and its cancel
flag: `start` (queued -> running), `progress`, a heartbeat thread, `emit`, `cancel_requested`
and `finish` (running -> finished | failed | cancelled). `RedisChannel` serves queued jobs: its
writes are fenced by the run's lease and kept through a Redis outage (`outbox`). `LocalChannel`
serves `crucible train --local`, where the same job code runs in-process with events going to a
callback and Ctrl-C as the cancel flag.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from crucible_shared import events, keys
from crucible_shared.lifecycle import (
    JobStatus,
    decode,
    start_command,
    start_result,
    transition_command,
    transition_result,
)
from redis.exceptions import RedisError

from crucible_trainer.runtime.outbox import Outbox

log = logging.getLogger(__name__)
STREAM_MAXLEN = 10_000
# The longest a run holds its lease without Redis confirming it; capped at half the reaper's
# heartbeat timeout (`keys.heartbeat_timeout`, 60 s by default) when the gateway publishes it.
LEASE_S = 30.0
# Set when the worker process was asked to stop (SIGTERM: `docker compose restart trainer`, a
# rolling update): the running job stops at its next step boundary and goes back to the queue.
WORKER_STOPPING = threading.Event()


class Superseded(Exception):
    """The job was taken from this run (re-queued or started elsewhere), or this run's lease lapsed
    and Redis never confirmed it again: stop, writing nothing."""


def metrics_steps(stream: list[str]) -> set[int]:
    """The steps of the `metrics` events among events' JSON."""
    steps = set()
    for data in stream:
        try:
            event = json.loads(data)
        except ValueError:
            continue
        if isinstance(event, dict) and event.get("type") == "metrics" and isinstance(event.get("step"), int):
            steps.add(event["step"])
    return steps


class JobChannel:
    """Base: what a job may say about itself. Subclasses say where it goes."""

    job_id: str
    # The run's fencing token (its lease): larger for every run of the job; None in-process.
    token: int | None = None

    @property
    def tag(self) -> str:
        """The suffix of what this run names in shared stores (adapter versions, checkpoints):
        none for a job's first run or an in-process one, `-r<token>` for each later run, so no two
        runs of a job ever write the same name."""
        return f"-r{self.token}" if self.token is not None and self.token > 1 else ""

    def gate(self) -> None:
        """Before a write outside Redis (run dir, adapter store, generators): raise `Superseded`
        unless this run still holds the job (in-process: always)."""

    def commit(self, **fields: Any) -> bool:
        """Set record fields (the checkpoint pointer) only while this run holds the job; False
        where there is no record (in-process)."""
        return False

    def committed(self, field: str) -> str | None:
        """A field `commit` set (by this run or an earlier one); None in-process."""
        return None

    def delivered_steps(self) -> set[int] | None:
        """The steps whose `metrics` event is in the job's stream (None: no stream to read)."""
        stream = self.stream_data()
        return None if stream is None else metrics_steps(stream)

    def stream_data(self) -> list[str] | None:
        """The JSON of every event in the job's stream, in order (None: no stream to read)."""
        return None

    def undelivered(self, after: int = 0) -> list[tuple[int, str]]:
        """(sequence number, JSON) of this run's events numbered over `after` that are not in the
        stream yet, while this run holds its lease ([]: in-process, or nothing waits)."""
        return []

    def resend(self, data: str) -> None:
        """Send again, as it was, an event an earlier run recorded and never delivered."""

    def start(self) -> bool:
        """Mark the job running; False when it may not run (cancelled or taken meanwhile)."""
        return True

    def progress(self, step: int, total_steps: int, metrics: dict[str, float], policy_version: str) -> None:
        """The latest finished step, for listings and `GET /v1/jobs/{id}`."""

    def emit(self, kind: str, **data: Any) -> None:
        """One event of the job's story (progress, evaluations, swaps, samples)."""

    def cancel_requested(self) -> bool:
        return False

    def stop_requested(self) -> bool:
        """The process running the job is shutting down (not a cancel: the job is to go on)."""
        return False

    def superseded(self) -> bool:
        """This run no longer holds the job (re-queued by the reaper, or started by another run):
        it is to stop without writing anything more (not a cancel, not a failure)."""
        return False

    def release(self, reason: str) -> None:
        """Give the job back to the queue, to resume from its checkpoint on another worker."""

    def finish(self, status: JobStatus, *, summary: dict | None = None, error: str | None = None) -> None:
        """The job's end: finished, failed or cancelled."""

    @contextmanager
    def heartbeat(self, every_s: float = 5.0) -> Iterator[None]:
        yield


class RedisChannel(JobChannel):
    """A queued job's channel. Its writes go through an `Outbox`: fenced by the lease this run
    got at `start`, and kept in memory while Redis is unreachable (see `crucible_trainer.runtime.outbox`)."""

    def __init__(
        self, redis: Any, job_id: str, *, outage_wait_s: float = 600.0, lease_s: float = LEASE_S
    ) -> None:
        self.redis, self.job_id, self.outage_wait_s = redis, job_id, outage_wait_s
        self.worker = f"{socket.gethostname()}:{os.getpid()}"
        self.lease = uuid.uuid4().hex  # replaced by the fencing token at `start`
        self.lease_s = lease_s
        self.lost = False  # the lease lapsed and Redis did not confirm it within outage_wait_s
        self._lapsed = False  # the lapse was reported (once per lapse)
        self.outbox = Outbox(redis, job_id, self.lease, limit=STREAM_MAXLEN, maxlen=STREAM_MAXLEN)

    def _transition(self, status: JobStatus, allowed: set[JobStatus], **fields: Any) -> bool:
        """This run's own transition: only while it holds the job; waits out a Redis outage."""
        deadline = time.monotonic() + self.outage_wait_s
        while True:
            try:
                reply = self.redis.eval(
                    *transition_command(self.job_id, status, allowed_from=allowed, fence=self.lease, **fields)
                )
                break
            except RedisError as exc:
                if time.monotonic() > deadline:
                    raise
                log.warning("job %s: %s waits for Redis (%r)", self.job_id, status.value, exc)
                time.sleep(1.0)
        changed, current = transition_result(reply)
        if not changed:
            log.warning("job %s: %s refused, the job is %s", self.job_id, status.value, current)
        return changed

    def start(self) -> bool:
        now = time.time()
        sent_at = time.monotonic()
        token, current = start_result(
            self.redis.eval(
                *start_command(
                    self.job_id,
                    started_at=now,
                    heartbeat_at=now,
                    worker=self.worker,
                    delivered=0,
                    error=None,
                    finished_at=None,
                )
            )
        )
        if token is None:
            log.warning("job %s: not started, the job is %s", self.job_id, current)
            return False
        self.token, self.lease = token, str(token)
        self.outbox.lease, self.outbox.confirmed_at = self.lease, sent_at
        # The lease lapses on this host before the reaper may take the job: at most half of the
        # reaper's heartbeat timeout, counted from when the last accepted write was sent.
        reaper = self.redis.get(keys.heartbeat_timeout())
        if reaper is not None:
            self.lease_s = min(self.lease_s, float(reaper) / 2)
        return True

    def holds_lease(self) -> bool:
        """Whether this run's lease is unexpired by this host's clock (it may still be taken:
        the outbox finds that out at its next delivery)."""
        held = self.outbox.fenced is None and time.monotonic() - self.outbox.confirmed_at < self.lease_s
        if held and self._lapsed:
            self._lapsed = False
            log.warning("job %s: lease confirmed again; writing again", self.job_id)
        return held

    def _note_lapse(self) -> None:
        if not self._lapsed:
            self._lapsed = True
            log.warning(
                "job %s: lease lapsed (no write accepted for %.1f s); writing nothing until Redis "
                "confirms it", self.job_id, time.monotonic() - self.outbox.confirmed_at,
            )  # fmt: skip

    def gate(self) -> None:
        if self.outbox.fenced is not None or self.lost:
            raise Superseded(f"job {self.job_id} is no longer this run's")
        if self.holds_lease():
            return
        # The lease lapsed (Redis unreachable, or this process was paused): write nothing until
        # Redis says whether the job is still this run's.
        self._note_lapse()
        deadline = time.monotonic() + self.outage_wait_s
        while True:
            self.outbox.deliver(beat=True)
            if self.outbox.fenced is not None:
                raise Superseded(f"job {self.job_id} is no longer this run's")
            if self.holds_lease():
                return
            if time.monotonic() > deadline:
                self.lost = True
                raise Superseded(f"job {self.job_id}: Redis did not confirm this run's lease")
            time.sleep(min(1.0, self.lease_s / 4))

    def commit(self, **fields: Any) -> bool:
        deadline = time.monotonic() + self.outage_wait_s
        while True:
            self.gate()  # waits while the lease has lapsed, until Redis confirms or refuses it
            done = self.outbox.commit(fields)
            if done:
                return True
            if done is False:
                raise Superseded(f"job {self.job_id} is no longer this run's")
            if time.monotonic() > deadline:
                self.lost = True
                raise Superseded(f"job {self.job_id}: Redis did not confirm this run's lease")
            time.sleep(1.0)

    def committed(self, field: str) -> str | None:
        value = self.redis.hget(keys.job(self.job_id), field)
        return None if value is None else decode(field, value.decode()) or None

    def stream_data(self) -> list[str] | None:
        entries = self.redis.xrange(keys.events(self.job_id))
        return [fields[b"data"].decode() for _, fields in entries if b"data" in fields]

    def undelivered(self, after: int = 0) -> list[tuple[int, str]]:
        if self.outbox.pending == 0 or not self.holds_lease():
            return []
        return self.outbox.waiting(after)

    def resend(self, data: str) -> None:
        self.outbox.event(data)
        self._send()

    def progress(self, step: int, total_steps: int, metrics: dict[str, float], policy_version: str) -> None:
        latest = {k: v for k, v in metrics.items() if not k.startswith("update/ratio")}
        self.outbox.progress(
            {"step": step, "total_steps": total_steps, "policy_version": policy_version, "metrics": latest}
        )
        self._send()

    def emit(self, kind: str, **data: Any) -> None:
        self.outbox.event(events.record(kind, **data))  # validated: one of crucible_shared.events
        self._send()

    def _send(self) -> None:
        # While Redis is away the heartbeat thread retries; the job loop does not wait on it.
        if self.outbox.down_since is None:
            self.outbox.deliver()

    def cancel_requested(self) -> bool:
        return bool(self.redis.exists(keys.cancel(self.job_id)))

    def stop_requested(self) -> bool:
        return WORKER_STOPPING.is_set()

    def superseded(self) -> bool:
        return self.outbox.fenced is not None or self.lost

    def release(self, reason: str) -> None:
        # The gateway's reaper puts a released job back on its RQ queue within seconds.
        self.outbox.event(events.record("requeued", reason=reason))
        if self.outbox.drain(self.outage_wait_s):
            self._transition(JobStatus.queued, {JobStatus.running}, queued_at=time.time(), error=reason)

    def finish(self, status: JobStatus, *, summary: dict | None = None, error: str | None = None) -> None:
        fields: dict[str, Any] = {"finished_at": time.time()}
        if summary is not None:
            fields["summary"] = summary
        if error is not None:
            fields["error"] = error[:2000]
        # Every event first (a watcher's stream ends at a final status), then the status.
        if self.outbox.drain(self.outage_wait_s):
            self._transition(status, {JobStatus.running}, **fields)
        elif not self.superseded():
            log.error("job %s: Redis stayed unreachable; %s not recorded", self.job_id, status.value)

    @contextmanager
    def heartbeat(self, every_s: float = 5.0) -> Iterator[None]:
        """Stamps `heartbeat_at` (and delivers waiting events) from a thread, so a killed worker
        shows up as a silent job (the gateway then retries or fails it) even in the middle of a
        long step, and a superseded run finds out within `every_s`."""
        stop = threading.Event()
        every_s = min(every_s, self.lease_s / 3)  # several renewals within every lease

        def beat() -> None:
            while not stop.wait(every_s) and not self.superseded():
                try:
                    self.outbox.deliver(beat=True)
                except Exception as exc:  # a Redis blip must not kill the job
                    log.warning("heartbeat failed: %r", exc)
                if not self.holds_lease() and self.outbox.fenced is None:
                    self._note_lapse()  # said as it happens; the job's next write waits (`gate`)

        thread = threading.Thread(target=beat, name=f"heartbeat-{self.job_id}", daemon=True)
        thread.start()
        try:
            yield
        finally:
            stop.set()


class LocalChannel(JobChannel):
    """In-process: events go to `on_event` (the CLI prints them), cancel is `cancel()`."""

    def __init__(self, job_id: str, on_event: Callable[[str, dict[str, Any]], None] | None = None) -> None:
        self.job_id, self.on_event = job_id, on_event
        self._cancel = threading.Event()

    def emit(self, kind: str, **data: Any) -> None:
        if self.on_event is not None:
            self.on_event(kind, events.record(kind, **data))

    def cancel(self) -> None:
        self._cancel.set()

    def cancel_requested(self) -> bool:
        return self._cancel.is_set()
