"""bench/tta.py on a CPU: TRL's reward is Crucible's (the sandbox's verdict on the answer's code),
and a tiny random Qwen2 goes through the whole race: Crucible's job and TRL's GRPOTrainer (HF
generation) each save adapters at the chosen steps with increasing wall times, the evaluation
scores the base and every adapter through Crucible's evaluation jobs (HumanEval at the base and
the last point), and the table compares the curves; the table's arithmetic on curves made up here."""

from __future__ import annotations

import gzip
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


@pytest.mark.slow  # a sandbox service
def test_trl_reward_is_the_sandbox_verdict_on_the_answer_code() -> None:
    from crucible_cli.spawn import start
    from crucible_shared.jobs import DataSpec
    from crucible_trainer import tasks

    from bench.common import load_job
    from bench.tta import sandbox_reward

    problems = tasks.load_tasks(DataSpec(dataset="mbpp", split="train", limit=2))
    spec = load_job(ROOT / "recipes" / "grpo_smollm2.yaml")
    sandbox = start("crucible_sandbox", {}, "CRUCIBLE_SANDBOX_PORT", timeout=300)
    try:
        reward, counts = sandbox_reward(problems, spec, sandbox.url)
        right = f"Here it is:\n```python\n{problems[1].reference}\n```\nIt works."
        name = problems[0].entry_point
        wrong = f"```python\ndef {name}(*args):\n    return None\n```"
        scores = reward(
            [right, wrong, "no code at all"], task_index=[1, 0, 0], completion_ids=[[1], [1], [1]]
        )
    finally:
        sandbox.stop()
    assert scores == [1.0, 0.0, 0.0]
    assert counts == {"scored": 3, "sandbox_errors": 0}


def test_trl_config_follows_the_job_spec() -> None:
    from bench.common import load_job
    from bench.tta import trl_config

    spec = load_job(
        ROOT / "recipes" / "grpo_smollm2.yaml",
        ["optim.micro_batch=16", "optim.lr=2e-5", "rollout.temperature=0.9", "optim.steps=40",
         "method.group_size=4", "optim.problems_per_step=16", "model.gradient_checkpointing=true"],
    )  # fmt: skip
    config = trl_config(spec, Path("/tmp/out"), "vllm", 0.25, True)
    assert config["per_device_train_batch_size"] * config["gradient_accumulation_steps"] == 64
    assert (config["num_generations"], config["learning_rate"], config["temperature"]) == (4, 2e-5, 0.9)
    assert (config["max_steps"], config["gradient_checkpointing"], config["bf16"]) == (40, True, True)
    assert config["use_vllm"] and config["vllm_mode"] == "colocate"
    assert config["vllm_gpu_memory_utilization"] == 0.25
    # the race recipe as it is: its defaults become TRL's
    c = trl_config(
        load_job(ROOT / "recipes" / "grpo_smollm2.yaml", ["optim.micro_batch=8"]),
        Path("/x"),
        "hf",
        0.3,
        False,
    )
    assert (c["per_device_train_batch_size"], c["gradient_accumulation_steps"], c["num_generations"]) == (
        8,
        8,
        8,
    )
    assert (c["learning_rate"], c["max_completion_length"], c["beta"]) == (0.0001, 256, 0.0)
    assert (c["loss_type"], c["lr_scheduler_type"]) == ("dapo", "constant")
    with pytest.raises(SystemExit, match="micro_batch"):
        trl_config(
            load_job(ROOT / "recipes" / "grpo_smollm2.yaml", ["optim.micro_batch=24"]),
            Path("/x"),
            "hf",
            0.3,
            False,
        )


