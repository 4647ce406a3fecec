"""Self-play figures (SPIRAL) on one GPU in a fixed budget: the code-output game and tic-tac-toe,
each with role-conditioned advantages (RAE) and with one shared baseline (the ablation).

Starts one sandbox, and one generator per game job and one for the evaluation (a 135M model leaves
an H100 mostly idle, so the runs share it concurrently; sharing one generator, five streams of short
game turns of different adapters queued behind each other's batches), runs every game job as its
own process, and evaluates the base model's MBPP-test greedy pass@1 meanwhile through the one
evaluation path (an eval job). Each
job plays arena games against fixed opponents every `--arena-every` steps (tic-tac-toe: the random
player and the frozen base; code-output: the frozen base), evaluates MBPP-test greedy pass@1 halfway
and after training (transfer), and logs per-role returns, win and illegal-move rates, predictor
accuracy, writer invalid rate and the mean squared advantage under both baselines.

Writes `--json` (every run's metric series, the MBPP figures before / halfway / after, the RAE vs
shared comparison, timings) and, into `--out-dir`, each run's metrics.jsonl, games.md and
learning curve plus `selfplay.png` (the runs side by side). A run still going at `--deadline-s`
is cancelled (its figures so far are kept, marked partial), so the JSON is always written.

Usage: python bench/selfplay.py [--runs ttt-role,ttt-shared,code-role,code-shared]
           [--ttt-steps 36] [--code-steps 26] [--games 32] [--arena-every 5] [--eval-tasks 500]
           [--deadline-s 720] [--parallel 2] [--json out.json] [--out-dir dir]
       python bench/selfplay.py --tiny ...   # a CPU smoke run of the script (2 steps, tiny games)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.common import card, load_job, run_job  # noqa: E402

RUNS = {  # name -> (game, baseline)
    "ttt-role": ("tictactoe", "role"),
    "ttt-shared": ("tictactoe", "shared"),
    "code-role": ("code_output", "role"),
    "code-shared": ("code_output", "shared"),
}
SERIES = [  # metric patterns kept per step in the JSON (`*`: any role or opponent)
    "role/", "arena/", "game/", "rae/", "reward_mean", "samples", "completion_tokens_mean",
    "update/sequences", "time/step_s", "time/generate_s", "time/train_s", "eval/greedy_pass@1",
]  # fmt: skip


def spec_of(name: str, args: argparse.Namespace) -> dict[str, Any]:
    """The run's job: examples/spiral_<game>.yaml with this benchmark's budget as `--set` overrides."""
    game, baseline = RUNS[name]
    ttt = game == "tictactoe"
    steps = args.ttt_steps if ttt else args.code_steps
    evaluation = {"data": {"dataset": "mbpp", "split": "test", "limit": args.eval_tasks}, "max_tokens": 256}
    evaluation |= {"before": False, "every": steps // 2}  # before: the base model's eval job, once
    sets = [f"name={name}", f"method.games_per_step={args.games}", f"method.baseline={baseline}"]
    sets += [f"method.arena.every={args.arena_every}", f"method.arena.games={args.arena_games}"]
    sets += [f"model.base={args.model}", "model.gradient_checkpointing=false"]
    sets += [f"rollout.max_tokens={args.ttt_tokens if ttt else args.code_tokens}", f"optim.lr={args.lr}"]
    sets += [f"optim.steps={steps}", f"optim.micro_batch={args.micro_batch}", "publish.stale_tolerance=0.25"]
    sets += ["eval=" + (json.dumps(evaluation) if args.eval_tasks else "null"), "checkpoint.every=100000"]
    sets += ["logging={wandb_mode: disabled, samples_every: 0}", f"seed={args.seed}"]
    return load_job(ROOT / "examples" / f"spiral_{game}.yaml", sets).model_dump(mode="json")


# -- one run, as its own process ---------------------------------------------------------------------


def child(args: argparse.Namespace) -> None:
    """Run one job in this process (exactly what a worker runs), cancelled at its deadline."""
    from crucible_shared.jobs import TrainJob
    from crucible_trainer.online.train import run_train_job
    from crucible_trainer.runtime.channel import LocalChannel
    from crucible_trainer.settings import Settings

    spec = TrainJob.model_validate_json(Path(args.child_spec).read_text())
    work = Path(args.work)
    settings = Settings(
        generator_urls=[args.generator],
        sandbox_url=args.sandbox,
        adapter_dir=work / "adapters",
        runs_dir=work / "jobs",
    )
    channel = LocalChannel(args.child)
    deadline = threading.Timer(max(1.0, args.child_deadline - time.time()), channel.cancel)
    deadline.daemon = True
    deadline.start()
    started = time.perf_counter()
    summary = asyncio.run(run_train_job(spec, args.child, settings, channel))
    summary["wall_s"] = time.perf_counter() - started
    (work / f"{args.child}.summary.json").write_text(json.dumps(summary, indent=1, default=str))


# -- the set ------------------------------------------------------------------------------------------


def base_eval(generator: str, sandbox: str, work: Path, args: argparse.Namespace) -> dict[str, Any]:
    """The base model's MBPP-test greedy pass@1, through an eval job (the one evaluation path)."""
    from crucible_shared.jobs import EvalJob
    from crucible_trainer.settings import Settings

    spec = EvalJob(
        model={"base": args.model},
        data={"dataset": "mbpp", "split": "test", "limit": args.eval_tasks},
        max_tokens=256,
    )
    settings = Settings(
        generator_urls=[generator], sandbox_url=sandbox, adapter_dir=work / "adapters", runs_dir=work / "jobs"
    )
    summary = run_job(spec, "before", settings)
    return {**summary.get("eval", {}), "wall_s": summary["wall_s"]}


