"""Where a job may read files: the configured data, model and adapter roots.

A path in a job spec (a dataset file, a local model, an adapter) must lie inside a root of its
kind, or the job is refused at submission with the field named; the trainer checks again,
with symbolic links resolved, before it reads anything. So a job can never make the trainer
read or report `/etc/shadow`, `/root` or another job's files outside the roots.

Roots come from the environment (comma-separated): `CRUCIBLE_DATA_ROOTS`,
`CRUCIBLE_MODEL_ROOTS`, `CRUCIBLE_ADAPTER_ROOTS`. Each defaults to the service's working
directory (models: also Crucible's cache); services add their own stores (the adapter store
and the run directories are always adapter roots). A relative path in a spec is taken
relative to the first root of its kind.

Two checks, one containment rule (`resolve_inside`):
- lexical, everywhere: the normalised path lies under a root;
- real, wherever the root is on this host's disk: the path is walked one component at a time
  from an open descriptor of its root, `O_NOFOLLOW` at every step (`open_inside`), so no symbolic
  link below a root is followed (one is refused by name), and, at submission, the file or
  directory exists (`PathRoots.check_present`). The worker loads the normalised path it checked
  (`with_checked_paths`), never the spec's raw text.

What is read is what was checked: a reader that must not race a swap (a file replaced by a link
between the check and the read) reads from the descriptor the walk returned (`open_inside`,
`open_file_inside`, `open_dir_inside`), never by opening the path string again.
`open_file_inside` serves a request's relative path from one directory (the artifacts route).
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Any

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from crucible_shared.jobs import RootKind, job_paths
from crucible_shared.settings import split_csv


def _cache_dir() -> Path:
    return Path(os.environ.get("CRUCIBLE_CACHE_DIR") or Path.home() / ".cache" / "crucible").expanduser()


class JobPathError(ValueError):
    """A path a job names that it cannot use; `field` is the dotted spec field."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field, self.message = field, message


class PathOutsideRoots(JobPathError):
    """A path a job names lies outside the roots of its kind (lexically or through a link)."""


class PathMissing(JobPathError):
    """A path inside the roots, on a root this host sees, names nothing usable."""


class UnsafePath(ValueError):
    """A relative path from a request that does not name a regular file inside its root."""


_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC


def walk_from(dir_fd: int, parts: Sequence[str]) -> int:
    """A new descriptor of `parts` below the directory `dir_fd`, each component opened relative to
    the previous one with `O_NOFOLLOW`: a regular file or a directory, never through a link.
    `OSError` otherwise (ELOOP/ENOTDIR for a link, ENOENT, EINVAL for anything else)."""
    fd = os.dup(dir_fd)
    try:
        for part in parts[:-1]:
            next_fd = os.open(part, _FLAGS | os.O_DIRECTORY, dir_fd=fd)
            os.close(fd)
            fd = next_fd
        if not parts:
            return os.dup(fd)
        # O_NONBLOCK: opening a FIFO planted under a root must not hang the reader.
        leaf = os.open(parts[-1], _FLAGS | os.O_NONBLOCK, dir_fd=fd)
        mode = os.fstat(leaf).st_mode
        if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
            os.close(leaf)
            raise OSError(errno.EINVAL, "not a regular file or a directory")
        return leaf
    finally:
        os.close(fd)


def _request_parts(rel: str) -> list[str]:
    parts = rel.split("/")
    if (
        not rel
        or "\x00" in rel
        or "\\" in rel
        or rel.startswith("/")
        or any(part in ("", ".", "..") for part in parts)
    ):
        raise UnsafePath(rel)
    return parts


def _open_request(root: Path, rel: str, want_dir: bool) -> int:
    parts = _request_parts(rel)
    try:
        root_fd = os.open(root, _FLAGS | os.O_DIRECTORY)
    except OSError:
        raise UnsafePath(rel) from None
    try:
        fd = walk_from(root_fd, parts)
    except (OSError, ValueError):
        raise UnsafePath(rel) from None
    finally:
        os.close(root_fd)
    if stat.S_ISDIR(os.fstat(fd).st_mode) != want_dir:
        os.close(fd)
        raise UnsafePath(rel)
    return fd


def open_file_inside(root: Path, rel: str) -> int:
    """An open descriptor of the regular file `rel` names under `root`, reached without links;
    `UnsafePath` otherwise. The caller reads from it (and closes it): the file served is the file
    checked, whatever happens to the path meanwhile.

    The walk goes one component at a time from an open descriptor of `root` (`O_NOFOLLOW` at
    every step), so it is a containment check by construction, not a comparison of two joined
    paths: an absolute path, `..`, `.`, an empty component, a backslash, a NUL byte, a symbolic
    link anywhere on the way, and anything that is not a regular file (a FIFO, a device, a
    directory) are all refused the same way. `/proc` and other trees outside `root` cannot be
    reached because nothing outside `root` can be.
    """
    return _open_request(root, rel, want_dir=False)


