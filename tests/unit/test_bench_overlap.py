"""The overlap benchmark's recipes (recipes/learning.yaml `overlap-s0/1/2`, run by `bench/learning.py`):
the three jobs are the same job but for the overlap section, evaluated after training only."""

from __future__ import annotations

import sys
from pathlib import Path

from crucible_shared.jobs import TrainJob

ROOT = Path(__file__).resolve().parents[2]


def test_the_overlap_recipes_differ_only_in_overlap() -> None:
    sys.path.insert(0, str(ROOT))
    from bench.common import load_job, recipes

    found = recipes()
    jobs = {
        s: load_job(ROOT / found[f"overlap-s{s}"]["spec"], found[f"overlap-s{s}"]["set"]) for s in (0, 1, 2)
    }
    assert all(isinstance(j, TrainJob) for j in jobs.values())
    assert [j.overlap.max_staleness for j in jobs.values()] == [0, 1, 2]
    assert (jobs[2].overlap.cap, jobs[0].optim.micro_batch) == (2.0, 64)
    same = jobs[0].model_dump(exclude={"overlap"})
    assert all(j.model_dump(exclude={"overlap"}) == same for j in jobs.values())
    assert jobs[1].eval is not None and not jobs[1].eval.before and jobs[1].eval.greedy
