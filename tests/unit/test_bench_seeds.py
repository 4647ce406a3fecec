"""`bench/learning.py run`: one recipe (spec + overrides) over seeds, one JSON file per run, the
summary and the paired comparison, with a stand-in for `learning.py job` that reads the job spec and
overrides it is given (the real one trains; `bench/learning.py run tiny` runs it end to end on a CPU
in about a minute a seed). And every shipped recipe resolves to a valid training job."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FAKE_RACE = """
import argparse, json, yaml
p = argparse.ArgumentParser()
p.add_argument("verb"); p.add_argument("job"); p.add_argument("--set", action="append", default=[]); p.add_argument("--json")
p.add_argument("--keep-reports"); p.add_argument("--generator-rows"); p.add_argument("--humaneval", action="store_true")
a = p.parse_args()
spec = yaml.safe_load(open(a.job))
for override in a.set:  # flat fields are enough here
    field, value = override.split("=", 1)
    spec[field] = yaml.safe_load(value)
if spec["seed"] == 13:
    raise SystemExit(3)
tasks = spec["eval.data.limit"]
after = {"greedy_pass@1": 0.05 + 0.01 * spec["seed"] + (0.02 if spec.get("method.filter.mode") == "pre" else 0),
         "problems": tasks}
json.dump({"rows": [{"step": i + 1} for i in range(spec["optim.steps"])],
           "eval": {"before": {"greedy_pass@1": 0.034, "problems": tasks}, "after": after},
           "model": spec.get("model.base", "smollm2-135m-instruct"),
           **({"humaneval": {"before": {"greedy_pass@1": 0.5}, "after": {"greedy_pass@1": 0.52}}}
              if a.humaneval else {})},
          open(a.json, "w"))
"""
RECIPES = """
grpo: {about: no filter, spec: SPEC, set: [optim.steps=1, eval.data.limit=4], humaneval: true}
pre: {about: pre-filter, from: grpo, set: ["method.filter.mode=pre"]}
"""


def load_seeds():
    spec = importlib.util.spec_from_file_location("bench_learning", ROOT / "bench" / "learning.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def seeds(tmp_path, monkeypatch):
    module = load_seeds()
    race = tmp_path / "fake_race.py"
    race.write_text(FAKE_RACE)
    (tmp_path / "job.yaml").write_text("kind: train\n")
    recipes = tmp_path / "recipes.yaml"
    recipes.write_text(RECIPES.replace("SPEC", str(tmp_path / "job.yaml")))
    monkeypatch.setattr(module, "RACE", race)
    monkeypatch.setattr(module, "RECIPES", recipes)
    return module


def run(seeds, tmp_path, monkeypatch, *argv: str) -> int:
    monkeypatch.setattr(sys, "argv", ["learning.py", *argv, "--card", "card", "--out", str(tmp_path / "out")])
    try:
        seeds.main()
    except SystemExit as exit:
        return int(exit.code or 0)
    return 0


def test_a_seed_of_a_recipe_is_its_spec_and_overrides_with_the_seeds(seeds) -> None:
    recipe = {"spec": "recipes/grpo_smollm2.yaml", "set": ["method.filter.mode=pre"], "humaneval": True}
    args = seeds.argparse.Namespace(steps=None, eval_tasks=30, model=None)
    assert seeds.race_arguments(recipe, args, 2) == [
        "recipes/grpo_smollm2.yaml", "--set", "method.filter.mode=pre", "--set", "seed=2", "--set", "data.seed=2",
        "--set", "eval.data.limit=30", "--humaneval", "--generator-rows", "64",
    ]  # fmt: skip


def test_a_runs_file_holds_its_scores_and_samples_per_second(seeds) -> None:
    rows = [{"step": s, "samples": 8, "time/step_s": 2.0} for s in (1, 2)]
    race = {"rows": rows, "eval": {"before": {"greedy_pass@1": 0.036}, "after": {"greedy_pass@1": 0.07}}}
    r = seeds.record("pre", 1, race, ["python", "bench/learning.py", "job"], 12.5)
    assert (r["recipe"], r["seed"], r["before"], r["after"]) == ("pre", 1, 0.036, 0.07)
    assert (r["steps"], r["samples_per_s"], r["command"]) == (2, 4.0, "python bench/learning.py job")


def test_summary_and_comparison_over_seeds(seeds) -> None:
    assert seeds.mean_std([0.04, 0.06, 0.08]) == {"mean": 0.06, "std": 0.02, "n": 3}
    runs = [
        {"seed": s, "before": 0.036, "after": a, "steps": 100, "wall_s": 300.0, "eval_tasks": 500}
        for s, a in ((0, 0.066), (1, 0.086), (2, 0.076))
    ]
    s = seeds.summarise("pre", runs)
    assert s["after"] == {"mean": 0.076, "std": 0.01, "n": 3}
    assert (s["gain"]["mean"], s["seeds"]) == (0.04, [0, 1, 2])
    pa = [{"seed": 0, "after": 0.05, "samples_per_s": 10.0}, {"seed": 1, "after": 0.06}]
    pb = [{"seed": 0, "after": 0.07, "samples_per_s": 14.0}, {"seed": 1, "after": 0.07}]
    c = seeds.compare("grpo", pa, "pre", [*pb, {"seed": 3, "after": 0.2}])  # seed 3 has no pair
    assert (c["seeds"], c["difference"]["mean"], c["b_better"]) == ([0, 1], 0.015, 2)
    assert c["samples_per_s_ratio"] == {"mean": 1.4, "std": None, "n": 1}


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
        assert result["model"] == "tiny-m" and "--set model.base=tiny-m" in result["command"]
        assert (result["humaneval_before"], result["humaneval_after"]) == (0.5, 0.52)
        assert "--keep-reports" not in result["command"]
        assert (
            result["wall_s"] >= 0
            and f"--set seed={seed} --set data.seed={seed}" in result["command"]
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


def test_a_recipes_own_steps_and_tasks_hold_unless_the_command_says_otherwise(
    seeds, tmp_path, monkeypatch
) -> None:
    assert run(seeds, tmp_path, monkeypatch, "run", "pre", "--seeds", "4") == 0
    result = json.loads((tmp_path / "out" / "card" / "learning" / "pre-seed4.json").read_text())
    assert (result["steps"], result["eval_tasks"], result["after"]) == (1, 4, pytest.approx(0.11))
    assert result["command"].endswith(
        "--set optim.steps=1 --set eval.data.limit=4 --set method.filter.mode=pre --set seed=4 "
        "--set data.seed=4 --humaneval --generator-rows 64"
    )
    with pytest.raises(SystemExit, match="unknown recipe 'nope': one of grpo, pre"):
        seeds.cmd_run(seeds.argparse.Namespace(recipe="nope"), [])


SHIPPED = load_seeds().recipes()


@pytest.mark.parametrize("name", sorted(SHIPPED))
def test_every_shipped_recipe_is_a_valid_training_job(name: str) -> None:
    """What `bench/learning.py job` would run: the recipe's spec file with its overrides, validated."""
    from crucible_shared.jobs import TrainJob

    sys.path.insert(0, str(ROOT))
    from bench.common import load_job

    recipe = SHIPPED[name]
    assert recipe.get("about") and (ROOT / recipe["spec"]).is_file()
    job = load_job(ROOT / recipe["spec"], recipe["set"])
    assert isinstance(job, TrainJob) and job.data.shuffle  # `--set data.seed=S` orders the problems
    assert load_job(ROOT / recipe["spec"], [*recipe["set"], "seed=3", "data.seed=3"]).data.seed == 3
    if recipe.get("sft_first"):  # the job starts from the SFT adapter, pulled towards it
        assert job.method.kl_beta > 0 and job.model.lora_r == 16


