"""The policy update alone, timed with its micro-batches in the batch's order and filled longest
first (`optim.length_buckets` false / true), side by side in one run.

The job is `bench/multi_gpu.py`'s GRPO spec (the race's: LoRA r16 all-linear, `kl_beta` 0.01 so
every sequence trains and the reference is scored), resolved for the machine as a job resolves it
(`hardware.resolve`), its update built by the method (`methods.clipped.update_config`). The batch
is synthetic and seeded: `--prompts` groups of `--group` samples sharing a prompt of 30-120 tokens,
completions of 1 to `--max-tokens` tokens drawn uniformly (sampled completions vary so; random
weights would run every one to the limit), advantages drawn from a normal. The two arms alternate
on one policy, `--repeats` times each after a warm-up of each; the figures are per-arm medians of
the update's own metrics (its wall time, each part, tokens per second).

    python bench/update_speed.py --out /tmp/update-speed.json                # tiny Qwen2 on a CPU
    python bench/update_speed.py --shape smollm2-135m --out /tmp/u.json      # a real shape (GPU)
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

KEYS = [  # report key -> the update's metric
    ("update_s", None),
    ("score_s", "time/update_score_s"),
    ("ref_s", "time/update_ref_s"),
    ("forward_backward_s", "time/update_forward_backward_s"),
    ("optimizer_s", "time/update_optimizer_s"),
    ("tokens_per_s_per_gpu", "perf/update_tokens_per_s_per_gpu"),
    ("peak_fraction", "perf/update_peak_fraction"),
]


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", help="a real model's shape with random weights (bench/model_shapes.py)")
    p.add_argument("--prompts", type=int, default=8, help="groups (problems) in the batch")
    p.add_argument("--group", type=int, default=8, help="samples per group")
    p.add_argument("--max-tokens", type=int, default=128, help="longest completion")
    p.add_argument("--micro-batch", type=int, default=16, help="optim.micro_batch")
    p.add_argument(
        "--kl-beta", type=float, default=0.01, help="method.kl_beta (> 0: the reference is scored)"
    )
    p.add_argument("--repeats", type=int, default=3, help="timed updates per arm (after one warm-up each)")
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
            completion = [rng.randrange(10, vocab) for _ in range(rng.randint(1, args.max_tokens))]
            out.append(
                Sample(g, g, prompt, completion, "", "", None, None, reward=0.0, advantage=rng.gauss(0, 1))
            )
    return out


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    os.environ.setdefault("OMP_NUM_THREADS", str(os.cpu_count() or 1))
    with tempfile.TemporaryDirectory(prefix="crucible-update-speed-") as tmp:
        if args.shape:
            from bench.model_shapes import build
            from bench.multi_gpu import device

            model = build(args.shape, Path(tmp), device(), "bfloat16", 0, False)["path"]
        else:
            from bench.multi_gpu import tiny_model

            model = tiny_model(Path(tmp) / "tiny")
        roots = [tmp, *filter(None, os.environ.get("CRUCIBLE_MODEL_ROOTS", "").split(","))]
        os.environ["CRUCIBLE_MODEL_ROOTS"] = ",".join(roots)
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

    shape = argparse.Namespace(
        steps=1, prompts=args.prompts, max_tokens=args.max_tokens, micro_batch=args.micro_batch,
        group=args.group, kl_beta=args.kl_beta, tiny=True, strategy="ddp",
    )  # fmt: skip
    spec, chosen = hardware.resolve(TrainJob.model_validate(job(shape, model, 1)))
    policy = Policy(spec.model, spec.optim, spec.seed)
    batch = synthetic_batch(args, len(policy.tokenizer))
    arms: dict[str, list[dict[str, float]]] = {"batch_order": [], "length_buckets": []}
    for repeat in range(args.repeats + 1):
        for arm in arms:
            optim = spec.optim.model_copy(update={"length_buckets": arm == "length_buckets"})
            cfg = method_module(spec.method).update_config(
                spec.method, spec.model_copy(update={"optim": optim})
            )
            started = time.perf_counter()
            metrics = update(policy, batch, cfg, seed=repeat)
            metrics["update_s"] = time.perf_counter() - started
            if repeat:  # the first of each arm warms up
                arms[arm].append(metrics)
    medians = {arm: {key: _median(rows, metric or key) for key, metric in KEYS} for arm, rows in arms.items()}
    before, after = medians["batch_order"]["update_s"], medians["length_buckets"]["update_s"]
    lengths = [len(s.completion_ids) for s in batch]
    return {
        "model": args.shape or "tiny",
        "settings": chosen,
        "batch": len(batch),
        "completion_tokens_mean": statistics.mean(lengths),
        "max_tokens": args.max_tokens,
        "micro_batch": spec.optim.micro_batch,
        "kl_beta": args.kl_beta,
        "repeats": args.repeats,
        "medians": medians,
        "speedup": round(before / after, 3) if after else None,
        "updates": arms,
    }


def _median(rows: list[dict[str, float]], key: str) -> float | None:
    values = [r[key] for r in rows if key in r]
    return statistics.median(values) if values else None


if __name__ == "__main__":
    main()
