"""bench/multi_gpu.py runs end to end on a CPU (`--tiny`: gloo, a tiny random model, two CPU
generator replicas, one sandbox) and writes the JSON the GPU runs fill: per rank count, the real
job's s/step split into generation and update, samples/s, the speed-up over one rank and the
target; the two-rank run goes through the distributed launcher (its update ran on 2 ranks)."""

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
