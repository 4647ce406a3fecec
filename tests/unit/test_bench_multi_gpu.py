"""bench/multi_gpu.py runs end to end on a CPU (`--tiny`: gloo, a tiny random model, two CPU
generator replicas, one sandbox) and writes the JSON the GPU runs fill: per rank count, the real
job's s/step split into generation and update, samples/s, the speed-up over one rank and the
target; the two-rank run goes through the distributed launcher (its update ran on 2 ranks). And
the figures and the report from rows made up here."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow  # two jobs, each with its generators, a sandbox and (two ranks) torchrun
def test_tiny_run_writes_figures_for_each_rank_count(tmp_path) -> None:
    out = tmp_path / "multi.json"
    cmd = [sys.executable, "bench/multi_gpu.py", "--tiny", "--gpus", "1,2", "--out", str(out)]
    env = {k: v for k, v in os.environ.items() if k not in ("REDIS_URL", "CRUCIBLE_TRAINER_REDIS_URL")}
    subprocess.run(cmd, cwd=ROOT, check=True, timeout=900, env={**env, "OMP_NUM_THREADS": "1"})
    report = json.loads(out.read_text())
    assert report["batch"] == 8 and report["strategy"] == "ddp" and report["kl_beta"] > 0
    runs = {r["gpus"]: r for r in report["runs"]}
    assert set(runs) == {1, 2}
    for n, r in runs.items():
        assert r["device"] == "cpu" and r["steps"] == 1 and r["update_ranks"] == n
        assert r["update_sequences"] == 8  # kl_beta > 0: every sequence trained
        assert r["completion_tokens_mean"] == 8  # random weights: every completion at max_tokens
        assert 0 < r["generate_s"] < r["s_per_step"] and 0 < r["update_s"] < r["s_per_step"]
        assert r["samples_per_s"] == pytest.approx(8 / r["s_per_step"])
    assert runs[1]["speedup_samples_per_s"] == 1.0 and runs[1]["target_met"] is None
    assert runs[2]["speedup_samples_per_s"] > 0 and runs[2]["target"] == 1.8
    assert isinstance(runs[2]["target_met"], bool)
    for n in (1, 2):  # the services' logs kept beside the figures
        logs = {p.name for p in (tmp_path / "multi-logs" / f"n{n}").rglob("*.log")}
        assert "sandbox.log" in logs and sum(name.startswith("generator") for name in logs) == n, logs


def test_figures_are_medians_after_the_first_step() -> None:
    from bench.multi_gpu import figures

    rows = [
        {"time/step_s": 9.0, "time/generate_s": 5.0, "time/train_s": 3.0},
        {"time/step_s": 4.0, "time/generate_s": 2.0, "time/train_s": 1.5, "publish/total_s": 0.25},
    ]
    f = figures(rows, 2, 8)
    assert (f["s_per_step"], f["generate_s"], f["update_s"], f["publish_s"]) == (4.0, 2.0, 1.5, 0.25)
    assert f["samples_per_s"] == 2.0
    assert f["other_s"] == 0.25  # step - rollout (absent here: generate) - update - publish - stale wait


def test_the_report_holds_the_speedups_and_the_targets() -> None:
    import argparse

    from bench.multi_gpu import TINY, job, summarise

    args = argparse.Namespace(shape=None, tiny=True, model="m", strategy="ddp", generator_batch=4)
    args.overrides = []
    spec = job("m", 1, TINY)
    one = {"gpus": 1, "samples_per_s": 2.0, "generate_samples_per_s": 4.0, "update_samples_per_s": 4.0}
    two = {"gpus": 2, "samples_per_s": 3.8, "generate_samples_per_s": 8.0, "update_samples_per_s": 7.0}
    r = summarise(args, spec, [one, two])
    assert (r["runs"][1]["speedup_samples_per_s"], r["runs"][1]["target"]) == (1.9, 1.8)
    assert r["runs"][1]["target_met"] is True and r["batch"] == 8
    failed = summarise(args, spec, [{"gpus": 1, "error": "OOM"}, {"gpus": 2, "samples_per_s": 3.8}])
    assert failed["runs"][1]["target_met"] is None  # no one-GPU figure to measure against