def test_a_recipe_that_builds_on_an_unknown_one_or_names_no_spec_is_refused(tmp_path) -> None:
    sys.path.insert(0, str(ROOT))
    from bench.common import recipes

    bad = tmp_path / "r.yaml"
    bad.write_text("a: {from: b}\n")
    with pytest.raises(SystemExit, match="'b' is not defined"):
        recipes(bad)
    bad.write_text("a: {about: x, set: [optim.lr=1]}\n")
    with pytest.raises(SystemExit, match="one of spec/from"):
        recipes(bad)
    bad.write_text("a: {from: a}\n")
    with pytest.raises(SystemExit, match="builds on itself"):
        recipes(bad)


def test_an_override_naming_a_bad_field_fails_naming_it() -> None:
    sys.path.insert(0, str(ROOT))
    from bench.common import load_job

    with pytest.raises(SystemExit, match=r"optim\.lr.*from --set optim\.lr=-1"):
        load_job(ROOT / "recipes" / "grpo_smollm2.yaml", ["optim.lr=-1"])
    with pytest.raises(SystemExit, match="--set 'optim': expected FIELD=VALUE"):
        load_job(ROOT / "recipes" / "grpo_smollm2.yaml", ["optim"])


def test_no_evaluation_tasks_means_no_evaluation(seeds) -> None:
    recipe = {"spec": "recipes/grpo_smollm2.yaml", "set": []}
    args = seeds.argparse.Namespace(steps=3, eval_tasks=0, model="m")
    race = seeds.race_arguments(recipe, args, 1)
    assert "eval=null" in race and not any(a.startswith("eval.data") for a in race)
    sys.path.insert(0, str(ROOT))
    from bench.common import load_job

    sets = [race[i + 1] for i, a in enumerate(race) if a == "--set"]
    job = load_job(ROOT / recipe["spec"], sets)
    assert job.eval is None and (job.optim.steps, job.model.base, job.seed, job.data.seed) == (3, "m", 1, 1)
