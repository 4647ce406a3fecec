"""`crucible sandbox run`: one program through the sandbox, verdict per test."""

from __future__ import annotations

import os
from pathlib import Path

import typer

from crucible_cli.app import app
from crucible_cli.options import fail

sandbox_app = typer.Typer(help="Use the sandbox directly.", no_args_is_help=True)
app.add_typer(sandbox_app, name="sandbox")


@sandbox_app.command("run")
def sandbox_run(
    file: Path = typer.Argument(..., help="The program (Python)."),
    tests: Path = typer.Option(
        ...,
        "--tests",
        help="Tests: a .py file of assert lines, or a JSON file with a sandbox `tests` object.",
    ),
    sandbox: str = typer.Option(os.environ.get("CRUCIBLE_SANDBOX_URL", "http://127.0.0.1:8002"), "--sandbox"),
    api_key: str = typer.Option(os.environ.get("CRUCIBLE_SANDBOX_API_KEY"), "--api-key"),
) -> None:
    """Run FILE against TESTS in the sandbox and print the verdict of each test."""
    import json

    import httpx
    from crucible_shared.console import new_console
    from rich.table import Table

    for path, what in ((file, "FILE"), (tests, "--tests")):
        if not path.exists():
            raise typer.BadParameter(f"{path} does not exist", param_hint=what)
    if tests.suffix == ".json":
        try:
            spec = json.loads(tests.read_text())
        except ValueError as exc:
            raise typer.BadParameter(f"{tests} is not valid JSON: {exc}", param_hint="--tests") from None
    else:
        lines = [line for line in tests.read_text().splitlines() if line.strip().startswith("assert")]
        if not lines:
            raise typer.BadParameter(f"{tests} has no `assert` lines", param_hint="--tests")
        spec = {"kind": "asserts", "asserts": lines}
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        r = httpx.post(
            f"{sandbox.rstrip('/')}/v1/runs",
            json={"code": file.read_text(), "tests": spec},
            headers=headers,
            timeout=120,
        )
    except httpx.HTTPError as exc:
        fail(f"cannot reach the sandbox at {sandbox}: {exc}")
    if r.status_code != 200:
        try:
            message = r.json().get("error", {}).get("message", r.text)
        except ValueError:
            message = r.text
        fail(f"{r.status_code}: {message}")
    result = r.json()
    table = Table(title=f"{result['status']}: {result['passed']}/{result['total']} tests passed")
    for col in ("#", "status", "test / what went wrong"):
        table.add_column(col, overflow="fold")
    for t in result["tests"]:
        table.add_row(str(t["index"]), t["status"], t["message"] or t["test"])
    console = new_console()
    console.print(table)
    if result.get("traceback"):
        console.print(result["traceback"])
    raise typer.Exit(0 if result["status"] == "passed" else 1)
