"""The pre-filter streamed beside training (online/prefilter.py, `ProblemSampler.take`).

The sampler: a screened first epoch is the order an unscreened first draw gives, without the
rejected problems; a draw never passes a problem not judged yet (it waits for the verdict); once
every problem is judged later epochs shuffle the kept ones, as a restricted sampler does; a
checkpoint's state holds the verdicts so far. The job's `PreFilter`, with a judge that answers
from a fixed table when the test lets it: chunks in the epoch's order, step 1 drawn after the
first chunk, the verdicts in `filter.json` as they come, a restart or a resumed checkpoint
judging only what is left and drawing what an uninterrupted run draws, a judging cut short by
the job's end, a judge that fails, and the bulk path that judges everything first.
"""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path

import pytest
from crucible_shared.jobs import TrainJob
from crucible_trainer.online.prefilter import PreFilter, streams
from crucible_trainer.rl.context import ProblemSampler, StepContext

N = 20
KEEP = {i: i % 3 == 0 for i in range(N)}  # 7 of 20 kept
PER_STEP = 2  # problems a step: chunks of 4


def kept_order(order: list[int]) -> list[int]:
    return [i for i in order if KEEP[i]]


def test_the_screened_first_epoch_is_the_first_draw_without_the_rejected_and_later_epochs_shuffle_the_kept() -> (
    None
):
    plain, screened = ProblemSampler(list(range(N)), 4), ProblemSampler(list(range(N)), 4)
    first = plain.draw(N)
    assert screened.screen() == first
    screened.judge(KEEP)
    assert screened.verdicts is None and screened.pool == [i for i in range(N) if KEEP[i]]
    assert screened.draw(7) == kept_order(first)
    plain.restrict(screened.pool)  # the same RNG from here: the kept problems shuffled
    assert [screened.draw(7) for _ in range(3)] == [plain.draw(7) for _ in range(3)]


def test_a_draw_waits_for_the_verdicts_it_reaches() -> None:
    async def run() -> None:
        sampler = ProblemSampler(list(range(N)), 1)
        order = sampler.screen()
        kept = kept_order(order)
        sampler.judge({i: KEEP[i] for i in order[:6]})
        found = sum(KEEP[i] for i in order[:6])
        assert sampler.ready(found) and not sampler.ready(found + 1)
        with pytest.raises(RuntimeError, match="not judged yet"):
            sampler.draw(found + 1)
        taking = asyncio.ensure_future(sampler.take(found + 1))
        await asyncio.sleep(0.01)
        assert not taking.done()
        sampler.judge({i: KEEP[i] for i in order[6:12]})  # enough or not, it looks again
        sampler.judge({i: KEEP[i] for i in order[12:]})
        assert await asyncio.wait_for(taking, 5) == kept[: found + 1]
        assert sampler.verdicts is None and sampler.draw(7 - found - 1) == kept[found + 1 :]

    asyncio.run(run())


def test_nothing_kept_trains_on_every_problem(caplog) -> None:
    sampler = ProblemSampler(list(range(5)), 0)
    order = sampler.screen()
    with caplog.at_level(logging.WARNING):
        sampler.judge(dict.fromkeys(range(5), False))
    assert "kept no problem" in caplog.text
    assert sampler.pool == list(range(5)) and sampler.draw(5) == order


def test_a_checkpoints_state_holds_the_verdicts_so_far() -> None:
    sampler = ProblemSampler(list(range(N)), 2)
    order = sampler.screen()
    sampler.judge({i: KEEP[i] for i in order[:8]})
    sampler.draw(1)
    state = sampler.state()
    sampler.judge({order[9]: True})  # later verdicts do not reach the saved state
    assert order[9] not in state["verdicts"]
    again = ProblemSampler(list(range(N)), 99)
    again.load(json.loads(json.dumps(state)))  # keys as strings, as any serialiser may leave them
    assert again.verdicts == {i: KEEP[i] for i in order[:8]} and again.queue == state["queue"]
    assert again.unjudged() == order[8:]
    again.load(state | {"verdicts": None})
    assert again.verdicts is None
    old = {k: v for k, v in state.items() if k != "verdicts"}  # a checkpoint from before streaming
    again.load(old)
    assert again.verdicts is None


