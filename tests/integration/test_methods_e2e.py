"""Every method as a job through the gateway and a real worker with SmolLM2: REINFORCE with its
length penalty, PPO's epochs over stored rollouts, and a GRPO-vs-SRRL comparison by the
`crucible compare` command, followed in the terminal the way a person reads it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from crucible_shared.gateway_client import GatewayClient
from crucible_shared.lifecycle import JobStatus
from safetensors.torch import load_file

pytestmark = pytest.mark.slow

BASE = {
    "kind": "train",
    "data": {"dataset": "mbpp", "ids": [601, 602]},
    "rollout": {"max_tokens": 48, "temperature": 1.0},
    # Micro-batches of 2: the update's peak memory is about 2.5 MB per token of a micro-batch.
    "optim": {"lr": 5e-4, "steps": 2, "problems_per_step": 2, "micro_batch": 2},
    "eval": None,
    "checkpoint": {"every": 10},
    "publish": {"stale_check": False},  # tested in test_trainer; here the methods' updates are
    "logging": {"wandb_mode": "disabled"},
    "seed": 3,
}


def crucible(*args: str, timeout: float = 1800) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "crucible_cli", *args], capture_output=True, text=True, timeout=timeout
    )


def run_job(client: GatewayClient, spec: dict) -> tuple[str, list[dict]]:
    job_id = client.submit(spec).id
    kinds = [e[1] for e in client.events(job_id, timeout=1800)]
    record = client.job(job_id)
    assert record.status == JobStatus.finished, (record.error, kinds)
    rows = [json.loads(line) for line in client.download(job_id, "metrics.jsonl").decode().splitlines()]
    return job_id, rows


def lora_b(path: Path) -> float:
    return sum(float(t.float().norm()) for n, t in load_file(str(path)).items() if "lora_B" in n)


def test_reinforce_and_ppo_jobs(gateway, workers, stack_dirs) -> None:
    workers.start()
    client = GatewayClient(gateway.url, timeout=60)
    alpha = 0.5
    job_id, rows = run_job(
        client,
        {
            **BASE,
            "method": {"name": "reinforce", "samples": 3, "baseline": False},
            "reward": {"kind": "all_pass", "length_penalty": alpha},
            # One step: without a baseline every sample's advantage is its non-zero reward, so
            # the first step trains (PPO below keeps two: its groups may all tie).
            "optim": {**BASE["optim"], "steps": 1},
        },
    )
    # The length penalty is in every reward: all_pass (1/0) minus alpha * tokens / 100. (No baseline:
    # completions cut at the same length would all get the same reward, and a zero advantage.)
    for path in sorted((stack_dirs["runs"] / job_id / "rollouts").glob("step-*.jsonl")):
        for r in map(json.loads, path.read_text().splitlines()):
            base = 1.0 if r["status"] == "passed" else 0.0
            assert r["reward"] == pytest.approx(base - alpha * r["tokens"] / 100), r
            assert r["length_cost"] == pytest.approx(alpha * r["tokens"] / 100), r  # what the penalty took
    assert all(r["reward_mean"] < 0 for r in rows if "reward_mean" in r)
    assert lora_b(stack_dirs["runs"] / job_id / "adapter" / "adapter_model.safetensors") > 0

    job_id, rows = run_job(
        client,
        {
            **BASE,
            "method": {"name": "ppo", "epochs": 3, "samples": 3, "ratio": "sequence"},
            "reward": {"kind": "graded"},
        },
    )
    steps = [r for r in rows if "reward_mean" in r]
    trained = [r for r in steps if r["update/sequences"] > 0]
    assert trained, steps
    for r in trained:
        # Three epochs over the same stored rollouts: on-policy at first, then the ratio moves.
        assert {f"update/ratio_mean_iter{i}" for i in range(3)} <= set(r)
        assert r["update/ratio_mean_iter0"] == pytest.approx(1.0, abs=1e-3)
        assert r["update/ratio_mean_iter2"] != pytest.approx(1.0, abs=1e-6)
    assert lora_b(stack_dirs["runs"] / job_id / "adapter" / "adapter_model.safetensors") > 0


def test_compare_grpo_and_srrl_at_a_matched_budget(gateway, workers, tmp_path) -> None:
    workers.start()
    grpo = {
        **BASE,
        "name": "grpo",
        "method": {"name": "grpo", "group_size": 4},
        "reward": {"kind": "fraction"},
        # What is checked is the command (jobs, report, curves, artifacts, watch), not what the
        # methods learn: completions of 24 tokens, half the sampling of both jobs.
        "rollout": {**BASE["rollout"], "max_tokens": 24},
    }
    srrl = {
        **grpo,
        "name": "srrl",
        "method": {"name": "srrl", "c1": 2, "c2": 2, "budget": 4, "feedback": "all_tests"},
    }
    paths = []
    for spec in (grpo, srrl):
        path = tmp_path / f"{spec['name']}.yaml"
        path.write_text(yaml.safe_dump(spec))
        paths.append(path)
    out = tmp_path / "cmp"
    done = crucible(
        "compare", "-c", str(paths[0]), "-c", str(paths[1]), "--out", str(out), "--gateway", gateway.url
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = (out / "comparison.md").read_text()
    assert "| grpo | grpo | 8 |" in report and "| srrl | srrl | 8 |" in report, report
    assert (out / "curves.png").stat().st_size > 0
    # The story as a person reads it: hot-swaps with seconds, progress per step.
    assert "hot-swapped into the generator in" in done.stdout and "reward" in done.stdout
    assert "{'" not in done.stdout  # no dict reprs

    client = GatewayClient(gateway.url)
    srrl_id = next(j.id for j in client.jobs(kind="train", limit=10).jobs if j.name == "srrl")
    files = {a.path for a in client.artifacts(srrl_id).artifacts}
    assert {"refinements.md", "refinements.json"} <= files and any(p.startswith("rollouts/") for p in files)
    rows = json.loads(client.download(srrl_id, "refinements.json"))
    assert {r["problem_id"] for r in rows} == {"MBPP/601", "MBPP/602"}
    assert all(r["c1"] == 4 for r in rows)  # 2 first attempts x 2 steps

    watched = crucible("watch", srrl_id, "--gateway", gateway.url, "--samples")
    assert watched.returncode == 0 and "sample" in watched.stdout and "MBPP/60" in watched.stdout
    raw = crucible("watch", srrl_id, "--gateway", gateway.url, "--json")
    events = [json.loads(line) for line in raw.stdout.splitlines()]
    assert events[-1]["event"] == "end" and any(e["event"] == "metrics" for e in events)


def test_compare_refuses_what_it_cannot_compare(tmp_path) -> None:
    grpo = {**BASE, "method": {"name": "grpo", "group_size": 4}}
    other_data = {**grpo, "method": {"name": "srrl", "budget": 4}, "data": {"dataset": "mbpp", "ids": [603]}}
    other_budget = {**grpo, "method": {"name": "srrl", "budget": 6}}
    for bad, message in ((other_data, "differs from"), (other_budget, "sample budgets")):
        a, b = tmp_path / "a.yaml", tmp_path / "b.yaml"
        a.write_text(yaml.safe_dump(grpo))
        b.write_text(yaml.safe_dump(bad))
        done = crucible("compare", "-c", str(a), "-c", str(b), "--gateway", "http://127.0.0.1:9", timeout=120)
        assert done.returncode == 2 and message in done.stderr, done.stderr
