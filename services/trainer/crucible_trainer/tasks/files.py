"""Reading JSONL files line by line, with errors that name the file, the line and the field.

A file inside the data roots (every dataset path a job names: the roots check refused the rest)
is opened by a walk from its root's descriptor with `O_NOFOLLOW` on every component
(`crucible_shared.paths.open_inside`) and read from that descriptor: what is read is what the
check allowed, even if the file is swapped for a link meanwhile. Files outside the data roots
(bundled datasets, a run's own artifacts) are opened by path.
"""

from __future__ import annotations

import io
import json
import os
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

from crucible_shared.paths import JobPathError, PathRoots, open_inside
from pydantic import ValidationError

from .task import DatasetError

TEST_KINDS = ("asserts", "check", "stdio")


def open_data(path: str | Path, missing: str = "file not found") -> IO[bytes]:
    """The file at `path` opened for reading in binary (see the module docstring); `DatasetError`
    naming it when it is missing, is a directory, or is reached through a link inside the roots."""
    file = Path(os.path.abspath(Path(path).expanduser()))
    roots = PathRoots().data_roots
    if any(file == r or r in file.parents for r in roots):
        try:
            _, fd = open_inside("data.path", str(file), roots, "data")
        except JobPathError as exc:
            raise DatasetError(
                missing if "does not exist" in exc.message else exc.message, path=str(file)
            ) from None
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise DatasetError(f"{missing} (a directory)", path=str(file))
        return os.fdopen(fd, "rb")
    if not file.is_file():
        raise DatasetError(missing, path=str(file))
    return file.open("rb")


def read_jsonl(path: str | Path) -> Iterator[tuple[int, dict[str, Any]]]:
    """(line number, object) for every non-blank line; `DatasetError` for a line that is no JSON object."""
    file = Path(path).expanduser()
    with io.TextIOWrapper(open_data(file), encoding="utf-8") as lines:
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
