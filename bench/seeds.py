"""Every learning figure over seeds: one recipe, N seeds, one JSON file per run and a summary.

A recipe is a job spec plus `--set` overrides (recipes/learning.yaml: `python bench/seeds.py list`
prints each with the command it runs). `run` starts one `bench/grpo_race.py` process per seed with
the recipe's spec and overrides, `--set seed=S --set data.seed=S` and those of `--steps`,
`--eval-tasks` and `--model` when given (each run with its own sandbox and 64-row generator;
`--parallel K` of them at once, which one GPU holds: see docs/benchmarks.md), and writes, as each
run ends, `<out>/<card>/learning/<recipe>-seed<S>.json`: an object with `recipe`, `seed`, `before`
and `after` (greedy pass@1 on the evaluated MBPP test tasks, as fractions, from the job's own
evaluation), `humaneval_before`/`humaneval_after` (recipes with `humaneval`), `steps`, `wall_s`,
`model`, `command`, and what `grpo_race.py --json` wrote (per-step metrics, timing, the job spec);
every evaluation report (each answer with its verdict) under `reports/<recipe>-seed<S>/`. Then
`<recipe>-summary.json` and `.md`: mean +- standard deviation (n - 1) and the per-seed values.
`compare A B` pairs two recipes' runs by seed (the same seeds give both recipes the same problems
in the same order) and writes `compare-<A>-vs-<B>.json`.

Usage:
  python bench/seeds.py list
  python bench/seeds.py run RECIPE [--seeds 0 1 2] [--parallel 3] [--card gpu-h100] [--out docs/results]
                        [--steps N] [--eval-tasks N] [--model NAME] [-- more grpo_race.py arguments]
  python bench/seeds.py summary RECIPE [--card ...] [--out ...]
  python bench/seeds.py compare RECIPE_A RECIPE_B [--card ...] [--out ...]

On the GPU machine: `bash bench/gpu.sh seeds RECIPE ...` (results under $OUT/results/).
A tiny CPU run (about a minute a seed): `python bench/seeds.py run tiny --seeds 0 1 --card cpu --out /tmp/seeds`.
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.common import RECIPES, card, recipes  # noqa: E402

RACE = ROOT / "bench" / "grpo_race.py"


def card_name() -> str:
    """`gpu-h100`, `gpu-h200`, ... for the visible GPU, else `cpu`."""
    name = card().lower()
    if name == "cpu":
        return name
    known = next((model for model in ("h100", "h200", "a100", "l40s") if model in name), None)
    return f"gpu-{known}" if known else "gpu-" + "".join(c if c.isalnum() else "-" for c in name).strip("-")


def race_arguments(recipe: dict[str, Any], args: argparse.Namespace, seed: int) -> list[str]:
    """What `grpo_race.py` runs for one seed of `recipe` (resolved by `bench.common.recipes`).

    >>> recipe = {"spec": "recipes/grpo_smollm2.yaml", "set": ["method.filter.mode=pre"], "humaneval": True}
    >>> args = argparse.Namespace(steps=None, eval_tasks=30, model=None)
    >>> race_arguments(recipe, args, 2)  # doctest: +NORMALIZE_WHITESPACE
    ['recipes/grpo_smollm2.yaml', '--set', 'method.filter.mode=pre', '--set', 'seed=2', '--set', 'data.seed=2',
     '--set', 'eval.data.limit=30', '--humaneval', '--generator-rows', '64']
    """
    sets = [*recipe["set"], f"seed={seed}", f"data.seed={seed}"]
    sets += [f"optim.steps={args.steps}"] if args.steps is not None else []
    if args.eval_tasks is not None:  # 0: no evaluation
        sets += [f"eval.data.limit={args.eval_tasks}" if args.eval_tasks else "eval=null"]
    sets += [f"model.base={args.model}"] if args.model else []
    flags = [f for f in ("sft_first", "humaneval") if recipe.get(f)]
    out = [recipe["spec"]] + [part for s in sets for part in ("--set", s)]
    return out + ["--" + f.replace("_", "-") for f in flags] + ["--generator-rows", "64"]


def record(recipe: str, seed: int, race: dict[str, Any], command: list[str], wall_s: float) -> dict[str, Any]:
    """One run's result file from what `grpo_race.py --json` wrote.

    >>> race = {"rows": [{"step": 1}, {"step": 2}], "eval": {"before": {"greedy_pass@1": 0.036},
    ...         "after": {"greedy_pass@1": 0.07}}}
    >>> r = record("pre", 1, race, ["python", "bench/grpo_race.py"], 12.5)
    >>> r["recipe"], r["seed"], r["before"], r["after"], r["steps"], r["wall_s"], r["command"]
    ('pre', 1, 0.036, 0.07, 2, 12.5, 'python bench/grpo_race.py')
    """
    evals = race.get("eval") or {}

    def score(label: str) -> float | None:
        found = evals.get(label) or {}
        return found.get("greedy_pass@1")

    after = evals.get("after") or {}
    out = {
        "recipe": recipe,
        "seed": seed,
        "before": score("before"),
        "after": score("after"),
        "eval_tasks": after.get("problems"),
        "steps": len(race.get("rows", [])),
        "wall_s": round(wall_s, 1),
        "command": shlex.join(command),
    }
    if "sft" in evals:
        out["sft"] = score("sft")
    out["model"] = race.get("model") or (race.get("job") or {}).get("model", {}).get("base")
    humaneval = race.get("humaneval") or {}
    for label in ("before", "after"):
        if label in humaneval:
            out[f"humaneval_{label}"] = humaneval[label].get("greedy_pass@1")
    return out | {"race": race}


def mean_std(values: list[float]) -> dict[str, float | None]:
    """Mean and sample standard deviation (None for one value).

    >>> mean_std([0.04, 0.06, 0.08])
    {'mean': 0.06, 'std': 0.02, 'n': 3}
    """
    mean = round(statistics.fmean(values), 6)
    std = round(statistics.stdev(values), 6) if len(values) > 1 else None
    return {"mean": mean, "std": std, "n": len(values)}


def summarise(recipe: str, runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Mean +- std over seeds of before, after, their difference and ratio, with per-seed values.

    >>> runs = [{"seed": s, "before": 0.036, "after": a, "steps": 100, "wall_s": 300.0, "eval_tasks": 500}
    ...         for s, a in ((0, 0.066), (1, 0.086), (2, 0.076))]
    >>> s = summarise("pre", runs)
    >>> s["after"], s["gain"]["mean"], s["seeds"]
    ({'mean': 0.076, 'std': 0.01, 'n': 3}, 0.04, [0, 1, 2])
    """
    done = sorted((r for r in runs if r.get("after") is not None), key=lambda r: r["seed"])
    out: dict[str, Any] = {"recipe": recipe, "seeds": [r["seed"] for r in done]}
    if not done:
        return out
    fields = {
        "before": [r["before"] for r in done if r["before"] is not None],
        "after": [r["after"] for r in done],
        "gain": [r["after"] - r["before"] for r in done if r["before"] is not None],
        "ratio": [r["after"] / r["before"] for r in done if r["before"]],
        "wall_s": [r["wall_s"] for r in done],
        "humaneval_before": [r["humaneval_before"] for r in done if r.get("humaneval_before") is not None],
        "humaneval_after": [r["humaneval_after"] for r in done if r.get("humaneval_after") is not None],
    }
    if any("sft" in r for r in done):
        fields["sft"] = [r["sft"] for r in done if r.get("sft") is not None]
    for name, values in fields.items():
        if values:
            out[name] = mean_std(values)
    out["per_seed"] = [
        {
            k: r.get(k)
            for k in (
                "seed",
                "before",
                "sft",
                "after",
                "humaneval_before",
                "humaneval_after",
                "steps",
                "wall_s",
            )
        }
        for r in done
    ]
    out["model"] = sorted({str(r.get("model")) for r in done})
    out["eval_tasks"] = sorted({r.get("eval_tasks") for r in done}, key=str)
    out["single_seed"] = len(done) == 1
    return out


