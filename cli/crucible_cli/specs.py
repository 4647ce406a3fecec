"""Job specs from YAML or JSON files, with errors that name the field."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import typer


def validation_lines(exc: Any) -> list[str]:
    """One `field: message` line per problem of a pydantic `ValidationError`."""
    from crucible_shared.http import error_field

    lines = []
    for error in exc.errors():
        message = error["msg"].removeprefix("Value error, ")
        ctx_field = (error.get("ctx") or {}).get("field")
        if ctx_field and message.startswith(f"{ctx_field}: "):
            message = message[len(ctx_field) + 2 :]
        lines.append(f"{error_field(error)}: {message}")
    return lines


def load_spec(path: Path, expect: str):
    """Parse a YAML/JSON job spec of kind `expect`; exits 2 with a message naming the bad field."""
    import yaml
    from crucible_shared.jobs import JobSpec
    from pydantic import TypeAdapter, ValidationError

    if not path.exists():
        raise typer.BadParameter(f"{path} does not exist", param_hint="--config")
    try:
        raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise typer.BadParameter(f"{path} is not valid YAML: {exc}", param_hint="--config") from None
    if not isinstance(raw, dict):
        raise typer.BadParameter(f"{path} must hold a mapping (a job spec)", param_hint="--config")
    raw.setdefault("kind", expect)
    try:
        spec = TypeAdapter(JobSpec).validate_python(raw)
    except ValidationError as exc:
        typer.echo(
            f"{path}: invalid job spec:\n" + "\n".join(f"  {line}" for line in validation_lines(exc)),
            err=True,
        )
        raise typer.Exit(2) from None
    if spec.kind != expect:
        raise typer.BadParameter(
            f"{path} is a {spec.kind!r} job; use `crucible {spec.kind}`", param_hint="--config"
        )
    return spec
