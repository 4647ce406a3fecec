"""Which pass gives non-finite log-probs or gradients at the 1.5B shape, by rows and layout."""

import os
from contextlib import nullcontext
from pathlib import Path

import torch
from crucible_shared.jobs import TrainJob
from crucible_trainer.rl.batch import make_batch
from crucible_trainer.rl.policy import Policy

from bench.model_shapes import build

path = Path("/root/shapes/qwen2.5-coder-1.5b")
if not (path / "config.json").exists():
    build("qwen2.5-coder-1.5b", Path("/root/shapes"))
spec = TrainJob.model_validate(
    {
        "model": {"base": str(path), "device": "cuda", "dtype": "bfloat16", "gradient_checkpointing": "auto"},
        "optim": {"micro_batch": 128},
    }
)
policy = Policy(spec.model, spec.optim, 0)

policy.free_memory = lambda: int(float(os.environ.get("FREE", "1e13")))


def batch(rows, seed=0):
    g = torch.Generator().manual_seed(seed)
    prompts = [
        torch.randint(100, 5000, (int(n),), generator=g).tolist()
        for n in torch.randint(80, 200, (rows,), generator=g)
    ]
    comps = [torch.randint(100, 5000, (256,), generator=g).tolist() for _ in range(rows)]
    return make_batch(prompts, comps, policy.pad_id, "cuda")


def run(rows, unmasked, head, fused=True, grad=True):
    policy.unmasked, policy.head_mode = unmasked, head
    b = batch(rows)
    policy.model.zero_grad(set_to_none=True)
    try:
        with nullcontext() if fused else policy.unfused(), nullcontext() if grad else torch.no_grad():
            lp = policy._forward(b)
            print("checkpointing", policy._checkpointing_on, "chunked", policy._chunked_now, flush=True)
            bad_lp = int((~torch.isfinite(lp)).sum())
            rows_bad = (~torch.isfinite(lp)).any(-1).nonzero().flatten().tolist()[:10]
            if grad:
                lp.sum().backward()
        grads = [(n, p.grad) for n, p in policy.model.named_parameters() if p.grad is not None]
        bad_g = [n for n, g in grads if not torch.isfinite(g).all()]
        print(
            f"rows {rows} unmasked {unmasked} head {head} fused {fused} grad {grad}: bad logp {bad_lp} "
            f"rows {rows_bad} width {b.input_ids.shape[1]} bad grads {len(bad_g)} {bad_g[:2]}",
            flush=True,
        )
    except torch.OutOfMemoryError:
        print(f"rows {rows} unmasked {unmasked} head {head}: OOM", flush=True)
    policy.model.zero_grad(set_to_none=True)
    torch.cuda.empty_cache()


for args in [(128, True, "auto"), (64, True, "auto"), (128, False, "auto"), (128, True, "auto", False)]:
    run(*args)
