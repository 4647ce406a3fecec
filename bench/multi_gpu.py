"""Samples/s and s/step of the same GRPO job on 1, 2, 4 GPUs, with the split between generation and update.

    python bench/multi_gpu.py --gpus 1,2,4 --out multi_gpu.json                 # SmolLM2-135M
    python bench/multi_gpu.py --shape qwen2.5-coder-1.5b --gpus 1,2,4 --out multi_gpu_1p5b.json
    python bench/multi_gpu.py --tiny --gpus 1,2 --out /tmp/multi_gpu.json       # CPU, gloo: a check

For each GPU count N this runs the real job the way a user runs it on an N-GPU host: one sandbox,
N Crucible generator replicas (one per GPU, `CUDA_VISIBLE_DEVICES=i`, as `crucible up
--generator-gpus` places a generator) sharing the cards with the trainer's N ranks, and the GRPO
train job with `distributed.train_gpus: N` run by `crucible_trainer.runtime.entry.execute` (what
`crucible train --local` and a worker call): N > 1 goes through the worker's launcher
(`torchrun`, DDP or FSDP2, rank 0 leading), N = 1 is the ordinary one-process job. The trainer
gets every replica's URL (`generator_urls`), so its generator pool spreads the rollouts over them
and publishes every adapter version to all. Events go to a local channel: no Redis.

Figures come from the job's own `metrics.jsonl`: per N the median over the steps after the
first (start-up, first compilations) of `time/step_s`, and the same medians of the split:
generation (`time/generate_s`; `time/rollout_s` adds the sandbox's tail), the update
(`time/train_s`), publishing to every replica (`publish/total_s`), the stale-policy check the
rollouts did not hide (`time/stale_wait_s`) and the rest. Samples/s is `prompts x group` over
the median s/step; the speed-up is over N = 1, checked against issue 26's targets (>= 1.8x on 2
GPUs, >= 3.2x on 4).

The work per step is made constant: `method.kl_beta` (default 0.01) keeps every sequence in the
update (otherwise a group whose samples all earn the same reward, every group of a random-weight
shape, trains nothing), and random weights sample EOS about once in 50,000 tokens, so `--shape`
completions run to `--max-tokens` (the rollout spec has no `ignore_eos`; SmolLM2's real weights
stop at EOS, hence `completion_tokens_mean` in the report).

Why 64 problems x 8 samples by default: generation only scales with replicas once one replica
is throughput-bound, i.e. holds more rows than it decodes at once. Each replica decodes at most
`--generator-batch` rows together (128, the race's setting), so 512 rows take one replica four
rounds of decoding, two replicas two and four replicas one. At 8 x 8 (the race's batch) one
replica decodes the whole batch at once, decoding is latency-bound (one forward per token
whatever the rows), and more replicas cannot shorten it.

`--shape` builds a random-weight checkpoint of a real model's exact shape (bench/model_shapes.py).
`--tiny` is a check of the script on a CPU: a tiny random Qwen2, gloo, few tokens.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import common  # noqa: E402

TARGETS = {2: 1.8, 4: 3.2}  # issue 26: samples/s over one GPU's
SPLIT = {  # report key -> the job's metric (median over the steps after the first)
    "generate_s": "time/generate_s",
    "rollout_s": "time/rollout_s",
    "execute_tail_s": "time/execute_tail_s",  # the part of the rollout after the last completion
    "update_command_s": "time/update_command_s",  # the update's parts: handing the batch over,
    "update_score_s": "time/update_score_s",  # scoring the reference,
    "update_passes_s": "time/update_passes_s",  # forward, backward and optimizer steps
    "update_ref_s": "time/update_ref_s",  # the passes' parts (device time, rl/timing.py):
    "update_old_s": "time/update_old_s",
    "update_forward_backward_s": "time/update_forward_backward_s",
    "update_allreduce_s": "time/update_allreduce_s",  # DDP; FSDP's reduce-scatter is in the backward
    "update_optimizer_s": "time/update_optimizer_s",
    "update_s": "time/train_s",
    "publish_s": "publish/total_s",
    "stale_wait_s": "time/stale_wait_s",
}

PERF = [
    f"perf/update{part}_{figure}"
    for part in ("", "_train", "_ref", "_old")
    for figure in ("tokens_per_s_per_gpu", "peak_fraction")
]


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct", help="model.base of the job")
    p.add_argument("--shape", help="build this shape with random weights (bench/model_shapes.py)")
    p.add_argument(
        "--tiny", action="store_true", help="a tiny random Qwen2 on CPU (gloo): a check of the script"
    )
    p.add_argument("--gpus", default="1,2,4", help="comma-separated GPU counts (ranks = replicas = N)")
    p.add_argument("--strategy", choices=["ddp", "fsdp"], default="ddp", help="distributed.strategy (N > 1)")
    p.add_argument("--prompts", type=int, default=64, help="problems per step (see above)")
    p.add_argument("--group", type=int, default=8, help="GRPO samples per problem")
    p.add_argument("--max-tokens", type=int, default=256, help="rollout.max_tokens")
    p.add_argument("--steps", type=int, default=3, help="timed steps (+1 warm-up)")
    p.add_argument("--micro-batch", type=int, default=16, help="optim.micro_batch (per rank)")
    p.add_argument("--kl-beta", type=float, default=0.01, help="method.kl_beta (> 0: every sequence trains)")
    p.add_argument("--generator-batch", type=int, default=128, help="rows each replica decodes at once")
    p.add_argument("--out", type=Path, required=True)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    if args.tiny:
        args.prompts, args.group, args.max_tokens = 2, 4, 8
        args.steps, args.micro_batch, args.generator_batch = min(args.steps, 1), 4, 4
    # The job talks to its generators and sandbox directly and writes events locally.
    for name in ("REDIS_URL", "CRUCIBLE_TRAINER_REDIS_URL"):
        os.environ.pop(name, None)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with tempfile.TemporaryDirectory(prefix="crucible-multi-gpu-") as tmp:
        model = args.model
        if args.tiny:
            model = tiny_model(Path(tmp) / "tiny")
        elif args.shape:
            from bench.model_shapes import build

            model = build(args.shape, Path(tmp), device(), "bfloat16", 0, False)["path"]
        if model != args.model:  # a local checkpoint: let the trainer and the generators read it
            roots = [tmp, str(ROOT), *filter(None, os.environ.get("CRUCIBLE_MODEL_ROOTS", "").split(","))]
            os.environ["CRUCIBLE_MODEL_ROOTS"] = ",".join(roots)
        runs = []
        for n in (int(x) for x in args.gpus.split(",")):
            try:
                runs.append(run_one(args, model, n, Path(tmp) / f"n{n}"))
            except Exception as exc:  # the other counts still run: one failure costs one figure
                show_logs(Path(tmp) / f"n{n}")
                runs.append({"gpus": n, "error": f"{type(exc).__name__}: {exc}"})
    report = summarise(args, runs)
    args.out.write_text(json.dumps(report, indent=2))
    print(json.dumps({k: v for k, v in report.items() if k != "runs"}, indent=2))
    for r in report["runs"]:
        print(row_text(r))
    if any("error" in r for r in runs):
        sys.exit(1)


def device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def tiny_model(out: Path) -> str:
    """A 2-layer Qwen2 of hidden size 64 with the built-in tokenizer (random weights, CPU)."""
    import crucible_models
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    tokenizer = crucible_models.load_tokenizer()
    config = AutoConfig.for_model(
        "qwen2",
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return str(out)


def job(args: argparse.Namespace, model: str, n: int) -> Any:
    """The GRPO job of every N: the race's (recipes/grpo_smollm2.yaml) at this batch, over N ranks."""
    sets = [f"model.base={model}", f"optim.steps={args.steps + 1}", "eval=null"]
    sets += [f"optim.problems_per_step={args.prompts}", f"rollout.max_tokens={args.max_tokens}"]
    sets += [f"optim.micro_batch={args.micro_batch}", f"method.group_size={args.group}"]
    sets += [f"method.kl_beta={args.kl_beta}"]
    sets += [f"data.limit={max(args.prompts * (args.steps + 1), 4)}"] if args.tiny else []
    # One process at N = 1 whatever the strategy (fsdp needs two ranks or more).
    sets += ["distributed=" + json.dumps({"train_gpus": n, "strategy": args.strategy if n > 1 else "ddp"})]
    return common.load_job(ROOT / "recipes" / "grpo_smollm2.yaml", sets)


