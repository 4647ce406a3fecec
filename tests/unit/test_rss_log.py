"""The opt-in per-test memory log (CRUCIBLE_TEST_RSS_LOG, tests/conftest.py): a test that keeps
memory shows as growth of its process, one that frees it shows only in its peak."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

GROWING = r"""
KEPT = []

def test_keeps_memory():
    KEPT.append(b"x" * (200 << 20))

def test_frees_memory():
    data = b"y" * (200 << 20)
    del data

def test_nothing():
    pass

def test_busy_child():
    import subprocess, sys
    busy = "import time\nend = time.process_time() + 0.5\nwhile time.process_time() < end: pass"
    subprocess.run([sys.executable, "-c", busy], check=True)
"""


def test_each_test_logs_its_growth_and_peak(tmp_path) -> None:
    (tmp_path / "test_growing.py").write_text(GROWING)
    log = tmp_path / "rss.jsonl"
    env = {**os.environ, "CRUCIBLE_TEST_RSS_LOG": str(log)}
    env.pop("PYTEST_XDIST_WORKER", None)
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "tests.conftest",
            "-p",
            "no:cacheprovider",
            str(tmp_path),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    rows = {r["test"].rsplit("::", 1)[1]: r for r in map(json.loads, log.read_text().splitlines())}
    assert set(rows) == {"test_keeps_memory", "test_frees_memory", "test_nothing", "test_busy_child"}
    kept, freed = rows["test_keeps_memory"], rows["test_frees_memory"]
    assert kept["rss_after_mb"] - kept["rss_before_mb"] > 150 and kept["worker"] == "main"
    assert freed["rss_after_mb"] - freed["rss_before_mb"] < 50
    assert kept["cpu_s"] >= 0 and kept["seconds"] >= 0 and rows["test_nothing"]["children_cpu_s"] < 0.1
    assert rows["test_busy_child"]["children_cpu_s"] >= 0.45  # the CPU of a process the test started
    if freed["peak_mb"] is not None:  # where the kernel lets a process reset its peak
        assert freed["peak_mb"] - freed["rss_before_mb"] > 150
    report = subprocess.run(
        [sys.executable, "-m", "tests.rss_report", str(log)], cwd=ROOT, capture_output=True, text=True
    )
    assert report.returncode == 0 and "test_keeps_memory" in report.stdout.split("by peak")[0]
    assert "test_growing.py" in report.stdout.split("by seconds")[1]
