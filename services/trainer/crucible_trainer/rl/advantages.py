"""Advantages: from rewards to per-sample weights of the policy gradient. Pure functions.

>>> group_advantages([[1.0, 0.0, 0.0, 1.0]], scale="group")
[[1.0, -1.0, -1.0, 1.0]]
>>> group_advantages([[0.0, 0.0, 0.0]], scale="group")  # no signal in a uniform group
[[0.0, 0.0, 0.0]]
>>> batch_normalised([1.0, 2.0, 3.0])
[-1.2247, 0.0, 1.2247]
>>> mean_baseline([1.0, 0.0])
[0.5, -0.5]
"""

from __future__ import annotations

import math
from typing import Literal

EPS = 1e-6
SAME = 1e-9  # rewards closer than this agree (`agree`), a spread below it is none (`_scaled`)


def _mean_std(values: list[float]) -> tuple[float, float]:
    mean = sum(values) / len(values)
    var = sum((v - mean) ** 2 for v in values) / len(values)  # population std, as GRPO papers use
    return mean, math.sqrt(var)


def group_advantages(
    groups: list[list[float]],
    scale: Literal["group", "batch", "none"] = "group",
    task: list[list[float]] | None = None,
) -> list[list[float]]:
    """GRPO: reward minus its group's mean, divided by the group's std, the batch's std, or 1.

    `task`, the same rewards before a length penalty, sets the spread instead: the penalty is
    centred with the rest but never sets the scale. Without it, a group whose tests all agree
    would have its length differences divided by their own tiny spread, and a penalty of 0.01
    per 100 tokens would weigh as much as passing the tests (docs/benchmarks.md: such runs
    collapsed to 30-token answers). Where the task rewards agree (a group's, or with
    `scale: batch` the whole batch's), the centred penalty stays unscaled.

    >>> group_advantages([[0.99, 0.98]], task=[[1.0, 1.0]])
    [[0.005, -0.005]]
    >>> group_advantages([[0.99, 0.98]])  # the same group, its spread from the penalty alone
    [[0.9998, -0.9998]]
    >>> group_advantages([[0.99, -0.02]], task=[[1.0, 0.0]])
    [[1.01, -1.01]]
    >>> group_advantages([[0.99, 0.98], [0.97, 0.99]], scale="batch", task=[[1.0, 1.0], [1.0, 1.0]])
    [[0.005, -0.005], [-0.01, 0.01]]
    """
    task = task if task is not None else groups
    centred = []
    for rewards in groups:
        mean, _ = _mean_std(rewards)
        centred.append([r - mean for r in rewards])
    if scale == "none":
        return [[round(a, 4) for a in g] for g in centred]
    if scale == "batch":
        _, std = _mean_std([r for g in task for r in g])
        return [[_scaled(a, std) for a in g] for g in centred]
    spreads = [_mean_std(g)[1] for g in task]
    return [[_scaled(a, std) for a in adv] for std, adv in zip(spreads, centred, strict=True)]


def _scaled(a: float, std: float) -> float:
    """`a` over the task rewards' spread; unscaled where they agree (there is only a penalty to
    centre, and dividing it by EPS would make it a million times the tests' weight)."""
    return round(a / (std + EPS), 4) if std > SAME else round(a, 4)


def agree(values: list[float]) -> bool:
    """Whether `values` are all equal (within `SAME`).

    >>> agree([1.0, 1.0]), agree([0.0, 1.0])
    (True, False)
    """
    return max(values) - min(values) < SAME


def zero_signal(groups: list[list[float]]) -> int:
    """Number of groups whose rewards are all equal: they contribute no gradient.

    >>> zero_signal([[1, 1], [0, 1], [0, 0]])
    2
    """
    return sum(1 for g in groups if agree(g))


def batch_normalised(rewards: list[float]) -> list[float]:
    """PPO: (r - mean) / (std + eps) over the whole batch."""
    mean, std = _mean_std(rewards)
    return [round((r - mean) / (std + EPS), 4) for r in rewards]


def mean_baseline(rewards: list[float]) -> list[float]:
    """REINFORCE with a baseline: r - mean(r)."""
    mean = sum(rewards) / len(rewards)
    return [round(r - mean, 4) for r in rewards]


def ema_baselines(
    returns: list[tuple[str, float]], baselines: dict[str, float], decay: float
) -> dict[str, float]:
    """SPIRAL's role-conditioned baselines after folding in `returns`, (key, return) pairs in order:
    b[key] <- decay * b[key] + (1 - decay) * return. A key seen for the first time starts at 0.

    >>> ema_baselines([("ttt/x", 1.0), ("ttt/x", 1.0), ("ttt/o", -1.0)], {}, 0.5)
    {'ttt/x': 0.75, 'ttt/o': -0.5}
    """
    out = dict(baselines)
    for key, value in returns:
        out[key] = round(decay * out.get(key, 0.0) + (1 - decay) * value, 10)
    return out


def baseline_advantages(returns: list[float], keys: list[str], baselines: dict[str, float]) -> list[float]:
    """Role-conditioned advantages (RAE): each return minus the baseline of its key (its game and
    role), as the baseline was before this batch, so it is independent of the return it corrects.

    >>> baseline_advantages([1.0, -1.0, 1.0], ["w", "p", "w"], {"w": 0.5, "p": -0.5})
    [0.5, -0.5, 0.5]
    """
    return [round(r - baselines.get(k, 0.0), 6) for r, k in zip(returns, keys, strict=True)]


def scale_within(advantages: list[float], returns: list[float], groups: list[str]) -> list[float]:
    """Advantages divided by the std of their group's returns in the batch (GRPO-style), where it
    is positive; a group whose returns are all equal keeps its advantages as they are.

    >>> scale_within([0.5, -1.5, 1.0, 1.0], [1.0, -1.0, 1.0, 1.0], ["w", "w", "p", "p"])
    [0.5, -1.5, 1.0, 1.0]
    >>> scale_within([2.0, -2.0], [3.0, -1.0], ["w", "w"])
    [1.0, -1.0]
    """
    by_group: dict[str, list[float]] = {}
    for r, g in zip(returns, groups, strict=True):
        by_group.setdefault(g, []).append(r)
    stds = {g: _mean_std(v)[1] for g, v in by_group.items()}
    return [
        round(a / (stds[g] + EPS), 4) if stds[g] > 0 else a for a, g in zip(advantages, groups, strict=True)
    ]
