"""Offline-learning figures (docs/benchmarks.md, "Offline pipeline"): the pipeline job of
recipes/offline_smollm2.yaml and the GRPO job of recipes/grpo_smollm2.yaml, in parts of at most ten
minutes (one `bash bench/gpu.sh offline-<part>` call each) that keep their state in `--work`:

  data    baseline (once: greedy decoding has no seed) + per seed: candidates -> annotate -> build -> analyze
  train   per seed: SFT and DPO on that seed's candidates (`reuse`), each evaluated; the first SFT merges too
  rl      GRPO from the seed-0 SFT adapter (KL 0.02 to it) for --rl-steps steps, and GRPO alone for as
          many steps as match the samples SFT-then-GRPO generated (candidates + rollouts)
  table   the results table from every part's JSON (`offline-results.{json,md}` in --out, also after each part)

  python bench/offline_figures.py PART [--seeds 0 1] [--work DIR] [--out DIR] [--rl-steps 16] [--tasks N]
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

from bench.common import argument_parser, dump, load_job, md_table, read_json, run_job, services, step_rows  # noqa: E402

PIPELINE, GRPO = ROOT / "recipes" / "offline_smollm2.yaml", ROOT / "recipes" / "grpo_smollm2.yaml"
DPO = ["train={name: dpo, beta: 0.1, epochs: 2, max_length: 1024}"]  # the base model as reference
DPO += ["optim={lr: 5.0e-5, micro_batch: 8, warmup_steps: 5}"]
STEP_SAMPLES = 64  # the GRPO job's 8 problems x 8 samples


def limits(tasks: int) -> list[str]:
    """`--tasks N` below 500: the first N test and train tasks only (a quick run)."""
    return [f"eval.data.limit={tasks}", f"data.limit={tasks}"] if tasks < 500 else []


def pipeline(args: argparse.Namespace, job_id: str, seed: int, stages: list[str], sets: list[str],
             settings: Any) -> tuple[dict[str, Any], dict[str, float]]:  # fmt: skip
    """One pipeline job of the recipe: its summary and the seconds of each stage it ran."""
    spec = load_job(PIPELINE, [f"seed={seed}", f"stages={json.dumps(stages)}", *limits(args.tasks), *sets])
    summary = run_job(spec, job_id, settings)
    return summary, {k: v["seconds"] for k, v in summary["stages"].items() if v["status"] == "ran"}


def part_data(args: argparse.Namespace, settings: Any) -> dict[str, Any]:
    out: dict[str, Any] = {"seeds": {}}
    for seed in args.seeds:
        stages = ["baseline"] * (seed == args.seeds[0]) + ["generate", "annotate", "build", "analyze"]
        summary, times = pipeline(args, f"data-s{seed}", seed, stages, [], settings)
        analysis = read_json(Path(summary["run_dir"]) / "analysis" / "analysis.json")["rounds"]["round-1"]
        analysis.pop("per_problem_pass_rate")
        out["seeds"][seed] = {"stages_s": times, "counts": summary["rounds"]["round-1"], "analysis": analysis}
        if "eval" in summary:
            out["base"] = summary["eval"]["before"] | {"seconds": summary["stages"]["baseline"]["seconds"]}
    return out


def part_train(args: argparse.Namespace, settings: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for method in ("sft", "dpo"):
        for seed in args.seeds:
            merge = ["merge"] if (method, seed) == ("sft", args.seeds[0]) else []  # once, for its time
            sets = [f"reuse=data-s{seed}", *(DPO if method == "dpo" else [])]  # the data job's baseline too
            stages = ["build", "train", *merge, "evaluate"]
            summary, times = pipeline(args, f"{method}-s{seed}", seed, stages, sets, settings)
            record = read_json(Path(summary["run_dir"]) / "pipeline.json")["stages"]
            rows = summary["rounds"]["round-1"]["nbest" if method == "sft" else "pairs"]
            out.setdefault(method, {})[seed] = {"eval": summary["eval"]["after"], "stages_s": times,
                                                "train": record["round-1/train"]["detail"], "rows": rows,
                                                "adapter": summary.get("adapter")}  # fmt: skip
    return out


def grpo(
    args: argparse.Namespace, steps: int, seed: int, adapter: str | None, settings: Any
) -> dict[str, Any]:
    """The GRPO race's job for `steps` steps, evaluated after training only (the table's base and
    SFT rows are the "before"); from `adapter` with KL 0.02 to that SFT policy when given."""
    sets = [f"optim.steps={steps}", "optim.micro_batch=64", "eval.before=false", f"seed={seed}"]
    sets += [f"data.seed={seed}", "eval.data.limit=null", *limits(args.tasks)]
    if adapter:
        sets += [f"model={json.dumps({'base': 'smollm2-135m-instruct', 'init_adapter': adapter})}"]
        sets += ["method.kl_beta=0.02"]
    job_id = f"{'sft-grpo' if adapter else 'grpo'}-s{seed}"
    summary = run_job(load_job(GRPO, sets), job_id, settings)
    done = step_rows(Path(summary["run_dir"]))
    seconds = sorted(r["time/step_s"] for r in done)
    result = {"eval": summary["eval"]["after"], "steps": len(done), "wall_s": summary["wall_s"]}
    result |= {"samples": int(sum(r.get("samples", 0) for r in done)), "train_s": sum(seconds)}
    result |= {"median_step_s": seconds[len(seconds) // 2]}
    result["reward_mean"] = sum(r.get("reward_mean", 0) for r in done) / max(1, len(done))
    print(f"{job_id}: {json.dumps(result)}", flush=True)
    return result


def part_rl(args: argparse.Namespace, settings: Any) -> dict[str, Any]:
    seed = args.seeds[0]
    adapter = read_json(args.work / "offline-train.json")["sft"][str(seed)]["adapter"]
    sft_rl = grpo(args, args.rl_steps, seed, adapter, settings)
    # Matched budget: SFT-then-GRPO generated the K candidates per problem plus its rollouts.
    matched = read_json(args.work / "offline-data.json")["seeds"][str(seed)]["counts"]["candidates"]
    matched += sft_rl["samples"]
    alone = grpo(args, math.ceil(matched / STEP_SAMPLES), seed, None, settings)
    return {
        "sft_grpo": {**sft_rl, "samples_total": matched, "sft_adapter": adapter},
        "grpo": {**alone, "samples_total": alone["samples"], "matched_to": matched},
    }


def table(work: Path) -> tuple[dict[str, Any], str]:
    """Every part's results as rows (run, seed, greedy pass@1, samples, seconds) and as Markdown."""
    found = {p: read_json(work / f"offline-{p}.json") for p in ("data", "train", "rl")}
    parts = {p: part for p, part in found.items() if part is not None}
    data, train, rl = parts.get("data", {}), parts.get("train", {}), parts.get("rl", {})
    rows: list[dict[str, Any]] = []
    if "base" in data:
        base = data["base"]
        rows.append({"row": "base", "seed": "-", "eval": base, "samples": 0, "seconds": base["seconds"]})
    for method, label in (("sft", "SFT on rejection-sampled candidates"), ("dpo", "DPO on pass/fail pairs")):
        for seed, r in sorted(train.get(method, {}).items()):
            gen = data.get("seeds", {}).get(seed, {})
            seconds = round(sum(gen.get("stages_s", {}).values()) + sum(r["stages_s"].values()), 1)
            samples = gen.get("counts", {}).get("candidates")
            rows.append({"row": label, "seed": seed, "eval": r["eval"], "samples": samples})
            rows[-1] |= {"seconds": seconds, "train_rows": r["rows"], "train_steps": r["train"]["steps"]}
    for key, label in (("sft_grpo", "SFT then GRPO"), ("grpo", "GRPO alone, matched samples")):
        if r := rl.get(key):
            rows.append({"row": label, "seed": "0", "eval": r["eval"], "samples": r["samples_total"]})
            rows[-1] |= {"train_steps": r["steps"], "seconds": round(r["wall_s"], 1)}
    for r in rows:
        r["pass@1"] = round(100 * r.pop("eval")["greedy_pass@1"], 2)
    head = ["run", "seed", "greedy pass@1 (MBPP test)", "generated samples", "train rows", "steps"]
    cells = [[r["row"], r["seed"], f"{r['pass@1']:.1f}%", r.get("samples") or "-", r.get("train_rows", "-"),
              r.get("train_steps", "-"), r["seconds"]] for r in rows]  # fmt: skip
    jobs = {f"data-s{seed}": d for seed, d in sorted(data.get("seeds", {}).items())}
    jobs |= {f"{m}-s{seed}": r for m in ("sft", "dpo") for seed, r in sorted(train.get(m, {}).items())}
    stages = [[job, k, f"{v:.1f}"] for job, d in jobs.items() for k, v in d["stages_s"].items()]
    text = md_table([*head, "seconds (all its stages)"], cells, "  :::::")
    text += "\n\n" + md_table(["job", "stage", "seconds"], stages, "  :")
    return {"rows": rows, "parts": parts}, text + "\n"


def main() -> None:
    parser = argument_parser(__doc__)
    parser.add_argument("part", choices=["data", "train", "rl", "table"])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--work", type=Path, default=Path("/root/offline"))
    parser.add_argument("--out", type=Path, default=Path("/tmp"))
    parser.add_argument("--rl-steps", type=int, default=16, help="GRPO steps after SFT")
    parser.add_argument("--tasks", type=int, default=500, help="< 500: the first N test and train tasks only")
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    if args.part != "table":
        started = time.perf_counter()
        with services(args.work, "smollm2-135m-instruct") as settings:
            result = {"data": part_data, "train": part_train, "rl": part_rl}[args.part](args, settings)
        result["part_wall_s"] = time.perf_counter() - started
        for folder in (args.work, args.out):
            dump(folder / f"offline-{args.part}.json", result)
    results, markdown = table(args.work)
    dump(args.out / "offline-results.json", results)
    (args.out / "offline-results.md").write_text(markdown)
    print(markdown)


if __name__ == "__main__":
    main()
