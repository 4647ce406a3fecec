"""`crucible eval`: pass@k of a model or adapter against running generator and sandbox services.

    crucible eval --dataset mbpp --split test --n 10 --temperature 0.8 --out runs/eval/base
    crucible eval --dataset humaneval --n 0 --model my-adapter --compare runs/eval/base
    crucible eval-compare runs/eval/base runs/eval/after --out runs/eval/cmp

Writes `report.json`, `report.md` and `pass_at_k.png` into `--out` (and `comparison.*` with
`--compare`). The same `crucible_trainer.evaluation.evaluate` runs inside eval jobs.
"""

from __future__ import annotations

import os
import re
import time
from pathlib import Path
from typing import Any

import typer

from crucible_trainer.cli import app


def _fail(message: str, code: int = 2) -> None:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(code)


def _validation_message(exc: Any) -> str:
    parts = []
    for error in exc.errors():
        where = ".".join(str(p) for p in error["loc"])
        message = error["msg"].removeprefix("Value error, ")
        parts.append(f"{where}: {message}" if where else message)
    return "; ".join(parts)


def parse_ids(text: str | None) -> list[int | str] | None:
    """`"11, 12,HumanEval/3"` -> [11, 12, "HumanEval/3"]."""
    if not text:
        return None
    return [int(p) if p.isdigit() else p for p in (s.strip() for s in text.split(",")) if p]


def parse_range(text: str | None) -> tuple[int, int] | None:
    """`"11-40"` -> (11, 40)."""
    if not text:
        return None
    match = re.fullmatch(r"\s*(\d+)\s*[-:]\s*(\d+)\s*", text)
    if match is None:
        raise typer.BadParameter(f"expected START-END, got {text!r}", param_hint="--id-range")
    return int(match.group(1)), int(match.group(2))


@app.command("eval")
def eval_command(
    dataset: str = typer.Option("mbpp", help="mbpp | humaneval | stdio | jsonl."),
    split: str = typer.Option(
        None, help="MBPP split: prompt | test | validation | train | all (default test)."
    ),
    path: Path = typer.Option(
        None, help="JSONL file (stdio and jsonl datasets; or another MBPP/HumanEval file)."
    ),
    ids: str = typer.Option(None, help="Comma-separated task ids: 11,12 or HumanEval/3."),
    id_range: str = typer.Option(None, help="Inclusive numeric id range, e.g. 11-40."),
    limit: int = typer.Option(None, help="Keep the first (or, with --shuffle, a random) N tasks."),
    shuffle: bool = typer.Option(False, help="Shuffle tasks (with --data-seed) before --limit."),
    data_seed: int = typer.Option(0, help="Seed of --shuffle."),
    model: str = typer.Option(
        None, help="Base model or adapter name on the generator (default: its base model)."
    ),
    n: int = typer.Option(10, help="Samples per problem at --temperature (0: greedy only)."),
    temperature: float = typer.Option(0.8, help="Temperature of the n samples."),
    top_p: float = typer.Option(0.95, help="Nucleus mass of the n samples."),
    max_tokens: int = typer.Option(512, help="Most tokens per answer."),
    greedy: bool = typer.Option(
        True, "--greedy/--no-greedy", help="Also decode one greedy answer per problem."
    ),
    k: list[int] = typer.Option(None, "--k", help="pass@k to report (repeat; default 1 and 10)."),
    seed: int = typer.Option(0, help="Sampling seed (each problem derives its own from it)."),
    chat: bool = typer.Option(
        True, "--chat/--completion", help="Chat prompts (instruct) or plain completion (base)."
    ),
    stop: list[str] = typer.Option(None, "--stop", help="Stop string (repeat; default: the prompt style's)."),
    sanitize: bool = typer.Option(
        True, "--sanitize/--no-sanitize", help="Drop example calls around functions."
    ),
    concurrency: int = typer.Option(64, help="Generation requests in flight."),
    generator: list[str] = typer.Option(None, "--generator", help="Generator URL (repeat for replicas)."),
    sandbox: str = typer.Option(None, "--sandbox", help="Sandbox URL."),
    sandbox_api_key: str = typer.Option(None, "--sandbox-api-key", envvar="CRUCIBLE_SANDBOX_API_KEY"),
    out: Path = typer.Option(
        None, "--out", "-o", help="Report folder (default runs/eval/<model>-<data>-<time>)."
    ),
    compare: Path = typer.Option(
        None, "--compare", help="An earlier report (file or folder) to compare with."
    ),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress bar."),
    config_file: Path = typer.Option(
        None, "--config", "-c", help="Submit this eval job spec (YAML/JSON) to the gateway instead."
    ),
    gateway: str = typer.Option(
        os.environ.get("CRUCIBLE_GATEWAY_URL", "http://127.0.0.1:8000"),
        "--gateway",
        help="Gateway URL (with --config).",
    ),
    api_key: str = typer.Option(
        os.environ.get("CRUCIBLE_API_KEY"), "--api-key", help="Gateway API key (with --config)."
    ),
    detach: bool = typer.Option(False, "--detach", help="With --config: submit and return."),
) -> None:
    """Evaluate a model or adapter: generate, run in the sandbox, write pass@k reports.

    With --config, submit an eval job to the gateway and follow it instead.
    """
    if config_file is not None:
        from crucible_trainer.cli.train_cmd import load_spec, submit_and_follow

        submit_and_follow(load_spec(config_file, "eval"), gateway, api_key, detach)
        return
    from pydantic import ValidationError

    from crucible_trainer.evaluation.config import EvalConfig
    from crucible_trainer.settings import Settings
    from crucible_trainer.tasks.loading import DataSpec, load_tasks
    from crucible_trainer.tasks.task import DatasetError

    try:
        spec = DataSpec(
            dataset=dataset,
            split=split,
            path=str(path) if path else None,
            ids=parse_ids(ids),
            id_range=parse_range(id_range),
            limit=limit,
            shuffle=shuffle,
            seed=data_seed,
        )
        config = EvalConfig(
            model=model,
            n=n,
            temperature=temperature,
            top_p=top_p,
            max_tokens=max_tokens,
            greedy=greedy,
            ks=k or [1, 10],
            seed=seed,
            chat=chat,
            stop=stop or None,
            sanitize=sanitize,
            concurrency=concurrency,
        )
    except ValidationError as exc:
        _fail(_validation_message(exc))
    try:
        tasks = load_tasks(spec)
    except DatasetError as exc:
        _fail(str(exc))
    if compare is not None and not compare.exists():
        _fail(f"--compare: {compare} does not exist")
    settings = Settings()
    urls = generator or settings.generator_urls
    sandbox_url = sandbox or settings.sandbox_url
    if out is None:
        label = re.sub(r"[^A-Za-z0-9_.-]+", "-", f"{model or 'base'}-{spec.dataset}-{spec.effective_split}")
        out = Path("runs") / "eval" / f"{label}-{time.strftime('%Y%m%d-%H%M%S')}"

    import asyncio

    report = asyncio.run(_run(tasks, spec, config, urls, sandbox_url, sandbox_api_key, quiet))
    from crucible_trainer.evaluation.writers import compare_reports, write_report

    paths = write_report(report, out)
    _print_summary(report, paths)
    if compare is not None:
        cmp = compare_reports(compare, report, out)
        typer.echo(f"comparison: {cmp['markdown']}")


