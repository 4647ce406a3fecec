"""Programs per second through `POST /run_code`, per language: a small program compiled and run
(every program new, so every compile step misses the cache) and the same program again with
another stdin (its artifact from the compile cache; interpreted languages just run).

The program reads two numbers and prints their sum. Languages are measured in rounds, each round
a slice of every language in turn, so that load from other work on the host falls on all of them
alike; the table also gives each language's rate as a ratio to Python's.

Usage: python bench/sandbox_languages.py [--workers N] [--fresh 6] [--cached 30] [--rounds 2] [--json out.json]
Starts its own sandbox server (isolation on) on a free port; needs the toolchains (`make toolchains`).
"""

from __future__ import annotations

import argparse
import json
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import httpx
from crucible_sandbox.judging.languages import SUM_OF_TWO as SUM

COMMENT = {"python": "#", "bash": "#", "cpp": "//", "java": "//", "nodejs": "//", "go": "//", "rust": "//"}


def start_server(workers: int | None):
    from crucible_cli.spawn import start

    env = {"CRUCIBLE_SANDBOX_WORKERS": str(workers)} if workers else {}
    return start("crucible_sandbox", env, "CRUCIBLE_SANDBOX_PORT")


def run_many(url: str, bodies: list[dict], concurrency: int) -> float:
    """Seconds to run every body through /run_code, `concurrency` at a time; each must succeed."""

    def one(client: httpx.Client, body: dict) -> None:
        out = client.post(f"{url}/run_code", json=body).json()
        expected = sum(map(int, body["stdin"].split()))
        assert out.get("status") == "Success" and out["run_result"]["stdout"].strip() == str(expected), out

    started = time.perf_counter()
    with httpx.Client(timeout=300) as client, ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(lambda b: one(client, b), bodies))
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=None)
    parser.add_argument("--fresh", type=int, default=6, help="new programs per language per round")
    parser.add_argument("--cached", type=int, default=30, help="runs of the cached program per round")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    server = start_server(args.workers)
    try:
        health = httpx.get(f"{server.url}/health").json()
        languages = [lang for lang in SUM if lang in health["languages"]]
        concurrency = health["workers"]
        totals = {lang: {"fresh": [0, 0.0], "cached": [0, 0.0]} for lang in languages}
        for lang in languages:  # warm: the first run of each runtime loads it from disk
            run_many(server.url, [{"language": lang, "code": SUM[lang], "stdin": "1 2"}], 1)
        for _ in range(args.rounds):
            for lang in languages:
                fresh = [
                    {
                        "language": lang,
                        "code": f"{COMMENT[lang]} {uuid.uuid4()}\n{SUM[lang]}",
                        "stdin": f"{i} 2",
                    }
                    for i in range(args.fresh)
                ]
                cached = [
                    {"language": lang, "code": SUM[lang], "stdin": f"{i} 3"} for i in range(args.cached)
                ]
                for kind, bodies in (("fresh", fresh), ("cached", cached)):
                    seconds = run_many(server.url, bodies, concurrency)
                    totals[lang][kind][0] += len(bodies)
                    totals[lang][kind][1] += seconds
        rates = {lang: {kind: n / s for kind, (n, s) in kinds.items()} for lang, kinds in totals.items()}
        base = rates.get("python", {"fresh": 1.0, "cached": 1.0})
        print(
            f"{health['workers']} workers, isolation {health['isolation']['mode']}; programs/s (ratio to Python)"
        )
        print(f"{'language':<8} {'compile+run':>18} {'cached':>18}")
        for lang, r in rates.items():
            print(
                f"{lang:<8} {r['fresh']:>9.2f} ({r['fresh'] / base['fresh']:>5.2f}x) "
                f"{r['cached']:>9.2f} ({r['cached'] / base['cached']:>5.2f}x)"
            )
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"workers": health["workers"], "rates": rates, "totals": totals}, f, indent=2)
    finally:
        server.stop()


if __name__ == "__main__":
    main()
