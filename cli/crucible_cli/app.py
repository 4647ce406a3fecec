"""The typer app; each `*_cmd` module adds its commands. Heavy imports happen inside commands,
so `crucible --help` is instant."""

from __future__ import annotations

import importlib

import typer

app = typer.Typer(
    name="crucible", help="Crucible: RL for code models, rewarded by running the code.", no_args_is_help=True
)

COMMAND_MODULES = (
    "jobs_cmd",
    "pipeline_cmd",
    "eval_cmd",
    "compare_cmd",
    "stack_cmd",
    "sandbox_cmd",
    "models_cmd",
)


@app.callback()
def _root() -> None:
    """Crucible: RL for code models, rewarded by running the code."""


@app.command()
def version() -> None:
    """Print the versions of Crucible's installed packages."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as dist_version

    for dist in (
        "crucible-cli",
        "crucible-shared",
        "crucible-trainer",
        "crucible-generator",
        "crucible-sandbox",
        "crucible-gateway",
    ):
        try:
            typer.echo(f"{dist} {dist_version(dist)}")
        except PackageNotFoundError:
            typer.echo(f"{dist} (not installed)")


def main() -> None:
    for name in COMMAND_MODULES:
        importlib.import_module(f"crucible_cli.{name}")
    app()
