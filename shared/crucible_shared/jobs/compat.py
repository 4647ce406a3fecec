"""Older spec forms, read as today's: every shim in one place, each a `mode="before"` step of the
model that owns the field (the model's validator calls it). A shim rewrites the old form into the
new one and refuses a spec that gives both forms, or an old field that would have no effect.

- `method.difficulty_filter` / `method.filter_samples` (GRPO, SRRL): now `method.filter`.
- `eval.temperature: 0` (with `n: 1`) for a greedy evaluation: now `greedy: true, n: 0`.
- `rollout.group_size` (train job): now GRPO's `method.group_size`.
"""

from __future__ import annotations

from typing import Any

from crucible_shared.jobs.base import invalid, unused


def filter_from_difficulty(data: Any) -> Any:
    """Specs written before `filter` existed: `difficulty_filter: true` (+ `filter_samples`) is the
    pre-filter."""
    if isinstance(data, dict) and ("difficulty_filter" in data or "filter_samples" in data):
        data = dict(data)
        on, samples = data.pop("difficulty_filter", False), data.pop("filter_samples", None)
        if "filter" in data and (on or samples is not None):
            raise invalid("difficulty_filter", "give `filter` alone (difficulty_filter is its old form)")
        if on:
            data["filter"] = {"mode": "pre", **({"pre_samples": samples} if samples is not None else {})}
        elif samples is not None:
            raise unused("filter_samples", "the difficulty filter is off")
    return data


def greedy_from_temperature(data: Any) -> Any:
    """Older specs said `temperature: 0` (with n: 1) for a greedy evaluation."""
    if isinstance(data, dict) and data.get("temperature") == 0:
        data = {k: v for k, v in data.items() if k != "temperature"}
        if data.get("n", 1) not in (0, 1):
            raise unused("n", "temperature 0 is greedy: one answer per problem; set temperature > 0")
        data["n"], data["greedy"] = 0, True
    return data


def group_size_from_rollout(data: Any) -> Any:
    """`rollout.group_size` is GRPO's `method.group_size` (older specs put it in rollout)."""
    if not isinstance(data, dict) or not isinstance(data.get("rollout"), dict):
        return data
    if "group_size" not in data["rollout"]:
        return data
    rollout = dict(data["rollout"])
    size = rollout.pop("group_size")
    method = data.get("method") or {"name": "grpo"}
    if not isinstance(method, dict) or method.get("name", "grpo") != "grpo":
        name = method.get("name") if isinstance(method, dict) else "?"
        raise unused(
            "rollout.group_size",
            f"only GRPO samples groups (method {name} has its own sample counts: see its config)",
        )
    if "group_size" in method and method["group_size"] != size:
        raise invalid("rollout.group_size", "give method.group_size alone")
    return {**data, "rollout": rollout, "method": {**method, "group_size": size}}
