"""Generator benchmarks (docs/benchmarks.md, "Generator" and the serving races, where each protocol is):

  overhead  Crucible's generator of the built-in model, spawned here, against an in-process
            `model.generate` on the same device and dtype, then 20 hot-swaps of a rank-16 adapter
  race      running OpenAI-compatible servers under 1-128 closed-loop clients naming a random
            rank-16 adapter, alternating rounds; then 10 hot-swaps per server

    python bench/generator.py overhead [--json out.json]
    python bench/generator.py race --server vllm=http://127.0.0.1:8101 crucible=http://127.0.0.1:8102 \\
        --model-dir DIR [--swap-device cpu] [--json out.json]
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench import common

PROMPT_STARTS = [
    "def fibonacci(n):",
    "def is_palindrome(s: str) -> bool:",
    "# Return the sum of the squares of a list of numbers\ndef sum_squares(xs):",
    "def merge_sorted(a, b):\n    result = []",
    "class Stack:\n    def __init__(self):",
    "def count_vowels(text):",
    "import math\n\ndef circle_area(r):",
    "def flatten(nested):\n    # flatten a list of lists",
]
RACE_TEXT = (
    "Write a Python function `longest_run(xs)` that returns the length of the longest run of equal "
    "consecutive items in the list `xs`, and 0 for an empty list. Your code should pass these tests:\n"
    "assert longest_run([1, 1, 2, 2, 2, 3]) == 3\nassert longest_run([]) == 0\n"
    "assert longest_run(['a']) == 1\n\ndef longest_run(xs):\n"
)
RANK, MAX_TOKENS, ROUNDS = 16, 64, 5  # overhead: adapter rank, tokens per request, rounds
RACE_CLIENTS, RACE_PROMPT, RACE_TOKENS, RACE_SECONDS = [1, 8, 32, 128], 86, 128, 8.0
# One asyncio process with httpx serves only ~50 requests/s at 128 connections (seen on the H100
# host), which would measure the client instead of the server: clients are spread over processes.
CLIENTS_PER_PROCESS = 16


async def measure(url: str, name: str, model: Any, tokenizer: Any, clients: int) -> dict:
    """Tokens/s of `clients` clients sending one completion each, and of their prompts as one batch
    through `model.generate`, in alternating rounds after a warm-up of each (load from elsewhere on
    the host hits both sides alike); the ratio is the median of the per-round ratios."""
    import torch

    batch = [f"{PROMPT_STARTS[i % len(PROMPT_STARTS)]}  # variant {i}" for i in range(clients)]
    tokenizer.padding_side = "left"
    inputs = tokenizer(batch, return_tensors="pt", padding=True).to(model.device)
    kwargs = {"max_new_tokens": MAX_TOKENS, "min_new_tokens": MAX_TOKENS, "do_sample": False}
    sync = torch.cuda.synchronize if model.device.type == "cuda" else lambda: None

    def inprocess() -> tuple[int, float]:
        with torch.inference_mode():
            sync()
            started = time.perf_counter()
            out = model.generate(**inputs, **kwargs, pad_token_id=tokenizer.pad_token_id)
            sync()
        return (out.shape[1] - inputs["input_ids"].shape[1]) * len(batch), time.perf_counter() - started

    async with httpx.AsyncClient(base_url=url, timeout=600) as http:

        async def one(prompt: str) -> int:
            body = {"model": name, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0}
            response = await http.post("/v1/completions", json=body | {"ignore_eos": True})
            response.raise_for_status()
            return response.json()["usage"]["completion_tokens"]

        async def service() -> tuple[int, float]:
            started = time.perf_counter()
            tokens = sum(await asyncio.gather(*(one(p) for p in batch)))
            return tokens, time.perf_counter() - started

        await service()  # the warm-ups
        inprocess()
        runs = [(await service(), inprocess()) for _ in range(ROUNDS)]
    ratios = [(st / ss) / (it / is_) for (st, ss), (it, is_) in runs]
    service_tps, inprocess_tps = (sum(r[i][0] for r in runs) / sum(r[i][1] for r in runs) for i in (0, 1))
    out = {"service_tps": service_tps, "inprocess_tps": inprocess_tps}
    return out | {"ratio": statistics.median(ratios), "round_ratios": ratios}


def hot_swap(url: str, model: Any, swaps: int, job: str) -> dict[str, dict]:
    """`swaps` hot-swaps of a rank-16 adapter of `model` (p50, p90 and all of each step's seconds);
    the previous version unloaded after each."""
    import torch
    from peft import LoraConfig, get_peft_model

    peft_model = get_peft_model(model, LoraConfig(r=RANK, lora_alpha=2 * RANK, target_modules="all-linear"))
    lora_b = [p for n, p in peft_model.named_parameters() if "lora_B" in n]
    timings: dict[str, list[float]] = {"save": [], "load_returned": [], "first_token": []}
    with tempfile.TemporaryDirectory() as root, httpx.Client(base_url=url, timeout=120) as http:

        def post(path: str, **body: Any) -> None:
            http.post(path, json=body).raise_for_status()

        for step in range(swaps):
            with torch.no_grad():
                for p in lora_b:
                    p.add_(torch.randn_like(p) * 0.01)  # a "training update"
            name, path = f"{job}-v{step}", Path(root) / f"v{step}"
            t0 = time.perf_counter()
            peft_model.save_pretrained(path)
            timings["save"].append(time.perf_counter() - t0)
            post("/v1/load_lora_adapter", lora_name=name, lora_path=str(path))
            timings["load_returned"].append(time.perf_counter() - t0)
            post("/v1/completions", model=name, prompt="def f(x):", max_tokens=1, temperature=0)
            timings["first_token"].append(time.perf_counter() - t0)
            if step:
                post("/v1/unload_lora_adapter", lora_name=f"{job}-v{step - 1}")
        http.post("/v1/unload_lora_adapter", json={"lora_name": f"{job}-v{swaps - 1}"})
    peft_model.unload()
    pct = common.percentile
    return {k: {"p50": pct(v, 0.5), "p90": pct(v, 0.9), "all": v} for k, v in timings.items()}


def overhead(args: Any) -> dict:
    # The generator sets this for itself; the in-process baseline gets the same OpenMP behaviour.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    import torch
    from crucible_models import DEFAULT_MODEL, load_model, pick_device, pick_dtype

    device = pick_device("auto")
    model, tokenizer = load_model(DEFAULT_MODEL, device=device, dtype="auto")
    env = {"CRUCIBLE_GENERATOR_ADAPTER_ROOTS": tempfile.gettempdir()}  # where hot_swap saves its versions
    env["CRUCIBLE_GENERATOR_BATCH_WAIT_MS"] = "10"  # a lone request waits 10 ms for others
    work = Path(tempfile.mkdtemp(prefix="generator-bench-"))
    server = common.spawn_generator(work, DEFAULT_MODEL, 32, env=env)
    results: dict = {"max_tokens": MAX_TOKENS, "rounds": ROUNDS, "rank": RANK, "throughput": []}
    try:
        for clients in (1, 8, 32):
            row = asyncio.run(measure(server.url, DEFAULT_MODEL, model, tokenizer, clients))
            results["throughput"].append({"concurrency": clients} | row)
            print(results["throughput"][-1], flush=True)
        results["hot_swap"] = hot_swap(server.url, model, 20, job="bench")
    finally:
        server.stop()
    dtype = str(pick_dtype(device, "auto")).removeprefix("torch.")
    results["environment"] = {"device": common.card(), "dtype": dtype, "torch": torch.__version__}
    head = ["concurrent clients", "service tokens/s", "in-process `generate` tokens/s (same batch)", "ratio"]
    rows = [[r["concurrency"], f"{r['service_tps']:.1f}", f"{r['inprocess_tps']:.1f}", f"{r['ratio']:.2f}"]
            for r in results["throughput"]]  # fmt: skip
    swaps = [[step, f"{v['p50']:.3f}", f"{v['p90']:.3f}"] for step, v in results["hot_swap"].items()]
    print(f"{results['environment']}\n\n{common.md_table(head, rows, '::::')}\n")
    print(common.md_table(["hot-swap, seconds from the start of the save", "p50", "p90"], swaps, " ::"))
    return results


async def clients_here(url: str, body: dict, clients: int, start: float, deadline: float) -> list:
    """`clients` closed-loop clients here: tokens and requests done by `deadline`, and when the last ended."""
    limits = httpx.Limits(max_connections=clients + 4, max_keepalive_connections=clients + 4)
    done = [0, 0, start]
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as http:

        async def client() -> None:
            await asyncio.sleep(max(0.0, start - time.time()))
            while time.time() < deadline:
                response = await http.post("/v1/completions", json=body)
                response.raise_for_status()
                if (now := time.time()) <= deadline:
                    done[:] = done[0] + response.json()["usage"]["completion_tokens"], done[1] + 1, now

        await asyncio.gather(*(client() for _ in range(clients)))
    return done


def process(args: tuple) -> list:
    return asyncio.run(clients_here(*args))


def closed_loop(url: str, body: dict, clients: int, seconds: float) -> dict:
    """Tokens/s of `clients` closed-loop clients sending `body`, up to CLIENTS_PER_PROCESS per process."""
    procs = -(-clients // CLIENTS_PER_PROCESS)
    shares = [clients // procs + (i < clients % procs) for i in range(procs)]
    start = time.time() + 1.0  # every process starts its clients at the same moment
    with multiprocessing.get_context("spawn").Pool(procs) as pool:
        parts = pool.map(process, [(url, body, n, start, start + seconds) for n in shares])
    tokens, seconds = sum(p[0] for p in parts), max(p[2] for p in parts) - start
    out = {"tokens": tokens, "requests": sum(p[1] for p in parts), "seconds": seconds}
    return out | {"tps": tokens / max(seconds, 1e-9), "processes": procs}


def counters(url: str) -> dict[str, float] | None:
    """Crucible's graph captures and admissions (count, seconds) so far; None from a server without
    them (vLLM)."""
    found = common.generator_metrics(url) or {}
    keys = ("graph_captures_total", "admissions_total", "admission_seconds_total")
    return {k: found[k] for k in keys if k in found} or None


def race(args: Any) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    servers = dict(spec.split("=", 1) for spec in args.server)
    text = RACE_TEXT * (1 + RACE_PROMPT // 40)
    prompt = AutoTokenizer.from_pretrained(args.model_dir)(text).input_ids[:RACE_PROMPT]
    path = Path(tempfile.mkdtemp()) / f"race-r{RANK}"  # lora_B drawn too: every layer's output changes
    common.random_adapter(args.model_dir, path, RANK, b_std=1e-3, dtype="bfloat16")
    lora = f"race-r{RANK}-{path.parent.name}"  # a server kept up keeps the last race's
    for url in servers.values():
        load = {"lora_name": lora, "lora_path": str(path)}
        httpx.post(f"{url}/v1/load_lora_adapter", json=load, timeout=600).raise_for_status()
    body = {"model": lora, "prompt": prompt, "max_tokens": RACE_TOKENS, "temperature": 0, "ignore_eos": True}
    results: dict = {"clients": {}, "hot_swap": {}, "servers": servers}
    for clients in RACE_CLIENTS:
        for url in servers.values():  # warm-up
            closed_loop(url, body, clients, 3.0)
        before = {name: counters(url) for name, url in servers.items()}
        arms = {name: lambda _, u=url, c=clients: closed_loop(u, body, c, RACE_SECONDS)
                for name, url in servers.items()}  # fmt: skip
        row = {name: {"tps": statistics.median(r["tps"] for r in runs), "rounds": runs}
               for name, runs in common.alternate(arms, 2).items()}  # fmt: skip
        for name, url in servers.items():
            if before[name] is not None:  # what the measured rounds captured and admitted
                after = counters(url) or {}
                row[name]["while_measured"] = {k: round(after[k] - v, 3) for k, v in before[name].items()}
        results["clients"][clients] = row
        print({"clients": clients} | {n: round(r["tps"], 1) for n, r in row.items()}, flush=True)
    device = args.swap_device or ("cuda" if torch.cuda.is_available() else "cpu")
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.bfloat16).to(device)
    for name, url in servers.items():
        results["hot_swap"][name] = hot_swap(url, model, 10, job=f"race-{name}")
    return results


if __name__ == "__main__":
    common.commands(__doc__, {
        "overhead": (overhead, {}),
        "race": (race, {
            "server": (["crucible=http://127.0.0.1:8102"], "NAME=URL of each server"),
            "model_dir": (str, "the served model's directory (tokenizer, LoRA base)"),
            "swap_device": (None, "where the swapping trainer's model lives (default: cuda if any)"),
        }),
    })  # fmt: skip
