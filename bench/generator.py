"""Generator benchmark: what the service costs over plain `model.generate`, and LoRA hot-swap latency.

1. Throughput: 1, 8 and 32 concurrent clients, each sending one completion at a time (greedy,
   `ignore_eos`, fixed `max_tokens`), against the generator; then the same prompts as one batch
   through an in-process `model.generate` on the same device and dtype, rounds alternating. The
   ratio service/in-process at equal batch shows what the HTTP layer, batching and the decode loop add.
2. Hot-swap: 20 times, perturb a rank-16 LoRA adapter, `save_pretrained` it, `POST
   /v1/load_lora_adapter` under a new versioned name, then ask that name for one token. Reports p50
   and p90 of save, load-returned and first-token-served, all measured from the start of the save.

    python bench/generator.py                       # spawns the generator on the auto device
    python bench/generator.py --url http://host:8001 --served-name smollm2-135m-instruct   # an external one

Prints a Markdown table (for docs/benchmarks.md) and writes the raw numbers with `--json`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from common import free_port, percentile  # beside this script

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


def prompts(count: int) -> list[str]:
    return [f"{PROMPT_STARTS[i % len(PROMPT_STARTS)]}  # variant {i}" for i in range(count)]


class Server:
    """The generator as a subprocess (or an external URL)."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.proc: subprocess.Popen | None = None
        if args.url:
            self.url = args.url.rstrip("/")
            return
        port = free_port()
        env = {
            **os.environ,
            "CRUCIBLE_GENERATOR_MODEL": args.model,
            "CRUCIBLE_GENERATOR_DEVICE": args.device,
            "CRUCIBLE_GENERATOR_DTYPE": args.dtype,
            "CRUCIBLE_GENERATOR_PORT": str(port),
            "CRUCIBLE_GENERATOR_MAX_BATCH_SIZE": str(max(args.concurrency)),
            "CRUCIBLE_GENERATOR_BATCH_WAIT_MS": str(args.batch_wait_ms),
            "CRUCIBLE_GENERATOR_MAX_LORAS": "4",
            "CRUCIBLE_GENERATOR_MAX_LORA_RANK": str(max(64, args.rank)),
            "CRUCIBLE_GENERATOR_LOG_LEVEL": "warning",
        }
        self.proc = subprocess.Popen([sys.executable, "-m", "crucible_generator"], env=env)
        self.url = f"http://127.0.0.1:{port}"

    def wait_ready(self, timeout: float = 600) -> None:
        deadline = time.monotonic() + timeout
        while True:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError("the generator exited during start-up")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError("the generator did not become ready")
            time.sleep(0.5)

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(30)


async def service_round(http: httpx.AsyncClient, model: str, batch: list[str], max_tokens: int) -> int:
    async def one(prompt: str) -> int:
        response = await http.post(
            "/v1/completions",
            json={
                "model": model,
                "prompt": prompt,
                "max_tokens": max_tokens,
                "temperature": 0,
                "ignore_eos": True,
            },
        )
        response.raise_for_status()
        return response.json()["usage"]["completion_tokens"]

    return sum(await asyncio.gather(*(one(p) for p in batch)))


async def measure(
    url: str, model_name: str, model, tokenizer, batch: list[str], max_tokens: int, rounds: int
) -> dict:
    """Alternate service rounds and in-process rounds, so that load from other processes on the
    host hits both sides alike; the ratio is the median of the per-round ratios."""
    import torch

    tokenizer.padding_side = "left"
    inputs = tokenizer(batch, return_tensors="pt", padding=True).to(model.device)
    kwargs = dict(
        max_new_tokens=max_tokens,
        min_new_tokens=max_tokens,
        do_sample=False,
        pad_token_id=tokenizer.pad_token_id,
    )

    def inprocess_round() -> tuple[int, float]:
        with torch.inference_mode():
            sync(model)
            started = time.perf_counter()
            out = model.generate(**inputs, **kwargs)
            sync(model)
        return (out.shape[1] - inputs["input_ids"].shape[1]) * len(batch), time.perf_counter() - started

    async with httpx.AsyncClient(base_url=url, timeout=600) as http:

        async def service() -> tuple[int, float]:
            started = time.perf_counter()
            tokens = await service_round(http, model_name, batch, max_tokens)
            return tokens, time.perf_counter() - started

        await service()  # warm-up
        inprocess_round()
        service_runs, inprocess_runs = [], []
        for _ in range(rounds):
            service_runs.append(await service())
            inprocess_runs.append(inprocess_round())
    ratios = [
        (st / ss) / (it / is_) for (st, ss), (it, is_) in zip(service_runs, inprocess_runs, strict=True)
    ]
    return {
        "service_tps": sum(t for t, _ in service_runs) / sum(s for _, s in service_runs),
        "inprocess_tps": sum(t for t, _ in inprocess_runs) / sum(s for _, s in inprocess_runs),
        "ratio": statistics.median(ratios),
        "round_ratios": ratios,
    }


