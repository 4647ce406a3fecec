"""The rows SFT and DPO train on: TRL's prompt-completion and preference formats, checked.

A row's `prompt`, `completion`, `chosen` and `rejected` are each a string (plain language
modelling) or a list of `{role, content}` chat messages (TRL applies the tokenizer's chat
template); one file uses one form. Other fields (a pipeline's `task_id`, `margin`, ...) are
kept in the files and left out of training.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from crucible_trainer.tasks.files import read_jsonl
from crucible_trainer.tasks.task import DatasetError

# The columns each method trains on.
COLUMNS: dict[str, tuple[str, ...]] = {
    "sft": ("prompt", "completion"),
    "dpo": ("prompt", "chosen", "rejected"),
}


def load_rows(path: Path, method: str) -> list[dict[str, Any]]:
    """A user's JSONL for `method`, checked: every row has the method's columns, each a string or
    a list of chat messages, all rows in the same form. `DatasetError` names file, line and field."""
    rows = []
    form = None
    for number, row in read_jsonl(path):
        for column in COLUMNS[method]:
            value = row.get(column)
            kind = _form(value)
            if kind is None:
                raise DatasetError(
                    "expected a string or a list of {role, content} messages",
                    path=str(path),
                    line=number,
                    field=column,
                )
            if form is None:
                form = kind
            elif kind != form:
                raise DatasetError(
                    f"is a {kind} but earlier rows are {form}s: use one form in the whole file",
                    path=str(path),
                    line=number,
                    field=column,
                )
        rows.append({c: row[c] for c in COLUMNS[method]})
    if not rows:
        raise DatasetError("no rows", path=str(path))
    return rows


def _form(value: Any) -> str | None:
    if isinstance(value, str):
        return "string"
    if (
        isinstance(value, list)
        and value
        and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in value
        )
    ):
        return "message list"
    return None
