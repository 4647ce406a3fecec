"""`crucible train | jobs | watch | cancel | retry`: jobs on a gateway (and `train --local` here)."""

from __future__ import annotations

import uuid
from pathlib import Path

import typer

from crucible_cli.app import app
from crucible_cli.options import (
    API_KEY,
    DETACH,
    GATEWAY,
    LOCAL,
    LOCAL_GENERATORS,
    LOCAL_RUNS_DIR,
    LOCAL_SANDBOX,
    RAW,
    SAMPLES,
    gateway_session,
)
from crucible_cli.specs import SET, load_spec


def submit_and_follow(
    spec, gateway: str, api_key: str | None, detach: bool, *, samples: bool = False, raw: bool = False
) -> None:
    """Submit a job spec; unless detached, follow it to the end (exit 1 unless it finished)."""
    from crucible_shared.console import new_console

    from crucible_cli.render import follow

    console = new_console()
    with gateway_session(gateway, api_key) as gw:
        created = gw.submit(spec.model_dump(mode="json"))
        if raw:
            print(created.model_dump_json(), flush=True)
        else:
            console.print(f"submitted {created.id} ({created.location})", markup=False, highlight=False)
        if detach:
            return
        final = follow(gw, created.id, console, samples=samples, raw=raw)
    _outcome(console, final, raw)


def _outcome(console, final, raw: bool) -> None:
    """How a followed job ended (unless the events go out raw); exit 1 unless it finished."""
    from crucible_shared.lifecycle import JobStatus

    from crucible_cli.render import print_outcome

    if not raw:
        print_outcome(console, final)
    if final.status != JobStatus.finished:
        raise typer.Exit(1)


@app.command("train")
def train(
    config: Path = typer.Option(..., "--config", "-c", help="Job spec (YAML or JSON)."),
    overrides: list[str] = SET,
    local: bool = LOCAL,
    gateway: str = GATEWAY,
    api_key: str = API_KEY,
    detach: bool = DETACH,
    samples: bool = SAMPLES,
    raw: bool = RAW,
    generator: list[str] = LOCAL_GENERATORS,
    sandbox: str = LOCAL_SANDBOX,
    job_id: str = typer.Option(
        None, "--job-id", help="--local: resume this job (its run dir holds the checkpoints)."
    ),
    runs_dir: Path = LOCAL_RUNS_DIR,
) -> None:
    """Train: submit to the gateway and follow the job (or run it here with --local)."""
    spec = load_spec(config, "train", overrides)
    if not local:
        submit_and_follow(spec, gateway, api_key, detach, samples=samples, raw=raw)
        return
    run_local(spec, generator, sandbox, job_id, runs_dir, samples=samples, raw=raw)


def run_local(spec, generator, sandbox, job_id, runs_dir, *, samples: bool, raw: bool) -> None:
    """The same job code a worker runs, in this process, with events printed as they come."""
    import json
    import logging
    import signal

    from crucible_cli.heavy import require

    require("crucible_trainer", command="train --local")
    from crucible_shared.console import new_console
    from crucible_shared.lifecycle import JobStatus, valid_job_id
    from crucible_trainer.runtime.channel import LocalChannel
    from crucible_trainer.runtime.entry import execute, quiet_libraries
    from crucible_trainer.settings import Settings

    from crucible_cli.render import describe

    overrides: dict = {}
    if generator:
        overrides["generator_urls"] = generator
    if sandbox:
        overrides["sandbox_url"] = sandbox
    if runs_dir:
        overrides["runs_dir"] = runs_dir
    settings = Settings(**overrides)
    prefix = spec.method.name if spec.kind == "train" else spec.kind
    job_id = job_id or f"{prefix}-{uuid.uuid4().hex[:8]}"
    if not valid_job_id(job_id):
        raise typer.BadParameter("letters, digits, `_`, `.` and `-` only", param_hint="--job-id")
    console = new_console()

    def show(kind: str, data: dict) -> None:
        if raw:
            print(json.dumps({"event": kind, "data": data}, default=str), flush=True)
        elif kind == "metrics":
            from crucible_cli.render import bar_text

            console.print(bar_text(data.get("step"), data.get("metrics", {})), markup=False, highlight=False)
        elif (line := describe(kind, data, samples=samples)) is not None:
            console.print(line, markup=False, highlight=False)

    channel = LocalChannel(job_id, show)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(message)s")
    if not raw:
        quiet_libraries()

    def interrupt(*_: object) -> None:
        if channel.cancel_requested():
            raise KeyboardInterrupt
        console.print("stopping after the current await (Ctrl-C again to abort)")
        channel.cancel()

    signal.signal(signal.SIGINT, interrupt)
    console.print(f"job {job_id}: run dir {settings.runs_dir / job_id}", markup=False, highlight=False)
    try:
        summary = execute(spec, job_id, settings, channel)
    except KeyboardInterrupt:
        typer.echo("interrupted; the last checkpoint is in the run dir (resume with --job-id)", err=True)
        raise typer.Exit(130) from None
    status = summary.get("status")
    console.print(
        f"{job_id}: {status}" + (f"; adapter {summary['adapter']}" if summary.get("adapter") else "")
    )
    if summary.get("report"):
        console.print(f"report {summary['report']}", markup=False, highlight=False)
    if status != JobStatus.finished.value:
        raise typer.Exit(1)


@app.command("jobs")
def jobs(
    status: str = typer.Option(None, help="queued | running | finished | failed | cancelled."),
    kind: str = typer.Option(None, help="train | eval | pipeline."),
    gateway: str = GATEWAY,
    api_key: str = API_KEY,
) -> None:
    """List jobs, newest first."""
    from crucible_shared.console import new_console
    from crucible_shared.lifecycle import JobStatus
    from crucible_shared.text import shown
    from rich.markup import escape
    from rich.table import Table

    if status is not None and status not in JobStatus.__members__:
        raise typer.BadParameter(f"one of {', '.join(JobStatus.__members__)}", param_hint="--status")
    with gateway_session(gateway, api_key) as gw:
        listing = gw.jobs(status=status, kind=kind)
    table = Table()
    for col in ("id", "kind", "status", "step", "name"):
        table.add_column(col)
    for job in listing.jobs:
        step = f"{job.step}/{job.total_steps}" if job.step is not None else ""
        # A name is another user's text: hidden characters escaped, rich markup shown as written.
        table.add_row(job.id, job.kind, job.status.value, step, escape(shown(job.name or "")))
    new_console().print(table)


@app.command("watch")
def watch(
    job_id: str,
    samples: bool = SAMPLES,
    raw: bool = RAW,
    gateway: str = GATEWAY,
    api_key: str = API_KEY,
) -> None:
    """Follow a job's progress until it ends."""
    from crucible_shared.console import new_console

    from crucible_cli.render import follow

    console = new_console()
    with gateway_session(gateway, api_key) as gw:
        final = follow(gw, job_id, console, samples=samples, raw=raw)
    _outcome(console, final, raw)


@app.command("cancel")
def cancel(job_id: str, gateway: str = GATEWAY, api_key: str = API_KEY) -> None:
    """Ask a job to stop."""
    with gateway_session(gateway, api_key) as gw:
        job = gw.cancel(job_id)
    typer.echo(f"{job_id}: {job.status.value}")


@app.command("retry")
def retry(job_id: str, gateway: str = GATEWAY, api_key: str = API_KEY) -> None:
    """Run a failed or cancelled job again; training resumes from its last checkpoint."""
    with gateway_session(gateway, api_key) as gw:
        job = gw.retry(job_id)
    typer.echo(f"{job_id}: {job.status.value} (attempt {job.attempts})")
