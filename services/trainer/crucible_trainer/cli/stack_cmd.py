"""`crucible up | jobs | watch | cancel | retry | sandbox run`: the local stack and the gateway, for people."""

from __future__ import annotations

import os
from pathlib import Path

import typer

from crucible_trainer.cli import app

GATEWAY = typer.Option(
    os.environ.get("CRUCIBLE_GATEWAY_URL", "http://127.0.0.1:8000"),
    "--gateway",
    help="Gateway URL (env CRUCIBLE_GATEWAY_URL).",
)
API_KEY = typer.Option(
    os.environ.get("CRUCIBLE_API_KEY"), "--api-key", help="Gateway API key (env CRUCIBLE_API_KEY)."
)


def _client(url: str, key: str | None):
    from crucible_shared.gateway_client import GatewayClient

    return GatewayClient(url, key)


def _fail(exc: Exception) -> None:
    typer.echo(f"error: {exc}", err=True)
    raise typer.Exit(1)


@app.command("up")
def up(
    state_dir: Path = typer.Option(
        Path("runs"), help="Adapters, run dirs, logs and embedded Redis data go here."
    ),
    gateway_port: int = typer.Option(8000),
    generator_port: int = typer.Option(8001),
    sandbox_port: int = typer.Option(8002),
    model: str = typer.Option(None, help="Generator model (default: the built-in SmolLM2-135M-Instruct)."),
) -> None:
    """Start Redis, sandbox, generator, a trainer worker and the gateway; Ctrl-C stops them all."""
    import signal
    import time

    from rich.console import Console
    from rich.table import Table

    from crucible_trainer.stack import Stack

    console = Console()
    stack = Stack(state_dir, gateway_port, generator_port, sandbox_port, model=model)
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    try:
        with console.status("starting") as status:
            urls = stack.start(progress=lambda m: status.update(m))
        table = Table(title="Crucible is up")
        table.add_column("service")
        table.add_column("address")
        for name, url in urls.items():
            table.add_row(name, url)
        console.print(table)
        console.print(f"logs in {state_dir / 'logs'}; Ctrl-C stops everything")
        while all(p.popen.poll() is None for p in stack.procs):
            time.sleep(0.5)
        dead = [p.name for p in stack.procs if p.popen.poll() is not None]
        console.print(f"[red]{', '.join(dead)} exited; stopping the stack[/]")
        raise typer.Exit(1)
    except KeyboardInterrupt:
        console.print("stopping")
    except (RuntimeError, TimeoutError) as exc:
        console.print(f"[red]{exc}[/]")
        raise typer.Exit(1) from None
    finally:
        stack.stop()


@app.command("jobs")
def jobs(
    status: str = typer.Option(None),
    kind: str = typer.Option(None),
    gateway: str = GATEWAY,
    api_key: str = API_KEY,
) -> None:
    """List jobs, newest first."""
    from crucible_shared.gateway_client import GatewayError
    from rich.console import Console
    from rich.table import Table

    try:
        with _client(gateway, api_key) as client:
            listing = client.jobs(status=status, kind=kind)
    except (GatewayError, OSError) as exc:
        _fail(exc)
    table = Table()
    for col in ("id", "kind", "status", "step", "name"):
        table.add_column(col)
    for job in listing["jobs"]:
        step = f"{job['step']}/{job['total_steps']}" if job.get("step") is not None else ""
        table.add_row(job["id"], job["kind"], job["status"], step, job.get("name") or "")
    Console().print(table)


def follow(client, job_id: str, console) -> dict:
    """Live progress bar and metrics from a job's event stream; returns the final record."""
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total}"),
        TimeElapsedColumn(),
        console=console,
    ) as bar:
        task = bar.add_task(job_id, total=None)
        for _id, event, data in client.events(job_id):
            if event == "metrics":
                m = data.get("metrics", {})
                total = client.job(job_id).get("total_steps")
                bar.update(
                    task,
                    completed=data.get("step", 0),
                    total=total,
                    description=f"step {data.get('step')}: reward {m.get('reward_mean', 0):.3f} pass {m.get('pass_rate', 0):.2f}",
                )
            elif event in (
                "eval_started",
                "eval_finished",
                "adapter_published",
                "status",
                "resumed",
                "stale_policy",
                "difficulty_filter",
            ):
                detail = {k: v for k, v in data.items() if k not in ("type", "time", "summary")}
                bar.console.print(f"[dim]{event}[/] {detail}")
    return client.job(job_id)


@app.command("watch")
def watch(job_id: str, gateway: str = GATEWAY, api_key: str = API_KEY) -> None:
    """Follow a job's progress until it ends."""
    from crucible_shared.gateway_client import GatewayError
    from rich.console import Console

    console = Console()
    try:
        with _client(gateway, api_key) as client:
            final = follow(client, job_id, console)
    except (GatewayError, OSError) as exc:
        _fail(exc)
    console.print(f"{job_id}: {final['status']}" + (f" ({final['error']})" if final.get("error") else ""))


@app.command("cancel")
def cancel(job_id: str, gateway: str = GATEWAY, api_key: str = API_KEY) -> None:
    """Ask a job to stop."""
    from crucible_shared.gateway_client import GatewayError

    try:
        with _client(gateway, api_key) as client:
            job = client.cancel(job_id)
    except (GatewayError, OSError) as exc:
        _fail(exc)
    typer.echo(f"{job_id}: {job['status']}")


@app.command("retry")
def retry(job_id: str, gateway: str = GATEWAY, api_key: str = API_KEY) -> None:
    """Run a failed or cancelled job again; training resumes from its last checkpoint."""
    from crucible_shared.gateway_client import GatewayError

    try:
        with _client(gateway, api_key) as client:
            job = client.retry(job_id)
    except (GatewayError, OSError) as exc:
        _fail(exc)
    typer.echo(f"{job_id}: {job['status']} (attempt {job['attempts']})")


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
    from rich.console import Console
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
        _fail(RuntimeError(f"cannot reach the sandbox at {sandbox}: {exc}"))
    if r.status_code != 200:
        _fail(RuntimeError(f"{r.status_code}: {r.json().get('error', {}).get('message', r.text)}"))
    result = r.json()
    table = Table(title=f"{result['status']}: {result['passed']}/{result['total']} tests passed")
    for col in ("#", "status", "test / what went wrong"):
        table.add_column(col, overflow="fold")
    for t in result["tests"]:
        table.add_row(str(t["index"]), t["status"], t["message"] or t["test"])
    console = Console()
    console.print(table)
    if result.get("traceback"):
        console.print(result["traceback"])
    raise typer.Exit(0 if result["status"] == "passed" else 1)
