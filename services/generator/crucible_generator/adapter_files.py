"""Reading a LoRA adapter directory exactly as it was checked.

`lora_path` is walked from its adapter root one component at a time with `O_NOFOLLOW`
(`crucible_shared.paths.open_inside`); then every entry of the adapter directory is checked and
read through a descriptor relative to that directory (`crucible_shared.snapshot`): a symbolic
link anywhere (the directory, on the way to it, or any file in it, `adapter_config.json` and the
weights included) is refused, a special file too, and the regular files are placed in a private
snapshot directory (mode 0700) that PEFT then loads. So what PEFT reads is what was checked, whatever happens to the adapter
store meanwhile, and nothing outside the roots can be reached through a link inside them.

Error messages name files, never their content.
"""

from __future__ import annotations

import re
import shutil
from collections.abc import Sequence
from pathlib import Path

from crucible_shared.paths import PathMissing, PathOutsideRoots
from crucible_shared.snapshot import SnapshotRefused, snapshot_inside

from .adapters import WEIGHT_FILES
from .errors import BadRequest, NotFound

MAX_PATH_CHARS = 4096  # PATH_MAX
MAX_NAME_CHARS = 256
CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")


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
    (`crucible_shared.snapshot`); the caller loads it and removes it. `BadRequest` for a path
    outside the roots or a link, `NotFound` (vLLM's answer) when there is no directory there."""
    missing = NotFound(f"Loading lora {name} failed: No adapter found for {lora_path}")
    try:
        snapshot = snapshot_inside(
            "lora_path", lora_path, roots, "adapter", setting=setting, prefix="crucible-lora-"
        )
    except PathOutsideRoots as exc:
        raise BadRequest(f"Loading lora {name} failed: {exc.message}", param="lora_path") from None
    except (PathMissing, NotADirectoryError):
        raise missing from None
    except SnapshotRefused as exc:
        raise BadRequest(
            f"Loading lora {name} failed: {exc.entry} in lora_path {exc.reason}", param="lora_path"
        ) from None
    if not (snapshot / "adapter_config.json").is_file() or not any(
        (snapshot / f).is_file() for f in WEIGHT_FILES
    ):
        shutil.rmtree(snapshot, ignore_errors=True)
        raise missing
    return snapshot