def test_the_judges_error_is_raised_by_a_draw_that_needs_a_verdict_still_to_come() -> None:
    async def run() -> None:
        sampler = ProblemSampler(list(range(N)), 3)
        order = sampler.screen()
        sampler.judge({i: KEEP[i] for i in order[:9]})
        sampler.stopped(ConnectionError("generator gone"))
        have = sum(KEEP[i] for i in order[:9])
        assert len(await sampler.take(have)) == have  # judged already: no error
        with pytest.raises(ConnectionError, match="generator gone"):
            await sampler.take(1)

    asyncio.run(run())


class Judge:
    """A pre-filter's judge answering from `KEEP`; each call waits for the test's go-ahead when
    `held`, and fails when `fails`."""

    def __init__(self, held: bool = False, fails: bool = False) -> None:
        self.calls: list[list[int]] = []
        self.rounds: list[int] = []
        self.held, self.fails = held, fails
        self.go = asyncio.Semaphore(0)

    async def __call__(self, ctx, indices: list[int], round: int = 0) -> dict[int, bool]:
        self.calls.append(list(indices))
        self.rounds.append(round)
        if self.held:
            await self.go.acquire()
        if self.fails:
            raise ConnectionError("the generator went away")
        return {i: KEEP[i] for i in indices}


def pre_filter(
    tmp_path: Path, judge: Judge, sampler: ProblemSampler, summary: dict, events: list
) -> PreFilter:
    job = TrainJob.model_validate({"optim": {"problems_per_step": PER_STEP}})
    ctx = StepContext(job, None, None, sampler, "base", 0)  # the judge alone samples
    return PreFilter(
        judge,
        ctx,
        tmp_path / "filter.json",
        [f"T/{i}" for i in range(N)],
        lambda: None,
        lambda kind, **data: events.append((kind, data)),
        summary,
    )


def test_streamed_chunks_follow_the_epoch_and_step_one_needs_only_the_first(tmp_path) -> None:
    async def run() -> tuple[list[list[int]], list[int], Judge, dict, list]:
        judge, summary, events = Judge(held=True), {}, []
        sampler = ProblemSampler(list(range(N)), 5)
        pf = pre_filter(tmp_path, judge, sampler, summary, events)
        await pf.start(1, streamed=True)  # returns with the judging on its task
        order = pf.order
        await asyncio.sleep(0.01)
        assert judge.calls == [order[:4]] and pf.task is not None and not pf.task.done()
        taking = asyncio.ensure_future(sampler.take(PER_STEP))
        draws: list[list[int]] = []
        for chunk in range(5):  # one chunk let through at a time: each draw as soon as it can
            await asyncio.sleep(0.01)
            assert not taking.done()  # never ahead of the verdicts
            judge.go.release()
            await asyncio.sleep(0.01)
            assert len(judge.calls) == min(chunk + 2, 5)
            while taking.done() and len(draws) < 3:
                draws.append(taking.result())
                taking = asyncio.ensure_future(sampler.take(PER_STEP))
                await asyncio.sleep(0)
            if chunk == 0:
                assert draws == ([kept_order(order)[:2]] if sum(KEEP[i] for i in order[:4]) >= 2 else [])
        await pf.task
        taking.cancel()
        return draws, order, judge, summary, events

    draws, order, judge, summary, events = asyncio.run(run())
    assert judge.calls == [order[i : i + 4] for i in range(0, N, 4)]
    assert len(set(judge.rounds)) == 5  # each chunk its own seeds
    assert [i for d in draws for i in d] == kept_order(order)[:6]
    saved = json.loads((tmp_path / "filter.json").read_text())
    assert saved["order"] == order and dict(map(tuple, saved["verdicts"])) == KEEP
    assert saved["indices"] == kept_order(order) and saved["of"] == N
    assert summary["difficulty_filter"]["kept"] == 7 and summary["difficulty_filter"]["streamed"] is True
    assert events == [("difficulty_filter", {"kept": 7, "of": N})]


def uninterrupted(seed: int, steps: int) -> list[list[int]]:
    sampler = ProblemSampler(list(range(N)), seed)
    sampler.screen()
    sampler.judge(KEEP)
    return [sampler.draw(PER_STEP) for _ in range(steps)]


