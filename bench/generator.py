"""Generator benchmark: what the service costs over plain `model.generate`, and LoRA hot-swap latency.

Throughput: 1, 8 and 32 concurrent clients sending one greedy `ignore_eos` completion at a time,
against the same prompts as one batch through an in-process `model.generate` (same device and
dtype), rounds alternating. Hot-swap: 20 times, perturb a rank-16 LoRA, save it, load it under a new
name, ask it for one token: p50/p90 of each, from the start of the save. Prints a Markdown table
(docs/benchmarks.md, "Generator"); `--json` keeps the raw numbers.
"""

from __future__ import annotations

import asyncio
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import argument_parser, md_table, percentile

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


def prompts(count: int) -> list[str]:
    return [f"{PROMPT_STARTS[i % len(PROMPT_STARTS)]}  # variant {i}" for i in range(count)]


async def service_round(http: httpx.AsyncClient, model: str, batch: list[str], max_tokens: int) -> int:
    async def one(prompt: str) -> int:
        body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
        response = await http.post("/v1/completions", json=body | {"ignore_eos": True})
        response.raise_for_status()
        return response.json()["usage"]["completion_tokens"]

    return sum(await asyncio.gather(*(one(p) for p in batch)))


async def measure(
    url: str, name: str, model, tokenizer, batch: list[str], max_tokens: int, rounds: int
) -> dict:
    """Alternate service rounds and in-process rounds, so that load from other processes on the
    host hits both sides alike; the ratio is the median of the per-round ratios."""
    import torch

    tokenizer.padding_side = "left"
    inputs = tokenizer(batch, return_tensors="pt", padding=True).to(model.device)
    kwargs = dict(max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False)
    kwargs["pad_token_id"] = tokenizer.pad_token_id

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
            tokens = await service_round(http, name, batch, max_tokens)
            return tokens, time.perf_counter() - started

        await service()  # warm-up
        inprocess_round()
        service_runs, inprocess_runs = [], []
        for _ in range(rounds):
            service_runs.append(await service())
            inprocess_runs.append(inprocess_round())
    pairs = zip(service_runs, inprocess_runs, strict=True)
    ratios = [(st / ss) / (it / is_) for (st, ss), (it, is_) in pairs]
    out = {"service_tps": sum(t for t, _ in service_runs) / sum(s for _, s in service_runs)}
    out["inprocess_tps"] = sum(t for t, _ in inprocess_runs) / sum(s for _, s in inprocess_runs)
    return out | {"ratio": statistics.median(ratios), "round_ratios": ratios}


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
            one_token = {"model": name, "prompt": "def f(x):", "max_tokens": 1, "temperature": 0}
            http.post("/v1/completions", json=one_token).raise_for_status()
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
    env, swap = results["environment"], results["hot_swap"]
    head = ["concurrent clients", "service tokens/s", "in-process `generate` tokens/s (same batch)", "ratio"]
    rows = [[r["concurrency"], *(f"{r[k]:.1f}" for k in ("service_tps", "inprocess_tps")), f"{r['ratio']:.2f}"]
            for r in results["throughput"]]  # fmt: skip
    steps = {"save": "adapter saved", "load_returned": "`load_lora_adapter` returned"}
    steps["first_token"] = "first token served by it"
    swaps = [[label, *(f"{percentile(swap[k], q):.3f}" for q in (0.5, 0.9))] for k, label in steps.items()]
    return "\n".join([
        f"Device: {env['device']} ({env['dtype']}), {env['cpus']} CPU cores, torch {env['torch']}, model "
        f"`{env['model']}`, {results['max_tokens']} new tokens per request (greedy, `ignore_eos`), "
        f"{results['rounds']} rounds after a warm-up, service and in-process rounds alternating (the ratio "
        "is the median of the per-round ratios).\n",
        md_table(head, rows, "::::"),
        f"\nHot-swap of a rank-{results['rank']} all-linear LoRA adapter, {len(swap['first_token'])} swaps "
        "(seconds from the start of `save_pretrained`):\n",
        md_table(["step", "p50", "p90"], swaps, " ::"),
    ])  # fmt: skip


def main() -> None:
    # The generator sets this for itself; the in-process baseline gets the same OpenMP behaviour.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    parser = argument_parser(__doc__)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", type=Path, default=None, help="also write the raw results here")
    args = parser.parse_args()

    import torch
    from crucible_cli.spawn import start
    from crucible_models import load_model, pick_device, pick_dtype

    device = pick_device("auto")
    model, tokenizer = load_model(args.model, device=device, dtype="auto")
    settings = {"MODEL": args.model, "DEVICE": "auto", "DTYPE": "auto", "MAX_LORAS": "4", "MAX_LORA_RANK": 64}
    settings |= {"MAX_BATCH_SIZE": max(args.concurrency), "BATCH_WAIT_MS": 10.0, "LOG_LEVEL": "warning"}
    settings["ADAPTER_ROOTS"] = tempfile.gettempdir()  # where hot_swap saves its versions
    env = {f"CRUCIBLE_GENERATOR_{k}": str(v) for k, v in settings.items()}
    server = start("crucible_generator", env, "CRUCIBLE_GENERATOR_PORT", timeout=600)
    try:
        throughput = []
        for concurrency in args.concurrency:
            row = {"concurrency": concurrency}
            batch = prompts(concurrency)
            row |= asyncio.run(
                measure(server.url, args.model, model, tokenizer, batch, args.max_tokens, args.rounds)
            )
            print(json.dumps(row), flush=True)
            throughput.append(row)
        swaps = hot_swap(server.url, model, SWAPS, RANK, job="bench")
    finally:
        server.stop()

    name = torch.cuda.get_device_name() if device.startswith("cuda") else platform.processor() or "cpu"
    dtype = str(pick_dtype(device, "auto")).removeprefix("torch.")
    environment = {"device": name, "dtype": dtype, "cpus": os.cpu_count(), "torch": torch.__version__}
    results = {"environment": environment | {"model": args.model}, "max_tokens": args.max_tokens}
    results |= {"rounds": args.rounds, "rank": RANK, "throughput": throughput, "hot_swap": swaps}
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    print(markdown(results))


if __name__ == "__main__":
    main()
