"""`crucible compare`: several train jobs that differ only in their method, at a matched sample
budget, run through the gateway, then one comparison report.

    crucible compare -c examples/grpo_mbpp.yaml -c examples/srrl_mbpp.yaml --out runs/compare/grpo-vs-srrl

The specs must be the same job apart from `method` (and `name`), and draw the same number of
samples per step (GRPO's group_size, SRRL's budget, REINFORCE/PPO's samples, times
problems_per_step), or the comparison would measure the budget, not the method.
"""

from __future__ import annotations

from pathlib import Path

import typer
from crucible_shared import jsonl

from crucible_cli.app import app
from crucible_cli.options import API_KEY, GATEWAY, fail, gateway_session
from crucible_cli.specs import SET, load_spec


def check_comparable(specs: list[dict], labels: list[str], budgets: list[int]) -> None:
    """Exit 2 unless the specs differ only in their method and share one sample budget."""
    rest = [{k: v for k, v in s.items() if k not in ("method", "name")} for s in specs]
    for label, other in zip(labels[1:], rest[1:], strict=True):
        if other != rest[0]:
            diff = sorted(k for k in set(other) | set(rest[0]) if other.get(k) != rest[0].get(k))
            fail(f"{label} differs from {labels[0]} in {', '.join(diff)}: only the method may differ", 2)
    if len(set(budgets)) > 1:
        shown = ", ".join(f"{label} {b}" for label, b in zip(labels, budgets, strict=True))
        fail(f"the sample budgets per step differ ({shown}): match them, or pass --unmatched-budget", 2)


@app.command("compare")
def compare(
    config: list[Path] = typer.Option(..., "--config", "-c", help="A train job spec (repeat: two or more)."),
    overrides: list[str] = SET,
    out: Path = typer.Option(Path("runs/compare"), "--out", "-o", help="Where the comparison goes."),
    unmatched_budget: bool = typer.Option(
        False, "--unmatched-budget", help="Allow different samples per step."
    ),
    gateway: str = GATEWAY,
    api_key: str = API_KEY,
) -> None:
    """Run train jobs that differ only in the method, then write one comparison report."""
    from crucible_cli.heavy import require

    require("crucible_trainer", command="compare")
    from crucible_shared.console import new_console
    from crucible_shared.lifecycle import JobStatus
    from crucible_trainer.online.curves import compare_runs, samples_per_step

    from crucible_cli.render import follow

    if len(config) < 2:
        raise typer.BadParameter("give at least two specs", param_hint="--config")
    parsed = [load_spec(path, "train", overrides) for path in config]  # --set applies to every spec
    specs = [p.model_dump(mode="json") for p in parsed]
    labels = [p.name or path.stem for p, path in zip(parsed, config, strict=True)]
    budgets = [samples_per_step(s) for s in specs]
    if not unmatched_budget:
        check_comparable(specs, labels, budgets)
    console = new_console()
    runs = []
    with gateway_session(gateway, api_key) as gw:
        ids = [gw.submit(spec).id for spec in specs]
        for label, job_id in zip(labels, ids, strict=True):
            console.print(f"{label}: {job_id}", markup=False, highlight=False)
        for label, job_id, spec in zip(labels, ids, specs, strict=True):
            final = follow(gw, job_id, console)
            if final.status != JobStatus.finished:
                fail(f"{label} ({job_id}) {final.status.value}: {final.error}")
            folder = out / job_id
            folder.mkdir(parents=True, exist_ok=True)
            text = gw.download(job_id, "metrics.jsonl").decode()
            (folder / "metrics.jsonl").write_text(text)
            metrics = jsonl.rows(text)
            runs.append(
                {
                    "label": label,
                    "job_id": job_id,
                    "spec": spec,
                    "summary": final.summary.model_dump(mode="json") if final.summary else None,
                    "metrics": metrics,
                }
            )
    paths = compare_runs(runs, out)
    console.print(paths["markdown"].read_text(), markup=False, highlight=False)
    console.print(f"written: {paths['markdown']}, {paths['plot']}", markup=False, highlight=False)
