"""Custom problems from a JSONL file, one task per line.

Schema (only `prompt` and `tests` are required):

    {"task_id": "add-1",                       # default: "<file stem>/<line number>"
     "prompt": "Write a function add(a, b) that returns the sum of a and b.",
     "tests": {"kind": "asserts", "asserts": ["assert add(2, 2) == 4"], "setup": ""},
     "entry_point": "add", "reference": "def add(a, b):\\n    return a + b",
     "shown_test": "assert add(2, 2) == 4", "prompt_is_code": false, "preamble": "",
     "metadata": {"source": "mine"}}

`tests` takes any of the sandbox's three forms: `{"kind": "asserts", "asserts": [...], "setup": ...}`,
`{"kind": "check", "check": "def check(candidate): ...", "entry_point": "f"}` or
`{"kind": "stdio", "cases": [{"input": "1 2\\n", "output": "3\\n"}]}`; a plain list of assert
statements is short for the first. Unknown fields are refused, so a typo cannot pass unnoticed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import ValidationError

from .files import read_jsonl, validation_error
from .task import DatasetError, Task

DATASET = "jsonl"


def load(path: str | Path) -> list[Task]:
    """Every task of a custom JSONL file, in file order; `DatasetError` names the file, line and field."""
    file = Path(path).expanduser()
    tasks: list[Task] = []
    seen: dict[str, int] = {}
    for number, row in read_jsonl(file):
        tasks.append(parse_row(row, file, number))
        task_id = tasks[-1].task_id
        if task_id in seen:
            raise DatasetError(
                f"duplicate task_id {task_id!r} (first on line {seen[task_id]})",
                path=str(file),
                line=number,
                field="task_id",
            )
        seen[task_id] = number
    return tasks


def parse_row(row: dict[str, Any], file: Path, number: int) -> Task:
    """One line of the file as a `Task`."""
    fields = dict(row)
    fields.setdefault("task_id", f"{file.stem}/{number}")
    fields["task_id"] = str(fields["task_id"])
    fields.setdefault("dataset", DATASET)
    if isinstance(fields.get("tests"), list):
        fields["tests"] = {"kind": "asserts", "asserts": fields["tests"]}
    try:
        return Task.model_validate(fields)
    except ValidationError as exc:
        raise validation_error(exc, file, number) from exc
