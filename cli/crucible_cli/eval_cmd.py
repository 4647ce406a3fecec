"""`crucible eval`: pass@k of a model or adapter against running generator and sandbox services.

    crucible eval --dataset mbpp --split test --n 10 --temperature 0.8 --out runs/eval/base
    crucible eval --dataset humaneval --n 0 --adapter runs/jobs/JOB/adapter --compare runs/eval/base
    crucible eval --config examples/eval_mbpp_test.yaml        # an eval job, through the gateway
    crucible eval-compare runs/eval/base runs/eval/step-50 runs/eval/after --out runs/eval/cmp

Writes `report.json`, `report.md` and `pass_at_k.png` into `--out` (and `comparison.*` with
`--compare`). Local evaluations run the trainer's evaluation code here (the same code eval
jobs run), so they need the trainer package; `--config` needs only this CLI.
"""

from __future__ import annotations

import asyncio
import os
import re
import time
from pathlib import Path
from typing import Any

import typer

from crucible_cli.app import app
from crucible_cli.options import fail


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


_SET = typer.Option(
    None,
    "--set",
    metavar="FIELD=VALUE",
    help="With --config: override one spec field, e.g. --set n=4 (repeatable; value read as JSON or YAML).",
)


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
    adapter: Path = typer.Option(
        None, help="Evaluate this saved adapter directory (loaded into the generator for the run)."
    ),
    # Defaults (None here) are an eval spec's (`crucible_shared.jobs.EvalSampling`), as in an eval job.
    n: int | None = typer.Option(None, help="Samples per problem at --temperature (default 0: greedy only)."),
    temperature: float | None = typer.Option(None, help="Temperature of the n samples (default 0.8)."),
    top_p: float | None = typer.Option(None, help="Nucleus mass of the n samples (default 0.95)."),
    max_tokens: int | None = typer.Option(None, help="Most tokens per answer (default 256)."),
    greedy: bool = typer.Option(
        True, "--greedy/--no-greedy", help="Also decode one greedy answer per problem."
    ),
    k: list[int] = typer.Option(None, "--k", help="pass@k to report (repeat; default 1 and 10, those <= n)."),
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
    overrides: list[str] = _SET,
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
    if config_file is not None or overrides:
        _submit(config_file, overrides, gateway, api_key, detach)
        return
    from crucible_cli.heavy import require

    require("crucible_trainer", command="eval")
    _check_model_choice(model, adapter)
    data_fields: dict[str, Any] = {"dataset": dataset, "split": split, "path": str(path) if path else None}
    data_fields.update(ids=parse_ids(ids), id_range=parse_range(id_range), limit=limit, shuffle=shuffle)
    if shuffle:
        data_fields["seed"] = data_seed
    given = {"n": n, "max_tokens": max_tokens, "temperature": temperature, "top_p": top_p}
    eval_fields = _eval_fields(greedy, given, k)
    run_fields = {"model": model, "chat": chat, "seed": seed, "stop": stop or None, "sanitize": sanitize}
    data, config, problems = _prepare(data_fields, eval_fields, run_fields | {"concurrency": concurrency})
    if compare is not None and not compare.exists():
        fail(f"--compare: {compare} does not exist", 2)
    from crucible_trainer.settings import Settings

    settings = Settings()
    urls = generator or settings.generator_urls
    sandbox_url = sandbox or settings.sandbox_url
    out = out or _default_out(model, adapter, data)
    report = asyncio.run(_run(problems, data, config, urls, sandbox_url, sandbox_api_key, adapter, quiet))
    from crucible_trainer.evaluation.writers import compare_reports, write_report

    paths = write_report(report, out)
    _print_summary(report, paths)
    if compare is not None:
        cmp = compare_reports(compare, report, out)
        typer.echo(f"comparison: {cmp['markdown']}")


def _submit(config_file: Path | None, overrides: list[str], gateway: str, api_key: str, detach: bool) -> None:
    """`--config` (with its `--set` overrides): an eval job through the gateway."""
    from crucible_cli.jobs_cmd import submit_and_follow
    from crucible_cli.specs import load_spec

    if config_file is None:
        raise typer.BadParameter("overrides a spec: give the spec with --config", param_hint="--set")
    submit_and_follow(load_spec(config_file, "eval", overrides), gateway, api_key, detach)


def _default_out(model: str | None, adapter: Path | None, data: Any) -> Path:
    """runs/eval/<model>-<data>-<time>."""
    who = model or (adapter.name if adapter else "base")
    label = re.sub(r"[^A-Za-z0-9_.-]+", "-", f"{who}-{data.dataset}-{data.effective_split}")
    return Path("runs") / "eval" / f"{label}-{time.strftime('%Y%m%d-%H%M%S')}"


def _check_model_choice(model: str | None, adapter: Path | None) -> None:
    if model and adapter:
        raise typer.BadParameter("give --model or --adapter, not both", param_hint="--adapter")
    if adapter is not None and not (adapter / "adapter_config.json").is_file():
        raise typer.BadParameter(
            f"{adapter} is not a saved adapter (no adapter_config.json)", param_hint="--adapter"
        )


