"""Private copies of a checked directory, so that what a loader reads is what was checked.

A loader (PEFT, `from_pretrained`) takes a directory path and opens the files in it by name, long
after the containment check (`crucible_shared.paths.open_inside`) looked at them: a file swapped
for a symbolic link in between would be followed out of the roots. `snapshot_dir` reads every
entry of a directory through the descriptor the check opened, refuses any that is a symbolic
link or not a regular file, and places the regular files in a private directory (mode 0700) that
the loader is then given. What happens to the original directory afterwards changes nothing.

Each file is hard-linked when the snapshot lies on the same file system (no copy of a large
checkpoint; `linkat` without `AT_SYMLINK_FOLLOW` links the entry itself, which is then checked
to be a regular file) and otherwise copied from a descriptor opened with `O_NOFOLLOW`.
Subdirectories are left out: the loaders read a checkpoint's or an adapter's own files only.

Errors name entries, never their content.
"""

from __future__ import annotations

import errno
import os
import shutil
import stat
import tempfile
from collections.abc import Sequence
from pathlib import Path

from crucible_shared.paths import open_inside

_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK


class SnapshotRefused(ValueError):
    """An entry of the directory is a symbolic link or a special file; `entry` names it."""

    def __init__(self, entry: str, reason: str) -> None:
        super().__init__(f"{entry} {reason}")
        self.entry, self.reason = entry, reason


def snapshot_dir(dir_fd: int, into: Path) -> list[str]:
    """Every regular file directly in the directory `dir_fd`, placed in the existing directory
    `into` (see the module docstring); the names placed. `SnapshotRefused` for a link or a special
    file, `NotADirectoryError` when `dir_fd` is not a directory. An entry removed meanwhile is
    left out, as if it had never been there."""
    if not stat.S_ISDIR(os.fstat(dir_fd).st_mode):
        raise NotADirectoryError(errno.ENOTDIR, "not a directory")
    placed = []
    for entry in sorted(os.listdir(dir_fd)):
        if _place(dir_fd, entry, into / entry):
            placed.append(entry)
    return placed


def _place(dir_fd: int, entry: str, target: Path) -> bool:
    try:
        info = os.stat(entry, dir_fd=dir_fd, follow_symlinks=False)
    except OSError:
        return False
    if stat.S_ISDIR(info.st_mode):
        return False
    if stat.S_ISLNK(info.st_mode):
        raise SnapshotRefused(entry, "is a symbolic link; links are not followed: copy the file itself there")
    try:
        os.link(entry, target, src_dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return False
    except OSError:  # another file system, or protected_hardlinks: copy it instead
        return _copy(dir_fd, entry, target)
    # What was linked is whatever the name held at that instant: check that, not the earlier stat.
    mode = os.lstat(target).st_mode
    if not stat.S_ISREG(mode):
        target.unlink()
        what = "is a symbolic link; links are not followed" if stat.S_ISLNK(mode) else "is not a regular file"
        raise SnapshotRefused(entry, what)
    return True


def _copy(dir_fd: int, entry: str, target: Path) -> bool:
    try:
        fd = os.open(entry, _FLAGS, dir_fd=dir_fd)
    except FileNotFoundError:
        return False
    except OSError as exc:
        raise SnapshotRefused(entry, f"cannot be opened without following a link ({exc.strerror})") from None
    with os.fdopen(fd, "rb") as source:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise SnapshotRefused(entry, "is not a regular file")
        os.set_blocking(fd, True)
        with open(target, "xb") as out:
            shutil.copyfileobj(source, out, 1 << 20)
    return True


def snapshot_inside(
    field: str,
    value: str,
    roots: Sequence[Path],
    kind: str,
    *,
    setting: str = "",
    prefix: str = "crucible-",
    into: Path | None = None,
) -> Path:
    """A private snapshot (a new temporary directory, in `into` or the temp dir; the caller removes
    it) of the directory
    `value` names inside `roots`, taken through the descriptor the containment check opened.
    `PathOutsideRoots` / `PathMissing` as `open_inside` raises them, `SnapshotRefused` for a link
    or a special file in the directory, `NotADirectoryError` when `value` names a file."""
    _, dir_fd = open_inside(field, value, roots, kind, setting=setting)
    try:
        snapshot = Path(tempfile.mkdtemp(prefix=prefix, dir=into))
        try:
            snapshot_dir(dir_fd, snapshot)
        except BaseException:
            shutil.rmtree(snapshot, ignore_errors=True)
            raise
        return snapshot
    finally:
        os.close(dir_fd)
