"""`DataSpec`: which problems a job or an evaluation uses, and `load_tasks` to get them.

Selection order: the dataset's split (MBPP), then `ids` or `id_range`, then `shuffle` with `seed`,
then the first `limit`. So `limit=30` takes the first 30 tasks and `shuffle=True, limit=30, seed=1`
a random 30 that the same seed always reproduces.
"""

from __future__ import annotations

import random
import re
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from . import custom, humaneval, mbpp, stdio
from .task import DatasetError, Task

Dataset = Literal["mbpp", "humaneval", "stdio", "jsonl"]
Split = Literal["prompt", "test", "validation", "train", "all"]


class DataSpec(BaseModel):
    """A dataset and the subset of it to use (JSON-serialisable: it travels inside job specs)."""

    model_config = ConfigDict(extra="forbid")

    dataset: Dataset = Field(default="mbpp", description="Which adapter reads the tasks.")
    split: Split | None = Field(
        default=None,
        description="MBPP split by task id (prompt 1-10, test 11-510, validation 511-600, train 601-974); "
        "default `test`, or `all` when `ids` / `id_range` pick the tasks. Other datasets: `all` only.",
    )
    path: str | None = Field(
        default=None, description="JSONL file (required for stdio and jsonl; overrides MBPP/HumanEval data)."
    )
    ids: list[int | str] | None = Field(
        default=None, description="Task ids to keep, in this order: 11, `MBPP/11`, `HumanEval/3`, `my-task`."
    )
    id_range: tuple[int, int] | None = Field(
        default=None, description="Inclusive range of numeric task ids (MBPP 601-630, HumanEval 0-19)."
    )
    limit: int | None = Field(default=None, ge=1, description="Keep at most this many tasks.")
    shuffle: bool = Field(default=False, description="Shuffle (with `seed`) before applying `limit`.")
    seed: int = Field(default=0, description="Seed of the shuffle.")
    challenge_tests: bool = Field(default=True, description="MBPP: add `challenge_test_list` to the tests.")
    max_cases: int | None = Field(
        default=None, ge=1, description="stdio: keep at most this many cases per task."
    )

    @model_validator(mode="after")
    def _check(self) -> DataSpec:
        if self.dataset in ("stdio", "jsonl") and not self.path:
            raise ValueError(f"path: a {self.dataset} dataset needs the path of its JSONL file")
        if self.dataset != "mbpp" and self.split not in (None, "all"):
            raise ValueError(f"split: {self.dataset} has no split {self.split!r} (only MBPP has splits)")
        if self.ids is not None and self.id_range is not None:
            raise ValueError("ids and id_range: give one of them, not both")
        if self.ids is not None and not self.ids:
            raise ValueError("ids: empty list")
        if self.id_range is not None and self.id_range[0] > self.id_range[1]:
            raise ValueError(f"id_range: start {self.id_range[0]} is after end {self.id_range[1]}")
        return self

    @property
    def effective_split(self) -> str:
        if self.split is not None:
            return self.split
        if self.dataset == "mbpp" and self.ids is None and self.id_range is None:
            return "test"
        return "all"

    def describe(self) -> str:
        """A short human label: `mbpp/test[first 30]`."""
        parts = [f"{self.dataset}/{self.effective_split}"]
        if self.ids is not None:
            parts.append(f"ids={len(self.ids)}")
        if self.id_range is not None:
            parts.append(f"ids {self.id_range[0]}-{self.id_range[1]}")
        if self.limit is not None:
            parts.append(f"{'random' if self.shuffle else 'first'} {self.limit}")
        elif self.shuffle:
            parts.append("shuffled")
        return " ".join(parts)


def load_tasks(spec: DataSpec) -> list[Task]:
    """The tasks `spec` selects; `DatasetError` names the file, line and field of a bad source."""
    tasks = _read(spec)
    split = spec.effective_split
    if spec.dataset == "mbpp" and split != "all":
        lo, hi = mbpp.SPLITS[split]
        tasks = [t for t in tasks if lo <= t.metadata["number"] <= hi]
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