def test_a_retried_job_judges_only_what_is_left_and_draws_what_it_would_have(tmp_path) -> None:
    async def run(judge: Judge) -> list[list[int]]:
        sampler = ProblemSampler(list(range(N)), 6)
        pf = pre_filter(tmp_path, judge, sampler, {}, [])
        await pf.start(1, streamed=True)
        draws = [await sampler.take(PER_STEP) for _ in range(6)]
        await pf.close()
        return draws

    order = ProblemSampler(list(range(N)), 6).screen()
    partial = {"order": order, "verdicts": [[i, KEEP[i]] for i in order[:10]]}
    (tmp_path / "filter.json").write_text(json.dumps(partial))
    judge = Judge()
    assert asyncio.run(run(judge)) == uninterrupted(6, 6)
    assert sorted(i for call in judge.calls for i in call) == sorted(order[10:])


def test_a_job_resumed_mid_judging_judges_the_rest_and_draws_what_it_would_have(tmp_path) -> None:
    """The checkpoint (after step 2) had 8 verdicts; `filter.json` got 4 more before the kill."""
    sampler = ProblemSampler(list(range(N)), 7)
    order = sampler.screen()
    sampler.judge({i: KEEP[i] for i in order[:8]})
    if not sampler.ready(2 * PER_STEP):
        sampler.judge({i: KEEP[i] for i in order[8:16]})
    [sampler.draw(PER_STEP) for _ in range(2)]
    checkpoint = sampler.state()
    judged = set(checkpoint["verdicts"]) | set(order[: len(checkpoint["verdicts"]) + 4])
    (tmp_path / "filter.json").write_text(
        json.dumps({"order": order, "verdicts": [[i, KEEP[i]] for i in order if i in judged]})
    )

    async def run(judge: Judge) -> list[list[int]]:
        resumed = ProblemSampler(list(range(N)), 7)
        resumed.load(checkpoint)
        pf = pre_filter(tmp_path, judge, resumed, {}, [])
        await pf.start(3, streamed=True)
        draws = [await resumed.take(PER_STEP) for _ in range(4)]
        await pf.close()
        return draws

    judge = Judge()
    assert asyncio.run(run(judge)) == uninterrupted(7, 6)[2:]
    assert not judged & {i for call in judge.calls for i in call}


def test_the_jobs_end_stops_a_judging_still_running(tmp_path) -> None:
    async def run() -> dict:
        judge, summary = Judge(held=True), {}
        sampler = ProblemSampler(list(range(N)), 8)
        pf = pre_filter(tmp_path, judge, sampler, summary, [])
        await pf.start(1, streamed=True)
        judge.go.release()
        while len(judge.calls) < 2:
            await asyncio.sleep(0.01)
        await pf.close()
        assert pf.task is not None and pf.task.cancelled()
        return summary

    summary = asyncio.run(run())
    assert summary["difficulty_filter"]["judged"] == 4 and summary["difficulty_filter"]["of"] == N


def test_a_failing_judge_fails_the_draw_that_waits_for_it(tmp_path) -> None:
    async def run() -> None:
        sampler = ProblemSampler(list(range(N)), 9)
        pf = pre_filter(tmp_path, Judge(fails=True), sampler, {}, [])
        await pf.start(1, streamed=True)
        with pytest.raises(ConnectionError, match="went away"):
            await asyncio.wait_for(sampler.take(PER_STEP), 5)
        await pf.close()

    asyncio.run(run())


def test_judged_first_the_kept_problems_train_shuffled_and_a_retry_reuses_the_choice(tmp_path) -> None:
    async def run(judge: Judge, summary: dict) -> ProblemSampler:
        sampler = ProblemSampler(list(range(N)), 10)
        pf = pre_filter(tmp_path, judge, sampler, summary, [])
        await pf.start(1, streamed=False)
        assert pf.task is None
        return sampler

    judge, summary = Judge(), {}
    sampler = asyncio.run(run(judge, summary))
    assert judge.calls == [list(range(N))] and sampler.pool == [i for i in range(N) if KEEP[i]]
    assert sampler.verdicts is None and summary["difficulty_filter"]["kept"] == 7
    assert json.loads((tmp_path / "filter.json").read_text())["indices"] == sampler.pool
    again = Judge()
    retried = asyncio.run(run(again, {}))
    assert again.calls == [] and retried.pool == sampler.pool


@pytest.mark.parametrize(
    ("model", "expected"),
    [
        ({"device": "cuda:0"}, True),
        ({"device": "cuda:0", "init_adapter": "/adapters/sft"}, False),  # retired after step 1
        ({"device": "cpu"}, False),
    ],
)
def test_a_gpu_job_from_the_base_model_streams(model, expected) -> None:
    spec = TrainJob.model_validate({"model": {"base": "m"} | model})
    assert streams(spec.model) is expected
