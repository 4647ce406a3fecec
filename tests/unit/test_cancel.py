"""`CancelToken.guard` abandons its work at a cancel, including work it never started: a
coroutine handed to it after the cancel is closed, not left to warn "was never awaited"."""

from __future__ import annotations

import asyncio
import gc
import warnings

import pytest
from crucible_trainer.runtime.cancel import Cancelled, CancelToken, Superseded


async def forever() -> None:
    await asyncio.sleep(3600)


def never_awaited(play) -> list[str]:
    """Run `play`, collect what it dropped, and return the RuntimeWarnings raised on the way."""
    with warnings.catch_warnings(record=True) as caught:
        # Recorded rather than raised: raised inside a finalizer, the error would be swallowed.
        warnings.simplefilter("always", RuntimeWarning)
        asyncio.run(play())
        gc.collect()  # a dropped coroutine warns when it is collected
    return [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]


def test_guard_after_a_cancel_closes_the_coroutine() -> None:
    async def play() -> None:
        token = CancelToken()
        token.cancel()
        with pytest.raises(Cancelled):
            await token.guard(forever())

    assert never_awaited(play) == []


def test_guard_after_a_cancel_cancels_a_task() -> None:
    async def play() -> None:
        token = CancelToken()
        task = asyncio.ensure_future(forever())
        token.superseded = True
        token.cancel()
        with pytest.raises(Superseded):
            await token.guard(task)
        await asyncio.sleep(0)
        assert task.cancelled()

    assert never_awaited(play) == []


def test_guard_abandons_running_work_at_a_cancel() -> None:
    async def play() -> None:
        token = CancelToken()
        asyncio.get_running_loop().call_later(0.01, token.cancel)
        with pytest.raises(Cancelled):
            await token.guard(forever())

    assert never_awaited(play) == []


def test_guard_returns_the_result_without_a_cancel() -> None:
    async def play() -> None:
        assert await CancelToken().guard(asyncio.sleep(0, "done")) == "done"

    assert never_awaited(play) == []