def collect(name: str, work: Path, out_dir: Path | None, spec: dict[str, Any]) -> dict[str, Any]:
    run_dir = work / "jobs" / name
    summary_path = work / f"{name}.summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else {"status": "lost"}
    rows = []
    if (run_dir / "metrics.jsonl").exists():
        rows = [
            json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()
        ]
    steps = [r for r in rows if "games" in r]
    series: dict[str, list[list[float]]] = {}
    for r in rows:  # training steps and the evaluations (halfway, after)
        for key, value in r.items():
            if isinstance(value, int | float) and any(key.startswith(p) for p in SERIES):
                series.setdefault(key, []).append([r["step"], value])
    evals = {r["eval_label"]: r for r in rows if "eval_label" in r}
    last = steps[-5:]
    final = {
        key: statistics.fmean(r[key] for r in last if key in r)
        for key in sorted({k for r in last for k in r})
        if any(key.startswith(p) for p in ("role/", "game/", "rae/")) and any(key in r for r in last)
    }
    if out_dir is not None and run_dir.exists():
        target = out_dir / name
        target.mkdir(parents=True, exist_ok=True)
        for file in ("metrics.jsonl", "games.md", "learning_curve.png", "summary.json"):
            if (run_dir / file).exists():
                shutil.copy(run_dir / file, target / file)
    return {
        "spec": spec,
        "status": summary.get("status"),
        "partial": summary.get("status") != "finished",
        "steps_done": len(steps),
        "wall_s": summary.get("wall_s"),
        "median_step_s": statistics.median(r["time/step_s"] for r in steps) if steps else None,
        "mbpp_greedy_pass@1": {
            label: evals[label].get("eval/greedy_pass@1")
            for label in sorted(evals, key=lambda k: evals[k]["step"])
        },
        "final_5_steps": final,
        "series": series,
    }


def compare(runs: dict[str, Any]) -> dict[str, Any]:
    """RAE against the shared baseline, per game: the same figures side by side."""
    out: dict[str, Any] = {}
    for game, prefix in (("tictactoe", "ttt"), ("code_output", "code")):
        pair = {b: runs.get(f"{prefix}-{b}") for b in ("role", "shared")}
        if not all(pair.values()):
            continue
        row: dict[str, Any] = {}
        for baseline, run in pair.items():
            series = run["series"]

            def mean_of(key: str, series: dict = series) -> float | None:
                points = series.get(key, [])
                return statistics.fmean(v for _, v in points) if points else None

            def last_of(key: str, series: dict = series) -> float | None:
                points = series.get(key, [])
                return points[-1][1] if points else None

            def first_of(key: str, series: dict = series) -> float | None:
                points = series.get(key, [])
                return points[0][1] if points else None

            arena = sorted(
                {k for k in series if k.startswith("arena/") and k.count("/") == 2 and k.endswith("win_rate")}
            )
            row[baseline] = {
                "advantage_sq_trained": mean_of(f"rae/advantage_sq_{baseline}"),
                "advantage_sq_role_shadow": mean_of("rae/advantage_sq_role"),
                "advantage_sq_shared_shadow": mean_of("rae/advantage_sq_shared"),
                "illegal_rate_first_last": [first_of("game/illegal_rate"), last_of("game/illegal_rate")],
                "arena_win_rate_first_last": {k: [first_of(k), last_of(k)] for k in arena},
                "mbpp_greedy_pass@1": run["mbpp_greedy_pass@1"],
            }
        out[game] = row
    return out


