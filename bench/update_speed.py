"""The policy update alone, timed with its micro-batches in the batch's order and filled longest
first (`optim.length_buckets` false / true), side by side on one policy.

The job is bench/multi_gpu.py's GRPO spec (`kl_beta` 0.01: every sequence trains and the reference is
scored), resolved for the machine (`hardware.resolve`), its update built by the method. The batch is
synthetic and seeded: `--prompts` groups of `--group` samples sharing a 30-120 token prompt,
completions of 1 to `--max-tokens` tokens. The arms alternate `--repeats` times after a warm-up
each; the figures are per-arm medians of the update's own metrics.

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

KEYS = {"update_s": None, "score_s": "time/update_score_s", "ref_s": "time/update_ref_s"}  # key -> metric
KEYS |= {"forward_backward_s": "time/update_forward_backward_s", "optimizer_s": "time/update_optimizer_s"}
KEYS |= {
    "tokens_per_s_per_gpu": "perf/update_tokens_per_s_per_gpu",
    "peak_fraction": "perf/update_peak_fraction",
}


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
            advantage = rng.gauss(0, 1)
            out.append(Sample(g, g, prompt, completion, "", "", None, None, reward=0.0, advantage=advantage))
    return out


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    os.environ.setdefault("OMP_NUM_THREADS", str(os.cpu_count() or 1))
    with tempfile.TemporaryDirectory(prefix="crucible-update-speed-") as tmp:
        from bench.multi_gpu import local_model

        model = local_model(argparse.Namespace(tiny=not args.shape, shape=args.shape), Path(tmp))
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
    shape = argparse.Namespace(
        tiny=False, strategy="ddp", overrides=[*sets, f"method.kl_beta={args.kl_beta}"]
    )
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

    def median(rows: list[dict[str, float]], key: str) -> float | None:
        values = [r[key] for r in rows if key in r]
        return statistics.median(values) if values else None

    medians = {
        arm: {key: median(rows, metric or key) for key, metric in KEYS.items()} for arm, rows in arms.items()
    }
    before, after = medians["batch_order"]["update_s"], medians["length_buckets"]["update_s"]
    out = {
        "model": args.shape or "tiny",
        "settings": chosen,
        "batch": len(batch),
        "max_tokens": args.max_tokens,
    }
    out["completion_tokens_mean"] = statistics.mean(len(s.completion_ids) for s in batch)
    out |= {"micro_batch": spec.optim.micro_batch, "kl_beta": args.kl_beta, "repeats": args.repeats}
    return out | {"medians": medians, "speedup": round(before / after, 3) if after else None, "updates": arms}


if __name__ == "__main__":
    main()
