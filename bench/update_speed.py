"""The policy update alone, two arms alternating on one policy (docs/benchmarks.md, "The update near
the limit"): `--compare buckets`, micro-batches in the batch's order or longest first
(`optim.length_buckets`); `--compare precision`, PEFT's casting or autocast (`rl/policy.py`);
`--compare compile`, eager or compiled passes (`optim.compile`: "default" unless `--set` names
another mode). The job is bench/multi_gpu.py's GRPO spec with `--set` overrides; the batch is
synthetic and seeded; the figures are per-arm medians of the update's own metrics, and each arm's
first (warm-up) update is reported apart (`warmup_s`: with compile on, the compiler's time is there).

    python bench/update_speed.py --out /tmp/update-speed.json                # tiny Qwen2 on a CPU
    python bench/update_speed.py --shape qwen2.5-coder-1.5b --compare precision --out /tmp/p.json
    python bench/update_speed.py --compare compile --set optim.compile=reduce-overhead --out /tmp/c.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.common import argument_parser  # noqa: E402

KEYS = {"update_s": None, "score_s": "time/update_score_s", "ref_s": "time/update_ref_s"}  # key -> metric
KEYS |= {"forward_backward_s": "time/update_forward_backward_s", "optimizer_s": "time/update_optimizer_s"}
KEYS |= {
    "tokens_per_s_per_gpu": "perf/update_tokens_per_s_per_gpu",
    "peak_fraction": "perf/update_peak_fraction",
}


def batch_order(policy: Any, optim: Any) -> Any:
    return optim.model_copy(update={"length_buckets": False})


def length_buckets(policy: Any, optim: Any) -> Any:
    return optim.model_copy(update={"length_buckets": True})


def peft_casting(policy: Any, optim: Any) -> Any:
    policy.mixed_precision(False)
    return optim


def mixed(policy: Any, optim: Any) -> Any:
    policy.mixed_precision(True)
    return optim


def eager(policy: Any, optim: Any) -> Any:
    policy.run_eager = True
    return optim


def compiled(policy: Any, optim: Any) -> Any:
    policy.run_eager = False
    return optim


# --compare -> (before, after): each arm sets the policy up and returns the optimizer spec to use.
ARMS = {
    "buckets": (batch_order, length_buckets),
    "precision": (peft_casting, mixed),
    "compile": (eager, compiled),
}


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argument_parser(__doc__, overrides=True)
    p.add_argument("--shape", help="a real model's shape with random weights (bench/model_shapes.py)")
    p.add_argument("--model", help="an installed model or checkpoint instead (e.g. smollm2-135m-instruct)")
    p.add_argument("--prompts", type=int, default=8, help="groups (problems) in the batch")
    p.add_argument("--group", type=int, default=8, help="samples per group")
    p.add_argument("--max-tokens", type=int, default=128, help="longest completion")
    p.add_argument(
        "--min-tokens", type=int, default=1, help="shortest completion (= --max-tokens: all of one length)"
    )
    p.add_argument("--micro-batch", type=int, default=16, help="optim.micro_batch")
    p.add_argument(
        "--kl-beta", type=float, default=0.01, help="method.kl_beta (> 0: the reference is scored)"
    )
    p.add_argument("--repeats", type=int, default=3, help="timed updates per arm (after one warm-up each)")
    p.add_argument("--compare", choices=sorted(ARMS), default="buckets", help="which two arms")
    p.add_argument("--dtype", help="model.dtype (default: bf16 on a GPU, float32 on a CPU)")
    p.add_argument("--profile", type=Path, help="also write a PyTorch profile of one update per arm here")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, required=True)
    return p.parse_args(argv)


def synthetic_batch(args: argparse.Namespace, vocab: int) -> list[Any]:
    from crucible_trainer.rl.rollout import Sample

    rng = random.Random(args.seed)
    out = []
    for g in range(args.prompts):
        prompt = [rng.randrange(10, vocab) for _ in range(rng.randint(30, 120))]
        for _ in range(args.group):
            completion = [
                rng.randrange(10, vocab) for _ in range(rng.randint(args.min_tokens, args.max_tokens))
            ]
            advantage = rng.gauss(0, 1)
            out.append(Sample(g, g, prompt, completion, "", "", None, None, reward=0.0, advantage=advantage))
    return out


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    os.environ.setdefault("OMP_NUM_THREADS", str(os.cpu_count() or 1))
    with tempfile.TemporaryDirectory(prefix="crucible-update-speed-") as tmp:
        from bench.multi_gpu import local_model

        shape = argparse.Namespace(tiny=not args.shape, shape=args.shape)
        model = args.model or local_model(shape, Path(tmp))
        report = run(args, model)
    args.out.write_text(json.dumps(report, indent=2))
    print(json.dumps({k: v for k, v in report.items() if k != "updates"}, indent=2))


def run(args: argparse.Namespace, model: str) -> dict[str, Any]:
    from crucible_shared.jobs import TrainJob
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
    sets += args.overrides
    shape = argparse.Namespace(tiny=False, strategy="ddp", overrides=sets)
    spec, chosen = hardware.resolve(TrainJob.model_validate(job(shape, model, 1)))
    policy = Policy(spec.model, spec.optim, spec.seed)
    batch = synthetic_batch(args, len(policy.tokenizer))
    setups = {f.__name__: f for f in ARMS[args.compare]}
    arms: dict[str, list[dict[str, float]]] = {name: [] for name in setups}
    warmup: dict[str, float] = {}
    start = compiled_graphs()
    graphs: list[int] = []  # graphs traced by this run after the warm-ups and at the end
    for repeat in range(args.repeats + 1):
        if repeat == 1:
            graphs.append(compiled_graphs() - start)
        for arm in arms:
            optim = setups[arm](policy, spec.optim)
            cfg = method_module(spec.method).update_config(
                spec.method, spec.model_copy(update={"optim": optim})
            )
            started = time.perf_counter()
            metrics = update(policy, batch, cfg, seed=repeat)
            metrics["update_s"] = time.perf_counter() - started
            if repeat:  # the first of each arm warms up
                arms[arm].append(metrics)
            else:
                warmup[arm] = metrics["update_s"]
    graphs.append(compiled_graphs() - start)

    if args.profile:
        args.profile.write_text("\n".join(profiled(policy, batch, spec, setups[arm], update) for arm in arms))

    def median(rows: list[dict[str, float]], key: str) -> float | None:
        values = [r[key] for r in rows if key in r]
        return statistics.median(values) if values else None

    medians = {
        arm: {key: median(rows, metric or key) for key, metric in KEYS.items()} for arm, rows in arms.items()
    }
    before, after = (medians[f.__name__]["update_s"] for f in ARMS[args.compare])
    out = {
        "model": args.model or args.shape or "tiny",
        "compare": args.compare,
        "dtype": str(policy.model.get_base_model().dtype).removeprefix("torch."),
        "settings": chosen,
        "batch": len(batch),
        "max_tokens": args.max_tokens,
    }
    out["completion_tokens_mean"] = statistics.mean(len(s.completion_ids) for s in batch)
    out |= {"micro_batch": spec.optim.micro_batch, "kl_beta": args.kl_beta, "repeats": args.repeats}
    out |= {"overrides": args.overrides, "compile": spec.optim.compile, "warmup_s": warmup}
    if spec.optim.compile:
        # The compiler's time: the compiled arm's warm-up beyond its median update; graphs traced
        # after the warm-ups mean shapes the warm-up did not meet (or recompiles).
        out["compile_s"] = (
            warmup["compiled"] - medians["compiled"]["update_s"] if "compiled" in warmup else None
        )
        out["graphs"] = {"after_warmup": graphs[0], "at_end": graphs[-1]}
    return out | {"medians": medians, "speedup": round(before / after, 3) if after else None, "updates": arms}


def compiled_graphs() -> int:
    """Graphs torch.compile has traced in this process (0 when nothing is compiled)."""
    dynamo = sys.modules.get("torch._dynamo.utils")
    return int(dynamo.counters["stats"]["unique_graphs"]) if dynamo is not None else 0


def profiled(policy: Any, batch: list[Any], spec: Any, setup: Any, update: Any) -> str:
    """One more update of arm `setup`, profiled: its kernels by device time, then by host time."""
    from crucible_trainer.methods import method_module
    from torch.profiler import ProfilerActivity, profile

    optim = setup(policy, spec.optim)
    cfg = method_module(spec.method).update_config(spec.method, spec.model_copy(update={"optim": optim}))
    activities = [ProfilerActivity.CPU] + (
        [ProfilerActivity.CUDA] if policy.device.startswith("cuda") else []
    )
    with profile(activities=activities) as prof:
        update(policy, batch, cfg, seed=0)
    table = prof.key_averages()
    device = "cuda_time_total" if len(activities) > 1 else "cpu_time_total"
    return (
        f"# {setup.__name__}\n"
        + table.table(sort_by=device, row_limit=25)
        + table.table(sort_by="cpu_time_total", row_limit=12)
    )


if __name__ == "__main__":
    main()
