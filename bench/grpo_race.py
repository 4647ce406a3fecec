"""GRPO step time and reward with Crucible's own stack, in the setup of TRL's GRPOTrainer baseline:
SmolLM2-135M-Instruct, LoRA r16 on all linear layers, MBPP train tasks (601-974), 8 prompts x 8
samples per step, 256 new tokens, fraction-of-tests reward.

Starts a sandbox and a generator (CUDA + bf16 when present) as subprocesses, runs the training
job in-process (`crucible_trainer.train`, exactly what a queued job runs), and prints seconds per
step with the time split (generate / execute / train / publish) and the median over steps 2+.
With `--eval-tasks N` it also evaluates greedy pass@1 on the first N MBPP test tasks before and
after training (the learning run; `--method srrl` for SRRL at the same sample budget).

With `--generator-url URL` the job uses that generator instead (e.g. vLLM serving the same weights
under the served name `smollm2-135m-instruct`): adapters are published to it through
`/v1/load_lora_adapter` and the stale-policy check compares against its logprobs.

With `--spec FILE` the job is that spec (e.g. `examples/grpo_qwen1p5b.yaml`: its LoRA rank,
gradient checkpointing, micro-batch, token budget) with `--model`, `--steps` and evaluation taken
from the command line; the trainer's peak GPU memory and the card's use at the end are reported.
Random-weight checkpoints (bench/model_shapes.py) earn every answer the same reward, so no group
would train: `--kl-beta 0.01` keeps every sequence in the update (at the cost of one reference pass).

Usage: python bench/grpo_race.py [--steps 8] [--method grpo|srrl] [--eval-tasks 0] [--generator-url URL]
       [--spec FILE] [--kl-beta B] [--json out.json]
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
) -> dict:
    method_cfg = (
        {"name": "grpo", "group_size": 8}
        if method == "grpo"
        else {"name": "srrl", "c1": 2, "c2": 4, "c2_temperature": 0.3, "budget": 10}
    )
    method_cfg["filter"] = {"mode": group_filter}
    return {
        "kind": "train",
        "method": method_cfg,
        "model": {"base": model, "lora_r": 16, "lora_alpha": 32, "target_modules": "all-linear"},
        "data": {"dataset": "mbpp", "split": "train", "shuffle": True, "seed": 0},
        "rollout": {"temperature": 1.0, "max_tokens": max_tokens},
        "reward": {"kind": reward},
        "optim": {"lr": 1e-4, "steps": steps, "problems_per_step": prompts, "micro_batch": micro_batch},
        "publish": {"every": 1, "staleness_window": 1, "stale_tolerance": 0.25},
        "eval": {
            "data": {"dataset": "mbpp", "split": "test", "limit": eval_tasks},
            "max_tokens": 256,
            "before": before,
        }
        if eval_tasks
        else None,
        "checkpoint": {"every": 10_000},
        "logging": {"wandb_mode": "disabled"},
        "seed": 0,
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
    parser.add_argument("--spec", type=Path, default=None, help="a job spec YAML to run instead (see above)")
    parser.add_argument("--kl-beta", type=float, default=None, help="GRPO's KL weight (default: the spec's)")
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
        else start(
            "crucible_generator",
            {
                "CRUCIBLE_GENERATOR_MODEL": args.model,
                "CRUCIBLE_GENERATOR_MAX_BATCH_SIZE": "128",
                "CRUCIBLE_GENERATOR_LOG_LEVEL": "warning",
            },
            "CRUCIBLE_GENERATOR_PORT",
            log=work / "generator.log",
            timeout=600,
        )
    )
    try:
        settings = Settings(
            generator_urls=[args.generator_url or generator.url],
            sandbox_url=sandbox.url,
            adapter_dir=work / "adapters",
            runs_dir=work / "jobs",
        )
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
            )
        )
        if args.kl_beta is not None:
            raw["method"]["kl_beta"] = args.kl_beta
        spec = TrainJob.model_validate(raw)
        args.method = spec.method.name
        job_id = f"race-{args.method}"
        t = time.perf_counter()
        summary = asyncio.run(run_train_job(spec, job_id, settings, LocalChannel(job_id)))
        total = time.perf_counter() - t
        memory = gpu_memory()
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
    later = [r["time/step_s"] for r in rows[1:]] or [rows[0]["time/step_s"]]
    median = statistics.median(later)
    split = {k: statistics.median(r.get(k, 0.0) for r in rows[1:] or rows) for k in keys[:7]}
    print(
        f"median step (steps 2+): {median:.2f} s; split: "
        + ", ".join(f"{k} {v:.2f}" for k, v in split.items())
    )
    if memory:
        print("memory:", json.dumps(memory))
    if summary.get("difficulty_filter"):
        print("difficulty filter:", json.dumps(summary["difficulty_filter"]))
    if summary.get("eval"):
        print("eval:", json.dumps(summary["eval"]))
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "method": args.method,
                    "rows": rows,
                    "median_step_s": median,
                    "split": split,
                    "eval": summary.get("eval"),
                    "difficulty_filter": summary.get("difficulty_filter"),
                    "filter": "pre" if args.difficulty_filter else args.filter,
                    "reward": args.reward,
                    "generator": args.generator_url or "crucible",
                    "stale_check_final": summary.get("stale_check"),
                    "memory": memory,
                    "settings": summary.get("settings"),
                    "spec": str(args.spec) if args.spec else None,
                },
                indent=1,
            )
        )


if __name__ == "__main__":
    main()