def start_generators(args: argparse.Namespace, model: str, n: int, work: Path) -> list[Any]:
    """N generator replicas, replica i on GPU i (CPU: N processes of one thread each), at once."""
    cuda = device() == "cuda"

    def one(i: int) -> Any:
        where = {"CUDA_VISIBLE_DEVICES": str(i)} if cuda else {"CRUCIBLE_GENERATOR_THREADS": "1"}
        return common.spawn_generator(
            work, model, args.generator_batch, env=where, log=f"generator-{i}.log", timeout=900
        )

    with ThreadPoolExecutor(n) as pool:
        futures = [pool.submit(one, i) for i in range(n)]
    started, errors = [], []
    for f in futures:
        try:
            started.append(f.result())
        except Exception as exc:  # stop the ones that came up, then say why
            errors.append(exc)
    if errors:
        for g in started:
            g.stop()
        raise errors[0]
    return started


def run_one(args: argparse.Namespace, model: str, n: int, work: Path) -> dict[str, Any]:
    """Run the job on N GPUs (N ranks, N replicas, one sandbox); its figures."""
    from crucible_cli.spawn import start
    from crucible_trainer.runtime.channel import LocalChannel
    from crucible_trainer.runtime.entry import execute
    from crucible_trainer.settings import Settings

    work.mkdir(parents=True)
    spec = job(args, model, n)
    sandbox = start("crucible_sandbox", {}, "CRUCIBLE_SANDBOX_PORT", log=work / "sandbox.log", timeout=300)
    generators: list[Any] = []
    try:
        generators = start_generators(args, model, n, work)
        settings = Settings(
            generator_urls=[g.url for g in generators],
            sandbox_url=sandbox.url,
            adapter_dir=work / "adapters",
            runs_dir=work / "jobs",
            max_ranks=n,
        )
        job_id = f"multi-gpu-{n}"
        started = time.perf_counter()
        summary = execute(spec, job_id, settings, LocalChannel(job_id))
        wall = time.perf_counter() - started
    finally:
        for g in generators:
            g.stop()
        sandbox.stop()
    if summary.get("status") != "finished":
        ranks = work / "jobs" / job_id / "ranks" / "torchrun.log"
        raise RuntimeError(f"the job on {n} GPU(s) ended {summary.get('status')}: {summary} (see {ranks})")
    lines = (work / "jobs" / job_id / "metrics.jsonl").read_text().splitlines()
    rows = [r for line in lines if "eval_label" not in (r := json.loads(line))]
    timing = [{k: v for k, v in r.items() if k.startswith(("time/", "publish/"))} for r in rows]
    return figures(rows, n, args.prompts * args.group) | {
        "wall_s": round(wall, 1),
        "device": common.card(),
        "per_step": timing,  # every step's timings, the first included (the medians skip it)
    }


