"""`crucible up` and `crucible demo`: the whole stack as local processes (full install only)."""

from __future__ import annotations

from pathlib import Path

import typer

from crucible_cli.app import app

SERVICES = ("crucible_sandbox", "crucible_generator", "crucible_gateway", "crucible_trainer")

# The README's main job (examples/grpo_tiny.yaml; a test keeps them equal).
DEMO_JOB = {
    "kind": "train",
    "name": "grpo-tiny",
    "method": {"name": "grpo", "group_size": 4},
    "data": {"dataset": "mbpp", "split": "train", "limit": 4},
    "rollout": {"max_tokens": 96, "temperature": 1.0},
    "reward": {"kind": "graded"},
    "optim": {"lr": 1.0e-4, "steps": 2, "problems_per_step": 2, "micro_batch": 8},
    "publish": {"every": 1},
    "eval": {"data": {"dataset": "mbpp", "split": "test", "limit": 4}, "max_tokens": 128},
    "checkpoint": {"every": 1},
    "logging": {"wandb_mode": "disabled"},
    "seed": 0,
}


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
    """Start Redis, sandbox, generator, a trainer worker and the gateway; Ctrl-C stops them all.
    A trainer worker that dies is started again; any other service dying stops the stack."""
    import signal

    from crucible_cli.heavy import require

    require(*SERVICES, command="up")
    from rich.console import Console
    from rich.table import Table

    from crucible_cli.stack import Stack

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
        dead = stack.supervise(report=lambda m: console.print(f"[yellow]{m}[/]"))
        console.print(
            f"[red]the {dead} exited (see {state_dir / 'logs' / (dead + '.log')}); stopping the stack[/]"
        )
        raise typer.Exit(1)
    except KeyboardInterrupt:
        console.print("stopping")
    except (RuntimeError, TimeoutError) as exc:
        console.print(f"[red]{exc}[/]")
        raise typer.Exit(1) from None
    finally:
        stack.stop()


@app.command("demo")
def demo(
    state_dir: Path = typer.Option(
        Path("runs/demo"), help="Where the stack keeps adapters, run dirs and logs."
    ),
    steps: int = typer.Option(None, min=1, help="Training steps (default: the demo job's)."),
) -> None:
    """Start the stack, evaluate, train GRPO with adapter hot-swap, evaluate again, print before/after."""
    import time

    from crucible_cli.heavy import require

    require(*SERVICES, command="demo")
    from crucible_shared.gateway_client import GatewayClient
    from crucible_shared.jobs import TrainJob
    from crucible_shared.lifecycle import JobStatus
    from rich.console import Console

    from crucible_cli.render import follow, print_outcome
    from crucible_cli.spawn import free_port
    from crucible_cli.stack import Stack

    console = Console()
    job = dict(DEMO_JOB)
    if steps:
        job["optim"] = {**job["optim"], "steps": steps}
    spec = TrainJob.model_validate(job)
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
            console.print(
                f"submitted {created.id}: evaluate, train {spec.optim.steps} GRPO steps, evaluate again"
            )
            final = follow(client, created.id, console, samples=False)
    except (RuntimeError, TimeoutError) as exc:
        console.print(f"[red]{exc}[/]")
        raise typer.Exit(1) from None
    finally:
        stack.stop()
    print_outcome(console, final)
    if final.status != JobStatus.finished:
        console.print(f"logs: {state_dir / 'logs'}")
        raise typer.Exit(1)
    _story(console, final)
    console.print(f"done in {time.monotonic() - started:.0f} s")


def _story(console, final) -> None:
    """Before/after table of the demo job."""
    from rich.table import Table

    evals = (final.summary or {}).get("eval", {})
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
