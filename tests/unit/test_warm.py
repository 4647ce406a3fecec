"""The trainer's warm-up (`runtime.warm`): it imports what a job runs and resolves a one-rank
training job's settings once, in a fresh process; on its thread (`WarmUp`) a failure is logged, not
raised, and left to the job."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from crucible_shared.jobs import EvalJob, TrainJob
from crucible_trainer.runtime import hardware, warm

ROOT = Path(__file__).resolve().parents[2]

# In a fresh interpreter: which heavy modules were there before and after the warm-up.
PROBE = """
import json, sys
from crucible_trainer.runtime.warm import warm_up
spec = None
if len(sys.argv) > 1:
    from crucible_shared.jobs import EvalJob, TrainJob
    spec = {"eval": EvalJob, "train": TrainJob}[sys.argv[2]].model_validate(json.loads(sys.argv[1]))
heavy = ("torch", "transformers", "peft", "crucible_trainer.online.train", "crucible_trainer.evaluation.job")
before = [m for m in heavy if m in sys.modules]
seconds = warm_up(spec)
print(json.dumps({"before": before, "after": [m for m in heavy if m in sys.modules], "seconds": seconds}))
"""


def probe(*args: str) -> dict:
    done = subprocess.run(
        [sys.executable, "-c", PROBE, *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_the_worker_warm_up_imports_the_training_and_evaluation_jobs() -> None:
    found = probe()
    assert found["before"] == []
    assert found["after"] == [
        "torch",
        "transformers",
        "peft",
        "crucible_trainer.online.train",
        "crucible_trainer.evaluation.job",
    ]
    assert found["seconds"] > 0


@pytest.mark.slow
def test_a_job_warm_up_imports_its_own_runner() -> None:
    evaluation = EvalJob.model_validate({"data": {"limit": 1}})
    found = probe(evaluation.model_dump_json(), "eval")
    assert "crucible_trainer.evaluation.job" in found["after"]
    assert "crucible_trainer.online.train" not in found["after"]
    train = TrainJob.model_validate({"method": {"name": "grpo"}, "model": {"device": "cpu"}})
    assert "crucible_trainer.online.train" in probe(train.model_dump_json(), "train")["after"]


def test_resolves_a_one_rank_job_once_and_a_ranked_job_never(monkeypatch) -> None:
    calls: list[int] = []
    real = hardware.resolve

    def counted(spec, base=None):
        calls.append(spec.distributed.train_gpus)
        return real(spec, base)

    monkeypatch.setattr(hardware, "resolve", counted)
    one = TrainJob.model_validate({"method": {"name": "grpo"}, "model": {"device": "cpu"}})
    parts: dict[str, float] = {}
    seconds = warm.warm_up(one, parts)
    assert calls == [1]
    # Where it went: the imports, then the settings (here a CPU's: the model's config read)
    assert set(parts) == {"imports_s", "resolve_s"} and parts["resolve_s"] > 0
    assert parts["imports_s"] + parts["resolve_s"] == pytest.approx(seconds, abs=0.01)
    two = one.model_copy(update={"distributed": one.distributed.model_copy(update={"train_gpus": 2})})
    warm.warm_up(two)  # its ranks are other processes: nothing to resolve here
    assert calls == [1]


def test_a_failed_warm_up_is_quiet_and_leaves_the_error_to_the_job(caplog, monkeypatch) -> None:
    def fails(spec, base=None):
        raise ValueError("attn_implementation flash_attention_2 needs the flash-attn package")

    monkeypatch.setattr(hardware, "resolve", fails)
    spec = TrainJob.model_validate({"method": {"name": "grpo"}, "model": {"device": "cpu"}})
    with caplog.at_level("INFO", logger="crucible_trainer.runtime.warm"):
        thread = warm.in_background(spec)
        thread.join(120)
    assert not thread.is_alive() and thread.seconds is None
    assert "trainer warm-up stopped" in caplog.text and "flash-attn" in caplog.text
    ok = warm.in_background(None)
    ok.join(120)
    assert ok.seconds is not None and ok.seconds >= 0
    assert ok.parts["imports_s"] >= 0 and ok.parts["resolve_s"] == pytest.approx(0, abs=0.01)  # no job


def test_only_a_host_with_cores_to_spare_warms_up(monkeypatch) -> None:
    import os

    cores = len(os.sched_getaffinity(0))
    monkeypatch.setattr(warm, "MIN_CORES", cores)
    assert warm.worth_it()
    monkeypatch.setattr(warm, "MIN_CORES", cores + 1)
    assert not warm.worth_it()