def compare(a: str, runs_a: list[dict[str, Any]], b: str, runs_b: list[dict[str, Any]]) -> dict[str, Any]:
    """`b` against `a`, paired by seed: the per-seed differences of `after` and their mean +- std.

    >>> pa = [{"seed": 0, "after": 0.05}, {"seed": 1, "after": 0.06}, {"seed": 2, "after": 0.05}]
    >>> pb = [{"seed": 0, "after": 0.07}, {"seed": 1, "after": 0.07}, {"seed": 3, "after": 0.2}]
    >>> c = compare("grpo", pa, "pre", pb)
    >>> c["seeds"], c["difference"]["mean"], c["b_better"]
    ([0, 1], 0.015, 2)
    """
    by_a = {r["seed"]: r for r in runs_a if r.get("after") is not None}
    by_b = {r["seed"]: r for r in runs_b if r.get("after") is not None}
    seeds = sorted(by_a.keys() & by_b.keys())
    diffs = [round(by_b[s]["after"] - by_a[s]["after"], 6) for s in seeds]
    return {
        "a": a,
        "b": b,
        "seeds": seeds,
        "per_seed": [
            {"seed": s, "a": by_a[s]["after"], "b": by_b[s]["after"], "b_minus_a": d}
            for s, d in zip(seeds, diffs, strict=True)
        ],
        "difference": mean_std(diffs) if diffs else None,
        "b_better": sum(d > 0 for d in diffs),
    }


def markdown(summary: dict[str, Any], described: str) -> str:
    """One table row: recipe | seeds | before | after | gain | per-seed after | wall."""

    def pm(key: str) -> str:
        v = summary.get(key)
        if not v:
            return "-"
        std = f" ± {100 * v['std']:.1f}" if v["std"] is not None else " (1 seed)"
        return f"{100 * v['mean']:.1f}%{std}"

    per_seed = ", ".join(f"{100 * r['after']:.1f}" for r in summary.get("per_seed", []))
    wall = summary.get("wall_s", {}).get("mean")
    return (
        f"| {summary['recipe']} ({described}) | {len(summary['seeds'])} | {pm('before')} | {pm('after')} | "
        f"{pm('gain')} | {per_seed} | {wall:.0f} s |\n"
        if wall is not None
        else f"| {summary['recipe']} ({described}) | 0 | - | - | - | - | - |\n"
    )


