"""The `crucible` command line. Subcommands live in their own modules and import heavy
dependencies (torch, transformers) only when they run, so `crucible --help` is instant."""

from __future__ import annotations

import typer

app = typer.Typer(
    name="crucible", help="Crucible: RL for code models, rewarded by running the code.", no_args_is_help=True
)


@app.callback()
def _root() -> None:
    """Crucible: RL for code models, rewarded by running the code."""


@app.command()
def version() -> None:
    """Print Crucible's version."""
    from importlib.metadata import version as dist_version

    typer.echo(f"crucible {dist_version('crucible-trainer')}")


def _register() -> None:
    # Each module adds its commands to `app`; a missing one (not built yet) is simply absent.
    import importlib

    for name in ("eval_cmd", "train_cmd", "stack_cmd", "demo_cmd"):
        try:
            importlib.import_module(f"crucible_trainer.cli.{name}")
        except ModuleNotFoundError as exc:
            if exc.name != f"crucible_trainer.cli.{name}":
                raise


def main() -> None:
    _register()
    app()
