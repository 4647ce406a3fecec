"""Read compose files the way `docker compose config` does, for the features Crucible's files use.

* `!reset` and `!override` (Compose 2.24+) in override files: drop a key, or replace a value
  instead of merging into it.
* Merging an override file into compose.yaml: mappings merge key by key, scalars replace; a list
  in the override must be tagged `!override` or `!reset` when the base has the key too (Compose
  merges lists differently per key; the tag makes the intent explicit and keeps this merge exact).
* Interpolation: `$VAR`, `${VAR}`, `${VAR:-default}`, `${VAR-default}`, `${VAR:?error}`,
  `${VAR?error}`, `${VAR:+alt}`, `${VAR+alt}` and `$$`.
"""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml


class Reset:
    """`!reset`: remove the key from the merged file."""


@dataclass
class Override:
    """`!override value`: replace the base value instead of merging into it."""

    value: Any


class ComposeLoader(yaml.SafeLoader):
    pass


def _reset(loader: ComposeLoader, node: yaml.Node) -> Reset:
    return Reset()


def _override(loader: ComposeLoader, node: yaml.Node) -> Override:
    if isinstance(node, yaml.MappingNode):
        return Override(loader.construct_mapping(node, deep=True))
    if isinstance(node, yaml.SequenceNode):
        return Override(loader.construct_sequence(node, deep=True))
    return Override(loader.construct_scalar(node))


ComposeLoader.add_constructor("!reset", _reset)
ComposeLoader.add_constructor("!override", _override)


def load(path: Path) -> dict[str, Any]:
    return yaml.load(path.read_text(), Loader=ComposeLoader)  # a SafeLoader subclass


def merge(base: Any, override: Any, where: str = "") -> Any:
    """`override` merged into `base` (see the module docstring)."""
    if isinstance(override, Override):
        return copy.deepcopy(override.value)
    if isinstance(override, dict) and isinstance(base, dict):
        merged = copy.deepcopy(base)
        for key, value in override.items():
            if isinstance(value, Reset):
                merged.pop(key, None)
            elif key in merged:
                merged[key] = merge(merged[key], value, f"{where}.{key}")
            else:
                merged[key] = strip_tags(value)
        return merged
    if isinstance(base, list) or isinstance(override, list):
        raise ValueError(f"{where}: tag the list with !override (or !reset) to replace the base value")
    return strip_tags(override)


def strip_tags(node: Any) -> Any:
    if isinstance(node, Override):
        return strip_tags(node.value)
    if isinstance(node, dict):
        return {k: strip_tags(v) for k, v in node.items() if not isinstance(v, Reset)}
    if isinstance(node, list):
        return [strip_tags(v) for v in node]
    return node


_VARIABLE = re.compile(
    r"\$(?:(?P<escaped>\$)|\{(?P<braced>[A-Za-z_][A-Za-z0-9_]*)(?:(?P<op>:?[-?+])(?P<arg>[^}]*))?\}"
    r"|(?P<bare>[A-Za-z_][A-Za-z0-9_]*))"
)


class MissingVariable(KeyError):
    """A `${VAR:?message}` whose variable is unset (or empty)."""


def _substitute(text: str, env: dict[str, str]) -> str:
    def replace(match: re.Match[str]) -> str:
        if match["escaped"]:
            return "$"
        name = match["braced"] or match["bare"]
        op, arg = match["op"], match["arg"] or ""
        if op and "$" in arg:
            raise ValueError(f"nested interpolation in {match[0]!r} is not supported here")
        value = env.get(name)
        unset_or_empty = value is None or (value == "" and op is not None and op.startswith(":"))
        if op in (":-", "-"):
            return arg if unset_or_empty else value
        if op in (":?", "?"):
            if unset_or_empty:
                raise MissingVariable(f"{name}: {arg}")
            return value
        if op in (":+", "+"):
            return "" if unset_or_empty else arg
        return value or ""

    return _VARIABLE.sub(replace, text)


def interpolate(node: Any, env: dict[str, str]) -> Any:
    """Every string value (not key) of `node` with variables substituted from `env`."""
    if isinstance(node, dict):
        return {k: interpolate(v, env) for k, v in node.items()}
    if isinstance(node, list):
        return [interpolate(v, env) for v in node]
    if isinstance(node, str):
        return _substitute(node, env)
    return node


def variables(node: Any) -> dict[str, str | None]:
    """Variables a file refers to: name -> operator (`:-`, `:?`, ... or None for a plain `${VAR}`)."""
    found: dict[str, str | None] = {}
    if isinstance(node, Override):
        return variables(node.value)
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


def resolve(paths: list[Path], env: dict[str, str]) -> dict[str, Any]:
    """The files merged in order and interpolated: what `docker compose -f a -f b config` sees."""
    merged: Any = None
    for path in paths:
        merged = load(path) if merged is None else merge(merged, load(path))
    return interpolate(strip_tags(merged), env)
