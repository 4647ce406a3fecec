"""Gateway benchmarks against a real gateway on a Redis of its own; docs/benchmarks.md ("Gateway
under open event streams", "Tenants") has each one's protocol and figures.

  streams  `GET /v1/jobs/{id}` and `GET /v1/jobs?status=queued` timed while N idle SSE streams are open
  tenants  tenant B's `GET /health` and `GET /v1/jobs` timed while tenant A's jobs sit queued

    python bench/gateway.py streams --streams 0,64,512 --calls 200 --json runs/bench/gateway_streams.json
    python bench/gateway.py tenants --jobs 1000 --calls 500 --json runs/bench/tenants_gateway.json
"""

from __future__ import annotations

import asyncio
import functools
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench import common


async def measure(url: str, job_ids: list[str], streams: int, calls: int) -> dict:
    """`calls` timed calls while `streams` SSE streams of queued jobs (which emit nothing) stay open."""
    limits = httpx.Limits(max_connections=streams + 16, max_keepalive_connections=streams + 16)
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as http:
        events = [f"/v1/jobs/{job_ids[i % len(job_ids)]}/events" for i in range(streams)]
        opened = [asyncio.create_task(http.get(path, timeout=600)) for path in events]
        await asyncio.sleep(2 + streams / 100)  # let them all connect
        took: list[float] = []
        for i in range(calls):
            path = f"/v1/jobs/{job_ids[i % len(job_ids)]}" if i % 2 else "/v1/jobs?status=queued&limit=20"
            t = time.perf_counter()
            (await http.get(path)).raise_for_status()
            took.append((time.perf_counter() - t) * 1000)
        alive = sum(1 for s in opened if not s.done())
        for s in opened:
            s.cancel()
        await asyncio.gather(*opened, return_exceptions=True)
    return {"streams": streams, "streams_open_while_measuring": alive, "calls": calls, **common.latency(took)}


def streams(args: Any) -> dict:
    with common.gateway(Path(tempfile.mkdtemp(prefix="gw-bench-"))) as server:
        spec = {"kind": "eval", "data": {"dataset": "mbpp", "ids": [11]}, "max_tokens": 16}
        jobs = [httpx.post(f"{server.url}/v1/jobs", json={**spec, "name": f"b{i}"}) for i in range(16)]
        ids = [r.json()["id"] for r in jobs]
        rows = [asyncio.run(measure(server.url, ids, int(n), args.calls)) for n in args.streams.split(",")]
    for row in rows:
        row["p99_vs_no_streams"] = row["p99_ms"] / rows[0]["p99_ms"] if rows[0]["p99_ms"] else None
    return {"rows": rows}


def tenants(args: Any) -> dict:
    env = {"CRUCIBLE_GATEWAY_TENANTS": common.tenants({"active_jobs": args.jobs + 10})}
    env["CRUCIBLE_GATEWAY_REAP_INTERVAL_S"] = "1"
    spec = {"kind": "eval", "data": {"dataset": "mbpp", "ids": list(range(11, 511))}, "max_tokens": 16}
    out: dict = {"jobs": args.jobs, "spec_bytes": len(json.dumps(spec))}
    work = Path(tempfile.mkdtemp(prefix="tenants-bench-"))
    with common.gateway(work, **env) as server, httpx.Client(base_url=server.url, timeout=120) as http:
        t = time.perf_counter()
        for i in range(args.jobs):
            r = http.post("/v1/jobs", json={**spec, "name": f"a{i}"}, headers=common.bearer("a"))
            assert r.status_code == 202, r.text
        out["submit_s"] = time.perf_counter() - t
        time.sleep(3)  # several reaper passes over the queued jobs
        for path in ("/health", "/v1/jobs"):
            call = functools.partial(http.get, path, headers=common.bearer("b"))
            out[path] = common.latency(common.timed_ms(call, args.calls, lambda r: r.status_code == 200))
    return out


if __name__ == "__main__":
    streams_options = {"streams": ("0,64,512", "comma-separated numbers of open streams"), "calls": 200}
    tenants_options = {"jobs": (1000, "tenant A's queued jobs"), "calls": (500, "B's calls of each route")}
    common.commands(__doc__, {"streams": (streams, streams_options), "tenants": (tenants, tenants_options)})
