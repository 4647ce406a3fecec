"""Where the 135M update's time goes on a GPU: one update at the benchmark's shape (64 x 8,
micro-batches of MB (default 128), kl_beta 0.01, 256-token completions) under torch.profiler, after
two warm-ups: wall time, GPU busy time (summed kernel time), kernel launches, and the top kernels
and CPU ops. Run from the repository root of the tree measured (commit 93c4098 and before: it
imports bench/update_speed.py and bench/multi_gpu.py), after `bash bench/gpu.sh setup`:

    PYTHONPATH=/tmp/site:/tmp/crucible-pkgs:$PWD CRUCIBLE_CACHE_DIR=/root/cache python3 prof.py 128
"""

import argparse
import sys
import time

sys.path.insert(0, ".")

import torch
from crucible_trainer.methods import method_module
from crucible_trainer.rl.policy import Policy
from crucible_trainer.rl.update import update
from crucible_trainer.runtime import hardware
from torch.profiler import ProfilerActivity, profile

from bench.multi_gpu import job
from bench.update_speed import synthetic_batch


def timed_update(policy, batch, cfg, seed: int) -> tuple[float, dict]:
    started = time.perf_counter()
    metrics = update(policy, batch, cfg, seed=seed)
    torch.cuda.synchronize()
    return time.perf_counter() - started, metrics


mb = int(sys.argv[1]) if len(sys.argv) > 1 else 128
args = argparse.Namespace(seed=0, prompts=64, group=8, min_tokens=256, max_tokens=256)
sets = ["optim.problems_per_step=64", "method.group_size=8", "rollout.max_tokens=256"]
sets += [f"optim.micro_batch={mb}", "method.kl_beta=0.01"]
spec, chosen = hardware.resolve(job("smollm2-135m-instruct", 1, sets))
policy = Policy(spec.model, spec.optim, spec.seed)
batch = synthetic_batch(args, len(policy.tokenizer))
cfg = method_module(spec.method).update_config(spec.method, spec)
for i in range(2):
    took, m = timed_update(policy, batch, cfg, i)
    print(
        "warm", i, round(took, 3), {k: round(v, 3) for k, v in m.items() if "time" in k or k.endswith("_s")}
    )
with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
    wall, m = timed_update(policy, batch, cfg, 5)
events = prof.key_averages()
gpu = sum(e.self_device_time_total for e in events) / 1e6
kernels = sum(e.count for e in events if e.device_type == torch.autograd.DeviceType.CUDA)
print(
    f"micro_batch {mb}: wall {wall:.3f} s, GPU kernel time {gpu:.3f} s ({gpu / wall:.0%}), kernels {kernels}"
)
print(events.table(sort_by="self_device_time_total", row_limit=30, max_name_column_width=70))
print(events.table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=70))
