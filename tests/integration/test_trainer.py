"""The trainer on CPU with the real SmolLM2 model against a spawned generator and sandbox."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import yaml
from crucible_shared.jobs import TrainJob
from safetensors.torch import load_file

pytestmark = pytest.mark.slow


# The stale-policy probe (a generator request and two scoring passes, seconds a step) is checked
# by the GRPO and tampering tests here and the overlapped run; other tests of jobs turn it off.
NO_STALE_CHECK = {"stale_check": False}
# For tests of what happens around a step (tampering caught, cancel, kill and resume) rather than
# what it learns: groups of two samples of 24 tokens, a few seconds a step on a CPU where
# tiny_job's eight of 64 take about 20.
SHORT_STEPS = {"method": {"name": "grpo", "group_size": 2}, "rollout": {"max_tokens": 24}}


def tiny_job(**overrides) -> TrainJob:
    spec = {
        "kind": "train",
        "method": {"name": "grpo", "group_size": 4},
        "data": {"dataset": "mbpp", "ids": [601, 602]},
        "rollout": {"max_tokens": 64, "temperature": 1.0},
        "reward": {"kind": "graded"},
        # Micro-batches of 2: a CPU update holds about 2.5 MB of activations per token of its
        # micro-batch (8 sequences peaked at 7 GB resident, 2 at 2.7 GB) and pads less.
        "optim": {"lr": 5e-4, "steps": 2, "problems_per_step": 2, "micro_batch": 2},
        "publish": {"every": 1, "staleness_window": 1},
        "eval": None,
        "checkpoint": {"every": 1},
        "logging": {"wandb_mode": "disabled"},
        "seed": 1,
    }
    for key, value in overrides.items():
        merge = key != "method" and isinstance(value, dict) and isinstance(spec.get(key), dict)
        spec[key] = {**spec[key], **value} if merge else value
    return TrainJob.model_validate(spec)


def train(spec: TrainJob, job_id: str, settings, channel=None) -> dict:
    """Run a training job in this process, as `crucible train --local` does."""
    from crucible_trainer.online.train import run_train_job
    from crucible_trainer.runtime.channel import LocalChannel

    return asyncio.run(run_train_job(spec, job_id, settings, channel or LocalChannel(job_id)))


def step_problems(run_dir: Path) -> list[list[str]]:
    """The problem ids each step trained on, from its rollouts file."""
    out = []
    for path in sorted((run_dir / "rollouts").glob("step-*.jsonl")):
        rows = [json.loads(line) for line in path.read_text().splitlines()]
        out.append(sorted({r["problem_id"] for r in rows}))
    return out


def settings_for(stack_generator, sandbox, stack_dirs):
    from crucible_trainer.settings import Settings

    return Settings(
        generator_urls=[stack_generator.url],
        sandbox_url=sandbox.url,
        adapter_dir=stack_dirs["adapters"],
        runs_dir=stack_dirs["runs"],
        cancel_poll_s=0.5,
    )


def lora_b_norm(adapter_dir: Path) -> float:
    weights = load_file(str(adapter_dir / "adapter_model.safetensors"))
    return sum(float(t.float().norm()) for name, t in weights.items() if "lora_B" in name)


def test_grpo_two_steps_publishes_and_learns(stack_generator, sandbox, stack_dirs) -> None:
    settings = settings_for(stack_generator, sandbox, stack_dirs)
    summary = train(tiny_job(), "grpo-it", settings)
    assert summary["status"] == "finished"
    run_dir = Path(summary["run_dir"])
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        for key in (
            "reward_mean",
            "reward_std",
            "pass_rate",
            "zero_signal_fraction",
            "completion_tokens_mean",
            "clip_fraction",
            "grad_norm",
            "lr",
            "time/generate_s",
            "time/train_s",
            "time/update_passes_s",
            "publish/load_s",
        ):
            assert key in row, key
        # The generator served the policy the trainer held while the step sampled from it (the
        # base model at step 1, v1 at step 2): the stale-policy check, run beside the rollouts.
        assert row["stale/diff"] <= 0.05
        assert row["time/stale_wait_s"] >= 0
    # v2, published after the last step, is checked once more before the job ends.
    assert summary["stale_check"]["stale/diff"] <= 0.05
    assert summary["stale_check"]["stale/policy_moved"] > 0 or sum(r["update/sequences"] for r in rows) == 0
    # v1 and v2 were published under new names and served (the stale checks above scored them
    # through the generator); once the job is over it frees the generator's adapter slots.
    assert (stack_dirs["adapters"] / "grpo-it" / "v1" / "adapter_config.json").exists()
    assert (stack_dirs["adapters"] / "grpo-it" / "v2" / "adapter_config.json").exists()
    assert [r["policy_version"] for r in rows] == [1.0, 2.0]
    served = {m["id"] for m in httpx.get(f"{stack_generator.url}/v1/models").json()["data"]}
    assert not {"grpo-it-v1", "grpo-it-v2"} & served
    # Training changed the LoRA weights (lora_B starts at zero).
    updated = [r["update/sequences"] for r in rows]
    assert sum(updated) > 0, f"no group had a learning signal: {rows}"
    assert lora_b_norm(run_dir / "adapter") > 0
    assert (
        lora_b_norm(stack_dirs["adapters"] / "grpo-it" / "v1")
        != lora_b_norm(stack_dirs["adapters"] / "grpo-it" / "v2")
        or updated[1] == 0
    )
    assert (run_dir / "learning_curve.png").exists()


def test_the_update_starts_on_the_groups_scored_while_the_last_programs_run(
    stack_generator, sandbox, stack_dirs, monkeypatch
) -> None:
    """`optim.early_update: true` on a CPU: every sandbox batch answers a second late, so the last
    completions' programs run after generation ends, and the update begins beside them (after
    the stale-policy check), trains exactly the samples of groups whose rewards differ, and
    publishes the version that the check after the last step finds the generator serving."""
    from crucible_shared.sandbox_client import SandboxClient

    real = SandboxClient.run_batch

    async def late(self, runs):
        await asyncio.sleep(1.0)
        return await real(self, runs)

    monkeypatch.setattr(SandboxClient, "run_batch", late)
    spec = tiny_job(**SHORT_STEPS, optim={"early_update": True, "steps": 1})
    summary = train(spec, "early-it", settings_for(stack_generator, sandbox, stack_dirs))
    assert summary["status"] == "finished"
    run_dir = Path(summary["run_dir"])
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1]
    for row in rows:
        step = row["step"]
        rollouts = [
            json.loads(line)
            for line in (run_dir / "rollouts" / f"step-{step:06d}.jsonl").read_text().splitlines()
        ]
        trained = [r for r in rollouts if r["advantage"] != 0 and r["tokens"] > 0]
        assert row["update/sequences"] == len(trained), (step, row, rollouts)
        assert row["update/normaliser_sequences"] == len(rollouts) == 4
        # The update was under way for the last second of the programs' run at least.
        assert row["time/update_beside_tail_s"] >= 0.8 and row["time/execute_tail_s"] >= 0.8
        assert row["update/early_micro_batches"] >= 0 and row["stale/diff"] <= 0.05
    assert summary["stale_check"]["stale/diff"] <= 0.05


def test_a_generator_serving_other_weights_fails_the_step(
    stack_generator, sandbox, stack_dirs, monkeypatch
) -> None:
    """A replica that serves other weights under a version's name (a botched copy, a lagging
    reload): the step sampling from it fails before its samples train anything."""
    import torch
    from crucible_trainer.online import train as train_module
    from crucible_trainer.online.train import StalePolicyError
    from safetensors.torch import save_file

    class TamperingPublisher(train_module.Publisher):
        async def publish(self, policy, version):
            save = policy.save_adapter

            def tampered(path: Path) -> Path:
                out = save(path)
                weights = load_file(str(path / "adapter_model.safetensors"))
                noise = torch.Generator().manual_seed(version)
                for name, t in weights.items():
                    if "lora_B" in name:
                        weights[name] = torch.randn(t.shape, generator=noise).to(t.dtype) * 0.2
                save_file(weights, str(path / "adapter_model.safetensors"))
                return out

            policy.save_adapter = tampered
            try:
                return await super().publish(policy, version)
            finally:
                del policy.save_adapter

    monkeypatch.setattr(train_module, "Publisher", TamperingPublisher)
    from crucible_trainer.runtime.channel import LocalChannel

    events: list[dict] = []
    channel = LocalChannel("stale-it", lambda kind, event: events.append(event))
    spec = tiny_job(**SHORT_STEPS, optim={"steps": 3, "problems_per_step": 1}, checkpoint={"every": 1})
    with pytest.raises(StalePolicyError, match=r"stale-it-v1 \(version 1\)"):
        train(spec, "stale-it", settings_for(stack_generator, sandbox, stack_dirs), channel)
    run_dir = stack_dirs["runs"] / "stale-it"
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    # Step 1 sampled from the untouched base model; step 2 never finished.
    assert [r["step"] for r in rows] == [1]
    assert rows[0]["stale/diff"] <= 0.05
    stale = [e for e in events if e["type"] == "stale_policy"]
    assert len(stale) == 1 and stale[0]["version"] == 1 and stale[0]["diff"] > spec.publish.stale_tolerance
    assert [p.name for p in (run_dir / "checkpoints").glob("step-*")] == ["step-000001"]


def test_the_policy_loads_while_the_prefilter_samples(
    stack_generator, sandbox, stack_dirs, monkeypatch
) -> None:
    """The trainer's model loads beside the job's first service calls: the policy's load here
    finishes only once the pre-filter has begun (a load awaited first would wait for good and
    fail the test), and the step that needs the policy waits for it."""
    import threading

    from crucible_trainer.methods import groups
    from crucible_trainer.online import train as train_module

    prefilter_began = threading.Event()
    real_prepare, real_make = train_module.TrainRun._start_pre_filter, train_module.TrainRun.make_policy
    seen: dict[str, bool] = {}

    async def prepare(self, ctx, start):
        prefilter_began.set()
        return await real_prepare(self, ctx, start)

    def make_policy(self):
        seen["began_first"] = prefilter_began.wait(timeout=60)
        return real_make(self)

    monkeypatch.setattr(train_module.TrainRun, "_start_pre_filter", prepare)
    monkeypatch.setattr(train_module.TrainRun, "make_policy", make_policy)
    # A random model solves nothing: the filter keeps the first problem, as if only it were sometimes solved.
    monkeypatch.setattr(
        groups, "worth_training", lambda members, keep: bool(members) and members[0].task_index == 0
    )
    spec = tiny_job(
        method={"name": "grpo", "group_size": 2, "filter": {"mode": "pre", "pre_samples": 2}},
        rollout={"max_tokens": 24},
        optim={"steps": 1, "problems_per_step": 1},
        publish=NO_STALE_CHECK,
    )
    summary = train(spec, "load-beside-it", settings_for(stack_generator, sandbox, stack_dirs))
    assert seen == {"began_first": True}
    assert summary["status"] == "finished"
    assert summary["policy_load_s"] > 0 and summary["policy_wait_s"] >= 0
    # A CPU: transformers' own norms and MLPs, every LoRA layer fused (7 linear layers in each of
    # SmolLM2's 30 blocks; rl/fused.py)
    assert summary["fused_modules"] == 0 and summary["fused_lora_layers"] == 30 * 7
    # Where the pre-filter's time went
    kept = summary["difficulty_filter"]
    assert kept["kept"] == 1 and kept["of"] > 1
    assert kept["seconds"] >= kept["generate_s"] + kept["execute_tail_s"] - 0.02 and kept["generate_s"] > 0


def test_a_streamed_pre_filter_judges_beside_the_steps(
    stack_generator, sandbox, stack_dirs, monkeypatch
) -> None:
    """The judging streamed, as on a GPU (forced here on the CPU): the job trains on the kept
    problems in its first epoch's order, each step reports how long its draw waited for verdicts,
    and `filter.json` ends with every verdict and the choice."""
    from crucible_trainer import tasks
    from crucible_trainer.methods import groups
    from crucible_trainer.online import prefilter
    from crucible_trainer.rl.context import ProblemSampler

    kept = {0, 2, 3}  # of the job's 5 problems (a random model solves none): as if sometimes solved
    monkeypatch.setattr(prefilter, "streams", lambda model: True)
    monkeypatch.setattr(
        groups, "worth_training", lambda members, keep: bool(members) and members[0].task_index in kept
    )
    spec = tiny_job(
        method={"name": "grpo", "group_size": 2, "filter": {"mode": "pre", "pre_samples": 2}},
        data={"dataset": "mbpp", "ids": [601, 602, 603, 604, 605]},
        rollout={"max_tokens": 16},
        optim={"steps": 3, "problems_per_step": 1},
        publish=NO_STALE_CHECK,
    )
    settings = settings_for(stack_generator, sandbox, stack_dirs)
    summary = train(spec, "streamed-it", settings)
    assert summary["status"] == "finished"
    assert summary["difficulty_filter"]["kept"] == 3 and summary["difficulty_filter"]["streamed"] is True
    sampler = ProblemSampler(list(range(5)), spec.seed)
    order = sampler.screen()
    sampler.judge({i: i in kept for i in range(5)})
    ids = [t.task_id for t in tasks.load_tasks(spec.data)]
    assert step_problems(Path(summary["run_dir"])) == [[ids[i] for i in sampler.draw(1)] for _ in range(3)]
    rows = [
        json.loads(line) for line in (Path(summary["run_dir"]) / "metrics.jsonl").read_text().splitlines()
    ]
    assert all(r["time/filter_wait_s"] >= 0 for r in rows if "eval_label" not in r)
    saved = json.loads((Path(summary["run_dir"]) / "filter.json").read_text())
    assert saved["order"] == order and {i for i, v in saved["verdicts"] if v} == kept
    assert saved["indices"] == [i for i in order if i in kept]


def test_a_policy_that_fails_to_load_fails_the_job_with_its_error(
    stack_generator, sandbox, stack_dirs, monkeypatch
) -> None:
    from crucible_trainer.online import train as train_module

    def make_policy(self):
        time.sleep(1.0)  # still loading when the job first asks for it
        raise RuntimeError("CUDA out of memory (test)")

    monkeypatch.setattr(train_module.TrainRun, "make_policy", make_policy)
    spec = tiny_job(**SHORT_STEPS, optim={"steps": 1, "problems_per_step": 1}, publish=NO_STALE_CHECK)
    with pytest.raises(RuntimeError, match=r"CUDA out of memory \(test\)"):
        train(spec, "load-fails-it", settings_for(stack_generator, sandbox, stack_dirs))


def test_a_job_failing_while_its_policy_loads_waits_for_the_load(
    stack_generator, sandbox, stack_dirs, monkeypatch
) -> None:
    """An error before the policy is needed (here the pre-filter's) is the job's error, and the
    job returns only after the load it started has ended (its thread cannot be stopped: a worker
    taking the next job would share the card with a model no one holds)."""
    import threading

    from crucible_trainer.online import train as train_module

    loading, loaded = threading.Event(), threading.Event()
    real_make = train_module.TrainRun.make_policy

    def make_policy(self):
        loading.set()
        time.sleep(2.0)
        policy = real_make(self)
        loaded.set()
        return policy

    async def prepare(self, ctx, start):
        await asyncio.to_thread(loading.wait, 60)
        raise ValueError("the pre-filter broke (test)")

    real_close = train_module.TrainRun.close_services
    at_close: list[bool] = []

    async def close_services(self):
        at_close.append(loaded.is_set())
        await real_close(self)

    monkeypatch.setattr(train_module.TrainRun, "make_policy", make_policy)
    monkeypatch.setattr(train_module.TrainRun, "_start_pre_filter", prepare)
    monkeypatch.setattr(train_module.TrainRun, "close_services", close_services)
    spec = tiny_job(**SHORT_STEPS, optim={"steps": 1, "problems_per_step": 1}, publish=NO_STALE_CHECK)
    with pytest.raises(ValueError, match=r"the pre-filter broke \(test\)"):
        train(spec, "fail-while-loading-it", settings_for(stack_generator, sandbox, stack_dirs))
    # Loaded before the job let go of its services (asyncio.run would wait for the thread
    # anyway; a worker's long-lived loop would not).
    assert at_close == [True]


def test_srrl_step_refines_failed_attempts(stack_generator, sandbox, stack_dirs) -> None:
    """How many refinements a step's failed first attempts get, not what they rescue: completions
    of 24 tokens (both rounds), as the lifecycle tests'."""
    spec = tiny_job(
        method={"name": "srrl", "c1": 2, "c2": 2, "budget": 6},
        rollout={"max_tokens": 24},
        optim={"steps": 1},
        reward={"kind": "fraction"},
        publish=NO_STALE_CHECK,
    )
    summary = train(spec, "srrl-it", settings_for(stack_generator, sandbox, stack_dirs))
    row = json.loads((Path(summary["run_dir"]) / "metrics.jsonl").read_text().splitlines()[0])
    assert 0 <= row["c2_rescue_rate"] <= 1
    # SmolLM2 fails these problems almost always: every failed first attempt got 2 refinements.
    assert row["refinements_per_problem"] > 0
    assert row["samples"] == 4 + row["refinements_per_problem"] * 2


def test_refinement_prompt_holds_actual_and_expected(sandbox) -> None:
    from crucible_shared.sandbox_client import SandboxClient
    from crucible_trainer import tasks

    task = tasks.load_tasks(tasks.DataSpec(dataset="mbpp", ids=[11]))[0]
    wrong = "def remove_Occ(s, ch):\n    return s.replace(ch, '')\n"

    async def run():
        async with SandboxClient(sandbox.url) as client:
            return await client.run(task.run_request(wrong))

    result = asyncio.run(run())
    messages = tasks.build_refinement_messages(task, wrong, result)
    text = "\n".join(m["content"] for m in messages)
    failing = next(t for t in result.tests if t.status == "failed")
    assert failing.actual and failing.expected
    assert f"Actual value: {failing.actual}" in text and f"Expected value: {failing.expected}" in text
    assert "<analysis>" in text and "<code>" in text and "s.replace(ch, '')" in text


def test_cancel_stops_a_running_job(stack_generator, sandbox, stack_dirs) -> None:
    from crucible_trainer.online.train import run_train_job
    from crucible_trainer.runtime.channel import LocalChannel

    async def go():
        channel = LocalChannel("cancel-it")
        job = asyncio.create_task(
            run_train_job(
                tiny_job(**SHORT_STEPS, optim={"steps": 50, "problems_per_step": 1}, publish=NO_STALE_CHECK),
                "cancel-it",
                settings_for(stack_generator, sandbox, stack_dirs),
                channel,
            )
        )
        metrics = stack_dirs["runs"] / "cancel-it" / "metrics.jsonl"
        while not metrics.exists():
            await asyncio.sleep(0.2)
            assert not job.done(), job
        channel.cancel()
        started = time.monotonic()
        summary = await asyncio.wait_for(job, 60)
        return summary, time.monotonic() - started

    summary, took = asyncio.run(go())
    assert summary["status"] == "cancelled"
    assert took < 30


def test_killed_job_resumes_exactly(stack_generator, sandbox, stack_dirs, tmp_path) -> None:
    """Killed after a checkpoint and resumed, a job trains on the same problems in the same order
    as one that never stopped (three problems, two per step: the order crosses epochs)."""
    spec = tiny_job(
        **SHORT_STEPS,
        data={"dataset": "mbpp", "ids": [601, 602, 603]},
        optim={"steps": 3},
        eval={"data": {"dataset": "mbpp", "ids": [11]}, "max_tokens": 16},
        publish=NO_STALE_CHECK,
    )
    spec_file = tmp_path / "spec.yaml"
    spec_file.write_text(yaml.safe_dump(spec.model_dump(mode="json")))
    runs = tmp_path / "runs"
    cmd = [
        sys.executable,
        "-m",
        "crucible_cli",
        "train",
        "--local",
        "-c",
        str(spec_file),
        "--job-id",
        "resume-it",
        "--generator",
        stack_generator.url,
        "--sandbox",
        sandbox.url,
        "--runs-dir",
        str(runs),
    ]
    env = {
        **os.environ,
        "WANDB_MODE": "disabled",
        "CRUCIBLE_TRAINER_ADAPTER_DIR": str(stack_dirs["adapters"]),
    }
    proc = subprocess.Popen(cmd, env=env, start_new_session=True)
    ckpt = runs / "resume-it" / "checkpoints"
    deadline = time.monotonic() + 600
    while not any(ckpt.glob("step-*")):
        assert proc.poll() is None, "the job ended before its first checkpoint"
        assert time.monotonic() < deadline
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    first = sorted(p.name for p in ckpt.glob("step-*"))
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    rows = [json.loads(line) for line in (runs / "resume-it" / "metrics.jsonl").read_text().splitlines()]
    resumed_from = int(first[-1].split("-")[1])
    steps = [r["step"] for r in rows if "eval_label" not in r]
    assert steps == [1, 2, 3], steps  # nothing redone, nothing skipped
    assert resumed_from < 3
    assert "resumed" in done.stderr + done.stdout
    # The comparison with the starting policy survives the kill.
    assert (runs / "resume-it" / "eval" / "before_after" / "comparison.md").exists()
    assert step_problems(runs / "resume-it") == uninterrupted_order(spec)


def uninterrupted_order(spec: TrainJob) -> list[list[str]]:
    """The problems each step of a job that never stopped trains on: its sampler from the start
    (what `online/train.py` builds), drawing `problems_per_step` a step."""
    from crucible_trainer import tasks
    from crucible_trainer.rl.context import ProblemSampler

    problems = tasks.load_tasks(spec.data)
    sampler = ProblemSampler(list(range(len(problems))), spec.seed)
    draws = [sampler.draw(spec.optim.problems_per_step) for _ in range(spec.optim.steps)]
    return [sorted({problems[i].task_id for i in draw}) for draw in draws]