@pytest.mark.slow  # two tiny training runs (each with a sandbox, one with a generator) and their evaluation
def test_tiny_race_end_to_end(tmp_path) -> None:
    from bench.model_shapes import tiny_model

    model = tiny_model(tmp_path / "model")
    env = {k: v for k, v in os.environ.items() if k not in ("REDIS_URL", "CRUCIBLE_TRAINER_REDIS_URL")}
    env |= {"OMP_NUM_THREADS": "1", "CRUCIBLE_GENERATOR_THREADS": "1", "CRUCIBLE_MODEL_ROOTS": str(tmp_path)}
    # with a length penalty, which TRL scales differently: its run records that
    sets = ["--set", f"model.base={model}", "--set", "reward.length_penalty=0.01", "--every", "1"]

    def run(*args: str) -> None:
        subprocess.run([sys.executable, "bench/tta.py", *args], cwd=ROOT, check=True, timeout=900, env=env)

    run("crucible", "tiny", *sets, "--rows", "8", "--out", str(tmp_path / "crucible-1gpu"))
    run("trl", "tiny", *sets, "--engine", "hf", "--out", str(tmp_path / "trl"))
    for name in ("crucible-1gpu", "trl"):
        record = json.loads((tmp_path / name / "run.json").read_text())
        points = record["points"]
        assert [p["step"] for p in points] == [0, 1, 2]
        walls = [p["wall_s"] for p in points]
        assert walls[0] == 0 and 0 < walls[1] <= walls[2] <= record["wall_s"]
        assert record["train_start_s"] < walls[1]
        for p in points[1:]:
            assert (Path(p["adapter"]) / "adapter_model.safetensors").is_file()
        assert record["eval"]["max_tokens"] == 24 and record["job"]["optim"]["steps"] == 2
    trl = json.loads((tmp_path / "trl" / "run.json").read_text())
    assert trl["rewards"]["scored"] == 2 * 2 * 2
    assert "own spread" in trl["not_matched"]["reward.length_penalty"]
    # Crucible's start-up, phase by phase: the job's first events in the order they came
    phases = json.loads((tmp_path / "crucible-1gpu" / "run.json").read_text())["phases"]
    order = ["status:starting", "settings", "metrics:1", "metrics:2", "status:finished"]
    assert [k for k in phases if k in order] == order
    assert sorted(phases[k] for k in order) == [phases[k] for k in order]
    # The policy loaded beside the job's first calls; how long the job then waited for it
    crucible = json.loads((tmp_path / "crucible-1gpu" / "run.json").read_text())
    assert crucible["policy_load_s"] > 0 and crucible["policy_wait_s"] >= 0
    # When each service came up (and the trainer's warm-up ended, where the cores allow one), before the job
    ready = crucible["ready_s"]
    assert set(ready) - {"trainer warm-up", "trainer imports"} == {"sandbox", "generator-0"}
    assert 0 < max(ready["sandbox"], ready["generator-0"]) <= crucible["train_start_s"]
    # A CPU: transformers' own norms and MLPs, the LoRA layers of the 2 blocks fused
    assert crucible["fused_modules"] == 0 and crucible["fused_lora_layers"] == 2 * 7
    # The generator's counters, a row a second while it trained: tokens only ever grow
    rows = [json.loads(line) for line in (tmp_path / "crucible-1gpu" / "generator.jsonl").open()]
    tokens = [r["0/generation_tokens_total"] for r in rows if "0/generation_tokens_total" in r]
    assert tokens and tokens == sorted(tokens) and tokens[-1] > 0
    assert all(0 <= r.get("0/kv_cache_usage", 0) <= 1 for r in rows)

    runs = [str(tmp_path / "crucible-1gpu"), str(tmp_path / "trl")]
    run("eval", *runs, "--tasks", "2", "--humaneval-tasks", "1", "--rows", "8")
    evals = json.loads((tmp_path / "trl" / "evals.json").read_text())
    assert set(evals) == {"0", "1", "2"} and {"mbpp", "humaneval"} == set(evals["0"]) == set(evals["2"])
    assert evals["1"]["mbpp"]["problems"] == 2 and evals["2"]["humaneval"]["problems"] == 1
    assert all(e["hard_coded_answers"] in (0, 1, 2) for point in evals.values() for e in point.values())
    # the last point's greedy answers, kept to be read by hand (the base's once, beside the runs)
    kept = sorted(p.name for p in (tmp_path / "trl" / "answers").iterdir())
    assert kept == ["trl-2-humaneval.jsonl.gz", "trl-2-mbpp.jsonl.gz"]
    with gzip.open(tmp_path / "trl" / "answers" / "trl-2-mbpp.jsonl.gz", "rt") as f:
        answers = [json.loads(line) for line in f]
    assert [sorted(a) for a in answers] == [["code", "passed", "task_id"]] * 2
    base = sorted(p.name for p in (tmp_path / "base-answers").iterdir())
    assert base == ["base-humaneval.jsonl.gz", "base-mbpp.jsonl.gz"]
    assert len(list((tmp_path / "crucible-1gpu" / "answers").iterdir())) == 2
    run("table", *runs, "--json", str(tmp_path / "tta.json"), "--md", str(tmp_path / "tta.md"))
    table = json.loads((tmp_path / "tta.json").read_text())
    assert table["trl_run"] == "trl" and table["one_gpu_run"] == "crucible-1gpu"
    assert [p["step"] for p in table["runs"]["crucible-1gpu"]["points"]] == [0, 1, 2]
    assert "reach_trl_final_s" in table["runs"]["crucible-1gpu"]
    assert "| crucible-1gpu (crucible) | 1 |" in (tmp_path / "tta.md").read_text()


def test_trl_gets_a_bfloat16_copy_of_a_float32_checkpoint(tmp_path) -> None:
    from bench.model_shapes import tiny_model
    from bench.tta import bf16_copy

    model = tiny_model(tmp_path / "model")  # float32, as Crucible's dense cache
    copy = bf16_copy(model)
    assert copy == str(tmp_path / "model-bf16")
    assert json.loads((tmp_path / "model-bf16" / "config.json").read_text())["dtype"] == "bfloat16"
    assert (tmp_path / "model-bf16" / "tokenizer.json").is_file()
    assert bf16_copy(copy) == copy  # already bfloat16: used as it is
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model", "model-bf16"]


