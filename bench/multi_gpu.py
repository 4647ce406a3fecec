"""Samples/s and s/step of one GRPO step's work on 1, 2, 4 GPUs: generation and the update, apart.

    python bench/multi_gpu.py --model smollm2-135m-instruct --gpus 1,2,4 --out multi_gpu.json
    python bench/multi_gpu.py --shape qwen2.5-coder-1.5b --gpus 1,2,4 --out multi_gpu_qwen.json
    python bench/multi_gpu.py --tiny --gpus 1,2 --out /tmp/multi_gpu.json      # CPU, gloo: a check

For each GPU count N the script runs `torchrun --nproc-per-node N` of itself. Every rank builds the
job's policy exactly as a distributed job does (`crucible_trainer.distributed`: LoRA under DDP,
or FSDP2 with `--strategy fsdp`); each step, every rank generates its share of the batch
(`prompts x group` completions of exactly `--max-tokens` tokens: random weights, so EOS is
ignored; the share of one generator replica per GPU), the completions are gathered, and every rank
runs the update of `rl/update.py` on its share of the whole batch (the GRPO normaliser over all
of it). Rank 0 times both halves; the JSON holds per N the median s/step over the steps after
the first (warm-up), the split, samples/s and the speed-up over one GPU.

The generation here is transformers' `generate` on each trainer GPU, a stand-in for generator
replicas: it measures how the step scales when every GPU also generates, not vLLM's speed.
`--shape` builds a random-weight checkpoint of a real model's exact shape (bench/model_shapes.py).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct", help="model.base of the job")
    p.add_argument("--shape", help="build this shape with random weights (bench/model_shapes.py)")
    p.add_argument(
        "--tiny", action="store_true", help="a tiny random Qwen2 on CPU (gloo): a check of the script"
    )
    p.add_argument("--gpus", default="1,2,4", help="comma-separated rank counts")
    p.add_argument("--strategy", choices=["ddp", "fsdp"], default="ddp")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--steps", type=int, default=2, help="timed steps (+1 warm-up)")
    p.add_argument("--micro-batch", type=int, default=16)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--rank-of", type=Path, help=argparse.SUPPRESS)  # internal: run as a rank
    return p.parse_args()


def main() -> None:
    args = parse()
    if args.tiny:
        args.prompts, args.group, args.max_tokens, args.prompt_tokens = 2, 4, 8, 8
        args.steps, args.micro_batch = min(args.steps, 2), 4
    if args.rank_of is not None:
        return rank(args)
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model
        if args.tiny:
            model = tiny_model(Path(tmp) / "tiny")
        elif args.shape:
            sys.path.insert(0, str(ROOT / "bench"))
            from model_shapes import build

            model = build(args.shape, Path(tmp), "cuda", "bfloat16", 0, False)["path"]
        results = []
        for n in [int(x) for x in args.gpus.split(",")]:
            out = Path(tmp) / f"ranks-{n}.json"
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n}"]
            cmd += [__file__, *sys.argv[1:], "--rank-of", str(out), "--model", str(model)]
            env = {**os.environ, "OMP_NUM_THREADS": "1", "NCCL_NVLS_ENABLE": "0"}
            env.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
            subprocess.run(cmd, check=True, env=env, cwd=ROOT)
            results.append(json.loads(out.read_text()))
    one = next((r for r in results if r["gpus"] == 1), None)
    for r in results:
        r["speedup_samples_per_s"] = r["samples_per_s"] / one["samples_per_s"] if one else None
    report = {"model": args.shape or ("tiny" if args.tiny else args.model), "strategy": args.strategy}
    report.update(
        batch=args.prompts * args.group, max_tokens=args.max_tokens, prompt_tokens=args.prompt_tokens
    )
    report["runs"] = results
    args.out.write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2))


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


def rank(args: argparse.Namespace) -> None:
    """One rank: build the policy as a job does, then time generation and update per step."""
    import random

    import torch
    import torch.distributed as dist
    from crucible_shared.jobs import TrainJob
    from crucible_trainer.distributed.leader import make_rank_policy
    from crucible_trainer.distributed.parallel import DataParallel, shares
    from crucible_trainer.rl.rollout import Sample
    from crucible_trainer.rl.update import UpdateConfig, update

    r, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local = int(os.environ.get("LOCAL_RANK", "0"))
    cuda = torch.cuda.is_available() and not args.tiny
    if cuda:
        torch.cuda.set_device(local)
    dist.init_process_group("nccl" if cuda else "gloo")
    device = f"cuda:{local}" if cuda else "cpu"
    spec = TrainJob.model_validate(
        {
            "model": {"base": args.model, "device": device},
            "optim": {"micro_batch": args.micro_batch, "problems_per_step": args.prompts},
            "method": {"name": "grpo", "group_size": args.group},
        }
    )
    policy = make_rank_policy(spec.model_dump_json(), device, DataParallel(args.strategy, r, world), None)
    cfg = UpdateConfig(micro_batch=args.micro_batch, max_tokens=args.max_tokens)
    rng = random.Random(0)
    vocab = policy.model.get_base_model().config.vocab_size
    tok = policy.tokenizer
    low = max(tok.eos_token_id or 0, policy.pad_id or 0) + 1
    times: list[tuple[float, float]] = []
    for step in range(args.steps + 1):
        prompts = [
            [rng.randrange(low, min(vocab, 40000)) for _ in range(args.prompt_tokens)]
            for _ in range(args.prompts)
        ]
        rows = [(p, g) for p in range(args.prompts) for g in range(args.group)]
        mine = shares(list(range(len(rows))), world)[r]
        sync(cuda)
        t0 = time.perf_counter()
        completions = generate(policy, [prompts[rows[i][0]] for i in mine], args.max_tokens)
        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, completions)
        sync(cuda)
        t1 = time.perf_counter()
        flat = [c for part in gathered for c in part]
        batch = [
            Sample(p, p, prompts[p], flat[i], "", "", None, None, reward=0.0, advantage=rng.uniform(-1, 1))
            for i, (p, _g) in enumerate(rows)
        ]
        update(policy, batch, cfg, seed=step, parallel=policy.parallel)
        sync(cuda)
        t2 = time.perf_counter()
        if step > 0 or args.steps == 0:
            times.append((t1 - t0, t2 - t1))
    if r == 0:
        gen = statistics.median(t[0] for t in times)
        upd = statistics.median(t[1] for t in times)
        samples = args.prompts * args.group
        result = {
            "gpus": world,
            "device": torch.cuda.get_device_name(local) if cuda else "cpu",
            "s_per_step": gen + upd,
            "generate_s": gen,
            "update_s": upd,
            "samples_per_s": samples / (gen + upd),
            "update_samples_per_s": samples / upd,
            "steps": len(times),
        }
        args.rank_of.write_text(json.dumps(result))
    dist.destroy_process_group()


def generate(policy: Any, prompts: list[list[int]], tokens: int) -> list[list[int]]:
    """Sampled completions of exactly `tokens` tokens (EOS ignored: random weights)."""
    import torch

    if not prompts:
        return []
    model = policy.model
    ids = torch.tensor(prompts, device=policy.device)
    with torch.no_grad():
        out = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=tokens,
            min_new_tokens=tokens,
            do_sample=True,
            pad_token_id=policy.pad_id,
        )
    return out[:, ids.shape[1] :].tolist()


def sync(cuda: bool) -> None:
    if cuda:
        import torch

        torch.cuda.synchronize()


if __name__ == "__main__":
    main()
