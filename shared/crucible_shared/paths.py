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
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Annotated, Any

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from crucible_shared.jobs import RootKind, job_paths
from crucible_shared.settings import split_csv


def _cache_dir() -> Path:
    return Path(os.environ.get("CRUCIBLE_CACHE_DIR") or Path.home() / ".cache" / "crucible").expanduser()


class PathOutsideRoots(ValueError):
    """A path a job names lies outside the roots of its kind."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field, self.message = field, message


class UnsafePath(ValueError):
    """A relative path from a request that does not name a regular file inside its root."""


def file_inside(root: Path, rel: str) -> Path:
    """The regular file `rel` names under `root`, reached without links; `UnsafePath` otherwise.

    The check walks `rel` one component at a time from an open descriptor of `root`
    (`O_NOFOLLOW` at every step), so it is a containment check by construction, not a
    comparison of two joined paths: an absolute path, `..`, `.`, an empty component, a
    backslash, a NUL byte, a symbolic link anywhere on the way, and anything that is not a
    regular file (a FIFO, a device, a directory) are all refused the same way. `/proc` and
    other trees outside `root` cannot be reached because nothing outside `root` can be.
    """
    parts = rel.split("/")
    if (
        not rel
        or "\x00" in rel
        or "\\" in rel
        or rel.startswith("/")
        or any(part in ("", ".", "..") for part in parts)
    ):
        raise UnsafePath(rel)
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        fd = os.open(root, flags | os.O_DIRECTORY)
    except OSError:
        raise UnsafePath(rel) from None
    try:
        for part in parts[:-1]:
            next_fd = os.open(part, flags | os.O_DIRECTORY, dir_fd=fd)
            os.close(fd)
            fd = next_fd
        # O_NONBLOCK: opening a FIFO planted in the run dir must not hang the request.
        leaf = os.open(parts[-1], flags | os.O_NONBLOCK, dir_fd=fd)
        try:
            if not stat.S_ISREG(os.fstat(leaf).st_mode):
                raise UnsafePath(rel)
        finally:
            os.close(leaf)
    except (OSError, ValueError):
        raise UnsafePath(rel) from None
    finally:
        os.close(fd)
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
        """The absolute path `value` names, if inside a root of `kind`; `PathOutsideRoots` if not.

        Lexical by default (the gateway may not see the trainer's disk); `real=True` also
        resolves symbolic links, so a link inside a root cannot point outside it.
        """
        roots = self.of(kind)
        if "\x00" in value:
            raise PathOutsideRoots(field, "a path cannot contain a NUL byte")
        path = Path(value).expanduser()
        if not path.is_absolute():
            path = roots[0] / path
        path = Path(os.path.normpath(path))
        checked = [Path(os.path.realpath(r)) for r in roots] if real else roots
        if real:
            path = Path(os.path.realpath(path))
        if not any(path == r or r in path.parents for r in checked):
            shown = ", ".join(str(r) for r in roots)
            raise PathOutsideRoots(
                field,
                f"{value} is outside the {kind} roots ({shown}); put it there or add a root "
                f"with CRUCIBLE_{kind.upper()}_ROOTS",
            )
        return path

    def check(self, spec: Any, *, real: bool = False) -> dict[str, Path]:
        """Every path of a job spec, resolved; raises `PathOutsideRoots` for the first bad one."""
        return {field: self.resolve(field, value, kind, real=real) for field, value, kind in job_paths(spec)}


def with_checked_model(spec: Any, paths: dict[str, Path]) -> Any:
    """`spec` with `model.base` and `model.init_adapter` replaced by the absolute paths
    `PathRoots.check` found for them (`paths`), so the trainer loads what was checked: a relative
    `./m` lies under the first model root, not under whatever directory the worker runs in.
    Lexical paths (not `real=True`) keep the names the job gave, which the generator's served
    model is matched against."""
    update = {
        field.removeprefix("model."): str(paths[field])
        for field in ("model.base", "model.init_adapter")
        if field in paths
    }
    if not update:
        return spec
    return spec.model_copy(update={"model": spec.model.model_copy(update=update)})
