"""Generator benchmark: what the service costs over plain `model.generate`, and LoRA hot-swap latency.

Throughput: 1, 8 and 32 concurrent clients sending one greedy `ignore_eos` completion at a time,
against the same prompts as one batch through an in-process `model.generate` (same device and
dtype), rounds alternating. Hot-swap: 20 times, perturb a rank-16 LoRA, save it, load it under a new
name, ask it for one token: p50/p90 of each, from the start of the save. Prints a Markdown table
(docs/benchmarks.md, "Generator"); `--json` keeps the raw numbers.
"""

from __future__ import annotations

import asyncio
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
SWAPS, RANK = 20, 16  # hot-swaps of a rank-16 all-linear adapter


async def measure(
    url: str, name: str, model: Any, tokenizer: Any, clients: int, max_tokens: int, rounds: int
) -> dict:
    """Tokens/s of `clients` clients sending one completion each, and of their prompts as one batch
    through `model.generate`; rounds alternate after a warm-up of each, so that load from other
    processes on the host hits both sides alike; the ratio is the median of the per-round ratios."""
    import torch

    batch = [f"{PROMPT_STARTS[i % len(PROMPT_STARTS)]}  # variant {i}" for i in range(clients)]
    tokenizer.padding_side = "left"
    inputs = tokenizer(batch, return_tensors="pt", padding=True).to(model.device)
    kwargs = {"max_new_tokens": max_tokens, "min_new_tokens": max_tokens, "do_sample": False}
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
            body = {"model": name, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
            response = await http.post("/v1/completions", json=body | {"ignore_eos": True})
            response.raise_for_status()
            return response.json()["usage"]["completion_tokens"]

        async def service() -> tuple[int, float]:
            started = time.perf_counter()
            tokens = sum(await asyncio.gather(*(one(p) for p in batch)))
            return tokens, time.perf_counter() - started

        await service()  # the warm-ups
        inprocess()
        runs = [(await service(), inprocess()) for _ in range(rounds)]
    ratios = [(st / ss) / (it / is_) for (st, ss), (it, is_) in runs]
    service_tps, inprocess_tps = (sum(r[i][0] for r in runs) / sum(r[i][1] for r in runs) for i in (0, 1))
    out = {"service_tps": service_tps, "inprocess_tps": inprocess_tps}
    return out | {"ratio": statistics.median(ratios), "round_ratios": ratios}


def hot_swap(url: str, model: Any, swaps: int, rank: int, job: str) -> dict[str, list[float]]:
    """Seconds from the start of each save of a perturbed rank-`rank` adapter of `model` until it was
    saved, its load returned and its first token came; the previous version unloaded after each."""
    import torch
    from peft import LoraConfig, get_peft_model

    peft_model = get_peft_model(model, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules="all-linear"))
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
    return timings


def markdown(results: dict) -> str:
    env, swap, pct = results["environment"], results["hot_swap"], common.percentile
    head = ["concurrent clients", "service tokens/s", "in-process `generate` tokens/s (same batch)", "ratio"]
    rows = [[r["concurrency"], f"{r['service_tps']:.1f}", f"{r['inprocess_tps']:.1f}", f"{r['ratio']:.2f}"]
            for r in results["throughput"]]  # fmt: skip
    steps = {"save": "adapter saved", "load_returned": "`load_lora_adapter` returned"}
    steps["first_token"] = "first token served by it"
    swaps = [[label, f"{pct(swap[k], 0.5):.3f}", f"{pct(swap[k], 0.9):.3f}"] for k, label in steps.items()]
    return "\n".join([
        f"Device: {env['device']} ({env['dtype']}), {env['cpus']} CPU cores, torch {env['torch']}, model "
        f"`{env['model']}`, {results['max_tokens']} new tokens per request (greedy, `ignore_eos`), "
        f"{results['rounds']} rounds after a warm-up, service and in-process rounds alternating (the ratio "
        "is the median of the per-round ratios).\n",
        common.md_table(head, rows, "::::"),
        f"\nHot-swap of a rank-{RANK} all-linear LoRA adapter, {len(swap['first_token'])} swaps "
        "(seconds from the start of `save_pretrained`):\n",
        common.md_table(["step", "p50", "p90"], swaps, " ::"),
    ])  # fmt: skip


def main() -> None:
    # The generator sets this for itself; the in-process baseline gets the same OpenMP behaviour.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    parser = common.argument_parser(__doc__)
    common.options(parser, model="smollm2-135m-instruct", concurrency=[1, 8, 32], max_tokens=64, rounds=5)
    args = common.options(parser, json=(None, "also write the raw results here")).parse_args()

    import torch
    from crucible_models import load_model, pick_device, pick_dtype

    device = pick_device("auto")
    model, tokenizer = load_model(args.model, device=device, dtype="auto")
    env = {"CRUCIBLE_GENERATOR_ADAPTER_ROOTS": tempfile.gettempdir()}  # where hot_swap saves its versions
    env["CRUCIBLE_GENERATOR_BATCH_WAIT_MS"] = "10"  # a lone request waits 10 ms for others
    work = Path(tempfile.mkdtemp(prefix="generator-bench-"))
    server = common.spawn_generator(work, args.model, max(args.concurrency), env=env)
    results: dict = {"max_tokens": args.max_tokens, "rounds": args.rounds, "rank": RANK, "throughput": []}
    try:
        for clients in args.concurrency:
            row = measure(server.url, args.model, model, tokenizer, clients, args.max_tokens, args.rounds)
            results["throughput"].append({"concurrency": clients} | asyncio.run(row))
            print(results["throughput"][-1], flush=True)
        results["hot_swap"] = hot_swap(server.url, model, SWAPS, RANK, job="bench")
    finally:
        server.stop()
    dtype = str(pick_dtype(device, "auto")).removeprefix("torch.")
    results["environment"] = {"device": common.card(), "dtype": dtype, "cpus": os.cpu_count()}
    results["environment"] |= {"torch": torch.__version__, "model": args.model}
    if args.json:
        common.dump(Path(args.json), results)
    print(markdown(results))


if __name__ == "__main__":
    main()
