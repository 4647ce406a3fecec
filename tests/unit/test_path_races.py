"""What is read is what was checked: races against the containment rule (`crucible_shared.paths`)
and the generator's adapter snapshot, each attacked for a bounded time by a thread that swaps a
checked file for a link to a secret outside the roots and back. Each passes only with zero reads
of the secret; the old check-then-reopen code read it hundreds of times in the same loops."""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import pytest
from crucible_shared.paths import (
    PathMissing,
    PathOutsideRoots,
    UnsafePath,
    open_file_inside,
    open_inside,
    resolve_inside,
)

SECRET = "SECRET-0123456789"
LOOP_S = 1.5


def _swapper(target: Path, good: bytes, secret: Path, stop: threading.Event) -> threading.Thread:
    """Flip `target` between a regular file holding `good` and a link to `secret` (atomic renames)."""
    regular, link = target.with_name(".regular"), target.with_name(".link")

    def loop() -> None:
        while not stop.is_set():
            regular.write_bytes(good)
            os.replace(regular, target)
            if link.is_symlink():
                link.unlink()
            link.symlink_to(secret)
            os.replace(link, target)

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    return thread


@pytest.fixture
def world(tmp_path: Path) -> dict[str, Path]:
    root, outside = tmp_path / "root", tmp_path / "outside"
    (root / "sub").mkdir(parents=True)
    outside.mkdir()
    (outside / "secret.jsonl").write_text(json.dumps({"secret": SECRET}) + "\n")
    (root / "sub" / "data.jsonl").write_text('{"ok": 1}\n')
    return {"root": root, "outside": outside, "target": root / "sub" / "data.jsonl"}


def _race(world: dict[str, Path], read) -> tuple[int, int]:
    """(reads that saw the secret, reads done) while the swapper runs for `LOOP_S` seconds."""
    stop = threading.Event()
    thread = _swapper(world["target"], b'{"ok": 1}\n', world["outside"] / "secret.jsonl", stop)
    leaks = reads = 0
    deadline = time.monotonic() + LOOP_S
    try:
        while time.monotonic() < deadline:
            try:
                text = read()
            except (PathOutsideRoots, PathMissing, UnsafePath):
                continue  # a refusal is fine; only a read of the secret is a failure
            reads += 1
            leaks += SECRET in text
    finally:
        stop.set()
        thread.join()
    return leaks, reads


def test_data_paths_are_read_through_the_checked_descriptor(world) -> None:
    def read() -> str:
        _, fd = open_inside("data.path", "sub/data.jsonl", [world["root"]], "data")
        with os.fdopen(fd) as file:
            return file.read()

    leaks, reads = _race(world, read)
    assert leaks == 0 and reads > 0, (leaks, reads)


def test_artifact_descriptors_never_reach_outside(world) -> None:
    def read() -> str:
        with os.fdopen(open_file_inside(world["root"], "sub/data.jsonl")) as file:
            return file.read()

    leaks, reads = _race(world, read)
    assert leaks == 0 and reads > 0, (leaks, reads)


def test_a_link_anywhere_below_a_root_is_refused_by_name(world) -> None:
    (world["root"] / "inside-link").symlink_to(world["target"])  # even one that stays inside
    (world["root"] / "dir-link").symlink_to(world["root"] / "sub", target_is_directory=True)
    for value in ("inside-link", "dir-link/data.jsonl"):
        with pytest.raises(PathOutsideRoots, match="symbolic link"):
            resolve_inside("data.path", value, [world["root"]], "data", real=True)
        with pytest.raises(PathOutsideRoots, match="symbolic link"):
            open_inside("data.path", value, [world["root"]], "data")


def test_missing_files_are_4xx_errors_never_file_not_found(world) -> None:
    # real=True lets a missing file through (check_present words what is missing) ...
    path = resolve_inside("data.path", "sub/nope/x.jsonl", [world["root"]], "data", real=True)
    assert path == world["root"] / "sub" / "nope" / "x.jsonl"
    # ... and a reader gets a JobPathError, not a bare FileNotFoundError (a 500).
    with pytest.raises(PathMissing, match="does not exist"):
        open_inside("data.path", "sub/nope/x.jsonl", [world["root"]], "data")
    fifo = world["root"] / "sub" / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(PathMissing):
        open_inside("data.path", "sub/fifo", [world["root"]], "data")


def test_the_trainer_reads_dataset_files_through_the_checked_descriptor(world, monkeypatch) -> None:
    from crucible_trainer.tasks.files import read_jsonl
    from crucible_trainer.tasks.task import DatasetError

    monkeypatch.setenv("CRUCIBLE_DATA_ROOTS", str(world["root"]))

    def read() -> str:
        try:
            return json.dumps([row for _, row in read_jsonl(world["target"])])
        except DatasetError:
            raise PathMissing("data.path", "refused") from None

    leaks, reads = _race(world, read)
    assert leaks == 0 and reads > 0, (leaks, reads)
    with pytest.raises(DatasetError, match="file not found"):
        list(read_jsonl(world["root"] / "nope.jsonl"))
