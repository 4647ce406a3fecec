"""Overlapped rollouts against the synchronous loop: GRPO with `overlap.max_staleness` s = 1, 2
against s = 0 at an equal number of samples (the same steps x problems x group size), over seeds.

For each seed and each s, one training job (`--spec`, default recipes/grpo_smollm2.yaml: SmolLM2-135M,
LoRA r16 on all linear layers, MBPP train, 8 problems x 8 samples, 256 tokens, fraction-of-tests
reward, 100 steps; micro-batches of 64 and no evaluation before, as the race; then any `--set`
overrides) runs in this process through the worker's entry point against one sandbox and one
generator spawned for the whole benchmark, and its final adapter is evaluated greedily on the job's
MBPP test tasks (500). Reported
per s: samples per second of training (samples / the summed `time/step_s`: the loop's wall time,
evaluation excluded), the final greedy pass@1, each as mean and standard error over seeds, with
the ratios to s = 0 (seed by seed and of the means) and whether the issue's targets are met:
>= 1.4x the synchronous samples/s, final pass@1 within one standard error of the synchronous one.
The overlapped runs also report their importance weights (mean, max, fraction truncated).

Usage: python bench/overlap_race.py [--staleness 0 1 2] [--seeds 0 1 2] [--spec FILE]
           [--set optim.steps=60 --set optim.lr=2e-4 ...] [--json out.json]
       python bench/overlap_race.py --tiny --json /tmp/overlap.json   # CPU smoke test (minutes)
       python bench/overlap_race.py --merge a.json b.json --json all.json   # runs made apart (one
           seed per GPU: `bash bench/gpu.sh bg` per card) as one comparison
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.common import card, load_job, run_job, services, step_rows  # noqa: E402

# The race's job (micro-batches of 64), evaluated after training only: the same for every s of a seed.
RACE = ["optim.micro_batch=64", "eval.before=false"]
TINY = [
    *("optim.steps=3", "optim.problems_per_step=1", "method.group_size=2", "rollout.max_tokens=16"),
    *("eval.max_tokens=16", "eval.data.limit=2", "data.limit=4"),
]
SPEEDUP_TARGET = 1.4


def mean_se(values: list[float]) -> dict:
    """Mean and standard error (sample std / sqrt n; 0 for one value).

    >>> mean_se([1.0, 2.0, 3.0])
    {'mean': 2.0, 'se': 0.57735, 'n': 3}
    """
    if not values:
        return {"mean": None, "se": None, "n": 0}
    se = statistics.stdev(values) / math.sqrt(len(values)) if len(values) > 1 else 0.0
    return {"mean": round(statistics.fmean(values), 6), "se": round(se, 6), "n": len(values)}


def run_figures(rows: list[dict], summary: dict) -> dict:
    """One run's figures from its metrics rows and summary.

    >>> rows = [{"samples": 4.0, "time/step_s": 2.0, "tis/weight_mean": 1.0, "tis/weight_max": 1.5,
    ...          "tis/truncated_fraction": 0.0, "overlap/staleness_max": 1.0},
    ...         {"samples": 4.0, "time/step_s": 2.0}]
    >>> f = run_figures(rows, {"eval": {"after": {"greedy_pass@1": 0.25}}})
    >>> f["samples"], f["train_s"], f["samples_per_s"], f["pass1"], f["tis_weight_max"]
    (8.0, 4.0, 2.0, 0.25, 1.5)
    """
    samples = sum(r.get("samples", 0.0) for r in rows)
    train_s = sum(r["time/step_s"] for r in rows)
    tis = [r for r in rows if "tis/weight_mean" in r]
    after = ((summary.get("eval") or {}).get("after") or {}).get("greedy_pass@1")
    return {
        "steps": len(rows),
        "samples": samples,
        "train_s": round(train_s, 4),
        "samples_per_s": round(samples / train_s, 4) if train_s > 0 else None,
        "pass1": after,
        "tis_weight_mean": statistics.fmean(r["tis/weight_mean"] for r in tis) if tis else None,
        "tis_weight_max": max(r["tis/weight_max"] for r in tis) if tis else None,
        "tis_truncated_fraction": statistics.fmean(r["tis/truncated_fraction"] for r in tis) if tis else None,
        "staleness_max": max((r.get("overlap/staleness_max", 0.0) for r in rows), default=0.0),
        "rollout_wait_s": sum(r.get("time/rollout_wait_s", 0.0) for r in rows),
    }


def compare(runs: list[dict]) -> dict:
    """Per staleness: mean +- se of samples/s and pass@1, ratios to s = 0 and the targets.

    >>> runs = [{"staleness": 0, "seed": 0, "samples_per_s": 10.0, "pass1": 0.05},
    ...         {"staleness": 0, "seed": 1, "samples_per_s": 12.0, "pass1": 0.07},
    ...         {"staleness": 1, "seed": 0, "samples_per_s": 15.0, "pass1": 0.06},
    ...         {"staleness": 1, "seed": 1, "samples_per_s": 18.0, "pass1": 0.07}]
    >>> c = compare(runs)["1"]
    >>> c["speedup_of_means"], c["speedup_by_seed"], c["speedup_target_met"], c["pass1_within_one_se"]
    (1.5, [1.5, 1.5], True, True)
    """
    out: dict = {}
    by_s: dict[int, dict[int, dict]] = {}
    for r in runs:
        by_s.setdefault(r["staleness"], {})[r["seed"]] = r
    base = by_s.get(0, {})
    base_sps = mean_se([r["samples_per_s"] for r in base.values() if r["samples_per_s"]])
    base_pass = mean_se([r["pass1"] for r in base.values() if r["pass1"] is not None])
    for s, seeds in sorted(by_s.items()):
        sps = mean_se([r["samples_per_s"] for r in seeds.values() if r["samples_per_s"]])
        pass1 = mean_se([r["pass1"] for r in seeds.values() if r["pass1"] is not None])
        entry: dict = {"samples_per_s": sps, "pass1": pass1, "seeds": sorted(seeds)}
        if s and base:
            paired = sorted(set(seeds) & set(base))
            speedup = round(sps["mean"] / base_sps["mean"], 4) if sps["mean"] and base_sps["mean"] else None
            entry["speedup_of_means"] = speedup
            entry["speedup_by_seed"] = [
                round(seeds[k]["samples_per_s"] / base[k]["samples_per_s"], 4) for k in paired
            ]
            entry["speedup_target_met"] = speedup is not None and speedup >= SPEEDUP_TARGET
            if pass1["mean"] is not None and base_pass["mean"] is not None:
                diff = pass1["mean"] - base_pass["mean"]
                entry["pass1_minus_sync"] = round(diff, 6)
                entry["pass1_within_one_se"] = abs(diff) <= max(base_pass["se"], pass1["se"]) + 1e-12
        out[str(s)] = entry
    return out


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--staleness", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--spec", type=Path, default=ROOT / "recipes" / "grpo_smollm2.yaml")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="FIELD=VALUE")
    parser.add_argument("--cap", type=float, default=2.0, help="truncation of the importance weights")
    parser.add_argument("--generator-rows", type=int, default=128)
    parser.add_argument(
        "--generator-device",
        help="CUDA_VISIBLE_DEVICES of the spawned generator (default: the trainer's card); e.g. the "
        "trainer on card 0 and the generator on card 1 measures the overlap without the two sharing a card",
    )
    parser.add_argument("--tiny", action="store_true", help="a CPU smoke test: --set " + " --set ".join(TINY))
    parser.add_argument("--json", type=Path)
    parser.add_argument("--merge", type=Path, nargs="+", help="combine the runs of these JSON files")
    args = parser.parse_args()
    args.overrides = [*RACE, *(TINY if args.tiny else []), *args.overrides]
    if args.tiny:
        args.seeds = args.seeds[:1]
    return args


def spec_of(args: argparse.Namespace, staleness: int, seed: int) -> object:
    """The job of one run: the spec and its overrides, this seed and this staleness."""
    overlap = [f"overlap.max_staleness={staleness}", f"overlap.cap={args.cap}"] if staleness else []
    return load_job(args.spec, [*args.overrides, f"seed={seed}", f"data.seed={seed}", *overlap])


def merge(paths: list[Path]) -> dict:
    """One comparison from results written apart (their setups must agree; devices are listed)."""
    parts = [json.loads(p.read_text()) for p in paths]
    setups = {json.dumps(p["setup"], sort_keys=True) for p in parts}
    if len(setups) > 1:
        raise SystemExit(f"--merge: the files ran different setups: {sorted(setups)}")
    runs = [run for p in parts for run in p["runs"]]
    return {
        "setup": parts[0]["setup"],
        "device": sorted({p["device"] for p in parts}),
        "runs": runs,
        "by_staleness": compare(runs),
        "targets": parts[0]["targets"],
        "merged_from": [p.name for p in paths],
    }


def main() -> None:
    args = parse()
    if args.merge:
        merged = merge(args.merge)
        print(json.dumps(merged["by_staleness"], indent=1))
        if args.json:
            args.json.write_text(json.dumps(merged, indent=1))
        return
    first = spec_of(args, 0, args.seeds[0])
    work = Path(tempfile.mkdtemp(prefix="crucible-overlap-"))
    runs: list[dict] = []
    with services(
        work,
        first.model.base,
        args.generator_rows,
        device=args.generator_device,
        max_loras=max(4, max(args.staleness) + 2),
    ) as settings:
        for seed in args.seeds:
            for s in args.staleness:
                job_id = f"overlap-s{s}-seed{seed}"
                summary = run_job(spec_of(args, s, seed), job_id, settings)
                figures = {
                    "staleness": s,
                    "seed": seed,
                    "wall_s": round(summary["wall_s"], 2),
                    **run_figures(step_rows(work / "jobs" / job_id), summary),
                }
                runs.append(figures)
                print(json.dumps(figures), flush=True)
    result = {
        "setup": {
            "spec": str(
                args.spec.resolve().relative_to(ROOT)
                if args.spec.resolve().is_relative_to(ROOT)
                else args.spec
            ),
            "overrides": args.overrides,
            "cap": args.cap,
            "tiny": args.tiny,
            "generator_device": args.generator_device,
        },
        "device": card(),
        "runs": runs,
        "by_staleness": compare(runs),
        "targets": {"speedup": SPEEDUP_TARGET, "pass1": "within one standard error of s = 0"},
    }
    print(json.dumps(result["by_staleness"], indent=1))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
