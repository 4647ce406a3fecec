"""`crucible pipeline --config SPEC`: the offline learning pipeline (submit and follow, or --local).

A pipeline spec (`kind: pipeline`, see examples/pipeline_*.yaml and docs/pipeline.md) runs its
stages on the trainer worker like any job; `--local` runs the same code in this process.
"""

from __future__ import annotations

from pathlib import Path

import typer

from crucible_cli.app import app
from crucible_cli.jobs_cmd import run_local, submit_and_follow
from crucible_cli.options import (
    API_KEY,
    DETACH,
    GATEWAY,
    LOCAL,
    LOCAL_GENERATORS,
    LOCAL_RUNS_DIR,
    LOCAL_SANDBOX,
    RAW,
)
from crucible_cli.specs import SET, load_spec


@app.command("pipeline")
def pipeline(
    config: Path = typer.Option(..., "--config", "-c", help="Pipeline spec (YAML or JSON, kind: pipeline)."),
    overrides: list[str] = SET,
    local: bool = LOCAL,
    gateway: str = GATEWAY,
    api_key: str = API_KEY,
    detach: bool = DETACH,
    raw: bool = RAW,
    generator: list[str] = LOCAL_GENERATORS,
    sandbox: str = LOCAL_SANDBOX,
    job_id: str = typer.Option(
        None,
        "--job-id",
        help="--local: run in this job's run dir (its finished stages are skipped, training resumes).",
    ),
    runs_dir: Path = LOCAL_RUNS_DIR,
) -> None:
    """Offline pipeline: baseline, candidates, execution, datasets, SFT/DPO, merge, evaluation, analysis."""
    spec = load_spec(config, "pipeline", overrides)
    if not local:
        submit_and_follow(spec, gateway, api_key, detach, raw=raw)
        return
    run_local(spec, generator, sandbox, job_id, runs_dir, samples=False, raw=raw)
