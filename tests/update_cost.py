"""`python -m tests.update_cost MICRO_BATCH [MICRO_BATCH ...]`: what one GRPO update of SmolLM2 on
the CPU costs by micro-batch, in CPU seconds and peak resident memory: the update the training
tests run (8 samples, prompts of 240-260 tokens, completions of 30-64, every advantage non-zero),
twice, in a fresh process per micro-batch. CPU seconds, not wall time: on a shared machine they
are what the load inflates least (docs/testing.md)."""

from __future__ import annotations

import json
import subprocess
import sys


def _hwm_mib() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) // 1024 for line in f if line.startswith("VmHWM"))


def measure(micro_batch: int) -> dict[str, float]:
    """The update's figures in this process (which it loads SmolLM2 into)."""
    import random
    import resource

    from crucible_shared.jobs import ModelSpec, OptimSpec
    from crucible_trainer.rl.policy import Policy
    from crucible_trainer.rl.rollout import Sample
    from crucible_trainer.rl.update import UpdateConfig, update

    policy = Policy(ModelSpec(), OptimSpec(lr=5e-4), 0)
    rng = random.Random(0)
    samples = [
        Sample(
            task_index=i // 4,
            group=i // 4,
            prompt_ids=[rng.randrange(1000, 20000) for _ in range(240 + 20 * (i % 2))],
            completion_ids=[rng.randrange(1000, 20000) for _ in range(rng.randint(30, 64))],
            text="",
            code="",
            gen_logprobs=None,
            finish_reason="length",
            reward=float(i % 2),
            advantage=1.0 if i % 2 else -1.0,
        )
        for i in range(8)
    ]
    with open("/proc/self/clear_refs", "w") as f:  # the peak from here on
        f.write("5")
    start = resource.getrusage(resource.RUSAGE_SELF)
    for seed in range(2):
        update(policy, samples, UpdateConfig(micro_batch=micro_batch), seed=seed)
    end = resource.getrusage(resource.RUSAGE_SELF)
    cpu = end.ru_utime - start.ru_utime + end.ru_stime - start.ru_stime
    return {"micro_batch": micro_batch, "cpu_s": round(cpu, 1), "peak_mib": _hwm_mib()}


def main() -> None:
    if sys.argv[1:2] == ["--one"]:
        print(json.dumps(measure(int(sys.argv[2]))))
        return
    for mb in sys.argv[1:] or ["8", "2"]:
        out = subprocess.run(
            [sys.executable, "-m", "tests.update_cost", "--one", mb],
            capture_output=True,
            text=True,
            check=True,
        )
        print(out.stdout.strip().splitlines()[-1])


if __name__ == "__main__":
    main()
