"""One training job, timed: a job spec (or a recipe of recipes/learning.yaml) plus `--set`
overrides, run in-process through the worker's entry point against a sandbox and a generator
spawned for it (CUDA + bf16 when present), with seconds per step split into generate / execute /
train / publish, the median over steps 2+ and over the steps 2+ that updated the policy (a step
whose groups all had equal rewards skips its update), greedy pass@1 before and after from the job's
own evaluation, and the trainer's peak GPU memory.

  python bench/grpo_race.py recipes/grpo_smollm2.yaml --set optim.steps=8 --set optim.micro_batch=64 \\
      --set eval=null                        # the GRPO race (bash bench/gpu.sh race 8)
  python bench/grpo_race.py pre-t07 --set seed=1 --set data.seed=1 --json out.json   # a recipe
  python bench/grpo_race.py examples/grpo_qwen1p5b.yaml --set model.base=DIR --set method.kl_beta=0.01

Two steps of the benchmark around the job (a recipe may ask for them):
- `--sft-first`: a pipeline job first (its baseline evaluation when the job evaluates, then K=8
  candidates per train problem at T=1, run, up to 4 distinct passing ones per problem trained on
  with SFT: bench/common.py's recipe); the job then starts from that adapter (`model.init_adapter`,
  its LoRA settings going to the SFT stage). The run's "before" is the base model's (the pipeline's
  baseline), and the job's own "before" is reported as "sft".
- `--humaneval`: greedy pass@1 on HumanEval's 164 tasks of the base model and of the trained
  adapter, as two evaluation jobs through the same entry point (the job's prompts and max tokens).

With `--generator-url URL` the job uses that generator instead (e.g. vLLM serving the same weights
under the job's `model.base` name): adapters are published to it and the stale-policy check
compares against its logprobs. Random-weight checkpoints (bench/model_shapes.py) earn every answer
the same reward, so no group would train: `--set method.kl_beta=0.01` keeps every sequence in the
update (at the cost of one reference pass). `bench/seeds.py` runs a recipe over several seeds.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.common import TRAIN, load_job, recipes, run_job, services, step_medians, step_rows  # noqa: E402

# Printed per step; the first seven also as medians over steps 2+ (the time split).
KEYS = [
    "time/step_s",
    "time/generate_s",
    "time/execute_tail_s",
    "time/train_s",
    "publish/total_s",
    "time/stale_wait_s",  # the part of the stale-policy check the rollouts did not hide
    "reward_mean",
    "zero_signal_fraction",
    "completion_tokens_mean",
    "filter/groups_drawn",
]


def sft_stage(job: dict[str, Any]) -> dict[str, Any]:
    """The `--sft-first` pipeline of the training job `job` (a dumped spec): its model, LoRA
    settings, train problems, token budget, evaluation and seed."""
    lora = {k: job["model"][k] for k in ("lora_r", "lora_alpha", "target_modules")}
    data = {k: v for k, v in job["data"].items() if k not in ("shuffle", "seed")}  # in task-id order
    evaluation = job.get("eval") or {}
    return {
        "kind": "pipeline",
        "stages": (["baseline"] if evaluation else []) + ["generate", "annotate", "build", "train"],
        "model": {"base": job["model"]["base"], **lora},
        "data": data,
        "generate": {"k": 8, "temperature": 1.0, "top_p": 1.0, "max_tokens": job["rollout"]["max_tokens"]}
        | {"concurrency": 32},
        "build": {"n_best": 4, "pairing": "pass_fail", "max_pairs": 4},
        "eval": {
            "data": evaluation.get("data") or {"dataset": "mbpp", "split": "test", "limit": 1},
            "greedy": True,
            "max_tokens": evaluation.get("max_tokens", 256),
        },
        "checkpoint": {"every": 1000},
        "logging": {"wandb_mode": "disabled"},
        "seed": job["seed"],
        **TRAIN["sft"],
    }


def from_adapter(job: dict[str, Any], adapter: str) -> dict[str, Any]:
    """`job` starting from `adapter`: its LoRA settings are the adapter's."""
    lora = ("lora_r", "lora_alpha", "lora_dropout", "target_modules")
    model = {k: v for k, v in job["model"].items() if k not in lora}
    return {**job, "model": {**model, "init_adapter": adapter}}