def results_dir(args: argparse.Namespace) -> Path:
    return Path(args.out) / (args.card or card_name()) / "learning"


def load_runs(folder: Path, recipe: str) -> list[dict[str, Any]]:
    return [json.loads(p.read_text()) for p in sorted(folder.glob(f"{recipe}-seed*.json"))]


def write_summary(folder: Path, recipe: str) -> dict[str, Any]:
    summary = summarise(recipe, load_runs(folder, recipe))
    (folder / f"{recipe}-summary.json").write_text(json.dumps(summary, indent=1))
    described = recipes(RECIPES).get(recipe, {}).get("about", "custom")
    (folder / f"{recipe}-summary.md").write_text(markdown(summary, described))
    return summary


def run_one(recipe: str, seed: int, race: list[str], folder: Path, log_dir: Path) -> dict[str, Any] | None:
    """One seed of the recipe through grpo_race.py; its result file, or None if the run failed."""
    out = Path(tempfile.mkdtemp(prefix=f"seeds-{recipe}-{seed}-")) / "race.json"
    script = RACE.relative_to(ROOT) if RACE.is_relative_to(ROOT) else RACE
    keep = folder / "reports" / f"{recipe}-seed{seed}"
    command = [sys.executable, str(script), *race]
    log = log_dir / f"{recipe}-seed{seed}.log"
    started = time.perf_counter()
    with log.open("w") as handle:
        run = [*command, "--keep-reports", str(keep), "--json", str(out)]
        done = subprocess.run(run, cwd=ROOT, stdout=handle, stderr=subprocess.STDOUT)
    wall = time.perf_counter() - started
    if done.returncode != 0 or not out.exists():
        print(f"{recipe} seed {seed}: failed (exit {done.returncode}); log: {log}", flush=True)
        return None
    result = record(recipe, seed, json.loads(out.read_text()), ["python", *command[1:]], wall)
    (folder / f"{recipe}-seed{seed}.json").write_text(json.dumps(result, indent=1))
    print(
        f"{recipe} seed {seed}: before {result['before']} after {result['after']} in {wall:.0f} s", flush=True
    )
    return result


def cmd_run(args: argparse.Namespace, extra: list[str]) -> int:
    known = recipes(RECIPES)
    if args.recipe not in known:
        raise SystemExit(f"unknown recipe {args.recipe!r}: one of {', '.join(known)} ({RECIPES})")
    folder = results_dir(args)
    folder.mkdir(parents=True, exist_ok=True)
    logs = folder / "logs"
    logs.mkdir(exist_ok=True)

    def one(seed: int) -> dict[str, Any] | None:
        race = race_arguments(known[args.recipe], args, seed) + extra
        return run_one(args.recipe, seed, race, folder, logs)

    with ThreadPoolExecutor(max_workers=max(1, args.parallel)) as pool:
        results = list(pool.map(one, args.seeds))
    summary = write_summary(folder, args.recipe)
    print(json.dumps({k: summary.get(k) for k in ("recipe", "seeds", "before", "after", "gain")}))
    return 0 if all(results) else 1


def main() -> None:
    argv = sys.argv[1:]
    extra = argv[argv.index("--") + 1 :] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("verb", choices=["list", "run", "summary", "compare"])
    parser.add_argument("recipe", nargs="*", help="run/summary: one recipe; compare: two")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--parallel", type=int, default=3, help="runs at once (one card holds 3-6)")
    parser.add_argument("--steps", type=int, help="optim.steps (default: the recipe's)")
    parser.add_argument("--eval-tasks", type=int, help="eval.data.limit (default: the recipe's; 0: none)")
    parser.add_argument("--model", help="model.base of the runs (default: the recipe's)")
    parser.add_argument("--card", default=None, help="results folder name (default: the GPU's, or cpu)")
    parser.add_argument("--out", default=str(ROOT / "docs" / "results"))
    args = parser.parse_args(argv)
    if args.verb == "list":
        for name, recipe in recipes(RECIPES).items():
            race = race_arguments(recipe, args, 0)
            print(
                f"{name:18} {recipe.get('about', '')}\n{'':18} python bench/grpo_race.py {shlex.join(race)}"
            )
        return
    if args.verb == "compare":
        if len(args.recipe) != 2:
            raise SystemExit("compare takes two recipes")
        folder = results_dir(args)
        a, b = args.recipe
        result = compare(a, load_runs(folder, a), b, load_runs(folder, b))
        (folder / f"compare-{a}-vs-{b}.json").write_text(json.dumps(result, indent=1))
        print(json.dumps(result, indent=1))
        return
    if len(args.recipe) != 1:
        raise SystemExit(f"{args.verb} takes one recipe")
    args.recipe = args.recipe[0]
    if args.verb == "summary":
        print(json.dumps(write_summary(results_dir(args), args.recipe), indent=1))
        return
    raise SystemExit(cmd_run(args, extra))


if __name__ == "__main__":
    main()
