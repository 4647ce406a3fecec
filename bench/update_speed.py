"""The policy update alone, two arms alternating on one policy (docs/benchmarks.md, "The update near
the limit"): `--compare` names the two (ARMS: each sets one field of the optimizer or the policy).
The job is bench/multi_gpu.py's GRPO spec with `--set` overrides; each update's batch is synthetic,
seeded and new (new lengths, as a job's steps have: costs per new shape count), the same for both
arms; the figures are per-arm medians of the update's own metrics, each arm's first (warm-up)
update apart (`warmup_s`).

    python bench/update_speed.py --out /tmp/update-speed.json                # tiny Qwen2 on a CPU
    python bench/update_speed.py --shape qwen2.5-coder-1.5b --compare precision --out /tmp/p.json
    python bench/update_speed.py --model qwen2.5-coder-1.5b-instruct --profile /tmp/prof ...  # where it goes
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench import common

# Report key -> the update's metric (update_s: the wall time around it).
KEYS = {"update_s": None} | {f"{k}_s": f"time/update_{k}_s" for k in ("score", "ref", "forward_backward")}
KEYS |= {"optimizer_s": "time/update_optimizer_s"}
KEYS |= {k: f"perf/update_{k}" for k in ("tokens_per_s_per_gpu", "peak_fraction")}
KEYS |= {k: f"update/{k}" for k in ("micro_batches", "checkpointed_micro_batches")}
KEYS |= {"peak_gib": None}  # the most the update held on the card at once, over what it held before
# --compare -> the field of the optimizer or the policy its arms set, and each arm's value (before, after).
ARMS = {
    "buckets": ("length_buckets", {"batch_order": False, "length_buckets": True}),
    "precision": ("mixed_precision", {"peft_casting": False, "mixed": True}),
    "compile": ("run_eager", {"eager": True, "compiled": False}),
    "fused": ("fused_kernels", {"unfused": False, "fused": True}),
    "lora": ("lora_kernels", {"peft_lora": False, "fused_lora": True}),
    "head": ("head_mode", {"full_logits": "full", "chunked_head": "chunked"}),
    "rope": ("rope_kernel", {"transformers_rope": False, "fused_rope": True}),
    "logprobs": ("logprob_kernel", {"autograd_logprobs": False, "kept_logprobs": True}),
    "attention": ("cudnn_attention", {"cudnn": True, "no_cudnn": False}),
    "padding": ("unmasked", {"masked": False, "unmasked": True}),
}


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = common.argument_parser(__doc__, overrides=True)
    parser.add_argument("--compare", choices=sorted(ARMS), default="buckets", help="which two arms")
    return common.options(
        parser,
        shape=(None, "a real model's shape with random weights (bench/model_shapes.py)"),
        model=(None, "an installed model or checkpoint instead (e.g. smollm2-135m-instruct)"),
        prompts=(8, "groups (problems) in the batch"),
        group=(8, "samples per group"),
        max_tokens=(128, "longest completion"),
        min_tokens=(1, "shortest completion (= --max-tokens: all of one length)"),
        micro_batch=(16, "optim.micro_batch"),
        kl_beta=(0.01, "method.kl_beta (> 0: the reference is scored)"),
        repeats=(3, "timed updates per arm (after one warm-up each)"),
        dtype=(None, "model.dtype (default: bf16 on a GPU, float32 on a CPU)"),
        out=Path,
        profile=(None, "a folder: one more update of the second arm, profiled (kernels.txt, trace.json)"),
    ).parse_args(argv)


def synthetic_batch(args: argparse.Namespace, vocab: int, update: int) -> list[Any]:
    from crucible_trainer.rl.rollout import Sample

    rng = random.Random(f"0:{update}")
    out = []
    for g in range(args.prompts):
        prompt = [rng.randrange(10, vocab) for _ in range(rng.randint(30, 120))]
        for _ in range(args.group):
            length = rng.randint(args.min_tokens, args.max_tokens)
            completion = [rng.randrange(10, vocab) for _ in range(length)]
            out.append(
                Sample(g, g, prompt, completion, "", "", None, None, reward=0.0, advantage=rng.gauss(0, 1))
            )
    return out


def main(argv: list[str] | None = None) -> None:
    from bench.model_shapes import local_model

    args = parse(argv)
    os.environ.setdefault("OMP_NUM_THREADS", str(os.cpu_count() or 1))
    with tempfile.TemporaryDirectory(prefix="crucible-update-speed-") as tmp:
        report = run(args, args.model or local_model(args.shape, Path(tmp)))
    common.dump(args.out, report)
    print(json.dumps({k: v for k, v in report.items() if k != "updates"}, indent=2))


def run(args: argparse.Namespace, model: str) -> dict[str, Any]:
    import torch
    from crucible_trainer.methods import method_module
    from crucible_trainer.rl.policy import Policy
    from crucible_trainer.rl.update import update
    from crucible_trainer.runtime import hardware

    from bench.multi_gpu import job

    sets = [f"optim.problems_per_step={args.prompts}", f"method.group_size={args.group}"]
    sets += [f"rollout.max_tokens={args.max_tokens}", f"optim.micro_batch={args.micro_batch}"]
    sets += [f"method.kl_beta={args.kl_beta}", *([f"model.dtype={args.dtype}"] if args.dtype else [])]
    if args.compare == "compile" and not any(o.startswith("optim.compile=") for o in args.overrides):
        sets.append("optim.compile=default")
    spec, chosen = hardware.resolve(job(model, 1, [*sets, *args.overrides]))
    policy = Policy(spec.model, spec.optim, spec.seed)
    batch_of = functools.cache(lambda n: synthetic_batch(args, len(policy.tokenizer), n))
    field, arms = ARMS[args.compare]

    def config(arm: str) -> Any:
        """The update's config with `arm`'s value of the field set."""
        value, optim = arms[arm], spec.optim
        if field == "length_buckets":
            optim = optim.model_copy(update={field: value})
        elif field in ("mixed_precision", "fused_kernels"):
            getattr(policy, field)(value)
        else:
            setattr(policy, field, value)
        if field in ("lora_kernels", "rope_kernel"):  # fused again with it, as a step run again re-fuses
            policy.fused_kernels(False)
            policy.fused_kernels(True)
        return method_module(spec.method).update_config(spec.method, spec.model_copy(update={"optim": optim}))

    def timed(arm: str, seed: int) -> dict[str, float]:
        cfg = config(arm)
        cuda = torch.cuda.is_available()
        if cuda:
            torch.cuda.synchronize()
            held = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
        started = time.perf_counter()
        out = update(policy, batch_of(seed), cfg, seed=seed) | {"update_s": time.perf_counter() - started}
        if cuda:
            out["peak_gib"] = round((torch.cuda.max_memory_allocated() - held) / 2**30, 2)
        return out

    start = compiled_graphs()
    warmup = {arm: timed(arm, 0)["update_s"] for arm in arms}  # the first of each arm warms up
    graphs = {"after_warmup": compiled_graphs() - start}  # graphs traced after the warm-ups
    updates = common.alternate({arm: lambda r, a=arm: timed(a, r + 1) for arm in arms}, args.repeats)
    graphs["at_end"] = compiled_graphs() - start
    profiled = (
        profile(lambda: timed(list(arms)[-1], args.repeats + 1), Path(args.profile)) if args.profile else None
    )

    medians = {
        arm: {k: median(rows, metric or k) for k, metric in KEYS.items()} for arm, rows in updates.items()
    }
    before, after = (m["update_s"] for m in medians.values())
    dtype = str(policy.model.get_base_model().dtype).removeprefix("torch.")
    out = {"model": args.model or args.shape or "tiny", "compare": args.compare, "dtype": dtype}
    out |= {"settings": chosen, "batch": len(batch_of(0)), "max_tokens": args.max_tokens}
    timed_batches = [batch_of(r + 1) for r in range(args.repeats)]
    out["completion_tokens_mean"] = statistics.mean(len(s.completion_ids) for b in timed_batches for s in b)
    out |= {"micro_batch": spec.optim.micro_batch, "kl_beta": args.kl_beta, "repeats": args.repeats}
    out |= {"overrides": args.overrides, "compile": spec.optim.compile, "warmup_s": warmup}
    if spec.optim.compile:
        # The compiler's time: the compiled arm's warm-up beyond its median update; graphs traced
        # after the warm-ups mean shapes the warm-up did not meet (or recompiles).
        compiled = "compiled" in warmup  # else compiled in both arms
        out["compile_s"] = warmup["compiled"] - medians["compiled"]["update_s"] if compiled else None
        out["graphs"] = graphs
    out |= {"medians": medians, "speedup": round(before / after, 3) if after else None}
    return out | {"profile": profiled, "updates": updates}


def profile(call: Any, folder: Path) -> str:
    """`call()` under torch.profiler: its operators by device time (CPU time without a GPU), the
    top 40 in `folder/kernels.txt`, and a Chrome trace in `folder/trace.json`; the table's path."""
    import torch
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as profiler

    cuda = torch.cuda.is_available()
    started = time.perf_counter()
    with profiler(activities=[ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]) as prof:
        call()
    wall = time.perf_counter() - started
    folder.mkdir(parents=True, exist_ok=True)
    averages = prof.key_averages()
    table = averages.table(sort_by="self_device_time_total" if cuda else "self_cpu_time_total", row_limit=40)
    # The device's busy time against the wall's: far below it, the host (launches) is what binds.
    # Counted on the kernels' rows, as the table's "Self CUDA time total" is: each kernel's time
    # shows twice in the averages, on its own row and on the operator that launched it.
    busy = sum(e.self_device_time_total for e in averages if _kernel(e)) / 1e6 if cuda else None
    launches = sum(
        e.count for e in averages if e.key in ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC")
    )
    header = f"wall {wall:.3f} s (profiled), device busy {busy} s, kernel launches {launches}\n\n"
    (folder / "kernels.txt").write_text(header + table)
    prof.export_chrome_trace(str(folder / "trace.json"))
    return str(folder / "kernels.txt")


def _kernel(event: Any) -> bool:
    """Whether a profiler row is the device's own work (a kernel, a copy), not an operator's."""
    from torch.autograd import DeviceType

    return event.device_type == DeviceType.CUDA and not event.is_user_annotation


def median(rows: list[dict[str, float]], key: str) -> float | None:
    """The median of `key` over the rows that have it (a CPU has no peak to report a fraction of)."""
    values = [r[key] for r in rows if key in r]
    return statistics.median(values) if values else None


def compiled_graphs() -> int:
    """Graphs torch.compile has traced in this process (0 when nothing is compiled)."""
    dynamo = sys.modules.get("torch._dynamo.utils")
    return int(dynamo.counters["stats"]["unique_graphs"]) if dynamo is not None else 0


if __name__ == "__main__":
    main()
