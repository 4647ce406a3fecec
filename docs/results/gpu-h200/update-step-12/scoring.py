"""Does scoring at 128 rows give non-finite log-probs after the job's warm-up (1.5B shape)?"""

import time
from pathlib import Path

import torch
from crucible_shared.jobs import TrainJob
from crucible_trainer.rl.head import _kept_forward, kept_kernels
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
t = time.perf_counter()
print("warm", policy.warm_kernels(128, 150, 256), flush=True)
g = torch.Generator().manual_seed(0)
prompts = [
    torch.randint(100, 5000, (int(n),), generator=g).tolist()
    for n in torch.randint(80, 200, (128,), generator=g)
]
comps = [torch.randint(100, 5000, (256,), generator=g).tolist() for _ in range(128)]
for mb in (128, 64, 128):
    out = policy.score(prompts, comps, micro_batch=mb, reference=True)
    x = torch.tensor(out)
    print(
        "score mb",
        mb,
        "non-finite",
        int((~torch.isfinite(x)).sum()),
        "mean",
        float(x[torch.isfinite(x)].mean()),
        flush=True,
    )
V = 151936
for rows in (64, 128):
    logits = torch.randn(rows, 257, V, device="cuda", dtype=torch.bfloat16) * 3
    targets = torch.randint(0, V, (rows, 256), device="cuda")
    mask = torch.ones(rows, 256, device="cuda")
    with torch.no_grad():
        a, _ = kept_kernels()[0](logits, targets, mask)
        b = torch.cat(
            [
                _kept_forward(logits[i : i + 8], targets[i : i + 8], mask[i : i + 8])[0]
                for i in range(0, rows, 8)
            ]
        )
    print(
        "kept rows",
        rows,
        "non-finite",
        int((~torch.isfinite(a)).sum()),
        "max diff",
        float((a - b).abs().max()),
        flush=True,
    )
    del logits
    torch.cuda.empty_cache()
