"""The reference scoring and one training micro-batch of the 135M update at the step's lengths,
timed and profiled apart (docs/benchmarks.md, "Tried and taken out: the reference scored beside
the rollouts"). Run from the repository root on the GPU machine after `bash bench/gpu.sh setup`:

    PYTHONPATH=/tmp/site:/tmp/crucible-pkgs:$PWD CRUCIBLE_CACHE_DIR=/root/cache OUT=/tmp \
        python3 docs/results/gpu-h200/reference-ahead-8/profile/prof_ref.py
"""

import os
import random
import time
from pathlib import Path

import torch
from crucible_shared.jobs import TrainJob
from crucible_trainer.rl.batch import make_batch
from crucible_trainer.rl.policy import Policy
from torch.profiler import ProfilerActivity, profile

out = os.environ.get("OUT", "/tmp")
spec = TrainJob.model_validate(
    {
        "model": {"base": "smollm2-135m-instruct", "device": "cuda", "dtype": "bfloat16"},
        "optim": {"micro_batch": 128},
    }
)
policy = Policy(spec.model, spec.optim, 0)
rng = random.Random(0)
P = [[rng.randrange(100, 40000) for _ in range(rng.randint(110, 190))] for _ in range(64)]
prompts, comps = [], []
for i in range(512):  # 64 problems x 8 samples; a little over half the completions at the 256 cap
    prompts.append(P[i // 8])
    n = 256 if rng.random() < 0.55 else rng.randint(30, 255)
    comps.append([rng.randrange(100, 40000) for _ in range(n)])
print("mean completion", sum(map(len, comps)) / 512, "mean prompt", sum(map(len, prompts)) / 512, flush=True)


def sync():
    torch.cuda.synchronize()


def timeit(fn, n=3):
    ts = []
    for _ in range(n):
        sync()
        t = time.perf_counter()
        fn()
        sync()
        ts.append(time.perf_counter() - t)
    return [round(x, 3) for x in ts]


def prof(fn, name):
    sync()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
        fn()
        sync()
    av = p.key_averages()
    busy = sum(e.self_device_time_total for e in av) / 1e6
    launches = sum(
        e.count for e in av if e.key in ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC")
    )
    t = av.table(sort_by="self_device_time_total", row_limit=22, max_name_column_width=60)
    s = f"== {name}: device busy {busy:.3f} s, launches {launches}\n{t}\n"
    print(s[:6000], flush=True)
    Path(out, f"{name}.txt").write_text(s)


def ref():
    return policy.score(prompts, comps, 128, reference=True)


ref()
ref()
print("ref scoring 512 (full logits):", timeit(ref), flush=True)
policy.head_mode = "chunked"
ref()
print("ref scoring 512 (chunked head):", timeit(ref), flush=True)
policy.head_mode = "auto"
prof(ref, "ref-full")
idx = sorted(range(512), key=lambda i: len(prompts[i]) + len(comps[i]), reverse=True)[128:256]
b = make_batch([prompts[i] for i in idx], [comps[i] for i in idx], policy.pad_id, "cuda")


def train():
    policy.model.zero_grad(set_to_none=True)
    policy.token_logprobs(b).sum().backward()


train()
train()
print("train fwd+bwd one micro-batch of 128:", timeit(train), flush=True)
prof(train, "train-mb")


def fwd():
    with torch.no_grad():
        policy.token_logprobs(b)


fwd()
print("no-grad forward same micro-batch (adapter on):", timeit(fwd), flush=True)
