"""`bench/seeds.py`: one recipe over seeds, one JSON file per run, the summary and the paired
comparison, with a stand-in for `grpo_race.py` (the real one trains; `bench/seeds.py run tiny`
runs it end to end on a CPU in minutes)."""

from __future__ import annotations

import doctest
import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FAKE_RACE = """
import argparse, json
p = argparse.ArgumentParser()
p.add_argument("--seed", type=int); p.add_argument("--json"); p.add_argument("--steps", type=int)
p.add_argument("--eval-tasks", type=int); p.add_argument("--filter")
p.add_argument("--keep-reports"); p.add_argument("--model", default="smollm2-135m-instruct")
a = p.parse_args()
if a.seed == 13:
    raise SystemExit(3)
after = {"greedy_pass@1": 0.05 + 0.01 * a.seed + (0.02 if a.filter == "pre" else 0), "problems": a.eval_tasks}
json.dump({"rows": [{"step": i + 1} for i in range(a.steps)],
           "eval": {"before": {"greedy_pass@1": 0.034, "problems": a.eval_tasks}, "after": after},
           "model": a.model, "humaneval": {"before": {"greedy_pass@1": 0.5}, "after": {"greedy_pass@1": 0.52}}},
          open(a.json, "w"))
"""


@pytest.fixture
def seeds(tmp_path, monkeypatch):
    spec = importlib.util.spec_from_file_location("bench_seeds", ROOT / "bench" / "seeds.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    race = tmp_path / "fake_race.py"
    race.write_text(FAKE_RACE)
    monkeypatch.setattr(module, "RACE", race)
    monkeypatch.setitem(module.RECIPES, "grpo", ([], "no filter"))
    monkeypatch.setitem(module.RECIPES, "pre", (["--filter", "pre"], "pre-filter"))
    return module


def run(seeds, tmp_path, monkeypatch, *argv: str) -> int:
    monkeypatch.setattr(sys, "argv", ["seeds.py", *argv, "--card", "card", "--out", str(tmp_path / "out")])
    try:
        seeds.main()
    except SystemExit as exit:
        return int(exit.code or 0)
    return 0


def test_doctests(seeds) -> None:
    assert doctest.testmod(seeds).failed == 0


def test_a_recipe_over_seeds_writes_one_file_per_run_and_the_summary(seeds, tmp_path, monkeypatch) -> None:
    code = run(
        seeds,
        tmp_path,
        monkeypatch,
        "run",
        "grpo",
        "--seeds",
        "0",
        "1",
        "2",
        "--steps",
        "3",
        "--eval-tasks",
        "5",
        "--model",
        "tiny-m",
    )
    assert code == 0
    folder = tmp_path / "out" / "card" / "learning"
    for seed in (0, 1, 2):
        result = json.loads((folder / f"grpo-seed{seed}.json").read_text())
        assert {k: result[k] for k in ("recipe", "seed", "before", "steps", "eval_tasks")} == {
            "recipe": "grpo", "seed": seed, "before": 0.034, "steps": 3, "eval_tasks": 5
        }  # fmt: skip
        assert result["after"] == pytest.approx(0.05 + 0.01 * seed)
        assert result["model"] == "tiny-m" and "--model tiny-m" in result["command"]
        assert (result["humaneval_before"], result["humaneval_after"]) == (0.5, 0.52)
        assert "--keep-reports" not in result["command"]
        assert (
            result["wall_s"] >= 0
            and f"--seed {seed}" in result["command"]
            and "--json" not in result["command"]
        )
    summary = json.loads((folder / "grpo-summary.json").read_text())
    assert summary["seeds"] == [0, 1, 2] and summary["after"]["n"] == 3
    assert summary["after"]["mean"] == pytest.approx(0.06) and summary["after"]["std"] == pytest.approx(0.01)
    assert [r["after"] for r in summary["per_seed"]] == pytest.approx([0.05, 0.06, 0.07])
    assert (
        (folder / "grpo-summary.md")
        .read_text()
        .startswith("| grpo (no filter) | 3 | 3.4% ± 0.0 | 6.0% ± 1.0 |")
    )


def test_a_failed_seed_is_reported_and_left_out(seeds, tmp_path, monkeypatch) -> None:
    assert run(seeds, tmp_path, monkeypatch, "run", "grpo", "--seeds", "1", "13", "--steps", "1") == 1
    folder = tmp_path / "out" / "card" / "learning"
    assert not (folder / "grpo-seed13.json").exists() and (folder / "logs" / "grpo-seed13.log").exists()
    summary = json.loads((folder / "grpo-summary.json").read_text())
    assert summary["seeds"] == [1] and summary["single_seed"] and summary["after"]["std"] is None


def test_two_recipes_compare_on_the_seeds_they_share(seeds, tmp_path, monkeypatch) -> None:
    run(seeds, tmp_path, monkeypatch, "run", "grpo", "--seeds", "0", "1", "--steps", "1")
    run(seeds, tmp_path, monkeypatch, "run", "pre", "--seeds", "0", "1", "2", "--steps", "1")
    assert run(seeds, tmp_path, monkeypatch, "compare", "grpo", "pre") == 0
    result = json.loads((tmp_path / "out" / "card" / "learning" / "compare-grpo-vs-pre.json").read_text())
    assert result["seeds"] == [0, 1] and result["b_better"] == 2
    assert result["difference"]["mean"] == pytest.approx(0.02)
