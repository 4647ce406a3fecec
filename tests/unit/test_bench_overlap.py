"""`bench/overlap_race.py`: its figures and comparison (its doctests, collected by pytest), and the jobs it runs are valid
specs with the overlap section only where s > 0 (the script itself runs end to end on a CPU with
`--tiny`)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
from crucible_shared.jobs import TrainJob

ROOT = Path(__file__).resolve().parents[2]


def _module():
    sys.path.insert(0, str(ROOT))
    spec = importlib.util.spec_from_file_location("bench_overlap_race", ROOT / "bench" / "overlap_race.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_jobs_differ_only_in_overlap(monkeypatch) -> None:
    race = _module()
    monkeypatch.setattr(sys, "argv", ["overlap_race.py", "--tiny"])
    args = race.parse()
    assert args.seeds == [0]
    jobs = {s: race.spec_of(args, s, seed=0) for s in (0, 1, 2)}
    assert all(isinstance(j, TrainJob) for j in jobs.values())
    assert (jobs[0].optim.steps, jobs[0].method.group_size, jobs[0].optim.micro_batch) == (3, 2, 64)
    assert jobs[0].overlap.max_staleness == 0
    assert (jobs[2].overlap.max_staleness, jobs[2].overlap.cap) == (2, 2.0)
    same = {k: v for k, v in jobs[0].model_dump().items() if k != "overlap"}
    assert all({k: v for k, v in j.model_dump().items() if k != "overlap"} == same for j in jobs.values())
    assert jobs[1].eval is not None and not jobs[1].eval.before and jobs[1].eval.greedy


def _result(tmp_path: Path, name: str, runs: list[dict], steps: int = 80) -> Path:
    path = tmp_path / name
    path.write_text(
        json.dumps(
            {"setup": {"overrides": [f"optim.steps={steps}"]}, "device": "card", "runs": runs, "targets": {}}
        )
    )
    return path


def test_merge_pairs_seeds_run_on_separate_cards(tmp_path: Path) -> None:
    race = _module()
    a = _result(
        tmp_path,
        "a.json",
        [
            {"staleness": 0, "seed": 0, "samples_per_s": 10.0, "pass1": 0.06},
            {"staleness": 1, "seed": 0, "samples_per_s": 14.0, "pass1": 0.07},
        ],
    )
    b = _result(
        tmp_path,
        "b.json",
        [
            {"staleness": 0, "seed": 1, "samples_per_s": 20.0, "pass1": 0.08},
            {"staleness": 1, "seed": 1, "samples_per_s": 24.0, "pass1": 0.07},
        ],
    )
    merged = race.merge([a, b])
    assert len(merged["runs"]) == 4 and merged["merged_from"] == ["a.json", "b.json"]
    one = merged["by_staleness"]["1"]
    assert one["speedup_by_seed"] == [1.4, 1.2] and one["seeds"] == [0, 1]
    assert one["speedup_of_means"] == round(19.0 / 15.0, 4)


def test_merge_refuses_different_setups(tmp_path: Path) -> None:
    race = _module()
    a = _result(tmp_path, "a.json", [], steps=80)
    b = _result(tmp_path, "b.json", [], steps=100)
    with pytest.raises(SystemExit, match="different setups"):
        race.merge([a, b])
