"""A worker runs job after job in one process: what a job held in reference cycles is given back
when it ends (`hardware.release_memory`, called by `runtime.entry.execute`), whether it finished or failed."""

from __future__ import annotations

import gc
from typing import Any

import pytest
import torch
from crucible_shared.jobs import JobSpec
from crucible_trainer.runtime import entry as jobs
from crucible_trainer.runtime.channel import LocalChannel
from crucible_trainer.runtime.hardware import release_memory
from crucible_trainer.settings import Settings
from pydantic import TypeAdapter

from tests.conftest import resident_bytes

MIB = 1 << 20
HELD = 256 * MIB
SPEC = {"kind": "eval", "name": "cycle", "data": {"dataset": "mbpp", "ids": [11]}, "max_tokens": 8}


def hold_in_cycle() -> None:
    """A job's state as PEFT and the trainer leave it: a large tensor reachable only from a cycle."""
    node: dict[str, Any] = {"weights": torch.ones(HELD // 4)}
    node["self"] = node


@pytest.fixture
def no_automatic_collection():
    """Collection at a moment of the interpreter's choosing would make the measure meaningless."""
    gc.collect()
    gc.disable()
    yield
    gc.enable()


def test_release_memory_frees_a_cycle(no_automatic_collection) -> None:
    start = resident_bytes()
    hold_in_cycle()
    assert resident_bytes() - start > HELD * 0.9  # still held: only the cycle collector can free it
    release_memory()
    assert resident_bytes() - start < HELD * 0.2


@pytest.mark.parametrize("outcome", ["finished", "failed"])
def test_execute_gives_a_jobs_memory_back(outcome, no_automatic_collection, monkeypatch) -> None:
    class Runner:
        def __init__(self, *args: Any) -> None:
            pass

        async def run(self) -> dict[str, Any]:
            hold_in_cycle()
            if outcome == "failed":
                raise RuntimeError("the job broke")
            return {"status": "finished"}

    monkeypatch.setattr(jobs, "runner_for", lambda spec: Runner)
    spec = TypeAdapter(JobSpec).validate_python(SPEC)
    start = resident_bytes()
    if outcome == "failed":
        with pytest.raises(RuntimeError, match="the job broke"):
            jobs.execute(spec, "j1", Settings(), LocalChannel("j1"))
    else:
        assert jobs.execute(spec, "j1", Settings(), LocalChannel("j1"))["status"] == "finished"
    assert resident_bytes() - start < HELD * 0.2


@pytest.mark.gpu
def test_release_memory_gives_cuda_memory_back(no_automatic_collection) -> None:
    """On a GPU the next job needs the card: a cycle's tensors are freed and the caching
    allocator's blocks returned to the driver."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    torch.cuda.init()
    start = torch.cuda.memory_reserved()
    node: dict[str, Any] = {"weights": torch.ones(HELD // 4, device="cuda")}
    node["self"] = node
    del node
    assert torch.cuda.memory_reserved() - start >= HELD  # held by the cycle
    release_memory()
    assert torch.cuda.memory_allocated() < HELD // 4 and torch.cuda.memory_reserved() - start < HELD // 4
