"""Samples/s and s/step of the same GRPO job on 1, 2, 4 GPUs, split between generation and update
(docs/benchmarks.md, "One job over several GPUs"): per GPU count N, one sandbox, N generator replicas
and the race's job (recipes/grpo_smollm2.yaml, JOB, then `--set`) with `distributed.train_gpus: N`,
through the worker's entry point; medians of the job's own metrics over the steps after the first.

    python bench/multi_gpu.py --gpus 1,2,4 --out multi_gpu.json                 # SmolLM2-135M
    python bench/multi_gpu.py --shape qwen2.5-coder-1.5b --gpus 1,2,4 --out multi_gpu_1p5b.json
    python bench/multi_gpu.py --tiny --gpus 1,2 --out /tmp/multi_gpu.json       # CPU, gloo: a check
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import traceback
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench import common

TARGETS = {2: 1.8, 4: 3.2}  # issue 26: samples/s over one GPU's
JOB = ["optim.problems_per_step=64", "optim.steps=4", "eval=null", "method.kl_beta=0.01"]  # 3 timed steps
TINY = ["optim.problems_per_step=2", "method.group_size=4", "rollout.max_tokens=8", "optim.steps=2"]
TINY += ["optim.micro_batch=4", "data.limit=4"]
# Report key -> the job's metric, medians over the steps after the first: the rollout, the update and
# its parts (docs/benchmarks.md, "What every step reports"), publishing, the unhidden stale check.
PARTS = ["generate", "rollout", "execute_tail", "update_command", "update_score", "update_passes"]
PARTS += ["update_ref", "update_old", "update_forward_backward", "update_allreduce", "update_optimizer"]
SPLIT = {f"{part}_s": f"time/{part}_s" for part in PARTS}
SPLIT |= {"update_s": "time/train_s", "publish_s": "publish/total_s", "stale_wait_s": "time/stale_wait_s"}
# The update's model FLOPs per second per GPU (rl/throughput.py) and the fraction of the card's peak.
FIGURES = ("tokens_per_s_per_gpu", "peak_fraction")
PERF = [f"perf/update{p}_{f}" for p in ("", "_train", "_ref", "_old") for f in FIGURES]


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = common.argument_parser(__doc__, overrides=True)
    parser.add_argument("--strategy", choices=["ddp", "fsdp"], default="ddp", help="distributed.strategy")
    args = common.options(
        parser,
        model=("smollm2-135m-instruct", "model.base of the job"),
        shape=(None, "build this shape with random weights (bench/model_shapes.py)"),
        tiny=(False, "a tiny random Qwen2 on CPU (gloo): a check of the script"),
        gpus=("1,2,4", "comma-separated GPU counts (ranks = replicas = N)"),
        generator_batch=(128, "rows each replica decodes at once"),
        out=Path,
    ).parse_args(argv)
    if args.tiny:  # rather than --shape
        args.shape, args.generator_batch = None, 4
    return args


def main(argv: list[str] | None = None) -> None:
    from bench.model_shapes import local_model

    args = parse(argv)
    common.local_events()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    runs, sets = [], [*(TINY if args.tiny else []), *args.overrides]
    with tempfile.TemporaryDirectory(prefix="crucible-multi-gpu-") as tmp:
        model = local_model(args.shape, Path(tmp)) if args.tiny or args.shape else args.model
        for n in (int(x) for x in args.gpus.split(",")):
            (work := Path(tmp) / f"n{n}").mkdir()
            try:
                runs.append(one_count(work, model, n, sets, args))
            except Exception as exc:  # the other counts still run: one failure costs one figure
                traceback.print_exc()
                common.show_logs(work, 40)  # the folder goes with the temporary directory
                runs.append({"gpus": n, "error": f"{type(exc).__name__}: {exc}"})
            if args.out:  # the services' logs beside the figures (the generator's graph captures, ...)
                for log in work.rglob("*.log"):
                    kept = args.out.with_name(f"{args.out.stem}-logs") / f"n{n}" / log.relative_to(work)
                    kept.parent.mkdir(parents=True, exist_ok=True)
                    shutil.copyfile(log, kept)
    report = summarise(args, job(model, 1, sets), runs)
    common.dump(args.out, report)
    print(json.dumps({k: v for k, v in report.items() if k != "runs"}, indent=2))
    columns = ["gpus", "s_per_step", "generate_s", "update_s", "publish_s", "other_s", "samples_per_s"]
    columns += ["speedup_samples_per_s", "target", "target_met", "error"]
    cells = [[r.get(c, "") for c in columns] for r in runs]
    print(common.md_table(columns, [[round(v, 2) if isinstance(v, float) else v for v in c] for c in cells]))
    if any("error" in r for r in runs):
        sys.exit(1)


def one_count(work: Path, model: str, n: int, sets: list[str], args: argparse.Namespace) -> dict[str, Any]:
    """The job over `n` ranks with a generator replica per GPU (on a CPU, `n` of them): its figures,
    and every step's split (the first one's too)."""
    spec = job(model, n, sets, args.strategy)
    devices = [str(i) for i in range(n)] if common.card() != "cpu" else [None] * n
    with common.services(work, model, args.generator_batch, devices=devices, max_ranks=n) as settings:
        summary = common.run_job(spec, f"multi-gpu-{n}", settings)
    rows = common.step_rows(work / "jobs" / f"multi-gpu-{n}")
    timing = [{k: v for k, v in r.items() if k.startswith(("time/", "publish/", "update/"))} for r in rows]
    found = figures(rows, n, spec.optim.problems_per_step * spec.method.group_size)
    return found | {"device": common.card(), "wall_s": round(summary["wall_s"], 1), "per_step": timing}


def job(model: str, n: int, overrides: list[str], strategy: str = "ddp") -> Any:
    """The job of every N: the race's with JOB's overrides, then `overrides`, over N ranks."""
    sets = [f"model.base={model}", *JOB, *overrides]
    # One process at N = 1 whatever the strategy (fsdp needs two ranks or more).
    sets += ["distributed=" + json.dumps({"train_gpus": n, "strategy": strategy if n > 1 else "ddp"})]
    return common.load_job(common.ROOT / "recipes" / "grpo_smollm2.yaml", sets)


def figures(rows: list[dict[str, Any]], n: int, samples: int) -> dict[str, Any]:
    """Medians over the steps after the first (all steps if there is one) of the job's metrics."""
    later = rows[1:] or rows
    med = {k: common.later_median(rows, m) for k, m in SPLIT.items()}
    step = common.later_median(rows, "time/step_s")
    rollout = med["rollout_s"] or med["generate_s"]
    other = step - rollout - med["update_s"] - med["publish_s"] - med["stale_wait_s"]
    out = {"gpus": n, "steps": len(later), "s_per_step": step, **med, "other_s": round(other, 6)}
    out["samples_per_s"] = samples / step
    out["generate_samples_per_s"] = samples / med["generate_s"] if med["generate_s"] else None
    out["update_samples_per_s"] = samples / med["update_s"] if med["update_s"] else None
    out["completion_tokens_mean"] = statistics.mean(r.get("completion_tokens_mean", 0.0) for r in later)
    out["update_sequences"] = common.later_median(rows, "update/sequences")
    out |= {k.removeprefix("perf/"): common.later_median(rows, k) for k in PERF if all(k in r for r in later)}
    return out | {"update_ranks": later[-1].get("update/ranks", 1.0)}