def test_two_runs_making_the_bfloat16_copy_at_once_both_get_it(tmp_path, monkeypatch) -> None:
    # Two TRL runs started together (one per card) both found no copy: the second's rename met
    # the first's finished copy (measured: "Directory not empty", one run lost). It uses that copy.
    import bench.tta as tta
    from bench.model_shapes import tiny_model

    model = tiny_model(tmp_path / "model")
    real = tta.os.replace

    def beaten(src, dst):
        shutil.copytree(src, dst)  # the other run's copy lands first
        real(src, dst)

    monkeypatch.setattr(tta.os, "replace", beaten)
    assert tta.bf16_copy(model) == str(tmp_path / "model-bf16")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model", "model-bf16"]  # its own copy removed


def test_a_run_keeps_every_nth_adapter_and_the_last() -> None:
    from bench.tta import saved_steps

    assert saved_steps(40, 10) == [10, 20, 30, 40]
    assert saved_steps(25, 10) == [10, 20, 25]
    assert saved_steps(2, 10) == [2]


def test_evaluation_takes_the_base_and_the_last_point_before_the_rest() -> None:
    from bench.tta import eval_order

    points = [{"step": s} for s in (0, 5, 10, 15, 20)]
    assert [(rank, p["step"]) for rank, p in eval_order(points)] == [
        (0, 0),
        (1, 20),
        (2, 15),
        (3, 10),
        (4, 5),
    ]


def test_training_figures_of_each_engine() -> None:
    from bench.tta import training

    rows = [
        {"step": s, "step_time": t, "reward": r, "completions/mean_length": 100.0}
        for s, t, r in ((1, 9.0, 0.2), (2, 4.0, 0.4), (3, 5.0, 0.6), (4, 6.0, 0.8))
    ]
    assert training("trl", rows) == {
        "steps": 4, "median_step_s": 5.0, "reward_first": 0.2, "reward_last": 0.8,
        "tokens_first": 100.0, "tokens_last": 100.0,
    }  # fmt: skip
    rows = [
        {"time/step_s": 3.0, "time/generate_s": g, "time/train_s": 1.0, "time/execute_tail_s": 0.5}
        for g in (2.0, 1.0, 1.5)
    ]
    found = {k: v for k, v in training("crucible", rows).items() if k.startswith(("median_", "tail"))}
    medians = {"median_step_s": 3.0, "median_generate_s": 1.25, "median_update_s": 1.0}
    assert found == medians | {"tail_sum_s": 1.5}


def test_reach_and_at_read_a_curve() -> None:
    from bench.tta import at, reach

    pts = [
        {"step": 0, "wall_s": 0, "pass@1": 0.5},
        {"step": 10, "wall_s": 60, "pass@1": 0.53},
        {"step": 20, "wall_s": 90, "pass@1": 0.56},
    ]
    # The base model (step 0) never counts as reaching a target.
    assert [reach(pts, t) for t in (0.53, 0.55, 0.6, 0.5)] == [60, 90, None, 60]
    assert (at(pts, 59.0), at(pts, 61.0)) == (0.5, 0.53)


def tta_run(engine: str, points: list[tuple[int, float, float]], gpus: int = 1) -> dict:
    """A run as `table` reads it: its saved points (step, wall_s) and their MBPP pass@1."""
    run = {"engine": engine, "gpus": gpus, "job": {}}
    run["points"] = [{"step": s, "wall_s": w, "adapter": None} for s, w, _ in points]
    return {"run": run, "evals": {str(s): {"mbpp": {"pass@1": p}} for s, _, p in points}}


def test_compare_times_each_run_against_trl_and_one_gpu() -> None:
    from bench.tta import compare

    c = compare({
        "trl": tta_run("trl", [(0, 0, 0.50), (10, 200, 0.52), (20, 400, 0.54)]),
        "c1": tta_run("crucible", [(0, 0, 0.50), (10, 80, 0.53), (20, 160, 0.56)]),
        "c2": tta_run("crucible", [(0, 0, 0.50), (10, 50, 0.54), (20, 100, 0.57)], gpus=2),
    })  # fmt: skip
    c1, c2 = c["runs"]["c1"], c["runs"]["c2"]
    assert (c["trl_final"], c1["reach_trl_final_s"], c1["reach_over_trl"]) == (0.54, 160, 0.4)
    assert (c1["not_lower_at_equal_wall"], c2["reach_one_gpu_final_s"]) == (True, 100)
    assert (c2["reach_over_one_gpu"], c2["last_point_over_one_gpu"]) == (0.625, 0.625)
    assert c1["last_point_over_trl"] == 0.4
    # TRL's final no better than its base: no time to reach it.
    flat = compare({
        "trl": tta_run("trl", [(0, 0, 0.50), (10, 200, 0.49), (20, 400, 0.50)]),
        "c1": tta_run("crucible", [(0, 0, 0.50), (10, 80, 0.53)]),
    })  # fmt: skip
    c1 = flat["runs"]["c1"]
    assert (flat["trl_gained"], c1["reach_over_trl"], c1["goal_half_trl_met"]) == (False, None, False)


