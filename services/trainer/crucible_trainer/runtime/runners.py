"""The runner registry: which `JobRun` runs a job, keyed by spec type.

A train job is keyed by its method's config type (the online methods run the loop of `online/train.py`;
SFT and DPO, TRL on a file, run `offline.job`), an eval or pipeline job by its own. Runners are
named by dotted path and imported when a job needs one: torch loads with the trainer, not here.
Adding a job kind or an offline method is one line below; an online method is one line in
`methods.REGISTRY`'s config union (`crucible_shared.jobs.Method`), which this table follows.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any, get_args

from crucible_shared.jobs import DPOConfig, EvalJob, Method, PipelineJob, SFTConfig, TrainJob

if TYPE_CHECKING:
    from crucible_trainer.runtime.jobrun import JobRun

ONLINE = "crucible_trainer.online.train:TrainRun"
RUNNERS: dict[type, str] = {
    **{config: ONLINE for config in get_args(get_args(Method)[0]) if config not in (SFTConfig, DPOConfig)},
    SFTConfig: "crucible_trainer.offline.job:OfflineTrainRun",
    DPOConfig: "crucible_trainer.offline.job:OfflineTrainRun",
    EvalJob: "crucible_trainer.evaluation.job:EvalRun",
    PipelineJob: "crucible_trainer.offline.pipeline:PipelineRun",
}


# A train job of several ranks (`distributed.train_gpus`): the worker launches them with torchrun.
DISTRIBUTED = "crucible_trainer.distributed.launch:DistributedLaunch"


def runner_key(spec: Any) -> type:
    """What a spec's runner is registered under: a train job's method config type, else its own."""
    return type(spec.method) if isinstance(spec, TrainJob) else type(spec)


def runner_for(spec: Any) -> type[JobRun]:
    """The `JobRun` class that runs `spec`."""
    try:
        path = RUNNERS[runner_key(spec)]
    except KeyError:
        raise ValueError(f"no runner is registered for {runner_key(spec).__name__}") from None
    if isinstance(spec, TrainJob) and spec.distributed.train_gpus > 1:
        path = DISTRIBUTED
    module, name = path.split(":")
    runner: type[JobRun] = getattr(importlib.import_module(module), name)
    return runner
