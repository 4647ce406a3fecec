"""Reading JSONL files line by line, with errors that name the file, the line and the field."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from .task import DatasetError

TEST_KINDS = ("asserts", "check", "stdio")


def read_jsonl(path: str | Path) -> Iterator[tuple[int, dict[str, Any]]]:
    """(line number, object) for every non-blank line; `DatasetError` for a line that is no JSON object."""
    file = Path(path).expanduser()
    if not file.is_file():
        raise DatasetError("file not found", path=str(file))
    with file.open(encoding="utf-8") as lines:
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError as exc:
                raise DatasetError(f"not valid JSON: {exc}", path=str(file), line=number) from exc
            if not isinstance(row, dict):
                raise DatasetError(
                    f"expected a JSON object, got {type(row).__name__}", path=str(file), line=number
                )
            yield number, row


def validation_error(exc: ValidationError, path: str | Path, line: int, prefix: str = "") -> DatasetError:
    """The first problem of a pydantic `ValidationError` as a `DatasetError` naming its field."""
    first = exc.errors()[0]
    loc = [str(p) for p in first["loc"]]
    # Pydantic puts the tag of a discriminated union in the location (`tests.check.entry_point`).
    for i in range(len(loc) - 1):
        if loc[i] == "tests" and loc[i + 1] in TEST_KINDS and len(loc) > i + 2:
            del loc[i + 1]
            break
    field = ".".join(filter(None, [prefix, *loc])) or None
    return DatasetError(first["msg"], path=str(path), line=line, field=field)
