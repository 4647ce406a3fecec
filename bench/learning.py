"""Learning jobs (docs/benchmarks.md, "Learning figures over seeds", "Overlapped rollouts", "Real
sizes"): a job spec or a recipe of recipes/learning.yaml plus `--set` overrides, run in-process
through the worker's entry point against a sandbox and a generator spawned for it.

  job      one training job, timed (or against `--generator-url`, e.g. vLLM): the step's time split
           and its medians over steps 2+, greedy pass@1 before and after, the trainer's peak GPU
           memory; `--json` keeps it all (what `run` reads)
  run      a recipe once per seed, each a `job` in a process of its own (`--parallel K` at once): a
           JSON file per run under `<out>/<card>/learning/`, then the mean ± std over seeds
  compare  two recipes' runs paired by seed; `list`: the recipes, each with the `job` a seed runs

  python bench/learning.py job pre-t07 --set seed=1 --set data.seed=1 --json out.json   # or a spec file
  python bench/learning.py list
  python bench/learning.py run RECIPE [--seeds 0 1 2] [--parallel 3] [--steps N] [--eval-tasks N]
                           [--model NAME] [--card gpu-h100] [--out docs/results] [-- job arguments]
  python bench/learning.py compare RECIPE_A RECIPE_B   # e.g. overlap-s0 overlap-s1: samples/s and pass@1
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench import common
from bench.common import RECIPES, ROOT, argument_parser, card, dump, read_json, recipes, samples_per_s

RACE = ROOT / "bench" / "learning.py"  # what `run` runs (`job`) for each seed
OFFLINE = ROOT / "recipes" / "offline_smollm2.yaml"
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


def parse_job(argv: list[str]) -> argparse.Namespace:
    parser = argument_parser("One training job, timed (docs: bench/learning.py --help).", job=True)
    parser.prog = "learning.py job"
    # `before` is then the base model's evaluation, and the job's own (from the SFT adapter) `sft`.
    parser.add_argument("--sft-first", action="store_true", help="SFT on passing candidates first")
    parser.add_argument("--humaneval", action="store_true", help="greedy HumanEval pass@1 before and after")
    parser.add_argument("--keep-reports", type=Path, help="copy the evaluation reports (every answer) here")
    parser.add_argument("--generator-url", help="an external generator (default: spawn Crucible's)")
    parser.add_argument("--generator-rows", type=lambda v: v if v == "auto" else int(v), default=128,
                        help="rows of the spawned generator (runs sharing a card: 64); auto: from memory")  # fmt: skip
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    args.spec, args.overrides, recipe = common.job_source(args.job, args.overrides)
    args.sft_first = args.sft_first or bool(recipe.get("sft_first"))
    args.humaneval = args.humaneval or bool(recipe.get("humaneval"))
    return args


def timed_job(argv: list[str]) -> None:
    """`learning.py job ...`: the job run and timed, its figures printed and (`--json`) kept."""
    args = parse_job(argv)
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
    """The run's lines on stdout and, with `--json`, its figures (what `run` reads)."""
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


def card_name() -> str:
    """`gpu-h100`, `gpu-h200`, ... for the visible GPU, else `cpu`."""
    name = card().lower()
    known = next((m for m in ("h100", "h200", "a100", "l40s") if m in name), None)
    return name if name == "cpu" else "gpu-" + (known or re.sub(r"[^a-z0-9]", "-", name).strip("-"))


def race_arguments(recipe: dict[str, Any], args: argparse.Namespace, seed: int) -> list[str]:
    """What `job` runs for one seed of `recipe` (resolved by `bench.common.recipes`)."""
    sets = [*recipe["set"], f"seed={seed}", f"data.seed={seed}"]
    sets += [f"optim.steps={args.steps}"] if args.steps is not None else []
    if args.eval_tasks is not None:  # 0: no evaluation
        sets += [f"eval.data.limit={args.eval_tasks}" if args.eval_tasks else "eval=null"]
    sets += [f"model.base={args.model}"] if args.model else []
    flags = ["--" + f.replace("_", "-") for f in ("sft_first", "humaneval") if recipe.get(f)]
    return [recipe["spec"], *(part for s in sets for part in ("--set", s)), *flags, "--generator-rows", "64"]