def test_seed_means_average_the_steps_all_seeds_evaluated() -> None:
    from bench.tta import seed_means

    m = seed_means({
        "a": tta_run("trl", [(0, 0, 0.5), (10, 100, 0.52)]),
        "b": tta_run("trl", [(0, 0, 0.5), (10, 120, 0.56), (20, 200, 0.6)]),
        "c": tta_run("crucible", [(0, 0, 0.5), (10, 60, 0.6)]),
    })  # fmt: skip
    assert list(m) == ["trl, 1 GPU, mean of 2 seeds"]
    mean = m["trl, 1 GPU, mean of 2 seeds"]
    assert mean["run"]["points"] == [{"step": 0, "wall_s": 0.0}, {"step": 10, "wall_s": 110.0}]
    assert mean["evals"]["10"] == {"mbpp": {"pass@1": 0.54}}


def test_table_cells() -> None:
    from bench.tta import cell

    assert (cell(0.5512, "{:.1%}"), cell(None), cell(171.6, "{:.0f} s")) == ("55.1%", "-", "172 s")


def test_learning_rows_are_named_by_recipe_overrides_and_seed() -> None:
    from bench.tta import learning_rows

    run = {
        "engine": "crucible",
        "job": {"seed": 1, "model": {"base": "m"}},
        "command": ["bench/tta.py", "crucible", "r", "--set", "seed=1", "--set", "optim.lr=1"],
        "points": [{"step": 0, "wall_s": 0}, {"step": 10, "wall_s": 9}],
    }
    evals = {"0": {"mbpp": {"pass@1": 0.5}}, "10": {"mbpp": {"pass@1": 0.6}}}
    rows = learning_rows({"c": {"run": run, "evals": evals}})
    assert list(rows) == ["r+optim.lr=1-seed1.json"] and rows["r+optim.lr=1-seed1.json"]["after"] == 0.6


def test_one_table_holds_runs_of_one_learning_job() -> None:
    from bench.tta import learning_job, one_job

    job = {"seed": 3, "reward": {"length_penalty": 0.01}, "optim": {"lr": 1e-4, "micro_batch": 8}}
    assert learning_job(job) == {"reward.length_penalty": 0.01, "optim.lr": 0.0001}
    one_job({"a": {"run": {"job": {"seed": 0, "optim": {"lr": 1e-4}}}},
             "b": {"run": {"job": {"seed": 1, "optim": {"lr": 1e-4}}}}})  # fmt: skip
    different = r"^a and b train different jobs \(reward\.length_penalty: 0\.0 against 0\.01\)"
    with pytest.raises(SystemExit, match=different + ": table them apart$"):
        one_job({"a": {"run": {"job": {"reward": {"length_penalty": 0.0}}}},
                 "b": {"run": {"job": {"reward": {"length_penalty": 0.01}}}}})  # fmt: skip


def _race_plan(tta: Path, cards: str, seeds: str) -> list[str]:
    env = {**os.environ, "TTA": str(tta), "TTA_DRY": "1"}
    done = subprocess.run(["bash", "bench/gpu.sh", "tta-race", cards, seeds], cwd=ROOT, env=env,
                          capture_output=True, text=True, check=True)  # fmt: skip
    return done.stdout.splitlines()


def test_the_race_deals_both_engines_to_each_card_and_drops_runs_asked_to(tmp_path) -> None:
    plan = _race_plan(tmp_path, "0,1", "0,1,2")
    evals = sorted(line.split()[3:] for line in plan if " tta-eval " in line)
    assert evals == [["0", "trl-s0", "c-s1", "trl-s2"], ["1", "c-s0", "trl-s1", "c-s2"]]
    assert plan[-1].endswith("tta-table")  # after every card's evaluation
    (tmp_path / "skip-trl-s1").touch()
    plan = _race_plan(tmp_path, "0", "0,1")
    assert "trl-s1 skipped" in plan
    assert [line.split()[3:] for line in plan if " tta-eval " in line] == [["0", "trl-s0", "c-s0", "c-s1"]]
    (tmp_path / "stop").touch()
    plan = _race_plan(tmp_path, "0", "0,1")
    assert [line for line in plan if "skipped" not in line] == ["bash bench/gpu.sh tta-table"]
