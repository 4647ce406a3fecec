"""`crucible demo`: the README's main job on the embedded defaults.

Starts the local stack (embedded Redis, sandbox, generator with SmolLM2, a trainer worker,
the gateway), submits a short GRPO job that evaluates SmolLM2 on a few MBPP test tasks, trains
with an adapter hot-swapped into the generator after every update, evaluates again, then
prints the before/after table and where the reports are.
"""

from __future__ import annotations

from pathlib import Path

import typer

from crucible_trainer.cli import app

# The same job as examples/grpo_tiny.yaml (a test keeps them equal).
DEMO_JOB = {
    "kind": "train",
    "name": "grpo-tiny",
    "method": {"name": "grpo"},
    "data": {"dataset": "mbpp", "split": "train", "limit": 4},
    "rollout": {"group_size": 4, "max_tokens": 96, "temperature": 1.0},
    "reward": {"kind": "graded"},
    "optim": {"lr": 1.0e-4, "steps": 2, "problems_per_step": 2, "micro_batch": 8},
    "publish": {"every": 1},
    "eval": {"data": {"dataset": "mbpp", "split": "test", "limit": 4}, "max_tokens": 128},
    "checkpoint": {"every": 1},
    "logging": {"wandb_mode": "disabled"},
    "seed": 0,
}


@app.command("demo")
def demo(
    state_dir: Path = typer.Option(
        Path("runs/demo"), help="Where the stack keeps adapters, run dirs and logs."
    ),
    steps: int = typer.Option(2, min=1, help="Training steps."),
) -> None:
    """Start the stack, evaluate, train GRPO with adapter hot-swap, evaluate again, print before/after."""
    import time

    from crucible_shared.gateway_client import GatewayClient
    from crucible_shared.jobs import TrainJob
    from rich.console import Console
    from rich.table import Table

    from crucible_trainer.cli.stack_cmd import follow
    from crucible_trainer.stack import Stack, free_port

    console = Console()
    spec = TrainJob.model_validate({**DEMO_JOB, "optim": {**DEMO_JOB["optim"], "steps": steps}})
    started = time.monotonic()
    stack = Stack(state_dir, gateway_port=free_port(), generator_port=free_port(), sandbox_port=free_port())
    try:
        with console.status("starting the stack") as status:
            urls = stack.start(progress=lambda m: status.update(m))
        console.print(
            f"stack up in {time.monotonic() - started:.0f} s: "
            + ", ".join(f"{k} {v}" for k, v in urls.items())
        )
        with GatewayClient(urls["gateway"], timeout=120) as client:
            created = client.submit(spec.model_dump(mode="json"))
            console.print(f"submitted {created['id']}: evaluate, train {steps} GRPO steps, evaluate again")
            final = follow(client, created["id"], console)
    except (RuntimeError, TimeoutError) as exc:
        console.print(f"[red]{exc}[/]")
        raise typer.Exit(1) from None
    finally:
        stack.stop()
    if final["status"] != "finished":
        console.print(
            f"[red]{final['id']} {final['status']}: {final.get('error')}[/]  (logs: {state_dir / 'logs'})"
        )
        raise typer.Exit(1)
    summary = final.get("summary") or {}
    evals = summary.get("eval", {})
    table = Table(
        title=f"SmolLM2-135M-Instruct on {evals.get('before', {}).get('problems', '?')} MBPP test tasks"
    )
    table.add_column("")
    table.add_column("before")
    table.add_column("after")
    for key, label in (
        ("greedy_pass@1", "greedy pass@1"),
        ("mean_generated_tokens", "mean generated tokens"),
    ):
        row = [evals.get(when, {}).get(key) for when in ("before", "after")]
        table.add_row(
            label, *("-" if v is None else f"{v:.3f}" if isinstance(v, float) else str(v) for v in row)
        )
    console.print(table)
    metrics = final.get("metrics") or {}
    console.print(
        f"last step: reward {metrics.get('reward_mean', 0):.3f}, zero-signal groups {metrics.get('zero_signal_fraction', 0):.0%}, "
        f"last adapter version {final.get('policy_version')} (hot-swapped into the generator after each update)"
    )
    for key in ("adapter", "before_after", "learning_curve", "run_dir"):
        if summary.get(key):
            console.print(f"  {key.replace('_', ' ')}: {summary[key]}")
    console.print(f"done in {time.monotonic() - started:.0f} s")
