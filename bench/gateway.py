"""Gateway benchmarks against a real gateway on a Redis of its own; docs/benchmarks.md ("Gateway
under open event streams", "Tenants") has each one's protocol and figures.

  streams  `GET /v1/jobs/{id}` and `GET /v1/jobs?status=queued` timed while N idle SSE streams are open
  tenants  tenant B's `GET /health` and `GET /v1/jobs` timed while tenant A's jobs sit queued

    python bench/gateway.py streams --streams 0,64,512 --calls 200 --json runs/bench/gateway_streams.json
    python bench/gateway.py tenants --jobs 1000 --calls 500 --json runs/bench/tenants_gateway.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.common import argument_parser, dump, gateway, latency  # noqa: E402

KEY_A, KEY_B = "bench-tenant-a-0123456789", "bench-tenant-b-0123456789"


async def measure(url: str, job_ids: list[str], streams: int, calls: int) -> dict:
    """`calls` timed calls while `streams` SSE streams of queued jobs (which emit nothing) stay open."""
    limits = httpx.Limits(max_connections=streams + 16, max_keepalive_connections=streams + 16)
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as http:
        opened = [
            asyncio.create_task(http.get(f"/v1/jobs/{job_ids[i % len(job_ids)]}/events", timeout=600))
            for i in range(streams)
        ]
        await asyncio.sleep(2 + streams / 100)  # let them all connect
        took: list[float] = []
        for i in range(calls):
            path = f"/v1/jobs/{job_ids[i % len(job_ids)]}" if i % 2 else "/v1/jobs?status=queued&limit=20"
            t = time.perf_counter()
            r = await http.get(path)
            took.append((time.perf_counter() - t) * 1000)
            assert r.status_code == 200, r.text
        alive = sum(1 for s in opened if not s.done())
        for s in opened:
            s.cancel()
        await asyncio.gather(*opened, return_exceptions=True)
    return {"streams": streams, "streams_open_while_measuring": alive, "calls": calls, **latency(took)}


def streams(args: argparse.Namespace) -> dict:
    with gateway(Path(tempfile.mkdtemp(prefix="gw-bench-"))) as server:
        spec = {"kind": "eval", "data": {"dataset": "mbpp", "ids": [11]}, "max_tokens": 16}
        jobs = [httpx.post(f"{server.url}/v1/jobs", json={**spec, "name": f"b{i}"}) for i in range(16)]
        ids = [r.json()["id"] for r in jobs]
        rows = [asyncio.run(measure(server.url, ids, int(n), args.calls)) for n in args.streams.split(",")]
    base = rows[0]["p99_ms"]
    for row in rows:
        row["p99_vs_no_streams"] = row["p99_ms"] / base if base else None
        print(
            f"{row['streams']:>5} streams: p50 {row['p50_ms']:7.2f} ms  p99 {row['p99_ms']:7.2f} ms  "
            f"max {row['max_ms']:7.2f} ms  (p99 x{row['p99_vs_no_streams']:.2f} of no streams; "
            f"{row['streams_open_while_measuring']} open)"
        )
    return {"rows": rows}


def tenants(args: argparse.Namespace) -> dict:
    table = [{"name": "a", "keys": [KEY_A], "quotas": {"active_jobs": args.jobs + 10}}]
    env = {"CRUCIBLE_GATEWAY_TENANTS": json.dumps({"tenants": [*table, {"name": "b", "keys": [KEY_B]}]})}
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
    verbs = parser.add_subparsers(dest="what", required=True)
    streams_, tenants_ = verbs.add_parser("streams"), verbs.add_parser("tenants")
    streams_.add_argument("--streams", default="0,64,512", help="comma-separated numbers of open streams")
    streams_.add_argument("--calls", type=int, default=200)
    tenants_.add_argument("--jobs", type=int, default=1000, help="tenant A's queued jobs")
    tenants_.add_argument("--calls", type=int, default=500, help="tenant B's calls of each route")
    for verb in (streams_, tenants_):
        verb.add_argument("--json", type=Path)
    args = parser.parse_args()
    result = streams(args) if args.what == "streams" else tenants(args)
    if args.json:
        dump(
            args.json,
            {"command": " ".join(sys.argv), "cpus": os.cpu_count(), "load": os.getloadavg(), **result},
        )


if __name__ == "__main__":
    main()