def plot(runs: dict[str, Any], path: Path, before: dict[str, Any] | None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [
        ("role/*/win_rate", "self-play win rate per role"),
        ("role/*/illegal_rate", "illegal answers per role"),
        ("arena/*/win_rate", "win rate vs fixed opponents"),
        ("arena/base/*/win_rate", "vs frozen base, per learner role"),
        ("game/predictor_accuracy", "predictor accuracy (self-play)"),
        ("game/writer_invalid_rate", "writer invalid rate"),
        ("rae/advantage_sq_*", "mean squared advantage"),
        ("eval/greedy_pass@1", "MBPP-test greedy pass@1"),
    ]
    import re

    fig, axes = plt.subplots(2, 4, figsize=(20, 8))
    for ax, (pattern, title) in zip(axes.flat, panels, strict=True):
        match = re.compile("^" + re.escape(pattern).replace(r"\*", "([^/]+)") + "$")
        for name, run in runs.items():
            for key, points in sorted(run["series"].items()):
                found = match.match(key)
                if found and points:
                    label = f"{name} {found.group(1)}" if found.groups() else name
                    ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", ms=2, label=label)
        if pattern.startswith("eval/") and before and before.get("greedy_pass@1") is not None:
            ax.plot([0], [before["greedy_pass@1"]], marker="s", color="black", label="base (before)")
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--runs", default=",".join(RUNS), help="comma-separated: " + ", ".join(RUNS))
    parser.add_argument("--ttt-steps", type=int, default=36)
    parser.add_argument("--code-steps", type=int, default=26)
    parser.add_argument("--games", type=int, default=32, help="games per training step")
    parser.add_argument("--arena-every", type=int, default=5)
    parser.add_argument("--arena-games", type=int, default=32, help="games per fixed opponent")
    parser.add_argument("--ttt-tokens", type=int, default=32, help="max new tokens of a tic-tac-toe turn")
    parser.add_argument("--code-tokens", type=int, default=160, help="max new tokens of a code-output turn")
    parser.add_argument("--eval-tasks", type=int, default=500, help="MBPP test tasks (0: no MBPP evaluation)")
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--micro-batch", type=int, default=32)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--parallel",
        type=int,
        default=2,
        help="runs at once (0: all); four trainers beside five generators overfill an 80 GB card",
    )
    parser.add_argument(
        "--deadline-s", type=float, default=720, help="cancel runs still going this long after the start"
    )
    parser.add_argument(
        "--tiny", action="store_true", help="a CPU smoke run: 2 steps of 2 games, short turns"
    )
    parser.add_argument("--json", type=Path)
    parser.add_argument("--out-dir", type=Path)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--child-spec", help=argparse.SUPPRESS)
    parser.add_argument("--child-deadline", type=float, help=argparse.SUPPRESS)
    parser.add_argument("--work", help=argparse.SUPPRESS)
    parser.add_argument("--generator", help=argparse.SUPPRESS)
    parser.add_argument("--sandbox", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
        return
    if args.tiny:
        args.ttt_steps = args.code_steps = 2
        args.games, args.arena_every, args.arena_games = 2, 1, 2
        args.ttt_tokens, args.code_tokens, args.eval_tasks, args.micro_batch = 8, 48, 2, 8
    names = [n for n in args.runs.split(",") if n]
    unknown = set(names) - set(RUNS)
    if unknown:
        parser.error(f"unknown runs {sorted(unknown)}; choose from {', '.join(RUNS)}")

    from crucible_cli.spawn import start

    t0 = time.perf_counter()
    deadline = time.time() + args.deadline_s
    work = Path(tempfile.mkdtemp(prefix="crucible-selfplay-"))
    cuda = card() != "cpu"
    sandbox = start("crucible_sandbox", {}, "CRUCIBLE_SANDBOX_PORT", log=work / "sandbox.log", timeout=300)
    generator_env = {
        "CRUCIBLE_GENERATOR_MODEL": args.model,
        "CRUCIBLE_GENERATOR_MAX_BATCH_SIZE": "128" if cuda else "32",
        "CRUCIBLE_GENERATOR_MAX_LORAS": "8",
        "CRUCIBLE_GENERATOR_LOG_LEVEL": "warning",
        **({} if cuda else {"CRUCIBLE_GENERATOR_DEVICE": "cpu"}),
    }
    # Game turns are short and a step plays `--games` games: 64 rows of 1,024 slots each (a quarter
    # of the evaluation generator's KV cache), so five generators leave room for two trainers
    # (`--parallel 2`; a trainer takes ~16 GiB at micro-batch 32) on one 80 GB card.
    game_env = (
        {"CRUCIBLE_GENERATOR_MAX_BATCH_SIZE": "64", "CRUCIBLE_GENERATOR_MAX_MODEL_LEN": "1024"}
        if cuda
        else {}
    )
    with ThreadPoolExecutor(len(names) + 1) as pool:  # start them side by side
        futures = {
            key: pool.submit(
                start,
                "crucible_generator",
                {**generator_env, **(game_env if key != "eval" else {})},
                "CRUCIBLE_GENERATOR_PORT",
                log=work / f"generator-{key}.log",
                timeout=600,
            )
            for key in [*names, "eval"]
        }
        generators = {key: future.result() for key, future in futures.items()}
    started_s = time.perf_counter() - t0
    print(f"services up in {started_s:.0f} s (work dir {work})", flush=True)
    specs = {name: spec_of(name, args) for name in names}
    procs: dict[str, subprocess.Popen] = {}
    try:
        before = None
        queue = list(names)

        def launch(name: str) -> None:
            spec_path = work / f"{name}.spec.json"
            spec_path.write_text(json.dumps(specs[name]))
            cmd = [
                sys.executable, __file__, "--child", name, "--child-spec", str(spec_path),
                "--child-deadline", str(deadline), "--work", str(work),
                "--generator", generators[name].url, "--sandbox", sandbox.url,
            ]  # fmt: skip
            procs[name] = subprocess.Popen(
                cmd, stdout=(work / f"{name}.log").open("w"), stderr=subprocess.STDOUT
            )
            print(f"started {name}", flush=True)

        width = args.parallel or len(queue)
        while queue and len(procs) < width:
            launch(queue.pop(0))
        if args.eval_tasks:
            before = base_eval(generators["eval"].url, sandbox.url, work, args)
            print("before:", json.dumps(before), flush=True)
        while any(p.poll() is None for p in procs.values()) or queue:
            running = sum(p.poll() is None for p in procs.values())
            if queue and running < width:
                launch(queue.pop(0))
                continue
            if time.time() > deadline + 45:  # a run that ignored its cancel: stop it
                for p in procs.values():
                    if p.poll() is None:
                        p.terminate()
            time.sleep(1)
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
        for generator in generators.values():
            generator.stop()
        sandbox.stop()
    out_dir = args.out_dir
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
    runs = {name: collect(name, work, out_dir, specs[name]) for name in names}
    for name, run in runs.items():
        print(
            f"{name}: {run['status']}, {run['steps_done']} steps, median {run['median_step_s'] or 0:.2f} s/step, "
            f"MBPP greedy pass@1 {run['mbpp_greedy_pass@1']}",
            flush=True,
        )
        for key in sorted(run["final_5_steps"]):
            if key.endswith(("win_rate", "illegal_rate", "accuracy", "invalid_rate")) or key.startswith(
                "rae/"
            ):
                print(f"  {key}: {run['final_5_steps'][key]:.3f}", flush=True)
    result = {
        "device": card(),
        "total_s": time.perf_counter() - t0,
        "services_s": started_s,
        "args": {
            k: v for k, v in vars(args).items() if not k.startswith("child") and k not in ("json", "out_dir")
        },
        "mbpp_before": before,
        "runs": runs,
        "rae_vs_shared": compare(runs),
    }
    print("rae vs shared:", json.dumps(result["rae_vs_shared"], indent=1), flush=True)
    if out_dir is not None:
        try:
            plot(runs, out_dir / "selfplay.png", before)
        except ImportError as exc:  # the JSON is the result; the figure is a convenience
            print(f"no plot: {exc}", flush=True)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1, default=str))
    print(f"total {result['total_s']:.0f} s", flush=True)


if __name__ == "__main__":
    main()
