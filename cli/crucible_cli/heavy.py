"""Commands that need more than the slim CLI: a clear message instead of an ImportError."""

from __future__ import annotations

import importlib
from types import ModuleType

import typer

# What each part is, and what installs it.
PARTS = {
    "crucible_trainer": "the trainer (crucible-trainer: torch, transformers, peft)",
    "crucible_generator": "the generator (crucible-generator)",
    "crucible_sandbox": "the sandbox (crucible-sandbox)",
    "crucible_gateway": "the gateway (crucible-gateway)",
    "crucible_models": "model loading (crucible-models: transformers, gguf)",
}


def require(*modules: str, command: str) -> list[ModuleType]:
    """Import `modules` for `command`, or exit 2 saying what to install."""
    found, missing = [], []
    for name in modules:
        try:
            found.append(importlib.import_module(name))
        except ImportError as exc:
            missing.append(f"{PARTS.get(name, name)} (missing module: {exc.name or exc})")
    if missing:
        parts = "; ".join(missing)
        typer.echo(
            f"error: `crucible {command}` runs {parts} on this machine, and it is not installed.\n"
            "Install the full stack (`make setup` in a checkout, or `pip install -r requirements.txt`), "
            "or submit to a running gateway instead (`crucible train --config SPEC --gateway URL`).",
            err=True,
        )
        raise typer.Exit(2)
    return found
