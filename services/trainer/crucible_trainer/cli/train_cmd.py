"""`crucible train --config spec.yaml`: submit a training job to the gateway and follow it, or,
with `--local`, run it in this process without gateway or queue (the same code path a queued
job takes: `crucible_trainer.train`; it then needs a generator and a sandbox)."""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import typer

from crucible_trainer.cli import app


def load_spec(path: Path, expect: str):
    """Parse a YAML/JSON job spec; exits with a message naming the bad field."""
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
        lines = [f"  {'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors()]
        typer.echo(f"{path}: invalid job spec:\n" + "\n".join(lines), err=True)
        raise typer.Exit(2) from None
    if spec.kind != expect:
        raise typer.BadParameter(
            f"{path} is a {spec.kind!r} job; use `crucible {spec.kind}`", param_hint="--config"
        )
    return spec


@app.command("train")
def train(
    config: Path = typer.Option(..., "--config", "-c", help="Job spec (YAML or JSON)."),
    local: bool = typer.Option(False, "--local", help="Run here instead of submitting to the gateway."),
    gateway: str = typer.Option(
        os.environ.get("CRUCIBLE_GATEWAY_URL", "http://127.0.0.1:8000"), "--gateway", help="Gateway URL."
    ),
    api_key: str = typer.Option(os.environ.get("CRUCIBLE_API_KEY"), "--api-key", help="Gateway API key."),
    detach: bool = typer.Option(False, "--detach", help="Submit and return without following the job."),
    generator: list[str] = typer.Option(None, "--generator", help="Generator URL (repeat for replicas)."),
    sandbox: str = typer.Option(None, "--sandbox", help="Sandbox URL."),
    job_id: str = typer.Option(None, "--job-id", help="Resume this job (its run dir holds the checkpoints)."),
    runs_dir: Path = typer.Option(None, "--runs-dir", help="Where run dirs go (default runs/jobs)."),
) -> None:
    """Train: submit to the gateway and follow the job (or run it here with --local)."""
    spec = load_spec(config, "train")
    if not local:
        submit_and_follow(spec, gateway, api_key, detach)
        return
    import asyncio
    import logging

    from crucible_trainer.cancel import CancelToken
    from crucible_trainer.settings import Settings
    from crucible_trainer.train import run_train_job

    overrides: dict = {}
    if generator:
        overrides["generator_urls"] = generator
    if sandbox:
        overrides["sandbox_url"] = sandbox
    if runs_dir:
        overrides["runs_dir"] = runs_dir
    settings = Settings(**overrides)
    job_id = job_id or f"{spec.method.name}-{uuid.uuid4().hex[:8]}"
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    typer.echo(f"job {job_id}: run dir {settings.runs_dir / job_id}")

    async def go() -> dict:
        token = CancelToken()
        try:
            return await run_train_job(spec, job_id, settings, cancel=token)
        except asyncio.CancelledError:
            token.cancel()
            raise

    try:
        summary = asyncio.run(go())
    except KeyboardInterrupt:
        typer.echo("interrupted; the last checkpoint is in the run dir (resume with --job-id)", err=True)
        raise typer.Exit(130) from None
    typer.echo(f"{summary.get('status')}: adapter {summary.get('adapter')}")


def submit_and_follow(spec, gateway: str, api_key: str | None, detach: bool) -> None:
    """Submit a job spec; unless detached, follow it to the end (exit 1 unless it finished)."""
    from crucible_shared.gateway_client import GatewayClient, GatewayError, GatewayUnreachable
    from rich.console import Console

    from crucible_trainer.cli.stack_cmd import follow

    console = Console()
    try:
        with GatewayClient(gateway, api_key) as client:
            created = client.submit(spec.model_dump(mode="json"))
            console.print(f"submitted {created['id']} ({created['location']})")
            if detach:
                return
            final = follow(client, created["id"], console)
    except (GatewayError, OSError) as exc:
        unreachable = isinstance(exc, GatewayUnreachable | OSError)
        hint = " (is the stack up? start it with `crucible up`)" if unreachable else ""
        typer.echo(f"error: {exc}{hint}", err=True)
        raise typer.Exit(1) from None
    console.print(
        f"{final['id']}: {final['status']}" + (f" ({final['error']})" if final.get("error") else "")
    )
    if final.get("summary"):
        for key in ("adapter", "learning_curve", "before_after", "run_dir"):
            if final["summary"].get(key):
                console.print(f"  {key}: {final['summary'][key]}")
    if final["status"] != "finished":
        raise typer.Exit(1)
