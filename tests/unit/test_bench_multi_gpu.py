"""bench/multi_gpu.py runs end to end on a CPU (`--tiny`: gloo, a tiny random model) and writes
the JSON the GPU runs fill: per rank count, s/step split into generation and update, samples/s
and the speed-up over one rank."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # three torchrun launches, each loading torch and transformers

ROOT = Path(__file__).resolve().parents[2]


def test_tiny_run_writes_figures_for_each_rank_count(tmp_path) -> None:
    out = tmp_path / "multi.json"
    cmd = [sys.executable, "bench/multi_gpu.py", "--tiny", "--gpus", "1,2", "--steps", "1", "--out", str(out)]
    subprocess.run(cmd, cwd=ROOT, check=True, timeout=900, env={**os.environ, "OMP_NUM_THREADS": "1"})
    report = json.loads(out.read_text())
    assert report["batch"] == 8 and report["strategy"] == "ddp"
    runs = {r["gpus"]: r for r in report["runs"]}
    assert set(runs) == {1, 2}
    for r in runs.values():
        assert r["device"] == "cpu" and r["steps"] == 1
        assert r["s_per_step"] == pytest.approx(r["generate_s"] + r["update_s"])
        assert r["samples_per_s"] == pytest.approx(8 / r["s_per_step"])
    assert runs[1]["speedup_samples_per_s"] == 1.0
    assert runs[2]["speedup_samples_per_s"] > 0
