"""Serving race (docs/benchmarks.md, "Real vLLM beside Crucible's generator"): tokens/s of
OpenAI-compatible servers under closed-loop clients, rounds alternating between the servers after a
warm-up each (a server's figure: its rounds' median), then `--swaps` LoRA hot-swaps per server.
`--adapter-rank R`: every request names a random rank-R adapter loaded into every server first.

    python bench/serve_race.py --server vllm=http://127.0.0.1:8001@base \\
        --server crucible=http://127.0.0.1:8002@smollm2-135m-instruct --model-dir /root/models/m --json race.json

`NAME=URL@MODEL`: MODEL is the `model` field the server expects for its base model.
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench import common
from bench.generator import hot_swap

TEXT = (
    "Write a Python function `longest_run(xs)` that returns the length of the longest run of equal "
    "consecutive items in the list `xs`, and 0 for an empty list. Your code should pass these tests:\n"
    "assert longest_run([1, 1, 2, 2, 2, 3]) == 3\nassert longest_run([]) == 0\n"
    "assert longest_run(['a']) == 1\n\ndef longest_run(xs):\n"
)
# One asyncio process with httpx serves only ~50 requests/s at 128 connections (seen on the H100
# host), which would measure the client instead of the server: clients are spread over processes.
CLIENTS_PER_PROCESS = 16


async def clients_here(url: str, body: dict, clients: int, start: float, deadline: float) -> list:
    """`clients` closed-loop clients in this process: completion tokens and requests that ended by
    `deadline`, and when the last of them ended."""
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


def captures(url: str) -> float | None:
    """Crucible's graph-capture counter, or None for a server without it (vLLM)."""
    found = common.counters(url, {"captures": "crucible_generator_graph_captures_total"})
    return found and found["captures"]


def main() -> None:
    parser = common.argument_parser(__doc__)
    parser.add_argument("--server", action="append", required=True, help="NAME=URL@MODEL (repeat)")
    common.options(
        parser,
        model_dir=(str, "the served model's directory (tokenizer, LoRA base)"),
        clients=[1, 8, 32, 128], seconds=8.0, rounds=2, prompt_tokens=86, max_tokens=128, swaps=10,
        swap_device=(None, "where the swapping trainer's model lives (default: cuda if any)"),
        adapter_rank=(0, "requests name a loaded rank-R adapter (0: the base model)"),
        json=None,
    )  # fmt: skip
    args = parser.parse_args()
    servers = {}
    for spec in args.server:
        name, _, rest = spec.partition("=")
        url, _, model = rest.partition("@")
        if not (name and url and model):
            raise SystemExit(f"--server {spec!r}: expected NAME=URL@MODEL")
        servers[name] = (url.rstrip("/"), model)

    from transformers import AutoTokenizer

    prompt = AutoTokenizer.from_pretrained(args.model_dir)(TEXT * (1 + args.prompt_tokens // 40)).input_ids
    if len(prompt) < args.prompt_tokens:
        raise SystemExit(f"the prompt text is only {len(prompt)} tokens; --prompt-tokens is too many")
    results: dict = {"clients": {}, "hot_swap": {}, "setup": vars(args)}
    if args.adapter_rank:  # lora_B drawn too, so that the adapter changes every layer's output
        path = Path(tempfile.mkdtemp()) / f"race-r{args.adapter_rank}"
        common.random_adapter(args.model_dir, path, args.adapter_rank, b_std=1e-3, dtype="bfloat16")
        lora = f"race-r{args.adapter_rank}-{path.parent.name}"  # a server kept up keeps the last race's
        for url, _ in servers.values():
            load = {"lora_name": lora, "lora_path": str(path)}
            httpx.post(f"{url}/v1/load_lora_adapter", json=load, timeout=600).raise_for_status()
        servers = {name: (url, lora) for name, (url, _) in servers.items()}
    request = {"prompt": prompt[: args.prompt_tokens], "max_tokens": args.max_tokens, "temperature": 0}
    for name, (url, model) in servers.items():  # each server's request body
        servers[name] = (url, request | {"model": model, "ignore_eos": True})
    for clients in args.clients:
        for url, body in servers.values():  # warm-up
            closed_loop(url, body, clients, min(args.seconds, 3.0))
        before = {name: captures(url) for name, (url, _) in servers.items()}
        arms = {name: lambda _, u=url, b=body, c=clients: closed_loop(u, b, c, args.seconds)
                for name, (url, body) in servers.items()}  # fmt: skip
        row = {name: {"tps": statistics.median(r["tps"] for r in runs), "rounds": runs}
               for name, runs in common.alternate(arms, args.rounds).items()}  # fmt: skip
        for name, (url, _) in servers.items():
            if before[name] is not None:
                row[name]["captures_while_measured"] = captures(url) - before[name]
        results["clients"][clients] = row
        print(json.dumps({"clients": clients} | {n: round(r["tps"], 1) for n, r in row.items()}), flush=True)

    if args.swaps:
        import torch
        from transformers import AutoModelForCausalLM

        device = args.swap_device or ("cuda" if torch.cuda.is_available() else "cpu")
        dtype = torch.bfloat16 if args.adapter_rank else torch.float32  # a 7B model in fp32 crowds the card
        model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=dtype).to(device)
        for name, (url, _) in servers.items():
            swap = {
                key: {"p50": common.percentile(v, 0.5), "p90": common.percentile(v, 0.9), "all": v}
                for key, v in hot_swap(url, model, args.swaps, 16, job=f"race-{name}").items()
            }
            results["hot_swap"][name] = swap
            print(json.dumps({"hot_swap": name} | {k: v["p50"] for k, v in swap.items()}), flush=True)
    if args.json:
        common.dump(Path(args.json), results)


if __name__ == "__main__":
    main()