def record(recipe: str, seed: int, race: dict[str, Any], command: list[str], wall_s: float) -> dict[str, Any]:
    """One run's result file from what `job --json` wrote."""
    evals, rows = race.get("eval") or {}, race.get("rows", [])
    score = {label: (evals.get(label) or {}).get("greedy_pass@1") for label in evals}
    out = {"recipe": recipe, "seed": seed, "before": score.get("before"), "after": score.get("after")}
    out |= {"eval_tasks": (evals.get("after") or {}).get("problems"), "steps": len(rows)}
    out |= {"samples_per_s": samples_per_s(rows), "wall_s": round(wall_s, 1), "command": shlex.join(command)}
    out |= {"sft": score["sft"]} if "sft" in evals else {}
    out["model"] = race.get("model") or (race.get("job") or {}).get("model", {}).get("base")
    for label, found in (race.get("humaneval") or {}).items():
        if label in ("before", "after"):
            out[f"humaneval_{label}"] = found.get("greedy_pass@1")
    return out | {"race": race}


def mean_std(values: list[float]) -> dict[str, float | None]:
    """Mean and sample standard deviation (None for one value)."""
    std = round(statistics.stdev(values), 6) if len(values) > 1 else None
    return {"mean": round(statistics.fmean(values), 6), "std": std, "n": len(values)}


FIELDS = ["before", "sft", "after", "humaneval_before", "humaneval_after", "samples_per_s", "wall_s"]


