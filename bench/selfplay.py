"""Self-play figures (docs/benchmarks.md, "Self-play"): the runs of recipes/selfplay.yaml, each
`crucible train --local` with a generator of its own, `--parallel` at a time, interrupted like a
Ctrl-C at `--deadline-s`, while an evaluation job scores the base model on MBPP. `--json`: every
run's metric series, MBPP before / halfway / after, RAE against shared; `--out-dir`: each run's
metrics.jsonl, games.md and learning curve.

    python bench/selfplay.py [--runs ttt-role,code-role] [--set FIELD=VALUE ...] [--json out.json]
    python bench/selfplay.py --tiny ...   # a CPU smoke run of the script (2 steps, tiny games)
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
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

RUNS = common.ROOT / "recipes" / "selfplay.yaml"
TINY = ["optim.steps=2", "method.games_per_step=2", "method.arena.every=1", "method.arena.games=2"]
TINY += ["optim.micro_batch=8", "eval.every=1"]
SERIES = [  # metric patterns kept per step in the JSON (`*`: any role or opponent)
    "role/", "arena/", "game/", "rae/", "reward_mean", "samples", "completion_tokens_mean",
    "update/sequences", "time/step_s", "time/generate_s", "time/train_s", "eval/greedy_pass@1",
]  # fmt: skip


def spec_of(name: str, args: argparse.Namespace) -> dict[str, Any]:
    """The run's job: its recipe, then `--tiny`'s budget, the model, the evaluation tasks, `--set`."""
    recipe, tokens = common.recipes(RUNS)[name], 8 if name.startswith("ttt") else 48
    sets = [*recipe["set"], *([*TINY, f"rollout.max_tokens={tokens}"] if args.tiny else [])]
    evaluation = f"eval.data.limit={args.eval_tasks}" if args.eval_tasks else "eval=null"
    sets += [f"model.base={args.model}", evaluation]
    return common.load_job(common.ROOT / recipe["spec"], [*sets, *args.overrides]).model_dump(mode="json")


def collect(name: str, run_dir: Path, out_dir: Path | None, spec: dict, wall: float) -> dict[str, Any]:
    """One run's figures from its run dir (what it wrote, also when it was interrupted)."""
    status = common.read_json(run_dir / "summary.json", {"status": "lost"}).get("status")
    rows = common.read_jsonl(run_dir / "metrics.jsonl")
    steps, evals = [r for r in rows if "games" in r], {r["eval_label"]: r for r in rows if "eval_label" in r}
    by_step = lambda label: evals[label]["step"]  # noqa: E731
    series: dict[str, list[list[float]]] = {}
    for r in rows:  # training steps and the evaluations (halfway, after)
        for key, value in r.items():
            if isinstance(value, int | float) and key.startswith(tuple(SERIES)):
                series.setdefault(key, []).append([r["step"], value])
    last = steps[-5:]
    keys = sorted({k for r in last for k in r if k.startswith(("role/", "game/", "rae/"))})
    if out_dir is not None and run_dir.exists():
        (out_dir / name).mkdir(parents=True, exist_ok=True)
        for file in ("metrics.jsonl", "games.md", "learning_curve.png", "summary.json"):
            if (run_dir / file).exists():
                shutil.copy(run_dir / file, out_dir / name / file)
    return {
        "spec": spec,
        "status": status,
        "partial": status != "finished",
        "steps_done": len(steps),
        "wall_s": wall,
        "median_step_s": statistics.median(r["time/step_s"] for r in steps) if steps else None,
        "mbpp_greedy_pass@1": {k: evals[k].get("eval/greedy_pass@1") for k in sorted(evals, key=by_step)},
        "final_5_steps": {k: statistics.fmean(r[k] for r in last if k in r) for k in keys},
        "series": series,
    }


def baseline_figures(run: dict[str, Any], baseline: str) -> dict[str, Any]:
    """A run's mean squared advantage under the baseline it trained with and under both as
    shadows, its illegal and arena win rates at the first and last step, its MBPP scores."""
    series = run["series"]

    def mean(key: str) -> float | None:
        return statistics.fmean(v for _, v in series[key]) if series.get(key) else None

    def ends(key: str) -> list[float | None]:
        points = series.get(key) or [[None, None]]
        return [points[0][1], points[-1][1]]

    arena = sorted(k for k in series if re.fullmatch(r"arena/[^/]+/win_rate", k))
    out = {"advantage_sq_trained": mean(f"rae/advantage_sq_{baseline}")}
    out |= {f"advantage_sq_{b}_shadow": mean(f"rae/advantage_sq_{b}") for b in ("role", "shared")}
    out |= {"illegal_rate_first_last": ends("game/illegal_rate")}
    out |= {"arena_win_rate_first_last": {k: ends(k) for k in arena}}
    return out | {"mbpp_greedy_pass@1": run["mbpp_greedy_pass@1"]}


def compare(runs: dict[str, Any]) -> dict[str, Any]:
    """RAE against the shared baseline, per game: the same figures side by side."""
    out: dict[str, Any] = {}
    for game, prefix in (("tictactoe", "ttt"), ("code_output", "code")):
        pair = {b: runs.get(f"{prefix}-{b}") for b in ("role", "shared")}
        if all(pair.values()):
            out[game] = {baseline: baseline_figures(run, baseline) for baseline, run in pair.items()}
    return out