def sync(model) -> None:
    import torch

    if model.device.type == "cuda":
        torch.cuda.synchronize()


def hot_swap(url: str, model, swaps: int, rank: int, job: str) -> dict[str, list[float]]:
    import torch
    from peft import LoraConfig, get_peft_model

    peft_model = get_peft_model(model, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules="all-linear"))
    lora_b = [p for n, p in peft_model.named_parameters() if "lora_B" in n]
    timings: dict[str, list[float]] = {"save": [], "load_returned": [], "first_token": []}
    previous = None
    with tempfile.TemporaryDirectory() as root, httpx.Client(base_url=url, timeout=120) as http:
        for step in range(swaps):
            with torch.no_grad():
                for p in lora_b:
                    p.add_(torch.randn_like(p) * 0.01)  # a "training update"
            name, path = f"{job}-v{step}", Path(root) / f"v{step}"
            t0 = time.perf_counter()
            peft_model.save_pretrained(path)
            t_saved = time.perf_counter()
            http.post(
                "/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(path)}
            ).raise_for_status()
            t_loaded = time.perf_counter()
            http.post(
                "/v1/completions",
                json={"model": name, "prompt": "def f(x):", "max_tokens": 1, "temperature": 0},
            ).raise_for_status()
            t_first = time.perf_counter()
            timings["save"].append(t_saved - t0)
            timings["load_returned"].append(t_loaded - t0)
            timings["first_token"].append(t_first - t0)
            if previous is not None:
                http.post("/v1/unload_lora_adapter", json={"lora_name": previous}).raise_for_status()
            previous = name
        if previous is not None:
            http.post("/v1/unload_lora_adapter", json={"lora_name": previous})
    peft_model.unload()
    return timings


def markdown(results: dict) -> str:
    env = results["environment"]
    lines = [
        f"Device: {env['device']} ({env['dtype']}), {env['cpus']} CPU cores, torch {env['torch']}, "
        f"model `{env['model']}`, {results['max_tokens']} new tokens per request (greedy, `ignore_eos`), "
        f"{results['rounds']} rounds after a warm-up, service and in-process rounds alternating (the ratio "
        "is the median of the per-round ratios).",
        "",
        "| concurrent clients | service tokens/s | in-process `generate` tokens/s (same batch) | ratio |",
        "|---:|---:|---:|---:|",
    ]
    for row in results["throughput"]:
        lines.append(
            f"| {row['concurrency']} | {row['service_tps']:.1f} | {row['inprocess_tps']:.1f} | {row['ratio']:.2f} |"
        )
    swap = results["hot_swap"]
    lines += [
        "",
        f"Hot-swap of a rank-{results['rank']} all-linear LoRA adapter, {len(swap['first_token'])} swaps "
        "(seconds from the start of `save_pretrained`):",
        "",
        "| step | p50 | p90 |",
        "|---|---:|---:|",
    ]
    for key, label in (
        ("save", "adapter saved"),
        ("load_returned", "`load_lora_adapter` returned"),
        ("first_token", "first token served by it"),
    ):
        lines.append(f"| {label} | {percentile(swap[key], 0.5):.3f} | {percentile(swap[key], 0.9):.3f} |")
    return "\n".join(lines)


def main() -> None:
    # The generator sets this for itself; the in-process baseline gets the same OpenMP behaviour.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--served-name", default=None, help="`model` of requests (default: --model)")
    parser.add_argument("--url", default=None, help="benchmark a running generator instead of spawning one")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--swaps", type=int, default=20)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--batch-wait-ms", type=float, default=10.0)
    parser.add_argument("--json", type=Path, default=None, help="also write the raw results here")
    args = parser.parse_args()

    import torch
    from crucible_models import load_model, pick_device, pick_dtype

    device = pick_device(args.device)
    model, tokenizer = load_model(args.model, device=device, dtype=args.dtype)
    served = args.served_name or args.model
    server = Server(args)
    try:
        server.wait_ready()
        throughput = []
        for concurrency in args.concurrency:
            batch = prompts(concurrency)
            row = {"concurrency": concurrency}
            row |= asyncio.run(
                measure(server.url, served, model, tokenizer, batch, args.max_tokens, args.rounds)
            )
            print(json.dumps(row), flush=True)
            throughput.append(row)
        swaps = hot_swap(server.url, model, args.swaps, args.rank, job="bench")
    finally:
        server.stop()

    results = {
        "environment": {
            "device": torch.cuda.get_device_name()
            if device.startswith("cuda")
            else platform.processor() or "cpu",
            "dtype": str(pick_dtype(device, args.dtype)).removeprefix("torch."),
            "cpus": os.cpu_count(),
            "torch": torch.__version__,
            "model": args.model,
        },
        "max_tokens": args.max_tokens,
        "rounds": args.rounds,
        "rank": args.rank,
        "throughput": throughput,
        "hot_swap": swaps,
    }
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    print(markdown(results))


if __name__ == "__main__":
    main()
