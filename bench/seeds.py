"""Every learning figure over seeds: a recipe of recipes/learning.yaml (a job spec plus `--set`
overrides), run once per seed by `bench/grpo_race.py` (`--parallel K` at once, each with its own
sandbox and 64-row generator), one JSON file per run under `<out>/<card>/learning/`, then a summary
(mean ± standard deviation over seeds) and paired comparisons of two recipes by seed.

  python bench/seeds.py list
  python bench/seeds.py run RECIPE [--seeds 0 1 2] [--parallel 3] [--steps N] [--eval-tasks N]
                        [--model NAME] [--card gpu-h100] [--out docs/results] [-- grpo_race.py arguments]
  python bench/seeds.py compare RECIPE_A RECIPE_B   # e.g. overlap-s0 overlap-s1: samples/s and pass@1
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import RECIPES, ROOT, argument_parser, card, dump, read_json, recipes, samples_per_s

RACE = ROOT / "bench" / "grpo_race.py"


def card_name() -> str:
    """`gpu-h100`, `gpu-h200`, ... for the visible GPU, else `cpu`."""
    name = card().lower()
    known = next((m for m in ("h100", "h200", "a100", "l40s") if m in name), None)
    return name if name == "cpu" else "gpu-" + (known or re.sub(r"[^a-z0-9]", "-", name).strip("-"))


def race_arguments(recipe: dict[str, Any], args: argparse.Namespace, seed: int) -> list[str]:
    """What `grpo_race.py` runs for one seed of `recipe` (resolved by `bench.common.recipes`)."""
    sets = [*recipe["set"], f"seed={seed}", f"data.seed={seed}"]
    sets += [f"optim.steps={args.steps}"] if args.steps is not None else []
    if args.eval_tasks is not None:  # 0: no evaluation
        sets += [f"eval.data.limit={args.eval_tasks}" if args.eval_tasks else "eval=null"]
    sets += [f"model.base={args.model}"] if args.model else []
    flags = ["--" + f.replace("_", "-") for f in ("sft_first", "humaneval") if recipe.get(f)]
    return [recipe["spec"], *(part for s in sets for part in ("--set", s)), *flags, "--generator-rows", "64"]


def record(recipe: str, seed: int, race: dict[str, Any], command: list[str], wall_s: float) -> dict[str, Any]:
    """One run's result file from what `grpo_race.py --json` wrote."""
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
    (folder / f"{recipe}-summary.json").write_text(json.dumps(summary, indent=1))
    described = recipes(RECIPES).get(recipe, {}).get("about", "custom")
    (folder / f"{recipe}-summary.md").write_text(markdown(summary, described))
    return summary


def run_one(recipe: str, seed: int, race: list[str], folder: Path) -> dict[str, Any] | None:
    """One seed of the recipe through grpo_race.py; its result file, or None if the run failed."""
    out = Path(tempfile.mkdtemp(prefix=f"seeds-{recipe}-{seed}-")) / "race.json"
    command = [sys.executable, str(RACE.relative_to(ROOT) if RACE.is_relative_to(ROOT) else RACE), *race]
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
    argv, extra = (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])
    parser = argument_parser(__doc__)
    parser.add_argument("verb", choices=["list", "run", "compare"])
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
            print(f"{name:18} {recipe.get('about', '')}\n{'':18} python bench/grpo_race.py {race}")
    elif len(args.recipe) != (2 if args.verb == "compare" else 1):
        raise SystemExit(f"{args.verb} takes {'two recipes' if args.verb == 'compare' else 'one recipe'}")
    elif args.verb == "compare":
        a, b = args.recipe
        result = compare(a, load_runs(args.folder, a), b, load_runs(args.folder, b))
        (args.folder / f"compare-{a}-vs-{b}.json").write_text(json.dumps(result, indent=1))
        print(json.dumps(result, indent=1))
    else:
        args.recipe = args.recipe[0]
        raise SystemExit(cmd_run(args, extra))


if __name__ == "__main__":
    main()