def humaneval(job: Any, adapter: str | None, settings: Any) -> dict[str, Any]:
    """Greedy pass@1 on HumanEval (164) of the job's base model and of `adapter`, each an evaluation
    job with the job's prompts and max tokens."""
    from crucible_shared.jobs import EvalJob

    max_tokens = job.eval.max_tokens if job.eval else job.rollout.max_tokens
    scores: dict[str, Any] = {}
    for label, loaded in (("before", None), ("after", adapter)):
        if label == "after" and not adapter:
            break
        spec = EvalJob(
            model={"base": job.model.base, "chat": job.model.chat},
            adapter=loaded,
            data={"dataset": "humaneval"},
            greedy=True,
            max_tokens=max_tokens,
        )
        found = run_job(spec, f"humaneval-{label}", settings)["eval"]["eval"]
        scores[label] = {"greedy_pass@1": found.get("greedy_pass@1"), "problems": found.get("problems")}
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
    """The trainer's peak GPU memory (this process) and the card's use after the jobs (the
    generator's, and what the trainer still holds once the job has given its memory back)."""
    import torch

    if not torch.cuda.is_available():
        return {}
    free, total = torch.cuda.mem_get_info()
    return {
        "trainer_peak_allocated_gb": round(torch.cuda.max_memory_allocated() / 2**30, 2),
        "trainer_peak_reserved_gb": round(torch.cuda.max_memory_reserved() / 2**30, 2),
        "card_used_gb": round((total - free) / 2**30, 2),
        "card_total_gb": round(total / 2**30, 2),
    }


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("job", help="a job spec file (YAML/JSON) or a recipe of recipes/learning.yaml")
    parser.add_argument(
        "--set", dest="overrides", action="append", default=[], metavar="FIELD=VALUE", help="override a field"
    )
    parser.add_argument("--sft-first", action="store_true", help="SFT on passing candidates first (above)")
    parser.add_argument("--humaneval", action="store_true", help="greedy HumanEval pass@1 before and after")
    parser.add_argument("--keep-reports", type=Path, help="copy the evaluation reports (every answer) here")
    parser.add_argument("--generator-url", help="an external generator (default: spawn Crucible's)")
    parser.add_argument(
        "--generator-rows",
        type=lambda v: v if v == "auto" else int(v),
        default=128,
        help="rows of the spawned generator (runs sharing a card: 64); auto: from memory, or from "
        "CRUCIBLE_GENERATOR_GPU_MEMORY_FRACTION when set",
    )
    parser.add_argument("--generator-device", help="CUDA_VISIBLE_DEVICES of the spawned generator")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    path = Path(args.job)
    if not path.is_file():
        known = recipes()
        if args.job not in known:
            raise SystemExit(f"{args.job}: neither a spec file nor a recipe ({', '.join(known)})")
        recipe = known[args.job]
        path = ROOT / recipe["spec"]
        args.overrides = [*recipe["set"], *args.overrides]
        args.sft_first = args.sft_first or bool(recipe.get("sft_first"))
        args.humaneval = args.humaneval or bool(recipe.get("humaneval"))
    args.spec = path
    return args