def play(args: argparse.Namespace, names: list[str], work: Path, settings: Any, generators: dict) -> dict:
    """Every run as `crucible train --local`, `--parallel` at a time; the base model's evaluation
    meanwhile; a run still going at the deadline is interrupted (SIGINT), and stopped 45 s later."""
    deadline, interrupted = time.time() + args.deadline_s, set()
    specs, procs, started, ended = {}, {}, {}, {}  # by run name
    env = {**os.environ, "CRUCIBLE_TRAINER_ADAPTER_DIR": str(work / "adapters")}
    queue, width, before = list(names), args.parallel or len(names), None
    try:
        while queue or len(ended) < len(procs) or (before is None and args.eval_tasks):
            if queue and len(procs) - len(ended) < width:
                name = queue.pop(0)
                specs[name] = spec_of(name, args)
                (spec_file := work / f"{name}.json").write_text(json.dumps(specs[name]))
                cmd = [sys.executable, "-m", "crucible_cli", "train", "--local", "-c", str(spec_file)]
                cmd += ["--generator", generators[name].url, "--sandbox", settings.sandbox_url]
                cmd += ["--runs-dir", str(work / "jobs"), "--job-id", name]
                log = (work / f"{name}.log").open("w")
                procs[name] = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
                started[name] = time.perf_counter()
                print(f"started {name}", flush=True)
                continue
            if before is None and args.eval_tasks:
                data = {"dataset": "mbpp", "split": "test", "limit": args.eval_tasks}
                before = common.evaluation(settings, "before", {"base": args.model}, data, 256)
                print("before:", json.dumps(before), flush=True)
            late = time.time() - deadline
            for name, p in procs.items():
                if p.poll() is not None:
                    ended.setdefault(name, time.perf_counter() - started[name])
                elif late > 45:  # it ignored the interrupt
                    p.terminate()
                elif late > 0 and name not in interrupted:
                    p.send_signal(signal.SIGINT)  # once: a second one aborts without a summary
                    interrupted.add(name)
            time.sleep(1)
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
    runs = {n: collect(n, work / "jobs" / n, args.out_dir, specs[n], ended.get(n)) for n in names}
    return {"mbpp_before": before, "runs": runs}


def main() -> None:
    parser = common.argument_parser(__doc__, overrides=True)
    names = ", ".join(common.recipes(RUNS))
    parser.add_argument("--runs", default=names.replace(" ", ""), help=f"comma-separated: {names}")
    parser.add_argument("--eval-tasks", type=int, default=500, help="MBPP test tasks (0: no MBPP evaluation)")
    parser.add_argument("--model", default="smollm2-135m-instruct")
    # Four trainers beside five generators overfill an 80 GB card.
    parser.add_argument("--parallel", type=int, default=2, help="runs at once (0: all)")
    parser.add_argument("--deadline-s", type=float, default=720, help="interrupt runs going this long")
    parser.add_argument("--tiny", action="store_true", help="a CPU smoke run: 2 steps of 2 games")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--out-dir", type=Path)
    args = parser.parse_args()
    if args.tiny:
        args.eval_tasks = 2
    names = [n for n in args.runs.split(",") if n]
    if unknown := set(names) - set(common.recipes(RUNS)):
        parser.error(f"unknown runs {sorted(unknown)}; choose from {', '.join(common.recipes(RUNS))}")
    if args.out_dir is not None:
        args.out_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    work, cuda = Path(tempfile.mkdtemp(prefix="crucible-selfplay-")), common.card() != "cpu"
    # Game turns are short: 64 rows of 1,024 slots each (a quarter of the evaluation generator's KV
    # cache), so five generators leave room for two trainers (~16 GiB each at micro-batch 32) on 80 GB.
    game_env = {"CRUCIBLE_GENERATOR_MAX_MODEL_LEN": "1024"} if cuda else {}
    with common.services(work, args.model, 128 if cuda else 32, max_loras=8) as settings:

        def game_generator(name: str) -> Any:
            rows, log = 64 if cuda else 32, f"generator-{name}.log"
            return common.spawn_generator(work, args.model, rows, max_loras=8, env=game_env, log=log)

        with ThreadPoolExecutor(len(names)) as pool:  # side by side
            generators = dict(zip(names, pool.map(game_generator, names), strict=True))
        started_s = time.perf_counter() - t0
        print(f"services up in {started_s:.0f} s (work dir {work})", flush=True)
        try:
            played = play(args, names, work, settings, generators)
        finally:
            for generator in generators.values():
                generator.stop()
    for name, run in played["runs"].items():
        median = f"{run['median_step_s'] or 0:.2f} s/step"
        print(f"{name}: {run['status']}, {run['steps_done']} steps, median {median}, MBPP greedy pass@1 "
              f"{run['mbpp_greedy_pass@1']}", flush=True)  # fmt: skip
        for key, value in sorted(run["final_5_steps"].items()):
            if key.endswith(("win_rate", "illegal_rate", "accuracy", "invalid_rate")) or "rae/" in key:
                print(f"  {key}: {value:.3f}", flush=True)
    result = {"device": common.card(), "total_s": time.perf_counter() - t0, "services_s": started_s}
    result["args"] = {k: v for k, v in vars(args).items() if k not in ("json", "out_dir")}
    result |= {**played, "rae_vs_shared": compare(played["runs"])}
    print("rae vs shared:", json.dumps(result["rae_vs_shared"], indent=1), flush=True)
    if args.json:
        common.dump(args.json, result)
    print(f"total {result['total_s']:.0f} s", flush=True)


if __name__ == "__main__":
    main()
