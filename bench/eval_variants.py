"""Evaluations of the base model (docs/benchmarks.md, "Evaluation baselines"): named evaluations
(`--runs`) through `crucible eval` (256 new tokens, seed 0) against running servers (`--server
NAME=URL`) or a Crucible generator started here (`MAX_BATCH_SIZE` `--batch-size`), each report kept
and summed up in one table (`<out>/summary.{md,json}`, `--json`). A Crucible generator's own
counters are read before and after each evaluation: decode steps, rows per step, admissions into
running batches.

  mbpp-greedy       MBPP test split (tasks 11-510), one greedy answer each: greedy pass@1
  humaneval-greedy  HumanEval (164 problems), greedy pass@1
  mbpp-sampled      MBPP test split, n=10 samples at T=0.8 (top_p 0.95): pass@1 and pass@10
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import argument_parser, counters, dump, md_table, sandbox, spawn_generator

RUNS = {  # name -> `crucible eval` arguments
    "mbpp-greedy": "--dataset mbpp --split test --n 0",
    "humaneval-greedy": "--dataset humaneval --n 0",
    "mbpp-sampled": "--dataset mbpp --split test --n 10 --temperature 0.8 --no-greedy",
}
COUNTERS = {
    "steps": "crucible_generator_batch_size_count",
    "rows_sum": "crucible_generator_batch_size_sum",
    "generated": "crucible_generator_generation_tokens_total",
    "prompt": "crucible_generator_prompt_tokens_total",
    "joined": "crucible_generator_joined_sequences_total",
    "captures": "crucible_generator_graph_captures_total",
}
TABLE = ["server", "run", "tasks", "sampling", "greedy_pass@1", "pass@1", "pass@10", "mean_tokens", "wall_s"]
TABLE += ["generation_s", "execution_s", "execution_hidden", "decode_steps", "rows_per_step", "ms_per_step"]
TABLE += ["joined"]


def evaluate(server: str, url: str, run: str, args: argparse.Namespace, sandbox: str, out: Path) -> dict:
    """One named evaluation through `crucible eval` against `url`: its report's figures, the
    generator's counters over it."""
    from crucible_trainer.evaluation import load_report

    limit = args.sampled_limit if run == "mbpp-sampled" and args.sampled_limit else args.limit
    cmd = [sys.executable, "-m", "crucible_cli", "eval", *f"{RUNS[run]} --max-tokens 256 --seed 0".split()]
    cmd += ["--concurrency", str(args.concurrency), "--generator", url, "--sandbox", sandbox]
    cmd += ["--out", str(out), "--quiet", *(["--limit", str(limit)] if limit else [])]
    before, started = counters(url, COUNTERS), time.perf_counter()
    subprocess.run(cmd, check=True)
    wall, after = time.perf_counter() - started, counters(url, COUNTERS)
    report = load_report(out / "report.json")
    t = report.timing
    row = {"server": server, "run": run, "tasks": report.num_problems, "wall_s": round(wall, 2)}
    row["data"] = report.data.describe() if report.data else None
    row["sampling"] = "greedy" if "--no-greedy" not in RUNS[run] else "n=10, T=0.8, top_p 0.95"
    row |= {k: v for k, v in report.summary().items() if v is not None}
    row |= {"mean_tokens": report.mean_generated_tokens, "truncated": report.truncated_fraction}
    row |= {"failures": report.failures, "generation_s": t.generation_s, "execution_s": t.execution_s}
    row |= {"execution_hidden": t.execution_hidden, "execution_exposed_s": t.execution_exposed_s}
    row |= {"fingerprint": report.fingerprint, "report": str(out / "report.md")}
    if before and after:
        delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in COUNTERS}
        steps = delta["steps"] or 1.0
        row |= {"decode_steps": int(delta["steps"]), "rows_per_step": round(delta["rows_sum"] / steps, 1)}
        row |= {"ms_per_step": round(1000 * t.generation_s / steps, 2)}
        row |= {f"{k}_tokens": int(delta[k]) for k in ("generated", "prompt")}
        row |= {k: int(delta[k]) for k in ("joined", "captures")}
    return row


def cell(row: dict[str, Any], key: str) -> str:
    value = row.get(key)
    if isinstance(value, float):
        return f"{100 * value:.1f}%" if "pass@" in key or key == "execution_hidden" else f"{value:.2f}"
    return "—" if value is None else str(value)


def main() -> None:
    parser = argument_parser(__doc__)
    parser.add_argument("--runs", default="mbpp-greedy", help="comma-separated: " + ", ".join(RUNS))
    parser.add_argument("--limit", type=int, help="every run: only the first N tasks")
    parser.add_argument("--sampled-limit", type=int, help="mbpp-sampled: only the first N tasks")
    parser.add_argument("--server", action="append", default=[], help="NAME=URL of a running server")
    parser.add_argument("--concurrency", type=int, default=256, help="generation requests in flight")
    parser.add_argument("--batch-size", type=int, default=64, help="MAX_BATCH_SIZE of the default generator")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--out", type=Path, help="keep each run's report here (SERVER/RUN/report.json, ...)")
    args = parser.parse_args()
    runs = [n for n in args.runs.split(",") if n]
    if unknown := set(runs) - set(RUNS):
        parser.error(f"unknown runs {sorted(unknown)}; choose from {', '.join(RUNS)}")
    work = args.out or Path(tempfile.mkdtemp(prefix="crucible-evals-"))
    work.mkdir(parents=True, exist_ok=True)
    servers = dict(spec.split("=", 1) for spec in args.server)
    settings = None if servers else f"MAX_BATCH_SIZE={args.batch_size}"
    started = [sandbox(work)]
    rows: list[dict[str, Any]] = []
    try:
        if not servers:
            model, log = "smollm2-135m-instruct", "generator-crucible.log"
            started.append(spawn_generator(work, model, args.batch_size, log=log, timeout=600))
            servers = {"crucible": started[-1].url}
        for name, url in servers.items():
            for run in runs:
                folder = work / (name if len(runs) == 1 else run if len(servers) == 1 else f"{name}/{run}")
                rows.append(evaluate(name, url.rstrip("/"), run, args, started[0].url, folder))
                rows[-1]["settings"] = settings
                print(json.dumps(rows[-1]), flush=True)
    finally:
        for server in reversed(started):
            server.stop()
    where = f"{platform.node()}: {platform.processor() or platform.machine()}"
    table = f"Machine: {where}. Command: `python bench/eval_variants.py {' '.join(sys.argv[1:])}`.\n\n"
    table += md_table(TABLE, [[cell(row, k) for k in TABLE] for row in rows])
    (work / "summary.md").write_text(table + "\n")
    dump(work / "summary.json", {"command": sys.argv, "runs": rows})
    print(table)
    if args.json:
        dump(args.json, {"limit": args.limit, "runs": rows})


if __name__ == "__main__":
    main()