def open_dir_inside(root: Path, rel: str) -> int:
    """`open_file_inside` for a directory (a job's run dir: one that is a link is refused)."""
    return _open_request(root, rel, want_dir=True)


def file_inside(root: Path, rel: str) -> Path:
    """`open_file_inside` as a check only (the path, the descriptor closed). Not for reading: a
    reader opens with `open_file_inside` and reads from the descriptor."""
    os.close(open_file_inside(root, rel))
    return root / rel


class PathRoots(BaseSettings):
    """The roots of each kind (see the module docstring)."""

    model_config = SettingsConfigDict(env_prefix="CRUCIBLE_", extra="ignore")

    data_roots: Annotated[list[Path], NoDecode] = Field(default_factory=lambda: [Path.cwd()])
    model_roots: Annotated[list[Path], NoDecode] = Field(default_factory=lambda: [Path.cwd(), _cache_dir()])
    adapter_roots: Annotated[list[Path], NoDecode] = Field(default_factory=lambda: [Path.cwd()])

    @field_validator("data_roots", "model_roots", "adapter_roots", mode="before")
    @classmethod
    def _split(cls, value: object) -> object:
        return split_csv(value)

    @field_validator("data_roots", "model_roots", "adapter_roots")
    @classmethod
    def _absolute(cls, value: list[Path]) -> list[Path]:
        if not value:
            raise ValueError("at least one root is needed")
        return [Path(os.path.abspath(p.expanduser())) for p in value]

    def with_adapter_dirs(self, *dirs: Path) -> PathRoots:
        """These roots plus service-owned adapter locations (the adapter store, the run dirs)."""
        extra = [Path(os.path.abspath(d)) for d in dirs]
        return self.model_copy(update={"adapter_roots": [*self.adapter_roots, *extra]})

    def of(self, kind: RootKind) -> list[Path]:
        return {"data": self.data_roots, "model": self.model_roots, "adapter": self.adapter_roots}[kind]

    def resolve(self, field: str, value: str, kind: RootKind, *, real: bool = False) -> Path:
        """`resolve_inside` over the roots of `kind`."""
        return resolve_inside(field, value, self.of(kind), kind, real=real)

    def check(self, spec: Any, *, real: bool = False) -> dict[str, Path]:
        """Every path of a job spec, resolved; raises `PathOutsideRoots` for the first bad one."""
        return {field: self.resolve(field, value, kind, real=real) for field, value, kind in job_paths(spec)}

    def check_present(self, spec: Any) -> dict[str, Path]:
        """`check` at submission: lexical everywhere, and for a path under a root this host sees
        (its directory exists here), links resolved and the file or directory present.

        A root this host does not see (the gateway has no mount of the trainer's datasets) is
        left to the worker, which checks again with `real=True` before it reads anything.
        Raises `PathOutsideRoots` (a link that leads out is named) or `PathMissing`.
        """
        out = {}
        for field, value, kind in job_paths(spec):
            path = self.resolve(field, value, kind)
            root = next(r for r in self.of(kind) if _within(path, [r]))
            if root.is_dir():
                path = self.resolve(field, value, kind, real=True)
                # An eval job's model.base names what the generator serves; the worker never reads it.
                if not (kind == "model" and spec.kind == "eval"):
                    _check_present(field, value, path, kind)
            out[field] = path
        return out


def _within(path: Path, roots: Sequence[Path]) -> bool:
    return any(path == r or r in path.parents for r in roots)


def resolve_inside(
    field: str, value: str, roots: Sequence[Path], kind: str, *, real: bool = False, setting: str = ""
) -> Path:
    """The normalised absolute path `value` names, if it lies inside one of `roots`.

    Relative paths are taken under the first root. Lexical by default (the gateway may not see
    the trainer's disk); `real=True` also walks the path from its root with `O_NOFOLLOW` at every
    component (`open_inside`), so no link below a root is followed and the error names the link.
    A path that does not exist (yet) passes `real=True`: `PathRoots.check_present` says what is
    missing. The one containment rule of every path a request names (job specs, the generator's
    `lora_path`); raises `PathOutsideRoots`.
    `setting` names the variable that adds a root (default `CRUCIBLE_<KIND>_ROOTS`).
    """
    setting = setting or f"CRUCIBLE_{kind.upper()}_ROOTS"
    if "\x00" in value:
        raise PathOutsideRoots(field, "a path cannot contain a NUL byte")
    try:
        path = Path(value).expanduser()
    except RuntimeError:  # `~someone` with no such user
        raise PathOutsideRoots(field, f"{value}: no such home directory") from None
    if not path.is_absolute():
        path = roots[0] / path
    path = Path(os.path.normpath(path))
    shown = ", ".join(str(r) for r in roots)
    if not _within(path, roots):
        raise PathOutsideRoots(
            field,
            f"{value} is outside the {kind} roots ({shown}); put it there or add a root with {setting}",
        )
    if real:
        try:
            os.close(open_inside(field, value, roots, kind, setting=setting, lexical=path)[1])
        except PathMissing:
            pass
    return path


