"""Outputs that appear atomically: written into a hidden temporary sibling, then renamed into
place, so a killed writer never leaves a half-written file or folder that a later reader would
take for finished, and a file hard-linked from elsewhere is replaced, never modified in place."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def output_file(path: Path) -> Iterator[Path]:
    """A temporary path that becomes `path` when the block ends without an error."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    os.close(fd)
    tmp = Path(name)
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


@contextmanager
def output_dir(path: Path) -> Iterator[Path]:
    """A temporary folder that replaces `path` when the block ends without an error."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
    try:
        yield tmp
        if path.exists():
            shutil.rmtree(path)
        os.replace(tmp, path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