def show_logs(work: Path, lines: int = 40) -> None:
    """The end of every log of a failed run (its folder goes with the temporary directory)."""
    for log in sorted(work.rglob("*.log")):
        tail = log.read_text(errors="replace").splitlines()[-lines:]
        print(f"== {log.relative_to(work)}", *tail, sep="\n", file=sys.stderr)


def figures(rows: list[dict[str, Any]], n: int, samples: int) -> dict[str, Any]:
    """Medians over the steps after the first (all steps if there is one) of the job's metrics.

    >>> rows = [{"time/step_s": 9.0, "time/generate_s": 5.0, "time/train_s": 3.0},
    ...         {"time/step_s": 4.0, "time/generate_s": 2.0, "time/train_s": 1.5, "publish/total_s": 0.25}]
    >>> f = figures(rows, 2, 8)
    >>> f["s_per_step"], f["generate_s"], f["update_s"], f["publish_s"], f["samples_per_s"]
    (4.0, 2.0, 1.5, 0.25, 2.0)
    >>> f["other_s"]  # step - rollout (absent here: generate) - update - publish - stale wait
    0.25
    """
    later = rows[1:] or rows
    med = {k: statistics.median(r.get(m, 0.0) for r in later) for k, m in SPLIT.items()}
    step = statistics.median(r["time/step_s"] for r in later)
    rollout = med["rollout_s"] or med["generate_s"]
    other = step - rollout - med["update_s"] - med["publish_s"] - med["stale_wait_s"]
    return {
        "gpus": n,
        "steps": len(later),
        "s_per_step": step,
        **med,
        "other_s": round(other, 6),
        "samples_per_s": samples / step,
        "generate_samples_per_s": samples / med["generate_s"] if med["generate_s"] else None,
        "update_samples_per_s": samples / med["update_s"] if med["update_s"] else None,
        "completion_tokens_mean": statistics.mean(r.get("completion_tokens_mean", 0.0) for r in later),
        "update_sequences": statistics.median(r.get("update/sequences", 0.0) for r in later),
        # The update's model FLOPs per second per GPU over its time (rl/throughput.py); the fraction
        # of the card's bf16 peak where the card is listed there.
        **{
            key.removeprefix("perf/"): statistics.median(r[key] for r in later)
            for key in PERF
            if all(key in r for r in later)
        },
        "update_ranks": later[-1].get("update/ranks", 1.0),
    }


