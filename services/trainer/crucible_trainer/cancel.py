"""Cooperative cancellation: a Redis flag (or Ctrl-C in direct mode) the job loop races against."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import Any, TypeVar

from crucible_shared import keys

T = TypeVar("T")


class Cancelled(Exception):
    """The job was asked to stop."""


class CancelToken:
    def __init__(self, redis: Any = None, job_id: str | None = None, poll_s: float = 1.0) -> None:
        self.redis, self.job_id, self.poll_s = redis, job_id, poll_s
        self.event = asyncio.Event()
        self._watcher: asyncio.Task | None = None

    def start(self) -> None:
        if self.redis is not None and self.job_id:
            self._watcher = asyncio.create_task(self._watch())

    async def _watch(self) -> None:
        while not self.event.is_set():
            try:
                if await asyncio.to_thread(self.redis.exists, keys.cancel(self.job_id)):
                    self.event.set()
                    return
            except Exception:
                pass  # Redis blips must not cancel or kill the job
            await asyncio.sleep(self.poll_s)

    def stop(self) -> None:
        if self._watcher:
            self._watcher.cancel()

    def cancel(self) -> None:
        self.event.set()

    @property
    def requested(self) -> bool:
        return self.event.is_set()

    def check(self) -> None:
        if self.event.is_set():
            raise Cancelled()

    async def guard(self, work: Awaitable[T]) -> T:
        """Await `work`, abandoning it as soon as a cancel is requested."""
        self.check()
        task = asyncio.ensure_future(work)
        waiter = asyncio.ensure_future(self.event.wait())
        done, _ = await asyncio.wait({task, waiter}, return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            waiter.cancel()
            return task.result()
        task.cancel()
        try:
            await task
        except BaseException:
            pass
        raise Cancelled()
