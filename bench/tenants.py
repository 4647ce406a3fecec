"""Tenants side by side: does one tenant's flood slow another down?

`sandbox`: a real sandbox server with two tenants. Tenant B runs a trivial program N times, one at
a time, alone; then again while tenant A floods the server from many concurrent clients with runs
that hold a worker (`--flood-program sleep`: `time.sleep(0.5)`, as the finding that prompted
tenants; `cpu`: a 0.2 s busy loop, which also takes CPU from B's run on a small machine). Reports
B's p50/p99 latency alone and under the flood, and their ratio.

`gateway`: a real Redis and gateway; tenant A submits `--jobs` jobs that stay queued (no worker),
the reaper runs every second, and B times `GET /health` and `GET /v1/jobs` meanwhile.

    python bench/tenants.py sandbox --workers 4 --runs 100 --rounds 3 --json runs/bench/tenants_sandbox.json
    python bench/tenants.py gateway --jobs 1000 --calls 500 --json runs/bench/tenants_gateway.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench.common import argument_parser, dump, gateway, latency, sandbox  # noqa: E402

KEY_A, KEY_B = "bench-tenant-a-0123456789", "bench-tenant-b-0123456789"
F = "def f(x): return x + 1"
TRIVIAL = {"code": F, "tests": {"kind": "asserts", "asserts": ["assert f(1) == 2"]}, "use_cache": False}
FLOODS = {  # runs that hold a worker: asleep, or busy (taking CPU from B's runs too)
    "sleep": f"import time\ntime.sleep(0.5)\n{F}",
    "cpu": f"import time\nend = time.perf_counter() + 0.2\nwhile time.perf_counter() < end: pass\n{F}",
}


def b_runs(url: str, runs: int) -> list[float]:
    took = []
    with httpx.Client(base_url=url, timeout=120, headers={"Authorization": f"Bearer {KEY_B}"}) as http:
        for _ in range(runs):
            t = time.perf_counter()
            r = http.post("/v1/runs", json=TRIVIAL)
            took.append((time.perf_counter() - t) * 1000)
            assert r.status_code == 200 and r.json()["status"] == "passed", r.text
    return took


def flood(
    url: str, program: str, clients: int, stop: threading.Event, done: list[int]
) -> list[threading.Thread]:
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


def bench_sandbox(args: argparse.Namespace) -> dict:
    work = Path(tempfile.mkdtemp(prefix="tenants-bench-"))
    quotas = {"concurrent_runs": args.a_concurrency} if args.a_concurrency else {}
    tenants = {"tenants": [{"name": "a", "keys": [KEY_A], "quotas": quotas}, {"name": "b", "keys": [KEY_B]}]}
    env = {"CRUCIBLE_SANDBOX_WORKERS": str(args.workers), "CRUCIBLE_SANDBOX_TENANTS": json.dumps(tenants)}
    env["CRUCIBLE_SANDBOX_LOG_LEVEL"] = "warning"
    server = sandbox(work, **env)
    samples: dict[str, list[float]] = {"alone": []}
    done_by: dict[str, int] = {}
    try:
        b_runs(server.url, 10)  # warm up
        # Alone and under each flood in turn, `rounds` times: a shared machine's load drifts, and
        # interleaving spreads the drift over every row alike.
        for _ in range(args.rounds):
            samples["alone"] += b_runs(server.url, args.runs)
            for name in args.flood_program.split(","):
                stop, done = threading.Event(), [0]
                threads = flood(server.url, FLOODS[name], args.clients, stop, done)
                time.sleep(2.0)  # the flood has filled the workers and queued behind them
                samples.setdefault(f"flood-{name}", []).extend(b_runs(server.url, args.runs))
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
        "a_clients": args.clients,
        "a_concurrent_runs": args.a_concurrency,
        "rows": rows,
    }


def bench_gateway(args: argparse.Namespace) -> dict:
    tenants = [{"name": "a", "keys": [KEY_A], "quotas": {"active_jobs": args.jobs + 10}}]
    env = {"CRUCIBLE_GATEWAY_TENANTS": json.dumps({"tenants": [*tenants, {"name": "b", "keys": [KEY_B]}]})}
    env["CRUCIBLE_GATEWAY_REAP_INTERVAL_S"] = "1"
    spec = {"kind": "eval", "data": {"dataset": "mbpp", "ids": list(range(11, 511))}, "max_tokens": 16}
    out: dict = {"jobs": args.jobs, "spec_bytes": len(json.dumps(spec))}
    a, b = {"Authorization": f"Bearer {KEY_A}"}, {"Authorization": f"Bearer {KEY_B}"}
    work = Path(tempfile.mkdtemp(prefix="tenants-bench-"))
    with gateway(work, **env) as server, httpx.Client(base_url=server.url, timeout=120) as http:
        t = time.perf_counter()
        for i in range(args.jobs):
            r = http.post("/v1/jobs", json={**spec, "name": f"a{i}"}, headers=a)
            assert r.status_code == 202, r.text
        out["submit_s"] = time.perf_counter() - t
        time.sleep(3)  # several reaper passes over the queued jobs
        for path in ("/health", "/v1/jobs"):
            took = []
            for _ in range(args.calls):
                t = time.perf_counter()
                r = http.get(path, headers=b)
                took.append((time.perf_counter() - t) * 1000)
                assert r.status_code == 200, r.text
            out[path] = latency(took)
            print(f"B GET {path:<9} with {args.jobs} of A's jobs queued: p50 {out[path]['p50_ms']:.1f} ms  "
                  f"p99 {out[path]['p99_ms']:.1f} ms  max {out[path]['max_ms']:.1f} ms")  # fmt: skip
    return out


def main() -> None:
    parser = argument_parser(__doc__)
    sub = parser.add_subparsers(dest="what", required=True)
    sb = sub.add_parser("sandbox")
    sb.add_argument("--workers", type=int, default=4)
    sb.add_argument("--runs", type=int, default=100, help="B's runs per round, alone and under each flood")
    sb.add_argument("--rounds", type=int, default=3)
    sb.add_argument("--clients", type=int, default=16, help="A's concurrent clients")
    sb.add_argument("--a-concurrency", type=int, default=0, help="A's concurrent_runs quota (0: the default)")
    sb.add_argument("--flood-program", default="sleep,cpu")
    gw = sub.add_parser("gateway")
    gw.add_argument("--jobs", type=int, default=1000)
    gw.add_argument("--calls", type=int, default=500)
    for p in (sb, gw):
        p.add_argument("--json", type=Path)
    args = parser.parse_args()
    result = bench_sandbox(args) if args.what == "sandbox" else bench_gateway(args)
    if args.json:
        dump(
            args.json,
            {"command": " ".join(sys.argv), "cpus": os.cpu_count(), "load": os.getloadavg(), **result},
        )


if __name__ == "__main__":
    main()
