"""Files of a pipeline run: JSONL rows, outputs that appear atomically, and content hashes.

Every stage output is written to a temporary sibling and renamed into place
(`crucible_trainer.runtime.atomic`), so a killed stage never leaves a half-written file that a
later run would take for finished, and files hard-linked from another run dir (`reuse`) are
replaced, never modified in place.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from crucible_trainer.runtime.atomic import output_file
from crucible_trainer.tasks.files import read_jsonl


def read_rows(path: Path) -> list[dict[str, Any]]:
    """Every row of a JSONL file (`DatasetError` names a bad line)."""
    return [row for _, row in read_jsonl(path)]


def write_rows(path: Path, rows: Iterable[dict[str, Any]]) -> Path:
    """Write JSONL rows atomically."""
    with output_file(path) as tmp, tmp.open("w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    return path


def write_json(path: Path, value: Any) -> Path:
    with output_file(path) as tmp:
        tmp.write_text(json.dumps(value, indent=2, default=str), encoding="utf-8")
    return path


def content_hash(path: Path) -> str | None:
    """sha256 of a file, or of a folder's (relative path, file hash) list; None when missing."""
    if path.is_file():
        return _file_hash(path)
    if not path.is_dir():
        return None
    digest = hashlib.sha256()
    for file in sorted(p for p in path.rglob("*") if p.is_file() and not p.name.startswith(".")):
        digest.update(f"{file.relative_to(path).as_posix()}\0{_file_hash(file)}\n".encode())
    return digest.hexdigest()


def _file_hash(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def json_hash(value: Any) -> str:
    """sha256 of a JSON value with sorted keys (a config's identity)."""
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()


def link_tree(source: Path, target: Path, names: Iterable[str]) -> list[str]:
    """Copy the entries `names` of `source` into `target`, hard-linking files (copying where links
    are impossible); returns the names copied.

    Symbolic links are skipped at every level, never followed: a link in the source run dir
    pointing at `/etc` must not turn into a regular file of the new run dir (which the
    artifacts route would then serve).
    """
    copied = []
    for name in names:
        src = source / name
        if src.is_symlink() or not src.exists() or (target / name).exists():
            continue
        if src.is_dir():
            shutil.copytree(src, target / name, copy_function=_link_or_copy, ignore=_links)
        else:
            target.mkdir(parents=True, exist_ok=True)
            _link_or_copy(str(src), str(target / name))
        copied.append(name)
    return copied


def _links(folder: str, names: list[str]) -> set[str]:
    return {n for n in names if os.path.islink(os.path.join(folder, n))}


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst, follow_symlinks=False)
    except OSError:
        shutil.copy2(src, dst, follow_symlinks=False)
