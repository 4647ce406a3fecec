"""GRPO step time and reward with Crucible's own stack, in the setup of TRL's GRPOTrainer baseline:
SmolLM2-135M-Instruct, LoRA r16 on all linear layers, MBPP train tasks (601-974), 8 prompts x 8
samples per step, 256 new tokens, fraction-of-tests reward.

Starts a sandbox and a generator (CUDA + bf16 when present) as subprocesses, runs the training
job in-process (`crucible_trainer.train`, exactly what a queued job runs), and prints seconds per
step with the time split (generate / execute / train / publish), the median over steps 2+ and the
median over the steps 2+ that updated the policy (a step whose groups all had equal rewards skips
its update), with how many did.
With `--eval-tasks N` it also evaluates greedy pass@1 on the first N MBPP test tasks before and
after training (the learning run; `--method srrl` for SRRL at the same sample budget).

With `--generator-url URL` the job uses that generator instead (e.g. vLLM serving the same weights
under the served name `smollm2-135m-instruct`): adapters are published to it through
`/v1/load_lora_adapter` and the stale-policy check compares against its logprobs.

A learning recipe is these flags: `--seed S` (the problems' order and every sampling seed), `--lr`,
`--group-size`, `--lora-r`, `--temperature`, `--filter`/`--pre-samples`/`--pre-keep`/
`--max-draw-factor`, `--reward`, `--loss`, `--kl-beta`, `--staleness`/`--cap` (overlapped
rollouts), and `--sft-first` (SFT on the policy's own passing candidates, K=8 per train problem,
before GRPO starts from that adapter, with KL 0.02 to it unless `--kl-beta` says otherwise; the
base model's score is then the pipeline's baseline). `--train-limit` and
`--eval-tasks` make a tiny run (CPU). `bench/seeds.py` runs one recipe over several seeds.

With `--spec FILE` the job is that spec (e.g. `examples/grpo_qwen1p5b.yaml`: its LoRA rank,
gradient checkpointing, micro-batch, token budget) with `--model`, `--steps` and evaluation taken
from the command line; the trainer's peak GPU memory and the card's use at the end are reported.
Random-weight checkpoints (bench/model_shapes.py) earn every answer the same reward, so no group
would train: `--kl-beta 0.01` keeps every sequence in the update (at the cost of one reference pass).

Usage: python bench/grpo_race.py [--steps 8] [--method grpo|srrl] [--eval-tasks 0] [--generator-url URL]
       [--spec FILE] [--seed 0] [recipe flags] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def job_spec(
    method: str,
    steps: int,
    eval_tasks: int,
    model: str,
    prompts: int = 8,
    max_tokens: int = 256,
    reward: str = "fraction",
    group_filter: str = "none",
    before: bool = True,
    micro_batch: int = 64,
    *,
    seed: int = 0,
    lr: float = 1e-4,
    group_size: int = 8,
    lora_r: int = 16,
    temperature: float = 1.0,
    pre_samples: int = 4,
    pre_keep: str = "pass_rate",
    max_draw_factor: float = 3.0,
    loss: str = "token",
    kl_beta: float = 0.0,
    init_adapter: str | None = None,
    train_limit: int | None = None,
    eval_max_tokens: int = 256,
    staleness: int = 0,
    cap: float = 2.0,
) -> dict:
    """The training job of one run (the race's setup unless a recipe flag changes it)."""
    method_cfg: dict = (
        {"name": "grpo", "group_size": group_size, "loss": loss, "kl_beta": kl_beta}
        if method == "grpo"
        else {"name": "srrl", "c1": 2, "c2": 4, "c2_temperature": 0.3, "budget": 10, "loss": loss}
    )
    method_cfg["filter"] = {
        "mode": group_filter,
        "pre_samples": pre_samples,
        "pre_keep": pre_keep,
        "max_draw_factor": max_draw_factor,
    }
    model_cfg = (
        {"base": model, "init_adapter": init_adapter}
        if init_adapter
        else {"base": model, "lora_r": lora_r, "lora_alpha": 2 * lora_r, "target_modules": "all-linear"}
    )
    limit = {"limit": train_limit} if train_limit else {}
    return {
        "kind": "train",
        "method": method_cfg,
        "model": model_cfg,
        "data": {"dataset": "mbpp", "split": "train", "shuffle": True, "seed": seed, **limit},
        "rollout": {"temperature": temperature, "max_tokens": max_tokens},
        "reward": {"kind": reward},
        "optim": {"lr": lr, "steps": steps, "problems_per_step": prompts, "micro_batch": micro_batch},
        "publish": {"every": 1, "staleness_window": 1, "stale_tolerance": 0.25},
        "eval": {
            "data": {"dataset": "mbpp", "split": "test", "limit": eval_tasks},
            "max_tokens": eval_max_tokens,
            "before": before,
        }
        if eval_tasks
        else None,
        "checkpoint": {"every": 10_000},
        "logging": {"wandb_mode": "disabled"},
        "seed": seed,
        **({"overlap": {"max_staleness": staleness, "cap": cap}} if staleness else {}),
    }


def sft_pipeline(args: argparse.Namespace) -> dict:
    """The `--sft-first` stage: K=8 candidates per train problem at T=1, run, the passing ones
    (up to 4 distinct per problem) trained on with SFT (`bench/offline_figures.py`'s recipe); the
    base model's evaluation first when the run evaluates."""
    from bench.common import TRAIN

    stages = ["generate", "annotate", "build", "train"]
    limit = {"limit": args.train_limit} if args.train_limit else {}
    return {
        "kind": "pipeline",
        "stages": (["baseline"] if args.eval_tasks else []) + stages,
        "model": {"base": args.model, "lora_r": args.lora_r, "lora_alpha": 2 * args.lora_r},
        "data": {"dataset": "mbpp", "split": "train", **limit},
        "generate": {
            "k": 8,
            "temperature": 1.0,
            "top_p": 1.0,
            "max_tokens": args.max_tokens,
            "concurrency": 32,
        },
        "build": {"n_best": 4, "pairing": "pass_fail", "max_pairs": 4},
        "eval": {
            "data": {"dataset": "mbpp", "split": "test", "limit": max(args.eval_tasks, 1)},
            "greedy": True,
            "max_tokens": args.eval_max_tokens,
        },
        "checkpoint": {"every": 1000},
        "logging": {"wandb_mode": "disabled"},
        "seed": args.seed,
        **TRAIN["sft"],
    }


def step_medians(rows: list[dict]) -> dict:
    """Median seconds per step over steps 2+ (step 1 pays start-up costs), over all of them and over
    those that updated the policy (a step whose groups all had equal rewards trains nothing and is
    faster), and how many updated.

    >>> rows = [{"time/step_s": 9.0, "update/sequences": 8.0}, {"time/step_s": 1.0, "update/sequences": 0.0},
    ...         {"time/step_s": 3.0, "update/sequences": 16.0}, {"time/step_s": 2.0, "update/sequences": 8.0}]
    >>> step_medians(rows)
    {'median_step_s': 2.0, 'median_updated_step_s': 2.5, 'updated_steps': 3}
    """
    later = rows[1:] or rows
    updated = [r for r in later if r.get("update/sequences", 0.0) > 0]
    return {
        "median_step_s": statistics.median(r["time/step_s"] for r in later),
        "median_updated_step_s": statistics.median(r["time/step_s"] for r in updated) if updated else None,
        "updated_steps": sum(1 for r in rows if r.get("update/sequences", 0.0) > 0),
    }


def from_spec_file(path: Path, model: str, steps: int, eval_tasks: int) -> dict:
    """The job spec in `path` with the model, the steps and the evaluation of this race."""
    import yaml

    raw = yaml.safe_load(path.read_text())
    raw["model"]["base"] = model
    raw["optim"]["steps"] = steps
    raw["eval"] = (
        {"data": {"dataset": "mbpp", "split": "test", "limit": eval_tasks}, "max_tokens": 256}
        if eval_tasks
        else None
    )
    raw["checkpoint"] = {"every": 10_000}
    raw["logging"] = {"wandb_mode": "disabled"}
    return raw


async def humaneval_pair(
    generator_url: str, sandbox_url: str, adapter: str | None, max_tokens: int, out: Path | None
) -> dict:
    """Greedy pass@1 on all 164 HumanEval tasks of the base model and of the trained adapter
    (loaded into the run's generator under a name of its own), with the run's prompts and
    extraction; each report written under `out` when given."""
    from crucible_shared.generator_client import GeneratorClient
    from crucible_shared.sandbox_client import SandboxClient
    from crucible_trainer.evaluation import EvalConfig, evaluate, write_report
    from crucible_trainer.tasks import DataSpec, load_tasks

    spec = DataSpec(dataset="humaneval")
    tasks = load_tasks(spec)
    scores: dict = {}
    async with GeneratorClient(generator_url, timeout=3600) as gen, SandboxClient(sandbox_url) as box:
        if adapter:
            await gen.load_adapter("trained-final", adapter)
        for label, model in (("before", None), ("after", "trained-final" if adapter else None)):
            if label == "after" and not adapter:
                break
            config = EvalConfig(model=model, n=0, greedy=True, max_tokens=max_tokens, concurrency=64, ks=[1])
            report = await evaluate(tasks, gen, box, config, data=spec)
            scores[label] = {"greedy_pass@1": report.summary().get("greedy_pass@1"), "problems": len(tasks)}
            if out is not None:
                write_report(report, out / f"humaneval-{label}")
    return scores


def keep_reports(run_dir: Path, out: Path) -> None:
    """The run's MBPP evaluation reports (every greedy answer, its verdict) copied to `out`."""
    import shutil

    for label in ("before", "after"):
        found = run_dir / "eval" / label / "report.json"
        if found.is_file():
            (out / f"mbpp-{label}").mkdir(parents=True, exist_ok=True)
            shutil.copy2(found, out / f"mbpp-{label}" / "report.json")


def gpu_memory() -> dict:
    """The trainer's peak GPU memory (this process) and the card's use now (the generator's too)."""
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


def spawn_generator(
    work: Path,
    model: str,
    rows: int | str,
    *,
    max_loras: int = 4,
    env: dict[str, str] | None = None,
    log: str = "generator.log",
    timeout: float = 600,
) -> Any:
    """A Crucible generator for a benchmark's job: `rows` at once, quiet, loading the adapters the
    job publishes under `work`; `env` adds settings (e.g. CUDA_VISIBLE_DEVICES)."""
    from crucible_cli.spawn import start

    settings = {
        "CRUCIBLE_GENERATOR_MODEL": model,
        "CRUCIBLE_GENERATOR_MAX_BATCH_SIZE": str(rows),
        "CRUCIBLE_GENERATOR_MAX_LORAS": str(max_loras),
        "CRUCIBLE_GENERATOR_LOG_LEVEL": "warning",
        "CRUCIBLE_GENERATOR_ADAPTER_ROOTS": str(work),
        **(env or {}),
    }
    return start("crucible_generator", settings, "CRUCIBLE_GENERATOR_PORT", log=work / log, timeout=timeout)


def on_device(device: str | None) -> dict[str, str]:
    """The environment that puts a spawned service on `device` (a CUDA_VISIBLE_DEVICES value)."""
    return {"CUDA_VISIBLE_DEVICES": device} if device else {}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--method", choices=["grpo", "srrl"], default="grpo")
    parser.add_argument(
        "--eval-tasks", type=int, default=0, help="MBPP test tasks to evaluate before/after (0: none)"
    )
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--prompts", type=int, default=8, help="problems per step (the race uses 8)")
    parser.add_argument(
        "--max-tokens", type=int, default=256, help="new tokens per completion (the race uses 256)"
    )
    parser.add_argument("--reward", default="fraction", choices=["fraction", "all_pass", "graded"])
    parser.add_argument(
        "--filter",
        default="none",
        choices=["none", "pre", "dynamic"],
        help="which groups train: all, a one-off pre-filter (0 < pass rate < 1), or dynamic sampling",
    )
    parser.add_argument(
        "--difficulty-filter", action="store_true", help="the same as --filter pre (older runs used it)"
    )
    parser.add_argument("--no-before", action="store_true", help="skip the evaluation before training")
    parser.add_argument(
        "--micro-batch",
        type=int,
        default=64,
        help="sequences per forward/backward (same gradient, less memory)",
    )
    parser.add_argument(
        "--generator-url", default=None, help="an external generator (default: spawn Crucible's)"
    )
    parser.add_argument(
        "--generator-batch",
        type=lambda v: v if v == "auto" else int(v),
        default=128,
        help="rows of the spawned generator (runs sharing a card: 64); auto: from memory, or from "
        "CRUCIBLE_GENERATOR_GPU_MEMORY_FRACTION when set",
    )
    parser.add_argument(
        "--generator-device", help="CUDA_VISIBLE_DEVICES of the spawned generator (default: the trainer's)"
    )
    recipe = parser.add_argument_group("recipe")
    recipe.add_argument("--seed", type=int, default=0, help="problem order and sampling seeds")
    recipe.add_argument("--lr", type=float, default=1e-4)
    recipe.add_argument("--group-size", type=int, default=8, help="GRPO samples per problem")
    recipe.add_argument("--lora-r", type=int, default=16, help="LoRA rank (alpha = 2 * rank)")
    recipe.add_argument("--temperature", type=float, default=1.0, help="rollout temperature")
    recipe.add_argument("--pre-samples", type=int, default=4, help="--filter pre: samples per problem")
    recipe.add_argument(
        "--pre-keep",
        default="pass_rate",
        choices=["pass_rate", "reward_spread"],
        help="--filter pre: keep rule",
    )
    recipe.add_argument("--max-draw-factor", type=float, default=3.0, help="--filter dynamic: draw cap")
    recipe.add_argument("--loss", default="token", choices=["token", "sequence", "dr_grpo"])
    recipe.add_argument(
        "--kl-beta", type=float, default=None, help="KL to the start (default 0; 0.02 after SFT)"
    )
    recipe.add_argument("--sft-first", action="store_true", help="SFT on passing candidates, then GRPO")
    recipe.add_argument(
        "--train-limit", type=int, default=None, help="the first N train problems (tiny runs)"
    )
    recipe.add_argument("--eval-max-tokens", type=int, default=256)
    recipe.add_argument(
        "--staleness", type=int, default=0, help="overlap.max_staleness (0: the synchronous loop)"
    )
    recipe.add_argument("--cap", type=float, default=2.0, help="--staleness: importance-weight cap")
    parser.add_argument(
        "--humaneval", action="store_true", help="also greedy pass@1 on HumanEval (164) before and after"
    )
    parser.add_argument(
        "--keep-reports", type=Path, default=None, help="copy the evaluation reports (every answer) here"
    )
    parser.add_argument("--spec", type=Path, default=None, help="a job spec YAML to run instead (see above)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()

    from crucible_cli.spawn import start
    from crucible_shared.jobs import TrainJob
    from crucible_trainer.channel import LocalChannel
    from crucible_trainer.settings import Settings
    from crucible_trainer.train import run_train_job

    work = Path(tempfile.mkdtemp(prefix="crucible-race-"))
    sandbox = start("crucible_sandbox", {}, "CRUCIBLE_SANDBOX_PORT", log=work / "sandbox.log", timeout=300)
    generator = (
        None
        if args.generator_url
        else spawn_generator(
            work,
            args.model,
            args.generator_batch,
            max_loras=max(4, args.staleness + 2),
            env=on_device(args.generator_device),
        )
    )
    try:
        settings = Settings(
            generator_urls=[args.generator_url or generator.url],
            sandbox_url=sandbox.url,
            adapter_dir=work / "adapters",
            runs_dir=work / "jobs",
        )
        t = time.perf_counter()
        sft: dict = {}
        if args.sft_first:
            from bench.common import run_pipeline

            done = run_pipeline(sft_pipeline(args), f"sft-s{args.seed}", settings)
            sft = {"adapter": done["adapter"], "seconds": done["wall_s"], "rounds": done.get("rounds")}
            sft["base_eval"] = done.get("eval", {}).get("before")
        kl_beta = args.kl_beta if args.kl_beta is not None else (0.02 if args.sft_first else 0.0)
        raw = (
            from_spec_file(args.spec, args.model, args.steps, args.eval_tasks)
            if args.spec
            else job_spec(
                args.method,
                args.steps,
                args.eval_tasks,
                args.model,
                args.prompts,
                args.max_tokens,
                args.reward,
                "pre" if args.difficulty_filter else args.filter,
                not args.no_before,
                args.micro_batch,
                seed=args.seed,
                lr=args.lr,
                group_size=args.group_size,
                lora_r=args.lora_r,
                temperature=args.temperature,
                pre_samples=args.pre_samples,
                pre_keep=args.pre_keep,
                max_draw_factor=args.max_draw_factor,
                loss=args.loss,
                kl_beta=kl_beta,
                init_adapter=sft.get("adapter"),
                train_limit=args.train_limit,
                eval_max_tokens=args.eval_max_tokens,
                staleness=args.staleness,
                cap=args.cap,
            )
        )
        if args.kl_beta is not None:
            raw["method"]["kl_beta"] = args.kl_beta
        spec = TrainJob.model_validate(raw)
        args.method = spec.method.name
        job_id = f"race-{args.method}"
        summary = asyncio.run(run_train_job(spec, job_id, settings, LocalChannel(job_id)))
        total = time.perf_counter() - t
        memory = gpu_memory()
        humaneval: dict = {}
        if args.humaneval:
            t_he = time.perf_counter()
            humaneval = asyncio.run(
                humaneval_pair(
                    args.generator_url or generator.url,
                    sandbox.url,
                    summary.get("adapter"),
                    args.eval_max_tokens,
                    args.keep_reports,
                )
            )
            humaneval["seconds"] = round(time.perf_counter() - t_he, 1)
            print("humaneval:", json.dumps(humaneval), flush=True)
        if args.keep_reports:
            keep_reports(work / "jobs" / f"race-{args.method}", args.keep_reports)
    finally:
        if generator is not None:
            generator.stop()
        sandbox.stop()
    rows = [
        row
        for line in (work / "jobs" / f"race-{args.method}" / "metrics.jsonl").read_text().splitlines()
        if "eval_label" not in (row := json.loads(line))
    ]
    keys = [
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
    print(f"{args.method}: {len(rows)} steps in {total:.1f} s ({summary.get('status')})")
    for r in rows:
        extra = f" c2_rescue {r['c2_rescue_rate']:.2f}" if "c2_rescue_rate" in r else ""
        print(
            f"step {r['step']}: "
            + " ".join(f"{k.split('/')[-1]} {r.get(k, float('nan')):.2f}" for k in keys)
            + f" stale_diff {r.get('stale/diff', float('nan')):.4f}{extra}"
        )
    timing = step_medians(rows)
    median = timing["median_step_s"]
    split = {k: statistics.median(r.get(k, 0.0) for r in rows[1:] or rows) for k in keys[:7]}
    print(
        f"median step (steps 2+): {median:.2f} s; split: "
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
    if sft and evals:  # the GRPO job's "before" is the SFT adapter; the run's is the base model
        evals["sft"] = evals.pop("before", None)
        evals["before"] = sft.get("base_eval")
    if evals:
        print("eval:", json.dumps(evals))
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "method": args.method,
                    "rows": rows,
                    "median_step_s": median,
                    "median_updated_step_s": timing["median_updated_step_s"],
                    "updated_steps": timing["updated_steps"],
                    "steps": len(rows),
                    "split": split,
                    "eval": evals or None,
                    "seed": args.seed,
                    "staleness": args.staleness,
                    "wall_s": total,
                    "job": spec.model_dump(mode="json"),
                    "sft": sft or None,
                    "difficulty_filter": summary.get("difficulty_filter"),
                    "filter": "pre" if args.difficulty_filter else args.filter,
                    "reward": args.reward,
                    "generator": args.generator_url or "crucible",
                    "stale_check_final": summary.get("stale_check"),
                    "memory": memory,
                    "settings": summary.get("settings"),
                    "spec": str(args.spec) if args.spec else None,
                    "model": args.model,
                    "humaneval": humaneval or None,
                },
                indent=1,
            )
        )


if __name__ == "__main__":
    main()
