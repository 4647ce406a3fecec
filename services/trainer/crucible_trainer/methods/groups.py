"""Groups of samples (one problem's samples share an advantage baseline) and which of them train.

A group whose rewards are all equal has zero advantage everywhere and carries no gradient.
`select_groups` implements the filters of `crucible_shared.jobs.GroupFilter`:

* `dynamic` (DAPO's dynamic sampling): drop such groups and sample groups of fresh problems
  (drawn from the job's `ProblemSampler`, so the order stays reproducible) until the step has
  its quota of informative groups or has drawn `max_draw_factor` times the quota;
* `pre`: `pre_filter`'s judge samples each problem a few times and keeps those the starting
  policy sometimes solves (0 < pass rate < 1) or, with `pre_keep: reward_spread`, those whose
  rewards differ; the job judges every problem before training or while it trains
  (online/prefilter.py).
"""

from __future__ import annotations

import logging
import math
from collections import defaultdict
from collections.abc import Awaitable, Callable

from crucible_shared.jobs import GroupFilter

from crucible_trainer.rl.advantages import agree, group_advantages, zero_signal
from crucible_trainer.rl.context import StepContext, first_prompts
from crucible_trainer.rl.rollout import Sample

log = logging.getLogger(__name__)

# (problem indices, first group id, draw round) -> (scored samples, counters to sum over rounds)
SampleGroups = Callable[[list[int], int, int], Awaitable[tuple[list[Sample], dict[str, float]]]]


def by_group(batch: list[Sample]) -> dict[int, list[Sample]]:
    groups: dict[int, list[Sample]] = defaultdict(list)
    for s in batch:
        if s.reward is not None:
            groups[s.group].append(s)
    return groups


def assign_group_advantages(batch: list[Sample], scale: str) -> tuple[int, int]:
    """Set `advantage` on every scored sample, group by group; returns (groups, zero-signal groups)."""
    groups = by_group(batch)
    keys = sorted(groups)
    rewards = [[s.reward for s in groups[k]] for k in keys]
    if not rewards:
        return 0, 0
    task = [[s.task_reward for s in groups[k]] for k in keys]  # the spread is the tests', not the length's
    for k, adv in zip(keys, group_advantages(rewards, scale=scale, task=task), strict=True):
        for s, a in zip(groups[k], adv, strict=True):
            s.advantage = a
    return len(keys), zero_signal(task)


def zero_signal_metrics(batch: list[Sample]) -> dict[str, float]:
    """How many of the sampled groups carry no signal from the tests (a length penalty's alone
    does not count, as `informative` has it)."""
    groups = by_group(batch)
    zero = zero_signal([[s.task_reward for s in members] for members in groups.values()]) if groups else 0
    return {"zero_signal_groups": float(zero), "zero_signal_fraction": zero / len(groups) if groups else 1.0}


def informative(batch: list[Sample]) -> list[int]:
    """Ids of the groups whose task rewards differ (in order of first appearance): a length
    penalty alone does not make a group worth its place in the step."""
    groups = by_group(batch)
    return [g for g, members in groups.items() if not agree([s.task_reward for s in members])]


async def select_groups(
    ctx: StepContext, filt: GroupFilter, indices: list[int], sample_groups: SampleGroups
) -> tuple[list[Sample], list[Sample], dict[str, float], dict[str, float]]:
    """Sample the step's groups; returns (training batch, everything sampled, summed counters,
    filter metrics). Without dynamic sampling both batches are the same."""
    batch, counts = await sample_groups(indices, 0, 0)
    if filt.mode != "dynamic":
        return batch, batch, counts, {}
    quota = len(indices)
    cap = max(quota, math.ceil(filt.max_draw_factor * quota))
    everything, drawn, rounds = list(batch), quota, 1
    kept = informative(batch)[:quota]
    found = len(informative(batch))
    while len(kept) < quota and drawn < cap:
        need = quota - len(kept)
        rate = max(found / drawn, 1 / 8)  # draw enough to expect `need` informative groups
        fresh = ctx.sampler.draw(min(cap - drawn, math.ceil(need / rate)))
        more, more_counts = await sample_groups(fresh, drawn, rounds)
        for s in more:  # refinements point at their first attempt inside `everything`
            if s.parent is not None:
                s.parent += len(everything)
        everything += more
        for key, value in more_counts.items():
            counts[key] = counts.get(key, 0.0) + value
        new = informative(more)
        found += len(new)
        kept += new[:need]
        drawn += len(fresh)
        rounds += 1
    chosen = set(kept)
    batch = [s for s in everything if s.group in chosen]
    # Whole groups are kept, so every kept refinement's first attempt is kept too: renumber.
    where = {id(s): i for i, s in enumerate(batch)}
    for s in batch:
        if s.parent is not None:
            s.parent = where[id(everything[s.parent])]
    metrics = {
        "filter/groups_drawn": float(drawn),
        "filter/groups_kept": float(len(kept)),
        "filter/rounds": float(rounds),
        "filter/extra_draw_fraction": (drawn - quota) / quota,
        "filter/quota_met": float(len(kept) >= quota),
    }
    return batch, everything, counts, metrics


# (step context, problem indices, draw round) -> whether each problem is worth training on
Judge = Callable[[StepContext, list[int], int], Awaitable[dict[int, bool]]]


def pre_filter(filt: GroupFilter) -> Judge | None:
    """`pre`'s judge: each problem's verdict from `pre_samples` first attempts (`worth_training`);
    None for the other modes. Which problems it judges, and when, is the job's (online/prefilter.py)."""
    if filt.mode != "pre":
        return None

    async def judge(ctx: StepContext, indices: list[int], round: int = 0) -> dict[int, bool]:
        batch = await ctx.sample(first_prompts(ctx, indices), filt.pre_samples, round=round)
        groups = by_group(batch)
        return {t: worth_training(groups.get(i, []), filt.pre_keep) for i, t in enumerate(indices)}

    return judge


def worth_training(members: list[Sample], keep: str) -> bool:
    """Whether a problem's pre-filter samples pass `keep`: `pass_rate`, some but not all passed;
    `reward_spread`, their rewards differ (the group would carry a gradient).

    >>> from crucible_shared.sandbox import RunResult
    >>> def s(status, reward):
    ...     r = RunResult(status=status, passed=int(reward == 1.0), total=1)
    ...     return Sample(0, 0, [], [], "", "", None, None, result=r, reward=reward)
    >>> partly = [s("failed", 0.5), s("failed", 0.0)]
    >>> worth_training(partly, "pass_rate"), worth_training(partly, "reward_spread")
    (False, True)
    >>> worth_training([s("passed", 1.0), s("failed", 0.0)], "pass_rate")
    True
    >>> worth_training([s("failed", 0.0), s("failed", 0.0)], "reward_spread"), worth_training([], "pass_rate")
    (False, False)
    """
    if not members:
        return False
    if keep == "reward_spread":  # of the tests' reward: every length differs
        return len({s.task_reward for s in members}) > 1
    rate = sum(1 for s in members if s.result and s.result.status == "passed") / len(members)
    return 0 < rate < 1
