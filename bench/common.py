"""What the benchmarks share: a free port, percentiles, the name of the card they ran on, the
offline training recipes and running a pipeline job in-process (the real entry point, timed).

Benchmarks import it as `bench.common` (the repository root on `sys.path`, as each script puts it)
or as `common` when run as `python bench/<script>.py` beside it.
"""

from __future__ import annotations

import asyncio
import json
import socket
import time
from typing import Any


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def percentile(values: list[float], q: float) -> float:
    """The `q` quantile (0..1) of `values`, nearest rank.

    >>> percentile([5.0, 1.0, 3.0, 2.0, 4.0], 0.5), percentile([5.0, 1.0, 3.0], 0.99)
    (3.0, 5.0)
    """
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def card() -> str:
    """The first visible GPU's name, else `cpu` (also without torch installed)."""
    try:
        import torch
    except ImportError:
        return "cpu"
    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"


# The offline training recipes (`bench/offline_figures.py`; `bench/grpo_race.py --sft-first` trains
# its SFT stage with the first).
TRAIN = {
    # SFT on the distinct passing candidates (shortest first), a few epochs: the set is small.
    "sft": {
        "train": {"name": "sft", "epochs": 3, "max_length": 1024},
        "optim": {"lr": 1e-4, "micro_batch": 8, "warmup_steps": 5},
    },
    # DPO on pass/fail pairs, the base model as reference.
    "dpo": {
        "train": {"name": "dpo", "beta": 0.1, "epochs": 2, "max_length": 1024},
        "optim": {"lr": 5e-5, "micro_batch": 8, "warmup_steps": 5},
    },
}


def run_pipeline(spec: dict[str, Any], job_id: str, settings) -> dict[str, Any]:
    """A pipeline job through the worker's own entry point, in this process; its summary plus
    `wall_s`. Raises when the job does not finish."""
    from crucible_shared.jobs import PipelineJob
    from crucible_trainer.channel import LocalChannel
    from crucible_trainer.offline.pipeline import run_pipeline_job

    started = time.perf_counter()
    summary = asyncio.run(
        run_pipeline_job(PipelineJob.model_validate(spec), job_id, settings, LocalChannel(job_id))
    )
    if summary.get("status") != "finished":
        raise RuntimeError(f"{job_id}: {summary.get('status')}")
    summary["wall_s"] = time.perf_counter() - started
    print(f"{job_id}: {summary['wall_s']:.1f} s; stages " + json.dumps(summary["stages"]), flush=True)
    return summary
