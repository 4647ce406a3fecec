"""Cooperative cancellation: the job channel's cancel flag (Redis, or Ctrl-C in-process), polled
from a task the job loop races its awaits against. A run that no longer holds its job
(`JobChannel.superseded`) stops the same way, with `Superseded` instead of `Cancelled`."""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Awaitable
from typing import Any, TypeVar

from crucible_trainer.runtime.channel import JobChannel, Superseded

__all__ = ["CancelToken", "Cancelled", "Interrupted", "Superseded"]

T = TypeVar("T")


class Cancelled(Exception):
    """The job was asked to stop."""


class Interrupted(Exception):
    """The worker is shutting down: the job stopped at a step boundary, checkpointed, to resume."""

    def __init__(self, step: int) -> None:
        super().__init__(f"interrupted after step {step}")
        self.step = step


def _discard(work: Awaitable[Any]) -> None:
    """Drop work that will never run: the caller already created the coroutine, and one left
    unawaited warns "coroutine ... was never awaited" when it is collected."""
    if inspect.iscoroutine(work):
        work.close()
    elif isinstance(work, asyncio.Future):
        work.cancel()


class CancelToken:
    def __init__(self, channel: JobChannel | None = None, poll_s: float = 1.0) -> None:
        self.channel, self.poll_s = channel, poll_s
        self.event = asyncio.Event()
        self._watcher: asyncio.Task | None = None
        self.superseded = False

    def start(self) -> None:
        if self.channel is not None:
            self._watcher = asyncio.create_task(self._watch())

    async def _watch(self) -> None:
        assert self.channel is not None
        while not self.event.is_set():
            if self.channel.superseded():
                self.superseded = True
                self.event.set()
                return
            try:
                if await asyncio.to_thread(self.channel.cancel_requested):
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

    def _stop(self) -> Exception:
        return Superseded() if self.superseded else Cancelled()

    def check(self) -> None:
        if self.event.is_set():
            raise self._stop()

    async def guard(self, work: Awaitable[T]) -> T:
        """Await `work`, abandoning it as soon as a cancel is requested."""
        if self.event.is_set():
            _discard(work)
            raise self._stop()
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
        raise self._stop()
