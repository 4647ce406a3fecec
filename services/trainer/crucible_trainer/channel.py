"""The trainer's half of the job lifecycle (`crucible_shared.lifecycle`): one channel per job.

A channel is the only way a running job touches its record, its event stream and its cancel
flag: `start` (queued -> running), `progress`, a heartbeat thread, `emit`, `cancel_requested`
and `finish` (running -> finished | failed | cancelled). `RedisChannel` serves queued jobs;
`LocalChannel` serves `crucible train --local`, where the same job code runs in-process with
events going to a callback and Ctrl-C as the cancel flag.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from crucible_shared import events, keys
from crucible_shared.lifecycle import JobStatus, encode_fields, transition_command, transition_result

log = logging.getLogger(__name__)
STREAM_MAXLEN = 10_000
# Set when the worker process was asked to stop (SIGTERM: `docker compose restart trainer`, a
# rolling update): the running job stops at its next step boundary and goes back to the queue.
WORKER_STOPPING = threading.Event()


class JobChannel:
    """Base: what a job may say about itself. Subclasses say where it goes."""

    job_id: str

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

    def release(self, reason: str) -> None:
        """Give the job back to the queue, to resume from its checkpoint on another worker."""

    def finish(self, status: JobStatus, *, summary: dict | None = None, error: str | None = None) -> None:
        """The job's end: finished, failed or cancelled."""

    @contextmanager
    def heartbeat(self, every_s: float = 5.0) -> Iterator[None]:
        yield


class RedisChannel(JobChannel):
    def __init__(self, redis: Any, job_id: str) -> None:
        self.redis, self.job_id = redis, job_id
        self.worker = f"{socket.gethostname()}:{os.getpid()}"

    def _transition(self, status: JobStatus, allowed: set[JobStatus], **fields: Any) -> bool:
        changed, current = transition_result(
            self.redis.eval(*transition_command(self.job_id, status, allowed_from=allowed, **fields))
        )
        if not changed:
            log.warning("job %s: %s refused, the job is %s", self.job_id, status.value, current)
        return changed

    def start(self) -> bool:
        now = time.time()
        return self._transition(
            JobStatus.running,
            {JobStatus.queued},
            started_at=now,
            heartbeat_at=now,
            worker=self.worker,
            error=None,
            finished_at=None,
        )

    def progress(self, step: int, total_steps: int, metrics: dict[str, float], policy_version: str) -> None:
        latest = {k: v for k, v in metrics.items() if not k.startswith("update/ratio")}
        fields = {
            "step": step,
            "total_steps": total_steps,
            "policy_version": policy_version,
            "metrics": latest,
        }
        try:
            self.redis.hset(keys.job(self.job_id), mapping=encode_fields(fields))
        except Exception as exc:  # progress reporting must never kill a training run
            log.warning("could not record progress: %r", exc)

    def emit(self, kind: str, **data: Any) -> None:
        record = events.record(kind, **data)  # validated: one of crucible_shared.events
        try:
            self.redis.xadd(
                keys.events(self.job_id), {"data": json.dumps(record, default=str)}, maxlen=STREAM_MAXLEN
            )
        except Exception as exc:
            log.warning("could not publish event: %r", exc)

    def cancel_requested(self) -> bool:
        return bool(self.redis.exists(keys.cancel(self.job_id)))

    def stop_requested(self) -> bool:
        return WORKER_STOPPING.is_set()

    def release(self, reason: str) -> None:
        # The gateway's reaper puts a released job back on its RQ queue within seconds.
        if self._transition(JobStatus.queued, {JobStatus.running}, queued_at=time.time(), error=reason):
            self.emit("requeued", reason=reason)

    def finish(self, status: JobStatus, *, summary: dict | None = None, error: str | None = None) -> None:
        fields: dict[str, Any] = {"finished_at": time.time()}
        if summary is not None:
            fields["summary"] = summary
        if error is not None:
            fields["error"] = error[:2000]
        self._transition(status, {JobStatus.running}, **fields)

    @contextmanager
    def heartbeat(self, every_s: float = 5.0) -> Iterator[None]:
        """Writes `heartbeat_at` from a thread, so a killed worker shows up as a silent job
        (the gateway then retries or fails it) even in the middle of a long step."""
        stop = threading.Event()

        def beat() -> None:
            while not stop.wait(every_s):
                try:
                    self.redis.hset(keys.job(self.job_id), "heartbeat_at", json.dumps(time.time()))
                except Exception as exc:  # a Redis blip must not kill the job
                    log.warning("heartbeat failed: %r", exc)

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
