"""MBPP (Austin et al. 2021), read from the vendored `data/mbpp.jsonl`.

Standard splits by task id: prompt 1-10, test 11-510, validation 511-600, train 601-974. Each task's
tests are its three `test_list` asserts plus its `challenge_test_list` ones (11 tasks have them), with
`test_setup_code` as the suite's setup. The first `test_list` assert is shown in the prompt, the MBPP
convention that tells the model the function's name and signature.
"""

from __future__ import annotations

import builtins
import keyword
import os
import re
from pathlib import Path

from crucible_shared.sandbox import AssertTests

from .files import read_jsonl
from .task import DatasetError, Task

SPLITS: dict[str, tuple[int, int]] = {
    "prompt": (1, 10),
    "test": (11, 510),
    "validation": (511, 600),
    "train": (601, 974),
    "all": (1, 974),
}

# Reference solutions that fail their own tests on CPython 3.11 (set iteration order: 341, 642;
# `sys.getsizeof` of another build: 596). See data/README.md.
KNOWN_BAD_REFERENCES = frozenset({341, 596, 642})

_FIELDS = ("task_id", "text", "code", "test_list", "test_setup_code", "challenge_test_list")


def default_path() -> Path:
    """`$CRUCIBLE_DATA_DIR/mbpp.jsonl`, else the repository's vendored `data/mbpp.jsonl`."""
    root = os.environ.get("CRUCIBLE_DATA_DIR")
    if root:
        return Path(root).expanduser() / "mbpp.jsonl"
    return Path(__file__).resolve().parents[4] / "data" / "mbpp.jsonl"


def task_number(task_id: str) -> int:
    """`MBPP/11` -> 11."""
    return int(task_id.rsplit("/", 1)[-1])


def load(path: str | Path | None = None, *, challenge_tests: bool = True) -> list[Task]:
    """Every MBPP task in `path` (default: the vendored file), in task-id order."""
    file = Path(path) if path else default_path()
    if not file.is_file():
        raise DatasetError("MBPP file not found (set CRUCIBLE_DATA_DIR or `path`)", path=str(file))
    tasks = []
    for number, row in read_jsonl(file):
        missing = [f for f in _FIELDS if f not in row]
        if missing:
            raise DatasetError("missing", path=str(file), line=number, field=missing[0])
        tasks.append(_task(row, challenge_tests))
    return sorted(tasks, key=lambda t: t.metadata["number"])


def _task(row: dict, challenge_tests: bool) -> Task:
    asserts = list(row["test_list"]) + (list(row["challenge_test_list"]) if challenge_tests else [])
    number = int(row["task_id"])
    return Task(
        task_id=f"MBPP/{number}",
        dataset="mbpp",
        prompt=row["text"].strip(),
        tests=AssertTests(asserts=asserts, setup=row["test_setup_code"]),
        entry_point=_function_name(row["test_list"][0]),
        reference=row["code"],
        shown_test=row["test_list"][0],
        metadata={
            "number": number,
            "split": split_of(number),
            "known_bad_reference": number in KNOWN_BAD_REFERENCES,
        },
    )


def split_of(number: int) -> str:
    """The standard split a task id belongs to."""
    for name, (lo, hi) in SPLITS.items():
        if name != "all" and lo <= number <= hi:
            return name
    return "all"


def _function_name(assertion: str) -> str | None:
    """The function a test calls, preferring non-builtins: `assert int(f(5)) == 35` -> `f`."""
    names = [
        m.group(1)
        for m in re.finditer(r"(?<![\w.])([A-Za-z_]\w*)\s*\(", assertion)
        if not keyword.iskeyword(m.group(1))
    ]
    own = [name for name in names if not hasattr(builtins, name)]
    return (own or names or [None])[0]
