"""bench/tta.py on a CPU: TRL's reward is Crucible's (the sandbox's verdict on the answer's code),
and a tiny random Qwen2 goes through the whole race: Crucible's job and TRL's GRPOTrainer (HF
generation) each save adapters at the chosen steps with increasing wall times, the evaluation
scores the base and every adapter through Crucible's evaluation jobs (HumanEval at the base and
the last point), and the table compares the curves."""

from __future__ import annotations

import json
import os
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
    # A CPU: transformers' own norms and MLPs, the LoRA layers of the 2 blocks fused
    assert crucible["fused_modules"] == 0 and crucible["fused_lora_layers"] == 2 * 7

    runs = [str(tmp_path / "crucible-1gpu"), str(tmp_path / "trl")]
    run("eval", *runs, "--tasks", "2", "--humaneval-tasks", "1", "--rows", "8")
    evals = json.loads((tmp_path / "trl" / "evals.json").read_text())
    assert set(evals) == {"0", "1", "2"} and {"mbpp", "humaneval"} == set(evals["0"]) == set(evals["2"])
    assert evals["1"]["mbpp"]["problems"] == 2 and evals["2"]["humaneval"]["problems"] == 1
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
