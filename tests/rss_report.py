"""`python -m tests.rss_report PATH [--top N]`: what a run logged with CRUCIBLE_TEST_RSS_LOG=PATH
(tests/conftest.py), summed up: the tests and test files after which a worker stayed most grown,
the highest peaks, each worker's memory at its first and last test, and the test files that take
longest (seconds and CPU seconds, a file being what `--dist loadfile` gives one worker).

>>> rows = [
...     {"test": "t/a.py::x", "worker": "gw0", "rss_before_mb": 100, "rss_after_mb": 900, "peak_mb": 1200},
...     {"test": "t/a.py::y", "worker": "gw0", "rss_before_mb": 900, "rss_after_mb": 950, "peak_mb": 960},
...     {"test": "t/b.py::z", "worker": "gw1", "rss_before_mb": 100, "rss_after_mb": 90, "peak_mb": None},
... ]
>>> by_file(rows)
[('t/a.py', 850.0), ('t/b.py', -10.0)]
>>> workers(rows)
{'gw0': (100, 950), 'gw1': (100, 90)}
>>> slowest_files([{"test": "t/a.py::x", "seconds": 2, "cpu_s": 1.5}, {"test": "t/a.py::y", "seconds": 1}])
[('t/a.py', 3.0, 1.5)]
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path


def load(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def growth(row: dict) -> float:
    return float(row["rss_after_mb"]) - float(row["rss_before_mb"])


def by_file(rows: list[dict]) -> list[tuple[str, float]]:
    """Each test file's total growth of its worker, largest first."""
    total: dict[str, float] = defaultdict(float)
    for row in rows:
        total[row["test"].split("::", 1)[0]] += growth(row)
    return sorted(total.items(), key=lambda kv: -kv[1])


def slowest_files(rows: list[dict]) -> list[tuple[str, float, float]]:
    """Each test file's seconds and CPU seconds (the test process and those it started), longest
    first."""
    total: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
    for row in rows:
        t = total[row["test"].split("::", 1)[0]]
        t[0] += float(row.get("seconds") or 0)
        t[1] += float(row.get("cpu_s") or 0) + float(row.get("children_cpu_s") or 0)
    return sorted(((name, s, c) for name, (s, c) in total.items()), key=lambda x: -x[1])


def workers(rows: list[dict]) -> dict[str, tuple[float, float]]:
    """Each worker's resident memory before its first logged test and after its last."""
    out: dict[str, tuple[float, float]] = {}
    for row in rows:
        first = out.get(row["worker"], (row["rss_before_mb"], 0.0))[0]
        out[row["worker"]] = (first, row["rss_after_mb"])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("path", type=Path)
    parser.add_argument("--top", type=int, default=15)
    args = parser.parse_args()
    rows = load(args.path)
    print(f"{len(rows)} tests")
    print("\nworkers (MiB before the first test -> after the last):")
    for worker, (first, last) in sorted(workers(rows).items()):
        print(f"  {worker}: {first:.0f} -> {last:.0f}")
    print(f"\ntest files by what their worker kept (MiB), top {args.top}:")
    for name, mb in by_file(rows)[: args.top]:
        print(f"  {mb:+8.0f}  {name}")
    print(f"\ntests by what their worker kept (MiB), top {args.top}:")
    for row in sorted(rows, key=growth, reverse=True)[: args.top]:
        print(f"  {growth(row):+8.0f}  {row['test']}  ({row['worker']})")
    print(f"\ntest files by seconds (and CPU seconds), top {args.top}:")
    for name, seconds, cpu in slowest_files(rows)[: args.top]:
        print(f"  {seconds:8.1f}  {cpu:8.1f}  {name}")
    peaks = [r for r in rows if r.get("peak_mb") is not None]
    print(f"\ntests by peak resident memory (MiB), top {args.top}:")
    for row in sorted(peaks, key=lambda r: -r["peak_mb"])[: args.top]:
        print(f"  {row['peak_mb']:8.0f}  {row['test']}  ({row['worker']})")


if __name__ == "__main__":
    main()