def main() -> None:
    args = parse()
    spec = load_job(args.spec, args.overrides)
    if spec.kind != "train":
        raise SystemExit(f"{args.spec} holds a {spec.kind!r} job: this benchmark times training jobs")
    work = Path(tempfile.mkdtemp(prefix="crucible-race-"))
    job_id = f"race-{spec.method.name}"
    sft: dict[str, Any] = {}
    scores: dict[str, Any] = {}
    with services(
        work,
        spec.model.base,
        args.generator_rows,
        generator_url=args.generator_url,
        device=args.generator_device,
        max_loras=max(4, spec.overlap.max_staleness + 2),
    ) as settings:
        started = time.perf_counter()
        if args.sft_first:
            job = spec.model_dump(mode="json")
            done = run_job(load_job(sft_stage(job)), f"sft-s{spec.seed}", settings)
            sft = {"adapter": done["adapter"], "seconds": done["wall_s"], "rounds": done.get("rounds")}
            sft["base_eval"] = done.get("eval", {}).get("before")
            spec = load_job(from_adapter(job, done["adapter"]))
        summary = run_job(spec, job_id, settings)
        total = time.perf_counter() - started
        memory = gpu_memory()
        if args.humaneval:
            t = time.perf_counter()
            scores = humaneval(spec, summary.get("adapter"), settings)
            scores["seconds"] = round(time.perf_counter() - t, 1)
            print("humaneval:", json.dumps(scores), flush=True)
        if args.keep_reports:
            keep_reports(settings.runs_dir, job_id, args.keep_reports)
    rows = step_rows(work / "jobs" / job_id)
    report(args, spec, summary, rows, total, memory, sft, scores)


def report(args: argparse.Namespace, spec: Any, summary: dict, rows: list[dict], total: float,
           memory: dict, sft: dict, scores: dict) -> None:  # fmt: skip
    """The run's lines on stdout and, with `--json`, its figures (what bench/seeds.py reads)."""
    print(f"{spec.method.name}: {len(rows)} steps in {total:.1f} s ({summary.get('status')})")
    for r in rows:
        extra = f" c2_rescue {r['c2_rescue_rate']:.2f}" if "c2_rescue_rate" in r else ""
        print(
            f"step {r['step']}: "
            + " ".join(f"{k.split('/')[-1]} {r.get(k, float('nan')):.2f}" for k in KEYS)
            + f" stale_diff {r.get('stale/diff', float('nan')):.4f}{extra}"
        )
    timing = step_medians(rows)
    split = {k: statistics.median(r.get(k, 0.0) for r in rows[1:] or rows) for k in KEYS[:7]}
    print(
        f"median step (steps 2+): {timing['median_step_s']:.2f} s; split: "
        + ", ".join(f"{k} {v:.2f}" for k, v in split.items())
    )
    updated = timing["median_updated_step_s"]
    print(
        f"steps that updated the policy: {timing['updated_steps']} of {len(rows)}; their median "
        + (f"(steps 2+): {updated:.2f} s" if updated is not None else "-")
    )
    if memory:
        print("memory:", json.dumps(memory))
    if summary.get("difficulty_filter"):
        print("difficulty filter:", json.dumps(summary["difficulty_filter"]))
    evals = dict(summary.get("eval") or {})
    if sft and evals:  # the job's "before" is the SFT adapter; the run's is the base model
        evals["sft"] = evals.pop("before", None)
        evals["before"] = sft.get("base_eval")
    if evals:
        print("eval:", json.dumps(evals))
    if not args.json:
        return
    job = spec.model_dump(mode="json")
    args.json.write_text(
        json.dumps(
            {
                "method": spec.method.name,
                "rows": rows,
                **timing,
                "steps": len(rows),
                "split": split,
                "eval": evals or None,
                "seed": spec.seed,
                "staleness": spec.overlap.max_staleness,
                "wall_s": total,
                "job": job,
                "sft": sft or None,
                "difficulty_filter": summary.get("difficulty_filter"),
                "filter": job["method"].get("filter", {}).get("mode", "none"),
                "reward": spec.reward.kind,
                "generator": args.generator_url or "crucible",
                "stale_check_final": summary.get("stale_check"),
                "memory": memory,
                "settings": summary.get("settings"),
                "spec": str(args.spec),
                "overrides": args.overrides,
                "model": spec.model.base,
                "humaneval": scores or None,
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
