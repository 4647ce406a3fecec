"""Offline-learning figures on one GPU with the built-in SmolLM2-135M-Instruct: greedy pass@1 on
all 500 MBPP test tasks for the base model; SFT on rejection-sampled candidates; DPO on
pass/fail pairs; SFT then GRPO; and GRPO alone at a matched number of generated samples; with
the time of every stage. SFT and DPO (the headline rows) run for seeds 0 and 1.

The work is split in parts, one `bash bench/gpu.sh offline-<part>` call each (a call may run 10
minutes; the parts keep their state in --work, which survives between calls while the machine
stays warm):

  data    baseline (once: greedy decoding has no seed) + for each seed: K=8 candidates on the
          374 MBPP train problems (256 tokens) -> annotate -> build -> analyze   (pipeline jobs)
  train   for each seed: SFT on nbest and DPO on pairs of that seed's candidates (`reuse`), each
          evaluated on the 500 test tasks; the first SFT run also merges          (pipeline jobs)
  rl      GRPO from the seed-0 SFT adapter (KL to it) for --rl-steps steps, and GRPO alone for as
          many steps as match the samples SFT-then-GRPO generated (candidates + GRPO rollouts)
  table   the results table from every part's JSON

Every part starts a sandbox and a generator (CUDA + bf16 when present) as subprocesses and runs
the jobs in-process through the worker's entry point (bench/common.py's `run_job`). Each
part writes `<work>/offline-<part>.json`, and `offline-results.{json,md}` (every part so far)
into --out.

Usage: python bench/offline_figures.py PART [--seeds 0 1] [--work DIR] [--out DIR] [--rl-steps 16]
       [--tasks N] (N < 500: a quick run on the first N test / train tasks)
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.common import TRAIN, load_job, run_job, run_pipeline, services, step_rows  # noqa: E402

MODEL = "smollm2-135m-instruct"
K, MAX_TOKENS, PROMPTS_PER_STEP, GROUP = 8, 256, 8, 8  # GRPO: 8 problems x 8 samples = 64 per step
TRAIN_PROBLEMS = 374  # MBPP 601-974


def eval_spec(tasks: int) -> dict[str, Any]:
    return {
        "data": {"dataset": "mbpp", "split": "test", **({"limit": tasks} if tasks < 500 else {})},
        "greedy": True,
        "max_tokens": MAX_TOKENS,
    }


def data_spec(tasks: int) -> dict[str, Any]:
    return {"dataset": "mbpp", "split": "train", **({"limit": tasks} if tasks < TRAIN_PROBLEMS else {})}


def pipeline(seed: int, tasks: int, **fields: Any) -> dict[str, Any]:
    return {
        "kind": "pipeline",
        "model": {"base": MODEL, "lora_r": 16, "lora_alpha": 32},
        "data": data_spec(tasks),
        "generate": {"k": K, "temperature": 1.0, "top_p": 1.0, "max_tokens": MAX_TOKENS, "concurrency": 32},
        "build": {"n_best": 4, "pairing": "pass_fail", "max_pairs": 4},
        "eval": eval_spec(tasks),
        "checkpoint": {"every": 1000},
        "logging": {"wandb_mode": "disabled"},
        "seed": seed,
        **fields,
    }


def stage_times(summary: dict[str, Any]) -> dict[str, float]:
    return {k: v["seconds"] for k, v in summary["stages"].items() if v["status"] == "ran"}


def part_data(args: argparse.Namespace, settings: Any) -> dict[str, Any]:
    out: dict[str, Any] = {"seeds": {}}
    for seed in args.seeds:
        stages = ["generate", "annotate", "build", "analyze"]
        if seed == args.seeds[0]:
            stages.insert(0, "baseline")
        summary = run_pipeline(pipeline(seed, args.tasks, stages=stages), f"data-s{seed}", settings)
        run = Path(summary["run_dir"])
        analysis = json.loads((run / "analysis" / "analysis.json").read_text())["rounds"]["round-1"]
        analysis.pop("per_problem_pass_rate")
        out["seeds"][seed] = {
            "stages_s": stage_times(summary),
            "counts": summary["rounds"]["round-1"],
            "analysis": analysis,
        }
        if "eval" in summary:
            out["base"] = summary["eval"]["before"] | {"seconds": summary["stages"]["baseline"]["seconds"]}
    return out


def part_train(args: argparse.Namespace, settings: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for method in ("sft", "dpo"):
        for seed in args.seeds:
            spec = pipeline(
                seed,
                args.tasks,
                reuse=f"data-s{seed}",
                # Merge once, for its time.
                stages=["build", "train", "merge", "evaluate"]
                if (method, seed) == ("sft", args.seeds[0])
                else ["build", "train", "evaluate"],
                **TRAIN[method],
            )
            # The baseline report is the data job's (copied by `reuse`), so `evaluate` compares against it.
            summary = run_pipeline(spec, f"{method}-s{seed}", settings)
            record = json.loads((Path(summary["run_dir"]) / "pipeline.json").read_text())["stages"]
            out.setdefault(method, {})[seed] = {
                "eval": summary["eval"]["after"],
                "stages_s": stage_times(summary),
                "train": record["round-1/train"]["detail"],
                "rows": summary["rounds"]["round-1"]["nbest" if method == "sft" else "pairs"],
                "adapter": summary.get("adapter"),
            }
    return out


def grpo_job(steps: int, tasks: int, seed: int, init_adapter: str | None) -> Any:
    """The GRPO race's job (recipes/grpo_smollm2.yaml at micro-batches of 64) for `steps` steps on
    this part's problems, evaluated after training only (before: the base / SFT rows of the table);
    from `init_adapter` with KL 0.02 to that SFT policy when given."""
    sets = [f"optim.steps={steps}", "optim.micro_batch=64", f"data={json.dumps(data_spec(tasks))}"]
    sets += ["data.shuffle=true", f"data.seed={seed}", f"seed={seed}"]
    sets += [f"eval={json.dumps({**eval_spec(tasks), 'before': False})}"]
    if init_adapter:
        sets += [f"model={json.dumps({'base': MODEL, 'init_adapter': init_adapter})}", "method.kl_beta=0.02"]
    return load_job(ROOT / "recipes" / "grpo_smollm2.yaml", sets)


def run_grpo(spec: Any, job_id: str, settings) -> dict[str, Any]:
    summary = run_job(spec, job_id, settings)
    steps = step_rows(Path(summary["run_dir"]))
    result = {
        "eval": summary["eval"]["after"],
        "steps": len(steps),
        "samples": int(sum(r.get("samples", 0) for r in steps)),
        "wall_s": summary["wall_s"],
        "train_s": sum(r["time/step_s"] for r in steps),
        "median_step_s": sorted(r["time/step_s"] for r in steps)[len(steps) // 2],
        "reward_mean": sum(r.get("reward_mean", 0) for r in steps) / max(1, len(steps)),
    }
    print(f"{job_id}: {json.dumps(result)}", flush=True)
    return result


def part_rl(args: argparse.Namespace, settings: Any) -> dict[str, Any]:
    seed = args.seeds[0]
    train = json.loads((args.work / "offline-train.json").read_text())
    sft_adapter = train["sft"][str(seed)]["adapter"]
    candidates = json.loads((args.work / "offline-data.json").read_text())["seeds"][str(seed)]["counts"][
        "candidates"
    ]
    sft_rl = run_grpo(grpo_job(args.rl_steps, args.tasks, seed, sft_adapter), f"sft-grpo-s{seed}", settings)
    # Matched budget: SFT-then-GRPO generated the K candidates per problem plus its rollouts.
    matched = candidates + sft_rl["samples"]
    steps = math.ceil(matched / (PROMPTS_PER_STEP * GROUP))
    alone = run_grpo(grpo_job(steps, args.tasks, seed, None), f"grpo-s{seed}", settings)
    return {
        "sft_grpo": {**sft_rl, "samples_total": matched, "sft_adapter": sft_adapter},
        "grpo": {**alone, "samples_total": alone["samples"], "matched_to": matched},
    }


def table(work: Path) -> tuple[dict[str, Any], str]:
    parts = {
        p: json.loads(f.read_text())
        for p in ("data", "train", "rl")
        if (f := work / f"offline-{p}.json").exists()
    }
    rows: list[dict[str, Any]] = []

    def pct(e: dict[str, Any]) -> float:
        return round(100 * e["greedy_pass@1"], 2)

    data, train, rl = parts.get("data", {}), parts.get("train", {}), parts.get("rl", {})
    if "base" in data:
        rows.append(
            {
                "row": "base",
                "seed": "-",
                "pass@1": pct(data["base"]),
                "samples": 0,
                "seconds": data["base"]["seconds"],
            }
        )
    for method, label in (("sft", "SFT on rejection-sampled candidates"), ("dpo", "DPO on pass/fail pairs")):
        for seed, r in sorted(train.get(method, {}).items()):
            gen = data.get("seeds", {}).get(seed, {})
            rows.append(
                {
                    "row": label,
                    "seed": seed,
                    "pass@1": pct(r["eval"]),
                    "samples": gen.get("counts", {}).get("candidates"),
                    "train_rows": r["rows"],
                    "train_steps": r["train"]["steps"],
                    "seconds": round(sum(gen.get("stages_s", {}).values()) + sum(r["stages_s"].values()), 1),
                }
            )
    for key, label in (("sft_grpo", "SFT then GRPO"), ("grpo", "GRPO alone, matched samples")):
        if key in rl:
            r = rl[key]
            rows.append(
                {
                    "row": label,
                    "seed": "0",
                    "pass@1": pct(r["eval"]),
                    "samples": r["samples_total"],
                    "train_steps": r["steps"],
                    "seconds": round(r["wall_s"], 1),
                }
            )
    lines = [
        "| run | seed | greedy pass@1 (MBPP test) | generated samples | train rows | steps | seconds (all its stages) |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['row']} | {r['seed']} | {r['pass@1']:.1f}% | {r.get('samples') or '-'} | {r.get('train_rows', '-')} "
            f"| {r.get('train_steps', '-')} | {r['seconds']} |"
        )
    stage_lines = ["", "| job | stage | seconds |", "|---|---|---:|"]
    for seed, d in sorted(data.get("seeds", {}).items()):
        stage_lines += [f"| data-s{seed} | {k} | {v:.1f} |" for k, v in d["stages_s"].items()]
    for method in ("sft", "dpo"):
        for seed, r in sorted(train.get(method, {}).items()):
            stage_lines += [f"| {method}-s{seed} | {k} | {v:.1f} |" for k, v in r["stages_s"].items()]
    return {"rows": rows, "parts": parts}, "\n".join(lines + stage_lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("part", choices=["data", "train", "rl", "table"])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--work", type=Path, default=Path("/root/offline"))
    parser.add_argument("--out", type=Path, default=Path("/tmp"))
    parser.add_argument("--rl-steps", type=int, default=16, help="GRPO steps after SFT")
    parser.add_argument("--tasks", type=int, default=500, help="< 500: the first N test and train tasks only")
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.part != "table":
        started = time.perf_counter()
        with services(args.work, MODEL) as settings:
            result = {"data": part_data, "train": part_train, "rl": part_rl}[args.part](args, settings)
        result["part_wall_s"] = time.perf_counter() - started
        (args.work / f"offline-{args.part}.json").write_text(json.dumps(result, indent=1))
        (args.out / f"offline-{args.part}.json").write_text(json.dumps(result, indent=1))
    results, markdown = table(args.work)
    (args.out / "offline-results.json").write_text(json.dumps(results, indent=1))
    (args.out / "offline-results.md").write_text(markdown)
    print(markdown)


if __name__ == "__main__":
    main()
