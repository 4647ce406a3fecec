"""One training job, timed (docs/benchmarks.md, "GRPO throughput race"): a job spec or a recipe of
recipes/learning.yaml plus `--set` overrides, run in-process through the worker's entry point
against a sandbox and a generator spawned for it (or `--generator-url`, e.g. vLLM). Prints every
step's time split, the medians over steps 2+, greedy pass@1 before and after and the trainer's peak
GPU memory; `--json` keeps it all (what bench/seeds.py reads).

    python bench/grpo_race.py recipes/grpo_smollm2.yaml --set optim.steps=8 --set eval=null
    python bench/grpo_race.py pre-t07 --set seed=1 --set data.seed=1 --json out.json   # a recipe
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench import common

OFFLINE = common.ROOT / "recipes" / "offline_smollm2.yaml"
# Printed per step; the first six also as medians over steps 2+ (the time split).
KEYS = ["time/step_s", "time/generate_s", "time/execute_tail_s", "time/train_s", "publish/total_s"]
KEYS += ["time/stale_wait_s", "reward_mean", "zero_signal_fraction", "completion_tokens_mean"]
KEYS += ["filter/groups_drawn"]


def sft_stage(job: dict[str, Any]) -> Any:
    """The `--sft-first` pipeline of the training job `job` (a dumped spec): its model, LoRA
    settings, train problems (in task-id order), token budget, evaluation and seed."""
    lora = {k: job["model"][k] for k in ("lora_r", "lora_alpha", "target_modules")}
    data = {k: v for k, v in job["data"].items() if k not in ("shuffle", "seed")}
    evaluation = job.get("eval") or {"data": {"dataset": "mbpp", "split": "test", "limit": 1}}
    stages = (["baseline"] if job.get("eval") else []) + ["generate", "annotate", "build", "train"]
    sets = [f"model={json.dumps({'base': job['model']['base'], **lora})}", f"data={json.dumps(data)}"]
    sets += [f"generate.max_tokens={job['rollout']['max_tokens']}", f"stages={json.dumps(stages)}"]
    sets += [f"eval.data={json.dumps(evaluation['data'])}"]
    sets += [f"eval.max_tokens={evaluation.get('max_tokens', 256)}"]
    return common.load_job(OFFLINE, [*sets, f"seed={job['seed']}"])


def humaneval(job: Any, adapter: str | None, settings: Any) -> dict[str, Any]:
    """Greedy pass@1 on HumanEval (164) of the base model and of `adapter`: the job's prompts, max tokens."""
    model, max_tokens = {"base": job.model.base, "chat": job.model.chat}, (job.eval or job.rollout).max_tokens
    scores: dict[str, Any] = {}
    for label, loaded in [("before", None), ("after", adapter)][: 2 if adapter else 1]:
        data, name = {"dataset": "humaneval"}, f"humaneval-{label}"
        found = common.evaluation(settings, name, model, data, max_tokens, loaded, greedy=True)
        scores[label] = {k: found.get(k) for k in ("greedy_pass@1", "problems")}
    return scores


def keep_reports(runs: Path, job_id: str, out: Path) -> None:
    """The evaluation reports (every greedy answer, its verdict) of the run copied to `out`."""
    found = {f"mbpp-{label}": runs / job_id / "eval" / label for label in ("before", "after")}
    found |= {f"humaneval-{label}": runs / f"humaneval-{label}" / "eval" for label in ("before", "after")}
    for name, folder in found.items():
        if (folder / "report.json").is_file():
            (out / name).mkdir(parents=True, exist_ok=True)
            shutil.copy2(folder / "report.json", out / name / "report.json")


def gpu_memory() -> dict[str, float]:
    """The trainer's peak GPU memory (this process) and the card's use after the jobs."""
    import torch

    if not torch.cuda.is_available():
        return {}
    free, total = torch.cuda.mem_get_info()
    gb = {"trainer_peak_allocated_gb": torch.cuda.max_memory_allocated(), "card_total_gb": total}
    gb |= {"trainer_peak_reserved_gb": torch.cuda.max_memory_reserved(), "card_used_gb": total - free}
    return {k: round(v / 2**30, 2) for k, v in gb.items()}


def parse() -> argparse.Namespace:
    parser = common.argument_parser(__doc__, job=True)
    # `before` is then the base model's evaluation, and the job's own (from the SFT adapter) `sft`.
    parser.add_argument("--sft-first", action="store_true", help="SFT on passing candidates first")
    parser.add_argument("--humaneval", action="store_true", help="greedy HumanEval pass@1 before and after")
    parser.add_argument("--keep-reports", type=Path, help="copy the evaluation reports (every answer) here")
    parser.add_argument("--generator-url", help="an external generator (default: spawn Crucible's)")
    parser.add_argument("--generator-rows", type=lambda v: v if v == "auto" else int(v), default=128,
                        help="rows of the spawned generator (runs sharing a card: 64); auto: from memory")  # fmt: skip
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    args.spec, args.overrides, recipe = common.job_source(args.job, args.overrides)
    args.sft_first = args.sft_first or bool(recipe.get("sft_first"))
    args.humaneval = args.humaneval or bool(recipe.get("humaneval"))
    return args


