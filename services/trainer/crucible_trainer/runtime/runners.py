"""The runner registry: which `JobRun` runs a job, keyed by spec type.

A train job is keyed by its method's config type (the online methods run the loop of
`online/train.py`; those whose config class says `offline`, SFT and DPO, TRL on a file, run
`offline.job`), an eval or pipeline job by its own. Runners are named by dotted path and imported
when a job needs one: torch loads with the trainer, not here. Adding a job kind is one line below;
a method is one config class in `crucible_shared.jobs.Method` (and, online, one line in
`methods.REGISTRY`), which this table follows.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from crucible_shared.jobs import METHOD_CONFIGS, EvalJob, PipelineJob, TrainJob

if TYPE_CHECKING:
    from crucible_trainer.runtime.jobrun import JobRun

ONLINE = "crucible_trainer.online.train:TrainRun"
OFFLINE = "crucible_trainer.offline.job:OfflineTrainRun"
RUNNERS: dict[type, str] = {
    **{config: OFFLINE if config.offline else ONLINE for config in METHOD_CONFIGS},
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
