"""A trainer's cold start, taken before a job needs it: the imports and the first use of the card.

In a fresh process a job's first seconds went to importing torch, transformers and PEFT, then to
`hardware.resolve`: creating the CUDA context, reading the model's config and importing its family's
transformers module (about 16 s on one H200 with Qwen2.5-Coder-1.5B, between the services being
ready and the job's settings). None of it needs the generator or the sandbox. So, on a host with
the cores for it (`worth_it`), the worker does it once at its start, before it takes a job, and a
local run (the benchmarks) does it on a thread while its services start, joined before the job
runs: never beside the job's own imports, where two threads importing one package's circular
modules can each get the other's half-made module.

What the warm-up resolves is thrown away: the job resolves its settings again when it starts,
against the memory the services hold by then. A warm-up that fails says nothing beyond a log
line (`attempt`): the job meets the same problem and reports it properly.
"""

from __future__ import annotations

import importlib
import logging
import os
import threading
import time
from typing import Any

log = logging.getLogger(__name__)

# Fewer cores than this: no warm-up. There the imports compete with the services' own start (on 2
# cores: 3 s saved, 6 s lost), and a CPU job's minutes dwarf them.
MIN_CORES = 8


def worth_it() -> bool:
    """Whether this process has the cores to warm up beside whatever else is starting."""
    return len(os.sched_getaffinity(0)) >= MIN_CORES


def warm_up(spec: Any | None = None, parts: dict[str, float] | None = None) -> float:
    """Import the modules a job of `spec` runs (without one: an online training job's and an
    evaluation's) and, for a training job whose policy lives in this process (one rank), resolve
    its hardware settings once. Returns the seconds taken; `parts` gets those of the imports
    (`imports_s`) and of the settings (`resolve_s`: the CUDA context, the model's config)."""
    from crucible_shared.jobs import EvalJob, TrainJob

    from crucible_trainer.runtime import hardware, runners

    started = time.perf_counter()
    # The job modules import these where they first load a model: here they are imported ahead.
    import peft  # noqa: F401
    from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: F401

    if spec is None:
        for path in (runners.ONLINE, runners.RUNNERS[EvalJob]):
            importlib.import_module(path.split(":")[0])
    else:
        runners.runner_for(spec)
    imported = time.perf_counter()
    if isinstance(spec, TrainJob) and spec.distributed.train_gpus == 1:
        hardware.resolve(spec)
    done = time.perf_counter()
    if parts is not None:
        parts.update(imports_s=imported - started, resolve_s=done - imported)
    return done - started


def attempt(spec: Any | None = None, parts: dict[str, float] | None = None) -> float | None:
    """`warm_up(spec, parts)`, logged: its seconds, or None (and a warning) when it stopped."""
    try:
        seconds = warm_up(spec, parts)
    except Exception as exc:  # the job meets it again and reports it
        log.warning("trainer warm-up stopped: %s", exc)
        return None
    log.info("trainer warm-up: %.1f s", seconds)
    return seconds


class WarmUp(threading.Thread):
    """`attempt(spec)` on a thread of its own: `seconds` once it is done (None if it stopped), and
    `parts`, its imports' and settings' seconds. Join it before the job starts."""

    def __init__(self, spec: Any | None = None) -> None:
        super().__init__(name="crucible-warm-up", daemon=True)
        self.spec = spec
        self.seconds: float | None = None
        self.parts: dict[str, float] = {}

    def run(self) -> None:
        self.seconds = attempt(self.spec, self.parts)


def in_background(spec: Any | None = None) -> WarmUp:
    """A started `WarmUp` of `spec`."""
    thread = WarmUp(spec)
    thread.start()
    return thread