def main() -> None:
    args = parse()
    spec = common.load_job(args.spec, args.overrides, kind="train")
    work = Path(tempfile.mkdtemp(prefix="crucible-race-"))
    job_id, sft, scores = f"race-{spec.method.name}", {}, {}
    loras = max(4, spec.overlap.max_staleness + 2)
    where = {"generator_url": args.generator_url, "max_loras": loras}
    with common.services(work, spec.model.base, args.generator_rows, **where) as settings:
        started = time.perf_counter()
        if args.sft_first:  # then the job from the SFT adapter, whose LoRA settings it takes
            job = spec.model_dump(mode="json")
            done = common.run_job(sft_stage(job), f"sft-s{spec.seed}", settings)
            sft = {"adapter": done["adapter"], "seconds": done["wall_s"], "rounds": done.get("rounds")}
            sft["base_eval"] = done.get("eval", {}).get("before")
            lora = ("lora_r", "lora_alpha", "lora_dropout", "target_modules")
            model = {k: v for k, v in job["model"].items() if k not in lora}
            spec = common.load_job({**job, "model": {**model, "init_adapter": done["adapter"]}})
        summary = common.run_job(spec, job_id, settings)
        total, memory = time.perf_counter() - started, gpu_memory()
        if args.humaneval:
            t = time.perf_counter()
            scores = humaneval(spec, summary.get("adapter"), settings)
            scores["seconds"] = round(time.perf_counter() - t, 1)
            print("humaneval:", json.dumps(scores), flush=True)
        if args.keep_reports:
            keep_reports(settings.runs_dir, job_id, args.keep_reports)
    report(args, spec, summary, common.step_rows(work / "jobs" / job_id), total, memory, sft, scores)


def report(args: argparse.Namespace, spec: Any, summary: dict, rows: list[dict], total: float,
           memory: dict, sft: dict, scores: dict) -> None:  # fmt: skip
    """The run's lines on stdout and, with `--json`, its figures (what bench/seeds.py reads)."""
    print(f"{spec.method.name}: {len(rows)} steps in {total:.1f} s ({summary.get('status')})")
    for r in rows:
        figures = " ".join(f"{k.split('/')[-1]} {r.get(k, float('nan')):.2f}" for k in KEYS)
        extra = f" c2_rescue {r['c2_rescue_rate']:.2f}" if "c2_rescue_rate" in r else ""
        print(f"step {r['step']}: {figures} stale_diff {r.get('stale/diff', float('nan')):.4f}{extra}")
    timing = common.step_medians(rows)
    split = {k: common.later_median(rows, k) for k in KEYS[:6]}
    print(f"median step (steps 2+): {timing['median_step_s']:.2f} s; split: " + json.dumps(split))
    updated = timing["median_updated_step_s"]
    print(f"steps that updated the policy: {timing['updated_steps']} of {len(rows)}; their median: {updated}")
    evals = dict(summary.get("eval") or {})
    if sft and evals:  # the job's "before" is the SFT adapter; the run's is the base model
        evals["sft"], evals["before"] = evals.pop("before", None), sft.get("base_eval")
    lines = {"memory": memory, "difficulty filter": summary.get("difficulty_filter"), "eval": evals}
    for name, value in lines.items():
        if value:
            print(f"{name}:", json.dumps(value))
    if not args.json:
        return
    job = spec.model_dump(mode="json")
    figures = {"method": spec.method.name, "rows": rows, **timing, "steps": len(rows), "split": split}
    figures |= {"eval": evals or None, "seed": spec.seed, "staleness": spec.overlap.max_staleness}
    figures |= {"wall_s": total, "memory": memory, "settings": summary.get("settings")}
    figures |= {"job": job, "sft": sft or None, "difficulty_filter": summary.get("difficulty_filter")}
    figures |= {"filter": job["method"].get("filter", {}).get("mode", "none"), "reward": spec.reward.kind}
    figures["generator"] = args.generator_url or "crucible"
    figures["stale_check_final"] = summary.get("stale_check")
    figures |= {"spec": str(args.spec), "overrides": args.overrides, "model": spec.model.base}
    common.dump(args.json, figures | {"humaneval": scores or None})


if __name__ == "__main__":
    main()
