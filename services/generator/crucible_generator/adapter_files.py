"""Reading a LoRA adapter directory exactly as it was checked.

`lora_path` is walked from its adapter root one component at a time with `O_NOFOLLOW`
(`crucible_shared.paths.open_inside`); then every entry of the adapter directory is checked and
read through a descriptor relative to that directory: a symbolic link anywhere (the directory, on
the way to it, or any file in it, `adapter_config.json` and the weights included) is refused, a
special file too, and the regular files are copied into a private snapshot directory (mode 0700)
that PEFT then loads. So what PEFT reads is what was checked, whatever happens to the adapter
store meanwhile, and nothing outside the roots can be reached through a link inside them.

Error messages name files, never their content.
"""

from __future__ import annotations

import os
import re
import shutil
import stat
import tempfile
from collections.abc import Sequence
from pathlib import Path

from crucible_shared.paths import PathMissing, PathOutsideRoots, open_inside

from .adapters import WEIGHT_FILES
from .errors import BadRequest, NotFound

MAX_PATH_CHARS = 4096  # PATH_MAX
MAX_NAME_CHARS = 256
CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")
_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK


def check_load_request(name: str, path: str, base_model: str) -> None:
    """Lengths and characters of a load request: `BadRequest` naming the parameter."""
    if len(name) > MAX_NAME_CHARS:
        raise BadRequest(f"lora_name is longer than {MAX_NAME_CHARS} characters", param="lora_name")
    if CONTROL.search(name):
        raise BadRequest("lora_name holds a control or bidirectional-override character", param="lora_name")
    if name == base_model:
        raise BadRequest(
            f"lora_name {name!r} is the base model's name: an adapter needs a name of its own",
            param="lora_name",
        )
    if len(path) > MAX_PATH_CHARS:
        raise BadRequest(
            f"Loading lora {name} failed: lora_path is longer than {MAX_PATH_CHARS} characters",
            param="lora_path",
        )
    if CONTROL.search(path):
        raise BadRequest(
            f"Loading lora {name} failed: lora_path holds a control character", param="lora_path"
        )


def snapshot_adapter(name: str, lora_path: str, roots: Sequence[Path], setting: str) -> Path:
    """A private copy of the adapter directory `lora_path` names, read through checked descriptors
    (see the module docstring); the caller loads it and removes it. `BadRequest` for a path
    outside the roots or a link, `NotFound` (vLLM's answer) when there is no directory there."""
    try:
        _, dir_fd = open_inside("lora_path", lora_path, roots, "adapter", setting=setting)
    except PathOutsideRoots as exc:
        raise BadRequest(f"Loading lora {name} failed: {exc.message}", param="lora_path") from None
    except PathMissing:
        raise NotFound(f"Loading lora {name} failed: No adapter found for {lora_path}") from None
    snapshot = Path(tempfile.mkdtemp(prefix="crucible-lora-"))
    try:
        if not stat.S_ISDIR(os.fstat(dir_fd).st_mode):
            raise NotFound(f"Loading lora {name} failed: No adapter found for {lora_path}")
        for entry in sorted(os.listdir(dir_fd)):
            _copy_entry(name, dir_fd, entry, snapshot)
        if not (snapshot / "adapter_config.json").is_file() or not any(
            (snapshot / f).is_file() for f in WEIGHT_FILES
        ):
            raise NotFound(f"Loading lora {name} failed: No adapter found for {lora_path}")
        return snapshot
    except BaseException:
        shutil.rmtree(snapshot, ignore_errors=True)
        raise
    finally:
        os.close(dir_fd)


def _copy_entry(name: str, dir_fd: int, entry: str, snapshot: Path) -> None:
    try:
        info = os.stat(entry, dir_fd=dir_fd, follow_symlinks=False)
    except OSError:
        return  # gone meanwhile: as if it had never been there
    if stat.S_ISDIR(info.st_mode):
        return  # PEFT reads only the directory's own files
    if stat.S_ISLNK(info.st_mode):
        raise BadRequest(
            f"Loading lora {name} failed: {entry} in lora_path is a symbolic link; links in an adapter "
            "directory are not followed: copy the file itself there",
            param="lora_path",
        )
    try:
        fd = os.open(entry, _FLAGS, dir_fd=dir_fd)
    except OSError as exc:
        raise BadRequest(
            f"Loading lora {name} failed: {entry} in lora_path cannot be opened without following a link "
            f"({exc.strerror})",
            param="lora_path",
        ) from None
    with os.fdopen(fd, "rb") as source:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise BadRequest(
                f"Loading lora {name} failed: {entry} in lora_path is not a regular file", param="lora_path"
            )
        with open(snapshot / entry, "xb") as target:
            shutil.copyfileobj(source, target, 1 << 20)
