"""`python -m crucible_sandbox.demo`: start the sandbox and run a small MBPP demo through it.

For a few MBPP test-split tasks it runs the reference solution and a deliberately broken
variant of it (every integer result off by one, every sequence reversed), and prints what the
sandbox says: status, tests passed and the first thing to fix.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rich.console import Console

BUMP = (
    "def __bump(v):\n"
    "    if isinstance(v, bool) or v is None:\n"
    "        return v\n"
    "    if isinstance(v, (int, float)):\n"
    "        return v + 1\n"
    "    return v[::-1] if isinstance(v, (list, str, tuple)) else v\n"
)


class _Break(ast.NodeTransformer):
    def visit_Return(self, node: ast.Return) -> ast.Return:
        if node.value is not None:
            node.value = ast.Call(ast.Name("__bump", ast.Load()), [node.value], [])
        return node


def broken(code: str) -> str:
    """The reference with every returned value perturbed."""
    tree = _Break().visit(ast.parse(code))
    return BUMP + ast.unparse(ast.fix_missing_locations(tree))


def find_mbpp() -> Path:
    here = Path(__file__).resolve()
    for parent in here.parents:
        candidate = parent / "data" / "mbpp.jsonl"
        if candidate.exists():
            return candidate
    raise SystemExit("data/mbpp.jsonl not found: run from a Crucible checkout")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tasks", type=int, default=8, help="how many MBPP test-split tasks (default 8)")
    parser.add_argument("--url", help="use a running sandbox instead of starting one")
    args = parser.parse_args()
    if args.tasks < 1:
        parser.error("--tasks must be at least 1")

    import httpx
    from crucible_shared.console import new_console

    console = new_console()  # piped (make, CI logs), lines print whole instead of folding at 80
    rows = [json.loads(line) for line in find_mbpp().open()]
    tasks = [r for r in rows if 11 <= r["task_id"] <= 510][: args.tasks]
    proc = None
    url = args.url
    if url is None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        proc = subprocess.Popen(
            [sys.executable, "-m", "crucible_sandbox", "--port", str(port)], env=os.environ.copy()
        )
        url = f"http://127.0.0.1:{port}"
        with console.status("starting the sandbox"):
            for _ in range(300):
                try:
                    if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                        break
                except httpx.HTTPError:
                    time.sleep(0.1)
            else:
                proc.kill()
                raise SystemExit("the sandbox did not start; see its log above")
    try:
        health = httpx.get(f"{url}/health").json()
        runs, labels = [], []
        for r in tasks:
            tests = {"kind": "asserts", "asserts": r["test_list"], "setup": r["test_setup_code"]}
            for label, code in (("reference", r["code"]), ("broken", broken(r["code"]))):
                runs.append({"code": code, "tests": tests, "use_cache": False})
                labels.append((r["task_id"], label))
        started = time.perf_counter()
        results = httpx.post(f"{url}/v1/runs/batch", json={"runs": runs}, timeout=120).json()["results"]
        elapsed = time.perf_counter() - started
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait()

    report(console, health, labels, results, elapsed)


def report(
    console: Console,
    health: dict[str, Any],
    labels: list[tuple[int, str]],
    results: list[dict[str, Any]],
    elapsed: float,
) -> None:
    """The demo's table: one row per run (task, which program, status, tests, first thing to fix)."""
    from rich.table import Table

    table = Table(title=f"MBPP through the Crucible sandbox ({health['isolation']['mode']} isolation)")
    for col in ("task", "program", "status", "tests", "first thing to fix"):
        table.add_column(col, overflow="fold")
    colours = {"passed": "green", "failed": "yellow"}
    for (task_id, label), res in zip(labels, results, strict=True):
        colour = colours.get(res["status"], "red")
        table.add_row(
            str(task_id),
            label,
            f"[{colour}]{res['status']}[/]",
            f"{res['passed']}/{res['total']}",
            res["message"][:110],
        )
    console.print(table)
    console.print(f"{len(results)} runs in {elapsed * 1000:.0f} ms through POST /v1/runs/batch")


if __name__ == "__main__":
    main()
