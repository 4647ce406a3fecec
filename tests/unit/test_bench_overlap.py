"""`bench/overlap_race.py`: its figures and comparison (doctests), and the jobs it runs are valid
specs with the overlap section only where s > 0 (the script itself runs end to end on a CPU with
`--tiny`)."""

from __future__ import annotations

import doctest
import importlib.util
import sys
from pathlib import Path

from crucible_shared.jobs import TrainJob

ROOT = Path(__file__).resolve().parents[2]


def _module():
    sys.path.insert(0, str(ROOT))
    spec = importlib.util.spec_from_file_location("bench_overlap_race", ROOT / "bench" / "overlap_race.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_doctests() -> None:
    assert doctest.testmod(_module()).failed == 0


def test_the_jobs_differ_only_in_overlap(monkeypatch) -> None:
    race = _module()
    monkeypatch.setattr(sys, "argv", ["overlap_race.py", "--tiny"])
    args = race.parse()
    assert (args.steps, args.group_size, args.seeds) == (3, 2, [0])
    jobs = {s: TrainJob.model_validate(race.spec_of(args, s, seed=0)) for s in (0, 1, 2)}
    assert jobs[0].overlap.max_staleness == 0
    assert (jobs[2].overlap.max_staleness, jobs[2].overlap.cap) == (2, 2.0)
    same = {k: v for k, v in jobs[0].model_dump().items() if k != "overlap"}
    assert all({k: v for k, v in j.model_dump().items() if k != "overlap"} == same for j in jobs.values())
    assert jobs[1].eval is not None and not jobs[1].eval.before and jobs[1].eval.greedy