def summarise(args: argparse.Namespace, spec: Any, runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The report: the job, every N's figures, their speed-ups over N = 1 and the targets met or not."""
    one = next((r for r in runs if r["gpus"] == 1 and "error" not in r), {})
    for r in (r for r in runs if "error" not in r):
        for key in ("samples_per_s", "generate_samples_per_s", "update_samples_per_s"):
            r[f"speedup_{key}"] = round(r[key] / one[key], 3) if one.get(key) and r.get(key) else None
        r["target"], speedup = TARGETS.get(r["gpus"]), r["speedup_samples_per_s"]
        r["target_met"] = None if r["target"] is None or speedup is None else speedup >= r["target"]
    prompts, group = spec.optim.problems_per_step, spec.method.group_size
    out = {"model": args.shape or ("tiny" if args.tiny else args.model), "batch": prompts * group}
    out |= {"strategy": args.strategy, "prompts": prompts, "group": group}
    out["max_tokens"] = spec.rollout.max_tokens
    out |= {"micro_batch": spec.optim.micro_batch, "kl_beta": spec.method.kl_beta, "steps": spec.optim.steps}
    out |= {"generator_batch": args.generator_batch, "overrides": args.overrides}
    return out | {"targets": {str(k): v for k, v in TARGETS.items()}, "runs": runs}


if __name__ == "__main__":
    main()