def open_inside(
    field: str,
    value: str,
    roots: Sequence[Path],
    kind: str,
    *,
    setting: str = "",
    lexical: Path | None = None,
) -> tuple[Path, int]:
    """(the normalised path, an open descriptor of it) for `value` inside `roots`: the lexical
    check of `resolve_inside`, then a walk from the descriptor of the root it lies under, one
    component at a time with `O_NOFOLLOW`. Read from the descriptor (`os.fdopen`, `dir_fd=`), never
    from the path again. `PathOutsideRoots` for a link on the way (named), `PathMissing` for
    anything missing or that is neither a regular file nor a directory: never a bare `OSError`."""
    path = lexical or resolve_inside(field, value, roots, kind, setting=setting)
    root = max((r for r in roots if _within(path, [r])), key=lambda r: len(r.parts))
    parts = path.parts[len(root.parts) :]
    try:
        root_fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)  # the root itself: configured
    except OSError as exc:
        raise PathMissing(
            field, f"{value}: the {kind} root {root} cannot be opened ({exc.strerror})"
        ) from None
    try:
        return path, walk_from(root_fd, parts)
    except OSError as exc:
        link = _first_link(root_fd, parts)
        if link is not None:
            shown = ", ".join(str(r) for r in roots)
            raise PathOutsideRoots(
                field,
                f"{value}: {root.joinpath(*link)} is a symbolic link; links inside the {kind} roots "
                f"({shown}) are not followed: name the file itself",
            ) from None
        what = "does not exist" if exc.errno == errno.ENOENT else f"cannot be read ({exc.strerror})"
        raise PathMissing(field, f"{value} {what}") from None
    finally:
        os.close(root_fd)


def _first_link(root_fd: int, parts: Sequence[str]) -> tuple[str, ...] | None:
    """The first prefix of `parts` below `root_fd` that is a symbolic link (for the error only)."""
    for i in range(1, len(parts) + 1):
        try:
            fd = walk_from(root_fd, parts[: i - 1]) if i > 1 else os.dup(root_fd)
        except OSError:
            return None
        try:
            if stat.S_ISLNK(os.stat(parts[i - 1], dir_fd=fd, follow_symlinks=False).st_mode):
                return tuple(parts[:i])
        except OSError:
            return None
        finally:
            os.close(fd)
    return None


def _check_present(field: str, value: str, path: Path, kind: str) -> None:
    """`PathMissing` unless `path` holds what a path of `kind` must: a data file, a PEFT adapter
    directory, a model checkpoint directory."""
    if kind == "data":
        if not path.is_file():
            what = "is a directory" if path.is_dir() else "does not exist"
            raise PathMissing(field, f"{value} {what}: name a JSONL file inside the data roots")
        return
    marker = "adapter_config.json" if kind == "adapter" else "config.json"
    if not (path / marker).is_file():
        thing = "PEFT adapter" if kind == "adapter" else "model checkpoint"
        raise PathMissing(field, f"no {thing} at {value} ({path / marker} is missing)")


def with_checked_paths(spec: Any, paths: dict[str, Path]) -> Any:
    """`spec` with each path field in `paths` (dotted field -> the path `PathRoots.check` found)
    replaced by that normalised absolute path, so the job reads what was checked: a relative
    `./m` lies under the first root of its kind, not under whatever directory the worker runs in,
    and `root/link/../x` is not read through the link. Lexical paths (not `real=True`) keep the
    names the job gave, which the generator's served model is matched against."""
    for field, path in paths.items():
        spec = _replaced(spec, field.split("."), str(path))
    return spec


def _replaced(obj: Any, parts: list[str], value: str) -> Any:
    head, rest = parts[0], parts[1:]
    new = _replaced(getattr(obj, head), rest, value) if rest else value
    return obj.model_copy(update={head: new})
