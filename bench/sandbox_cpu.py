"""CPU the sandbox spends per program: the CPU seconds of its whole process tree (server, workers,
zygotes, runs) for all 974 MBPP reference programs and, separately, the 164 HumanEval canonical
solutions against their `check` functions, through the batch API with isolation on.

Unlike programs per second, CPU seconds hardly move when other work shares the machine, so two
versions of the sandbox can be compared on a busy host. Each figure is one server's lifetime
(start, a 20-run warm-up, the batch, stop) less a lifetime without the batch, read from this
process's `RUSAGE_CHILDREN` (every process of the tree is reaped by its parent, so its CPU is
counted once the server has exited).

Usage: python bench/sandbox_cpu.py [--rounds N] [--workers N] [--json out.json]
The sandbox is whichever `crucible_sandbox` the interpreter imports: to compare another checkout's,
put it first on PYTHONPATH (docs/benchmarks.md shows how).
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
from pathlib import Path

import httpx
from sandbox_throughput import humaneval_runs, load_mbpp, runs_for, start_server


def _cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def lifetime(runs: list[dict], workers: int | None) -> tuple[float, int]:
    """CPU seconds of one server's tree running `runs` after a warm-up, and how many passed."""
    before = _cpu()
    server = start_server(workers)
    try:
        with httpx.Client(timeout=600) as client:
            warm = runs_for(load_mbpp()[:20])
            client.post(f"{server.url}/v1/runs/batch", json={"runs": warm})
            passed = 0
            if runs:
                results = client.post(f"{server.url}/v1/runs/batch", json={"runs": runs}).json()["results"]
                passed = sum(r["status"] == "passed" for r in results)
    finally:
        server.stop(grace_s=60)
    return _cpu() - before, passed


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=2, help="lifetimes of each kind (default 2)")
    parser.add_argument("--workers", type=int, default=None)
    parser.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = parser.parse_args()

    suites = {"mbpp": runs_for(load_mbpp()), "humaneval_checks": humaneval_runs()}
    idle, spent, passed = [], {name: [] for name in suites}, {}
    for _ in range(args.rounds):
        idle.append(lifetime([], args.workers)[0])
        for name, runs in suites.items():
            cpu, passed[name] = lifetime(runs, args.workers)
            spent[name].append(cpu)
    base = statistics.median(idle)
    figures: dict[str, float | int] = {"startup_cpu_s": round(base, 3)}
    print(f"sandbox start, warm-up and stop: {base:.2f} CPU s (median of {args.rounds})")
    for name, runs in suites.items():
        per = statistics.median(spent[name]) - base
        figures[f"{name}_cpu_s"] = round(per, 3)
        figures[f"{name}_cpu_ms_per_program"] = round(per / len(runs) * 1000, 3)
        figures[f"{name}_passed"] = passed[name]
        print(
            f"{name:17s}: {per:6.2f} CPU s for {len(runs)} programs, "
            f"{per / len(runs) * 1000:.2f} ms each ({passed[name]} passed)"
        )
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
