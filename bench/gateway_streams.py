"""Gateway responsiveness while event streams are open.

Starts a real Redis (embedded) and the gateway, submits a few jobs, opens N idle SSE streams
(jobs that are queued emit nothing, so every stream stays open and polling), and times other
calls made meanwhile: `GET /v1/jobs/{id}` and `GET /v1/jobs?status=queued`. Reports p50/p99
per N and the ratio of p99 with streams open to p99 with none (side by side, one run).

    python bench/gateway_streams.py --streams 0,64,512 --calls 200 --json runs/bench/gateway_streams.json
"""

from __future__ import annotations

import asyncio
import os
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.common import argument_parser, dump, gateway, latency  # noqa: E402


async def measure(url: str, job_ids: list[str], streams: int, calls: int) -> dict:
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


def main() -> None:
    parser = argument_parser(__doc__)
    parser.add_argument("--streams", default="0,64,512", help="comma-separated numbers of open streams")
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()

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
    if args.json:
        dump(args.json, {"command": " ".join(sys.argv), "cpus": os.cpu_count(), "rows": rows})


if __name__ == "__main__":
    main()
