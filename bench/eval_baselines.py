"""Evaluation baselines of the base model: the numbers training must beat.

Runs, each written as a full report (`report.json`, `report.md`, `pass_at_k.png`) under `--out`:

  mbpp-greedy       MBPP test split (tasks 11-510), one greedy answer each: greedy pass@1
  humaneval-greedy  HumanEval (164 problems), greedy pass@1
  mbpp-sampled      MBPP test split, n=10 samples at T=0.8 (top_p 0.95): pass@1 and pass@10
                    (`--sampled-limit N`: only the first N tasks, when time is short)

    python bench/eval_baselines.py                                   # spawns generator + sandbox here
    python bench/eval_baselines.py --generator http://gpu:8001 --sandbox http://gpu:8002
    python bench/eval_baselines.py --runs mbpp-greedy --max-tokens 256

Without URLs it starts a sandbox and a generator (the built-in SmolLM2-135M-Instruct on the auto
device: CUDA + bf16 when present, else CPU + fp32) on free ports. Prints a Markdown table for
docs/benchmarks.md (with the wall time split between generation and execution) and writes it,
with the raw figures, to `<out>/summary.md` and `<out>/summary.json`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import subprocess
import sys
import time
from contextlib import ExitStack
from pathlib import Path

from crucible_cli.spawn import start
from crucible_shared.generator_client import GeneratorClient
from crucible_shared.sandbox_client import SandboxClient
from crucible_trainer.evaluation import EvalConfig, EvalProgress, evaluate, write_report
from crucible_trainer.tasks import DataSpec, load_tasks

RUNS = {
    "mbpp-greedy": (DataSpec(dataset="mbpp", split="test"), {"n": 0, "greedy": True}),
    "humaneval-greedy": (DataSpec(dataset="humaneval"), {"n": 0, "greedy": True}),
    "mbpp-sampled": (DataSpec(dataset="mbpp", split="test"), {"n": 10, "temperature": 0.8, "greedy": False}),
}


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    gpu = ""
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=10,
        )
        gpu = out.stdout.strip().replace("\n", ", ")
    except (OSError, subprocess.SubprocessError):
        pass
    return f"{os.cpu_count()} x {cpu}" + (f", GPU: {gpu}" if gpu else ", no GPU")


def progress_printer(name: str):
    last = [0.0]

    def show(p: EvalProgress) -> None:
        now = time.monotonic()
        if now - last[0] >= 15 or p.executed == p.total:
            last[0] = now
            print(f"  {name}: generated {p.generated}/{p.total}, executed {p.executed}/{p.total}", flush=True)

    return show


async def run_one(name: str, generator: str, sandbox: str, args: argparse.Namespace) -> dict:
    spec, sampling = RUNS[name]
    if name == "mbpp-sampled" and args.sampled_limit:
        spec = spec.model_copy(update={"limit": args.sampled_limit})
    if args.limit:
        spec = spec.model_copy(update={"limit": min(args.limit, spec.limit or args.limit)})
    tasks = load_tasks(spec)
    config = EvalConfig(
        model=args.model,
        max_tokens=args.max_tokens,
        seed=args.seed,
        ks=[1, 10],
        concurrency=args.concurrency,
        **sampling,
    )
    print(f"{name}: {len(tasks)} tasks of {spec.describe()}", flush=True)
    async with GeneratorClient(generator, timeout=3600) as gen, SandboxClient(sandbox) as box:
        await gen.wait_ready()
        report = await evaluate(tasks, gen, box, config, progress_printer(name), data=spec)
    write_report(report, args.out / name)
    t = report.timing
    return {
        "run": name,
        "tasks": report.num_problems,
        "data": spec.describe(),
        "n": config.n,
        "temperature": config.temperature if config.n else 0.0,
        "max_tokens": config.max_tokens,
        **{k: v for k, v in report.summary().items() if v is not None},
        "mean_tokens": report.mean_generated_tokens,
        "truncated": report.truncated_fraction,
        "failures": report.failures,
        "wall_s": t.wall_s,
        "generation_s": t.generation_s,
        "execution_s": t.execution_s,
        "execution_hidden": t.execution_hidden,
        "execution_exposed_s": t.execution_exposed_s,
        "fingerprint": report.fingerprint,
        "report": str(args.out / name / "report.md"),
    }


def markdown(rows: list[dict], where: str, command: str) -> str:
    lines = [
        f"Machine: {where}. Command: `{command}`.",
        "",
        "| run | tasks | sampling | greedy pass@1 | pass@1 | pass@10 | mean tokens | wall | generation | execution | hidden |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]

    def pct(row: dict, key: str) -> str:
        return f"{row[key] * 100:.1f}%" if key in row else "—"

    for r in rows:
        sampling = f"n={r['n']}, T={r['temperature']}" if r["n"] else "greedy"
        lines.append(
            f"| {r['run']} | {r['tasks']} | {sampling}, max_tokens={r['max_tokens']} | {pct(r, 'greedy_pass@1')} | "
            f"{pct(r, 'pass@1')} | {pct(r, 'pass@10')} | {r['mean_tokens']:.0f} | {r['wall_s']:.0f} s | "
            f"{r['generation_s']:.0f} s | {r['execution_s']:.1f} s | {r['execution_hidden'] * 100:.0f}% |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--generator", help="Generator URL (default: start one here).")
    parser.add_argument("--sandbox", help="Sandbox URL (default: start one here).")
    parser.add_argument(
        "--model", default=None, help="Model or adapter name on the generator (default: its base)."
    )
    parser.add_argument(
        "--runs", default="mbpp-greedy,humaneval-greedy,mbpp-sampled", help="Comma-separated runs."
    )
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument(
        "--sampled-limit", type=int, default=None, help="mbpp-sampled: only the first N tasks."
    )
    parser.add_argument(
        "--limit", type=int, default=None, help="Every run: only the first N tasks (smoke test)."
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--concurrency", type=int, default=64, help="Generation requests in flight.")
    parser.add_argument("--batch-size", type=int, default=64, help="Spawned generator's MAX_BATCH_SIZE.")
    parser.add_argument("--out", type=Path, default=Path("runs/baselines"))
    args = parser.parse_args()
    names = [n.strip() for n in args.runs.split(",") if n.strip()]
    unknown = [n for n in names if n not in RUNS]
    if unknown:
        parser.error(f"unknown runs {unknown}; choose from {list(RUNS)}")

    command = "python bench/eval_baselines.py " + " ".join(sys.argv[1:])
    rows = []
    with ExitStack() as stack:
        generator, sandbox = args.generator, args.sandbox
        if sandbox is None:
            server = start("crucible_sandbox", {}, "CRUCIBLE_SANDBOX_PORT", timeout=600)
            stack.callback(server.stop)
            sandbox = server.url
        if generator is None:
            env = {
                "CRUCIBLE_GENERATOR_MAX_BATCH_SIZE": str(args.batch_size),
                "CRUCIBLE_GENERATOR_LOG_LEVEL": "warning",
            }
            server = start("crucible_generator", env, "CRUCIBLE_GENERATOR_PORT", timeout=600)
            stack.callback(server.stop)
            generator = server.url
        for name in names:
            rows.append(asyncio.run(run_one(name, generator, sandbox, args)))
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / "summary.json").write_text(
                json.dumps({"machine": machine(), "command": command, "runs": rows}, indent=1)
            )
    text = markdown(rows, machine(), command)
    (args.out / "summary.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