def summarise(args: argparse.Namespace, runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The report: every N's figures, their speed-ups over N = 1 and the targets met or not.

    >>> a = argparse.Namespace(shape=None, tiny=False, model="m", strategy="ddp", prompts=2, group=4,
    ...                        max_tokens=8, micro_batch=4, kl_beta=0.01, generator_batch=8)
    >>> r = summarise(a, [{"gpus": 1, "samples_per_s": 2.0, "generate_samples_per_s": 4.0,
    ...                    "update_samples_per_s": 4.0}, {"gpus": 2, "samples_per_s": 3.8,
    ...                    "generate_samples_per_s": 8.0, "update_samples_per_s": 7.0}])
    >>> r["runs"][1]["speedup_samples_per_s"], r["runs"][1]["target"], r["runs"][1]["target_met"]
    (1.9, 1.8, True)
    >>> summarise(a, [{"gpus": 1, "error": "OOM"}, {"gpus": 2, "samples_per_s": 3.8}])["runs"][1]["target_met"] is None
    True
    """
    one = next((r for r in runs if r["gpus"] == 1 and "error" not in r), None)
    for r in (r for r in runs if "error" not in r):
        for key in ("samples_per_s", "generate_samples_per_s", "update_samples_per_s"):
            base = one.get(key) if one else None
            r[f"speedup_{key}"] = round(r[key] / base, 3) if base and r.get(key) else None
        r["target"] = TARGETS.get(r["gpus"])
        speedup = r["speedup_samples_per_s"]
        r["target_met"] = None if r["target"] is None or speedup is None else speedup >= r["target"]
    return {
        "model": args.shape or ("tiny" if args.tiny else args.model),
        "strategy": args.strategy,
        "batch": args.prompts * args.group,
        "prompts": args.prompts,
        "group": args.group,
        "max_tokens": args.max_tokens,
        "micro_batch": args.micro_batch,
        "kl_beta": args.kl_beta,
        "generator_batch": args.generator_batch,
        "targets": {str(k): v for k, v in TARGETS.items()},
        "runs": runs,
    }


def row_text(r: dict[str, Any]) -> str:
    if "error" in r:
        return f"{r['gpus']} GPU(s): failed: {r['error']}"
    met = {True: "met", False: "NOT met", None: "-"}[r.get("target_met")]
    return (
        f"{r['gpus']} GPU(s): {r['s_per_step']:.2f} s/step (generate {r['generate_s']:.2f}, update "
        f"{r['update_s']:.2f}, publish {r['publish_s']:.2f}, other {r['other_s']:.2f}), "
        f"{r['samples_per_s']:.1f} samples/s, x{r['speedup_samples_per_s'] or 0:.2f} "
        f"(target {r.get('target') or '-'}: {met})"
    )


if __name__ == "__main__":
    main()
