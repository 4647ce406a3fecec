"""`DataSpec`: which problems a job or an evaluation uses, and `load_tasks` to get them.

Selection order: the dataset's split (MBPP by task id; HumanEval's seeded train/test split), then `ids` or `id_range`, then `shuffle` with `seed`,
then the first `limit`. So `limit=30` takes the first 30 tasks and `shuffle=True, limit=30, seed=1`
a random 30 that the same seed always reproduces.
"""

from __future__ import annotations

import random
import re

from crucible_shared.jobs import DataSpec

from . import custom, humaneval, mbpp, stdio
from .task import DatasetError, Task


def load_tasks(spec: DataSpec) -> list[Task]:
    """The tasks `spec` selects; `DatasetError` names the file, line and field of a bad source."""
    tasks = _read(spec)
    split = spec.effective_split
    if spec.dataset == "mbpp" and split != "all":
        lo, hi = mbpp.SPLITS[split]
        tasks = [t for t in tasks if lo <= t.metadata["number"] <= hi]
    elif spec.dataset == "humaneval" and split != "all":
        numbers = humaneval.split_numbers(split)
        tasks = [t for t in tasks if t.metadata["number"] in numbers]
    if spec.ids is not None:
        tasks = _by_ids(tasks, spec)
    elif spec.id_range is not None:
        lo, hi = spec.id_range
        tasks = [t for t in tasks if lo <= _number(t, spec) <= hi]
        if not tasks:
            raise DatasetError(f"no task of {spec.describe()} has an id in {lo}-{hi}", field="id_range")
    if spec.shuffle:
        tasks = list(tasks)
        random.Random(spec.seed).shuffle(tasks)
    if spec.limit is not None:
        tasks = tasks[: spec.limit]
    return tasks


def _read(spec: DataSpec) -> list[Task]:
    if spec.dataset == "mbpp":
        return mbpp.load(spec.path, challenge_tests=spec.challenge_tests)
    if spec.dataset == "humaneval":
        return humaneval.load(spec.path)
    if spec.dataset == "stdio":
        return stdio.load(spec.path or "", max_cases=spec.max_cases)
    return custom.load(spec.path or "")


def _by_ids(tasks: list[Task], spec: DataSpec) -> list[Task]:
    index = {t.task_id: t for t in tasks}
    for t in tasks:
        # Numeric shorthands: 11 for MBPP/11, 3 for HumanEval/3.
        index.setdefault(t.task_id.rsplit("/", 1)[-1], t)
    chosen, missing = [], []
    for wanted in spec.ids or []:
        task = index.get(str(wanted))
        if task is None:
            missing.append(wanted)
        else:
            chosen.append(task)
    if missing:
        shown = ", ".join(map(str, missing[:10])) + (" ..." if len(missing) > 10 else "")
        raise DatasetError(f"not in {spec.describe()}: {shown}", field="ids")
    return chosen


def _number(task: Task, spec: DataSpec) -> int:
    match = re.search(r"(\d+)$", task.task_id)
    if match is None:
        raise DatasetError(
            f"task id {task.task_id!r} is not numeric, so id_range cannot select it", field="id_range"
        )
    return int(match.group(1))