def summarise(recipe: str, runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Mean +- std over seeds of before, after, their difference and ratio, with per-seed values."""
    done = sorted((r for r in runs if r.get("after") is not None), key=lambda r: r["seed"])
    out: dict[str, Any] = {"recipe": recipe, "seeds": [r["seed"] for r in done]}
    if not done:
        return out
    values = {k: [r[k] for r in done if r.get(k) is not None] for k in FIELDS}
    values["gain"] = [r["after"] - r["before"] for r in done if r["before"] is not None]
    values["ratio"] = [r["after"] / r["before"] for r in done if r["before"]]
    out |= {name: mean_std(v) for name, v in values.items() if v}
    out["per_seed"] = [{k: r.get(k) for k in ("seed", *FIELDS[:5], "steps", "wall_s")} for r in done]
    out["model"] = sorted({str(r.get("model")) for r in done})
    out["eval_tasks"] = sorted({r.get("eval_tasks") for r in done}, key=str)
    return out | {"single_seed": len(done) == 1}


def compare(a: str, runs_a: list[dict[str, Any]], b: str, runs_b: list[dict[str, Any]]) -> dict[str, Any]:
    """`b` against `a`, paired by seed: the per-seed differences of `after` and ratios of samples/s."""
    by_a = {r["seed"]: r for r in runs_a if r.get("after") is not None}
    by_b = {r["seed"]: r for r in runs_b if r.get("after") is not None}
    seeds = sorted(by_a.keys() & by_b.keys())
    per_seed = [{"seed": s, "a": by_a[s]["after"], "b": by_b[s]["after"]} for s in seeds]
    diffs = [round(p["b"] - p["a"], 6) for p in per_seed]
    speeds = [(by_a[s].get("samples_per_s"), by_b[s].get("samples_per_s")) for s in seeds]
    ratios = [round(vb / va, 6) for va, vb in speeds if va and vb]
    out = {"a": a, "b": b, "seeds": seeds}
    out["per_seed"] = [p | {"b_minus_a": d} for p, d in zip(per_seed, diffs, strict=True)]
    out |= {"difference": mean_std(diffs) if diffs else None, "b_better": sum(d > 0 for d in diffs)}
    return out | {"samples_per_s_ratio": mean_std(ratios) if ratios else None}


def markdown(summary: dict[str, Any], described: str) -> str:
    """One table row: recipe | seeds | before | after | gain | per-seed after | wall."""

    def pm(key: str) -> str:
        v = summary.get(key)
        spread = " (1 seed)" if v and v["std"] is None else f" ± {100 * v['std']:.1f}" if v else ""
        return f"{100 * v['mean']:.1f}%{spread}" if v else "-"

    wall = summary.get("wall_s", {}).get("mean")
    cells = ["0", *["-"] * 5]
    if wall is not None:
        per_seed = ", ".join(f"{100 * r['after']:.1f}" for r in summary.get("per_seed", []))
        cells = [str(len(summary["seeds"])), pm("before"), pm("after"), pm("gain"), per_seed, f"{wall:.0f} s"]
    return f"| {summary['recipe']} ({described}) | " + " | ".join(cells) + " |\n"


def load_runs(folder: Path, recipe: str) -> list[dict[str, Any]]:
    return [read_json(p) for p in sorted(folder.glob(f"{recipe}-seed*.json"))]


def write_summary(folder: Path, recipe: str) -> dict[str, Any]:
    summary = summarise(recipe, load_runs(folder, recipe))
    dump(folder / f"{recipe}-summary.json", summary)
    described = recipes(RECIPES).get(recipe, {}).get("about", "custom")
    (folder / f"{recipe}-summary.md").write_text(markdown(summary, described))
    return summary


def run_one(recipe: str, seed: int, race: list[str], folder: Path) -> dict[str, Any] | None:
    """One seed of the recipe through `job`; its result file, or None if the run failed."""
    out = Path(tempfile.mkdtemp(prefix=f"seeds-{recipe}-{seed}-")) / "race.json"
    script = RACE.relative_to(ROOT) if RACE.is_relative_to(ROOT) else RACE
    command = [sys.executable, str(script), "job", *race]
    keep = ["--keep-reports", str(folder / "reports" / f"{recipe}-seed{seed}"), "--json", str(out)]
    log, started = folder / "logs" / f"{recipe}-seed{seed}.log", time.perf_counter()
    with log.open("w") as handle:
        done = subprocess.run([*command, *keep], cwd=ROOT, stdout=handle, stderr=subprocess.STDOUT)
    wall = time.perf_counter() - started
    if done.returncode != 0 or not out.exists():
        print(f"{recipe} seed {seed}: failed (exit {done.returncode}); log: {log}", flush=True)
        return None
    result = record(recipe, seed, read_json(out), ["python", *command[1:]], wall)
    dump(folder / f"{recipe}-seed{seed}.json", result)
    scores = f"before {result['before']} after {result['after']}"
    print(f"{recipe} seed {seed}: {scores} in {wall:.0f} s", flush=True)
    return result


def cmd_run(args: argparse.Namespace, extra: list[str]) -> int:
    known = recipes(RECIPES)
    if args.recipe not in known:
        raise SystemExit(f"unknown recipe {args.recipe!r}: one of {', '.join(known)} ({RECIPES})")
    (args.folder / "logs").mkdir(parents=True, exist_ok=True)

    def one(seed: int) -> dict[str, Any] | None:
        return run_one(args.recipe, seed, race_arguments(known[args.recipe], args, seed) + extra, args.folder)

    with ThreadPoolExecutor(max_workers=max(1, args.parallel)) as pool:
        results = list(pool.map(one, args.seeds))
    summary = write_summary(args.folder, args.recipe)
    print(json.dumps({k: summary.get(k) for k in ("recipe", "seeds", "before", "after", "gain")}))
    return 0 if all(results) else 1


def main() -> None:
    argv = sys.argv[1:]
    if argv[:1] == ["job"]:
        return timed_job(argv[1:])
    argv, extra = (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])
    parser = argument_parser(__doc__)
    parser.add_argument("verb", choices=["job", "list", "run", "compare"], help="job: see `job --help`")
    parser.add_argument("recipe", nargs="*", help="run: one recipe; compare: two")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--parallel", type=int, default=3, help="runs at once (one card holds 3-6)")
    parser.add_argument("--steps", type=int, help="optim.steps (default: the recipe's)")
    parser.add_argument("--eval-tasks", type=int, help="eval.data.limit (default: the recipe's; 0: none)")
    parser.add_argument("--model", help="model.base of the runs (default: the recipe's)")
    parser.add_argument("--card", default=None, help="results folder name (default: the GPU's, or cpu)")
    parser.add_argument("--out", default=str(ROOT / "docs" / "results"))
    args = parser.parse_args(argv)
    args.folder = Path(args.out) / (args.card or card_name()) / "learning"
    if args.verb == "list":
        for name, recipe in recipes(RECIPES).items():
            race = shlex.join(race_arguments(recipe, args, 0))
            print(f"{name:18} {recipe.get('about', '')}\n{'':18} python bench/learning.py job {race}")
    elif len(args.recipe) != (2 if args.verb == "compare" else 1):
        raise SystemExit(f"{args.verb} takes {'two recipes' if args.verb == 'compare' else 'one recipe'}")
    elif args.verb == "compare":
        a, b = args.recipe
        result = compare(a, load_runs(args.folder, a), b, load_runs(args.folder, b))
        dump(args.folder / f"compare-{a}-vs-{b}.json", result)
        print(json.dumps(result, indent=1))
    else:
        args.recipe = args.recipe[0]
        raise SystemExit(cmd_run(args, extra))


if __name__ == "__main__":
    main()
