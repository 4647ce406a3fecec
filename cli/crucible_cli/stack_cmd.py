"""`crucible up` and `crucible demo`: the whole stack as local processes (full install only)."""

from __future__ import annotations

from pathlib import Path

import typer
from crucible_shared import jsonl

from crucible_cli.app import app

SERVICES = ("crucible_sandbox", "crucible_generator", "crucible_gateway", "crucible_trainer")

# The README's main job (examples/grpo_tiny.yaml; a test keeps them equal). Two MBPP train
# problems SmolLM2-135M solves now and then (a third of its samples pass), so within a few CPU
# steps the reward has something to rise from; it is evaluated on those same two problems, which
# shows the mechanism at work, not generalisation (docs/benchmarks.md has the held-out figures).
DEMO_JOB = {
    "kind": "train",
    "name": "grpo-tiny",
    "method": {"name": "grpo", "group_size": 8},
    "data": {"dataset": "mbpp", "split": "train", "ids": [672, 678]},
    "rollout": {"max_tokens": 96, "temperature": 1.0},
    "reward": {"kind": "all_pass"},
    "optim": {"lr": 5.0e-4, "steps": 4, "problems_per_step": 2, "micro_batch": 8},
    "publish": {"every": 1},
    "eval": {
        "data": {"dataset": "mbpp", "split": "train", "ids": [672, 678]},
        "greedy": False,
        "n": 8,
        "temperature": 1.0,
        "max_tokens": 96,
    },
    "checkpoint": {"every": 2},
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
    generator_backend: str = typer.Option(
        None,
        help="auto (vLLM on a CUDA host that has it, else Crucible's server), vllm or crucible "
        "(default: $CRUCIBLE_GENERATOR_BACKEND, else auto).",
    ),
    generator_gpus: str = typer.Option(
        None, help="CUDA devices of the generator, e.g. 0 (default: every device)."
    ),
    trainer_gpus: str = typer.Option(
        None,
        help="CUDA devices of the trainer worker, e.g. 1,2,3: a job's distributed.train_gpus ranks run "
        "on them (default: every device).",
    ),
) -> None:
    """Start Redis, sandbox, generator, two trainer workers (one for eval jobs only) and the gateway;
    Ctrl-C stops them all.
    A trainer worker that dies is started again; any other service dying stops the stack."""
    from crucible_cli.heavy import require

    require(*SERVICES, command="up")
    from crucible_shared.console import new_console
    from rich.table import Table

    from crucible_cli.stack import Stack

    console = new_console()
    stack = Stack(
        state_dir,
        gateway_port,
        generator_port,
        sandbox_port,
        model=model,
        generator_backend=generator_backend,
        generator_gpus=generator_gpus,
        trainer_gpus=trainer_gpus,
    )
    stop_on_sigterm()
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
        console.print("stopping: workers first, handing their jobs back (Ctrl-C again: shorter waits)")
    except (RuntimeError, TimeoutError, ValueError) as exc:
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
    config: Path = typer.Option(
        None, "--config", "-c", help="Run this train spec (YAML/JSON) instead of the built-in demo job."
    ),
    overrides: list[str] = typer.Option(
        None,
        "--set",
        metavar="FIELD=VALUE",
        help="Override one field of the job (the --config spec or the demo job), e.g. --set optim.lr=1e-4 "
        "(repeatable; value read as JSON or YAML).",
    ),
    generator_backend: str = typer.Option(
        None,
        help="auto, vllm or crucible, as for `crucible up` (default: $CRUCIBLE_GENERATOR_BACKEND, else auto).",
    ),
) -> None:
    """Start the stack, evaluate, train GRPO with adapter hot-swap, evaluate again, print before/after."""
    import time

    from crucible_cli.heavy import require

    require(*SERVICES, command="demo")
    from crucible_shared.console import new_console
    from crucible_shared.gateway_client import GatewayClient
    from crucible_shared.lifecycle import JobStatus

    from crucible_cli.render import follow, print_outcome
    from crucible_cli.spawn import free_port
    from crucible_cli.stack import Stack

    console = new_console()
    from crucible_cli.specs import load_spec, parse_spec

    if config is not None:
        spec = load_spec(config, "train", overrides)
    else:
        spec = parse_spec(DEMO_JOB, "train", overrides, "the demo job")
    if steps:
        spec = spec.model_copy(update={"optim": spec.optim.model_copy(update={"steps": steps})})
    started = time.monotonic()
    stack = Stack(
        state_dir,
        gateway_port=free_port(),
        generator_port=free_port(),
        sandbox_port=free_port(),
        generator_backend=generator_backend,
    )
    stop_on_sigterm()  # a `kill` (or a timeout) stops the services too, not only this process
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
                f"submitted {created.id}: evaluate, train {spec.optim.steps} {spec.method.name.upper()} steps, evaluate again"
            )
            final = follow(client, created.id, console, samples=False)
    except (RuntimeError, TimeoutError, ValueError) as exc:
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
    """What changed: the reward per step, and each evaluated problem's passing samples before/after."""
    import json

    from rich.table import Table

    summary = final.summary.model_dump() if final.summary else {}
    run_dir = Path(summary.get("run_dir", ""))
    metrics = run_dir / "metrics.jsonl"
    if metrics.exists():
        rows = jsonl.rows(metrics.read_text())
        steps = [r for r in rows if "reward_mean" in r and "eval_label" not in r]
        console.print(
            "reward per step (share of samples passing every test): "
            + " → ".join(f"{r['reward_mean']:.2f}" for r in steps)
        )
    reports = {w: run_dir / "eval" / w / "report.json" for w in ("before", "after")}
    if not all(p.exists() for p in reports.values()):
        return
    before, after = (json.loads(reports[w].read_text()) for w in ("before", "after"))
    table = Table(title="the problems it trained on, sampled at T=1 before and after training")
    table.add_column("problem")
    table.add_column("before")
    table.add_column("after")
    table.add_column("an answer after training")
    for old, new in zip(before["problems"], after["problems"], strict=True):
        sample = next((s for s in new.get("samples", []) if s.get("status") == "passed"), None) or next(
            iter(new.get("samples", [])), {}
        )
        first = (sample.get("code") or "").strip().splitlines()
        table.add_row(
            old["task_id"],
            f"{old['correct']}/{old['n']} pass",
            f"{new['correct']}/{new['n']} pass",
            f"{sample.get('status', '-')}: {first[0] if first else ''}",
        )
    console.print(table)


def stop_on_sigterm() -> None:
    """SIGTERM raises KeyboardInterrupt, as Ctrl-C does, so the command's `finally` stops the
    services it started (they run in sessions of their own: a signal to this process alone
    would leave them running)."""
    import signal

    def interrupt(*_: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupt)