def _eval_fields(greedy: bool, given: dict[str, Any], k: list[int] | None) -> dict[str, Any]:
    """The eval spec's fields the options set; the rest keep the spec's defaults (`EvalSampling`)."""
    fields: dict[str, Any] = {"greedy": greedy, **{f: v for f, v in given.items() if v is not None}}
    if k or given["n"]:
        fields["ks"] = k or [x for x in (1, 10) if x <= (given["n"] or 0)]
    return fields


def _prepare(data_fields: dict[str, Any], eval_fields: dict[str, Any], run_fields: dict[str, Any]) -> Any:
    """The validated data spec, the evaluator's config and the problems, or a message saying what to fix."""
    from crucible_shared.jobs import DataSpec, EvalSpec
    from crucible_trainer.evaluation.config import EvalConfig
    from crucible_trainer.tasks.loading import load_tasks
    from crucible_trainer.tasks.task import DatasetError
    from pydantic import ValidationError

    from crucible_cli.specs import validation_lines

    try:
        data = DataSpec(**data_fields)
        spec = EvalSpec(data=data, **eval_fields)
        config = EvalConfig.from_spec(spec, **run_fields)
    except ValidationError as exc:
        fail("; ".join(validation_lines(exc)), 2)
    try:
        problems = load_tasks(data)
    except DatasetError as exc:
        fail(str(exc), 2)
    return data, config, problems


@app.command("eval-compare")
def eval_compare(
    reports: list[Path] = typer.Argument(..., help="Reports (report.json or their folders), oldest first."),
    out: Path = typer.Option(Path("."), "--out", "-o", help="Where results.md / comparison.md and plots go."),
    label: list[str] = typer.Option(
        None, "--label", help="A name per report (repeat; default: folder names)."
    ),
) -> None:
    """Compare evaluation reports: one table and plot for all of them, and with exactly two the
    before/after comparison (headline metrics, failures, per-problem changes)."""
    from crucible_cli.heavy import require

    require("crucible_trainer", command="eval-compare")
    from crucible_trainer.evaluation.writers import compare_many, compare_reports
    from pydantic import ValidationError

    if len(reports) < 2:
        raise typer.BadParameter("give at least two reports", param_hint="REPORTS")
    if label and len(label) != len(reports):
        raise typer.BadParameter(f"{len(label)} labels for {len(reports)} reports", param_hint="--label")
    for report in reports:
        if not report.exists():
            fail(f"{report} does not exist", 2)
    try:
        table = compare_many(list(reports), out, label or None)
        pair = compare_reports(reports[0], reports[1], out) if len(reports) == 2 else None
    except (ValidationError, OSError, ValueError) as exc:
        fail(f"cannot read the reports: {exc}", 2)
    typer.echo(table["markdown"].read_text())
    written = [table["markdown"], table["plot"]] + ([pair["markdown"], pair["plot"]] if pair else [])
    typer.echo("written: " + ", ".join(str(p) for p in written))


async def _run(problems, data, config, urls, sandbox_url, sandbox_api_key, adapter, quiet):
    from crucible_shared.generator_client import GeneratorClient, GeneratorPool
    from crucible_shared.sandbox_client import SandboxClient
    from crucible_trainer.evaluation.runner import evaluate
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    generator = GeneratorPool.from_urls(urls) if len(urls) > 1 else GeneratorClient(urls[0])
    async with generator, SandboxClient(sandbox_url, api_key=sandbox_api_key) as sandbox:
        try:
            await generator.wait_ready(30)
            await sandbox.wait_ready(timeout=30)
        except Exception as exc:  # timeouts and connection errors alike
            fail(f"services not reachable (generator {', '.join(urls)}, sandbox {sandbox_url}): {exc}")
        loaded = None
        if adapter is not None:
            loaded = f"eval-{adapter.resolve().name}-{int(time.time())}"
            try:
                await generator.load_adapter(loaded, str(adapter.resolve()))
            except Exception as exc:
                fail(f"the generator could not load {adapter}: {exc}")
            config = config.model_copy(update={"model": loaded})
        columns = [
            TextColumn("{task.description:<10}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
        ]
        try:
            with Progress(*columns, disable=quiet, transient=False) as bar:
                what = f"{len(problems)} tasks of {data.describe()}"
                bar.console.print(f"evaluating {adapter or config.model or 'the base model'} on {what}")
                generated = bar.add_task("generated", total=None)
                executed = bar.add_task("executed", total=None)

                def progress(p) -> None:
                    bar.update(generated, completed=p.generated, total=p.total)
                    bar.update(executed, completed=p.executed, total=p.total)

                try:
                    return await evaluate(problems, generator, sandbox, config, progress, data=data)
                except ValueError as exc:
                    fail(str(exc))
        finally:
            if loaded is not None:
                await generator.unload_adapter(loaded, missing_ok=True)


def _print_summary(report, paths: dict[str, Path]) -> None:
    from crucible_shared.console import new_console
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
    console = new_console()
    console.print(table)
    console.print(f"report: {paths['markdown']} ({paths['json'].name}, {paths['plot'].name})")
