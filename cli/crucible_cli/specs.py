"""Job specs from YAML or JSON files plus `--set field=value` overrides, with errors that name the
field.

Every command that takes a spec takes repeatable `--set a.b=c` too: each override replaces one
field of the spec (dotted path; a number indexes a list) before validation, so the same pydantic
models check it and an error names the full field path and the override it came from. A value is
read as JSON, else YAML: `3`, `1e-5`, `true`, `null`, `[1, 10]`, `{mode: pre}`; quote it
to keep a string (`name="'3'"`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import typer

SET = typer.Option(
    None,
    "--set",
    metavar="FIELD=VALUE",
    help="Override one spec field, e.g. --set optim.lr=1e-5 --set method.group_size=4 "
    "(repeatable; dotted path, value read as JSON or YAML).",
)


def validation_lines(exc: Any, overrides: list[str] | None = None) -> list[str]:
    """One `field: message` line per problem of a pydantic `ValidationError`; a line whose field an
    override set or lies inside ends with that override."""
    from crucible_shared.http import error_field

    lines = []
    for error in exc.errors():
        message = error["msg"].removeprefix("Value error, ")
        ctx_field = (error.get("ctx") or {}).get("field")
        if ctx_field and message.startswith(f"{ctx_field}: "):
            message = message[len(ctx_field) + 2 :]
        field = error_field(error)
        origin = next((o for o in reversed(overrides or []) if _within(o, field)), None)
        lines.append(f"{field}: {message}" + (f" (from --set {origin})" if origin else ""))
    return lines


def _within(override: str, field: str) -> bool:
    """Whether `field` (as errors name it: with the union tags, e.g. `train.method.grpo.lr`) is the
    override's field or lies inside it: the override's path appears in order within the field's."""
    want = override.split("=", 1)[0].split(".")
    for part in field.split("."):
        if want and part == want[0]:
            want.pop(0)
    return not want


def apply_overrides(raw: dict[str, Any], overrides: list[str] | None) -> dict[str, Any]:
    """A copy of `raw` with each `a.b=c` override applied in order (later ones win); `typer.BadParameter`
    for an override that is not `FIELD=VALUE` or whose path runs through a value that is not a
    mapping or list.

    >>> apply_overrides({"optim": {"lr": 1e-5}}, ["optim.lr=3e-5", "method.name=srrl", "eval.ks=[1, 4]"])
    {'optim': {'lr': 3e-05}, 'method': {'name': 'srrl'}, 'eval': {'ks': [1, 4]}}
    >>> apply_overrides({"eval": {"ks": [1, 10]}}, ["eval.ks.1=4", "name='007'", "eval=null"])
    {'eval': None, 'name': '007'}
    """
    import copy

    import yaml

    raw = copy.deepcopy(raw)  # the caller's spec (a module's default job) stays as it was
    for override in overrides or []:
        path, sep, text = override.partition("=")
        parts = path.strip().split(".")
        if not sep or not all(parts):
            raise typer.BadParameter(
                f"{override!r}: expected FIELD=VALUE, e.g. optim.lr=1e-5", param_hint="--set"
            )
        if not text.strip():
            raise typer.BadParameter(f"{override!r}: give a value (null for none)", param_hint="--set")
        try:
            value = _value(text)
        except yaml.YAMLError as exc:
            raise typer.BadParameter(
                f"{override!r}: the value is not YAML: {exc}", param_hint="--set"
            ) from None
        node: Any = raw
        for i, part in enumerate(parts):
            last = i == len(parts) - 1
            where = ".".join(parts[: i + 1])
            if isinstance(node, dict):
                if last:
                    node[part] = value
                else:
                    child = node.get(part)
                    if child is None:
                        child = node[part] = {}
                    node = child
            elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
                if last:
                    node[int(part)] = value
                else:
                    node = node[int(part)]
            else:
                above = ".".join(parts[:i])
                raise typer.BadParameter(
                    f"{override!r}: {where} does not exist ({above} is {type(node).__name__} {node!r}, "
                    "not a mapping"
                    + (f" or a list of more than {part} items" if isinstance(node, list) else "")
                    + ")",
                    param_hint="--set",
                )
    return raw


def _value(text: str) -> Any:
    """JSON first (so `3e-5` is a number, which YAML 1.1 reads as a string), else YAML."""
    import json

    import yaml

    try:
        return json.loads(text)
    except ValueError:
        return yaml.safe_load(text)


def parse_spec(raw: dict[str, Any], expect: str, overrides: list[str] | None, source: str):
    """Validate a job spec of kind `expect` after its overrides; exits 2 with a message naming the
    bad field (and the override that set it)."""
    from crucible_shared.jobs import JobSpec
    from pydantic import TypeAdapter, ValidationError

    raw = apply_overrides(raw, overrides)
    raw.setdefault("kind", expect)
    try:
        spec = TypeAdapter(JobSpec).validate_python(raw)
    except ValidationError as exc:
        typer.echo(
            f"{source}: invalid job spec:\n"
            + "\n".join(f"  {line}" for line in validation_lines(exc, overrides)),
            err=True,
        )
        raise typer.Exit(2) from None
    if spec.kind != expect:
        raise typer.BadParameter(
            f"{source} is a {spec.kind!r} job; use `crucible {spec.kind}`", param_hint="--config"
        )
    return spec


def load_spec(path: Path, expect: str, overrides: list[str] | None = None):
    """Parse a YAML/JSON job spec of kind `expect`, with `--set` overrides; exits 2 with a message
    naming the bad field."""
    import yaml

    if not path.exists():
        raise typer.BadParameter(f"{path} does not exist", param_hint="--config")
    try:
        raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise typer.BadParameter(f"{path} is not valid YAML: {exc}", param_hint="--config") from None
    if not isinstance(raw, dict):
        raise typer.BadParameter(f"{path} must hold a mapping (a job spec)", param_hint="--config")
    return parse_spec(raw, expect, overrides, str(path))