@app.command("eval-compare")
def eval_compare(
    before: Path = typer.Argument(..., help="Report before (report.json or its folder)."),
    after: Path = typer.Argument(..., help="Report after."),
    out: Path = typer.Option(Path("."), "--out", "-o", help="Where comparison.md and comparison.png go."),
) -> None:
    """Compare two evaluation reports: headline metrics, failures and per-problem changes."""
    from pydantic import ValidationError

    from crucible_trainer.evaluation.writers import compare_reports

    for report in (before, after):
        if not report.exists():
            _fail(f"{report} does not exist")
    try:
        paths = compare_reports(before, after, out)
    except (ValidationError, OSError) as exc:
        _fail(f"cannot read the reports: {exc}")
    typer.echo(paths["markdown"].read_text())
    typer.echo(f"written: {paths['markdown']}, {paths['plot']}")


async def _run(tasks, spec, config, urls, sandbox_url, sandbox_api_key, quiet):
    from crucible_shared.generator_client import GeneratorClient, GeneratorPool
    from crucible_shared.sandbox_client import SandboxClient
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from crucible_trainer.evaluation.runner import evaluate

    generator = GeneratorPool.from_urls(urls) if len(urls) > 1 else GeneratorClient(urls[0])
    async with generator, SandboxClient(sandbox_url, api_key=sandbox_api_key) as sandbox:
        try:
            await generator.wait_ready(30)
            await sandbox.wait_ready(timeout=30)
        except Exception as exc:  # timeouts and connection errors alike
            _fail(f"services not reachable (generator {', '.join(urls)}, sandbox {sandbox_url}): {exc}", 1)
        columns = [
            TextColumn("{task.description:<10}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
        ]
        with Progress(*columns, disable=quiet, transient=False) as bar:
            label = f"{len(tasks)} tasks of {spec.describe()}"
            bar.console.print(f"evaluating {config.model or 'the base model'} on {label}")
            generated = bar.add_task("generated", total=None)
            executed = bar.add_task("executed", total=None)

            def progress(p) -> None:
                bar.update(generated, completed=p.generated, total=p.total)
                bar.update(executed, completed=p.executed, total=p.total)

            try:
                return await evaluate(tasks, generator, sandbox, config, progress, data=spec)
            except ValueError as exc:
                _fail(str(exc), 1)


def _print_summary(report, paths: dict[str, Path]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"{report.model}: {report.num_problems} problems")
    table.add_column("metric")
    table.add_column("value", justify="right")
    for name, value in report.summary().items():
        if value is not None:
            table.add_row(name, f"{value * 100:.1f}%")
    if report.mean_generated_tokens is not None:
        table.add_row("mean generated tokens", f"{report.mean_generated_tokens:.1f}")
    t = report.timing
    table.add_row("wall time", f"{t.wall_s:.1f} s")
    table.add_row("generation / execution busy", f"{t.generation_s:.1f} s / {t.execution_s:.1f} s")
    table.add_row("execution hidden", f"{t.execution_hidden * 100:.0f}%")
    console = Console()
    console.print(table)
    console.print(f"report: {paths['markdown']} ({paths['json'].name}, {paths['plot'].name})")
