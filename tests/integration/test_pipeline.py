"""The offline pipeline and the SFT / DPO methods on CPU with the real SmolLM2 model, a spawned
generator and sandbox (and, once, the gateway and a worker): tiny counts throughout.

One SFT pipeline run (every stage) is shared by the tests that inspect it, re-run it, merge it,
reuse its candidates for DPO and start RL from its adapter.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import httpx
import pytest
from crucible_shared.jobs import PipelineJob, TrainJob
from safetensors.torch import load_file

from tests.integration.stack_fixtures import *  # noqa: F403

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
EASY = ROOT / "tests" / "fixtures" / "offline" / "easy.jsonl"  # tasks SmolLM2-135M often solves
STDIO = ROOT / "data" / "stdio" / "crucible_stdio.jsonl"


def pipeline_spec(**overrides) -> PipelineJob:
    spec = {
        "kind": "pipeline",
        "data": {"dataset": "jsonl", "path": str(EASY)},
        "generate": {"k": 4, "temperature": 0.8, "max_tokens": 48},
        "eval": {"data": {"dataset": "jsonl", "path": str(EASY), "ids": ["add", "square"]}, "max_tokens": 48},
        "train": {"name": "sft", "max_steps": 2},
        "optim": {"lr": 1e-3, "micro_batch": 2},
        "checkpoint": {"every": 1},
        "logging": {"wandb_mode": "disabled"},
        "seed": 0,
    }
    spec.update(overrides)
    return PipelineJob.model_validate(spec)


def settings_for(generator, sandbox, dirs):
    from crucible_trainer.settings import Settings

    return Settings(
        generator_urls=[generator.url],
        sandbox_url=sandbox.url,
        adapter_dir=dirs["adapters"],
        runs_dir=dirs["runs"],
        cancel_poll_s=0.5,
    )


def run_pipeline(spec: PipelineJob, job_id: str, settings) -> tuple[dict, list[tuple[str, dict]]]:
    """Run a pipeline job in this process (as `crucible pipeline --local` does); its events too."""
    from crucible_trainer.offline.pipeline import run_pipeline_job
    from crucible_trainer.runtime.channel import LocalChannel

    events: list[tuple[str, dict]] = []
    channel = LocalChannel(job_id, lambda kind, data: events.append((kind, data)))
    return asyncio.run(run_pipeline_job(spec, job_id, settings, channel)), events


def stage_status(events: list[tuple[str, dict]]) -> dict[str, str]:
    """The last status of every stage (started -> finished, or skipped)."""
    return {d["stage"]: d["status"] for kind, d in events if kind == "stage"}


def lora_b_norm(adapter: Path) -> float:
    weights = load_file(str(adapter / "adapter_model.safetensors"))
    return sum(float(t.float().norm()) for name, t in weights.items() if "lora_B" in name)


@pytest.fixture(scope="module")
def sft_run(stack_generator, sandbox, stack_dirs):
    settings = settings_for(stack_generator, sandbox, stack_dirs)
    started = time.monotonic()
    summary, events = run_pipeline(pipeline_spec(), "sft-it", settings)
    return {"summary": summary, "events": events, "settings": settings, "seconds": time.monotonic() - started}


def test_sft_pipeline_runs_every_stage(sft_run, stack_generator, stack_dirs) -> None:
    summary, events = sft_run["summary"], sft_run["events"]
    assert summary["status"] == "finished", summary
    run = Path(summary["run_dir"])
    keys = ["baseline", "round-1/generate", "round-1/annotate", "round-1/build", "round-1/train"]
    assert stage_status(events) == {k: "finished" for k in [*keys, "merge", "evaluate", "analyze"]}
    candidates = [json.loads(line) for line in (run / "round-1" / "candidates_annotated.jsonl").open()]
    assert len(candidates) == 4 * 4
    assert {"status", "passed", "tests_passed", "tests_total", "fraction", "message", "verdicts"} <= set(
        candidates[0]
    )
    manifest = json.loads((run / "round-1" / "manifest.json").read_text())
    assert manifest["counts"]["nbest"] == sum(1 for _ in (run / "round-1" / "nbest.jsonl").open()) > 0
    assert set(manifest["per_problem"]) == {"add", "square", "is_even", "max_of_two"}
    # Training: TRL's steps reached the job's metrics, checkpoints and the new adapter.
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "eval_label" not in r]
    assert [r["step"] for r in steps] == [1, 2] and all("loss" in r for r in steps)
    assert [d["step"] for k, d in events if k == "checkpoint"] == [1, 2]
    assert lora_b_norm(run / "round-1" / "adapter") > 0
    # Published to the generator when training ended (and unloaded when the job ended).
    published = [d["name"] for k, d in events if k == "adapter_published"]
    assert "sft-it-v1" in published
    assert (stack_dirs["adapters"] / "sft-it" / "v1" / "adapter_config.json").exists()
    served = {m["id"] for m in httpx.get(f"{stack_generator.url}/v1/models").json()["data"]}
    assert not any(name.startswith("sft-it-") for name in served)
    # Evaluation before and after, the comparison, the merged model, the analysis, the report.
    for path in (
        "eval/before/report.json",
        "eval/after/report.json",
        "eval/before_after/comparison.md",
        "eval/before_after/comparison.png",
        "merged/config.json",
        "merged/model.safetensors",
        "merged/generation_config.json",
        "merged/tokenizer_config.json",
        "analysis/analysis.json",
        "analysis/analysis.png",
        "report.md",
    ):
        assert (run / path).exists(), path
    assert summary["eval"]["after"]["problems"] == 2
    report = (run / "report.md").read_text()
    assert "round-1/train | ran" in report and "Candidate analysis" in report and "greedy pass@1" in report


def test_stages_are_skipped_until_their_inputs_change(sft_run) -> None:
    settings, run = sft_run["settings"], Path(sft_run["summary"]["run_dir"])
    adapter_mtime = (run / "round-1" / "adapter" / "adapter_model.safetensors").stat().st_mtime_ns
    started = time.monotonic()
    summary, events = run_pipeline(pipeline_spec(), "sft-it", settings)
    assert summary["status"] == "finished"
    assert set(stage_status(events).values()) == {"skipped"}
    assert time.monotonic() - started < sft_run["seconds"] / 2
    # Pairs change, nbest does not: build runs again, SFT (which reads nbest only) does not.
    summary, events = run_pipeline(pipeline_spec(build={"max_pairs": 1}), "sft-it", settings)
    status = stage_status(events)
    assert status["round-1/build"] == "finished"
    assert status["round-1/train"] == status["evaluate"] == status["merge"] == "skipped"
    assert (run / "round-1" / "adapter" / "adapter_model.safetensors").stat().st_mtime_ns == adapter_mtime
    # A deleted output makes its stage run again; `stages` runs a subset.
    import shutil

    shutil.rmtree(run / "merged")
    summary, events = run_pipeline(pipeline_spec(stages=["train", "merge"]), "sft-it", settings)
    assert stage_status(events) == {"round-1/train": "skipped", "merge": "finished"}
    assert (run / "merged" / "model.safetensors").exists()


def test_merged_model_equals_base_plus_adapter(sft_run) -> None:
    import torch
    from crucible_models import load_model
    from peft import PeftModel

    run = Path(sft_run["summary"]["run_dir"])
    merged, tokenizer = load_model(str(run / "merged"), device="cpu", dtype="float32")
    base, _ = load_model("smollm2-135m-instruct", device="cpu", dtype="float32")
    with torch.no_grad():
        plain = base(**tokenizer("def add(a, b):", return_tensors="pt")).logits
    adapted = PeftModel.from_pretrained(base, str(run / "round-1" / "adapter")).eval()
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Write a Python function add(a, b)."}],
        add_generation_prompt=True,
        return_tensors="pt",
    )
    ids = ids if isinstance(ids, torch.Tensor) else ids["input_ids"]
    with torch.no_grad():
        want, got = adapted(input_ids=ids).logits, merged(input_ids=ids).logits
        # Equal up to float32 rounding (the merged weight sums what the adapter adds at run time).
        assert torch.allclose(want, got, rtol=1e-4, atol=1e-3), float((want - got).abs().max())
        first = merged(**tokenizer("def add(a, b):", return_tensors="pt")).logits
        assert float((plain - first).abs().max()) > 1e-2  # the merge changed the weights
        kwargs = {"max_new_tokens": 12, "do_sample": False, "pad_token_id": tokenizer.eos_token_id}
        assert torch.equal(
            adapted.generate(input_ids=ids, **kwargs), merged.generate(input_ids=ids, **kwargs)
        )


def test_dpo_pipeline_reuses_the_candidates(sft_run) -> None:
    settings = sft_run["settings"]
    source = Path(sft_run["summary"]["run_dir"])
    before = (source / "pipeline.json").read_text()
    spec = pipeline_spec(
        reuse="sft-it",
        stages=["generate", "annotate", "build", "train"],
        train={"name": "dpo", "max_steps": 2, "beta": 0.2},
    )
    summary, events = run_pipeline(spec, "dpo-it", settings)
    assert summary["status"] == "finished", summary
    status = stage_status(events)
    assert status["round-1/generate"] == status["round-1/annotate"] == "skipped"  # reused, not sampled again
    assert status["round-1/build"] == status["round-1/train"] == "finished"
    run = Path(summary["run_dir"])
    pairs = [json.loads(line) for line in (run / "round-1" / "pairs.jsonl").open()]
    assert pairs and all(p["chosen_fraction"] > p["rejected_fraction"] for p in pairs)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and all("rewards/margins" in r for r in rows)
    assert lora_b_norm(run / "round-1" / "adapter") > 0
    assert (source / "pipeline.json").read_text() == before  # the reused run is left as it was


def test_second_round_samples_from_the_first_rounds_adapter(sft_run) -> None:
    """rounds: 2 -- round 2 samples from round 1's adapter, hot-swapped into the generator, and
    trains on top of it, its data kept apart in round-2/."""
    spec = pipeline_spec(reuse="sft-it", rounds=2, stages=["generate", "annotate", "build", "train"])
    summary, events = run_pipeline(spec, "rounds-it", sft_run["settings"])
    assert summary["status"] == "finished", summary
    status = stage_status(events)
    # Round 1 is reused (its build may run again: an earlier test rebuilt sft-it's pairs with
    # other settings; SFT reads nbest.jsonl, which comes out the same, so its training is skipped).
    assert [status[f"round-1/{s}"] for s in ("generate", "annotate", "train")] == ["skipped"] * 3
    assert [status[f"round-2/{s}"] for s in ("generate", "annotate", "build", "train")] == ["finished"] * 4
    run = Path(summary["run_dir"])
    sampled_by = {json.loads(line)["model"] for line in (run / "round-2" / "candidates.jsonl").open()}
    assert sampled_by == {"rounds-it-v1"}
    assert [d["name"] for k, d in events if k == "adapter_published"] == ["rounds-it-v1", "rounds-it-v2"]
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == [3, 4]  # counted on from round 1's two steps
    assert lora_b_norm(run / "round-2" / "adapter") != lora_b_norm(run / "round-1" / "adapter")


def test_standalone_sft_job_cancels_mid_training_and_resumes(
    stack_generator, sandbox, stack_dirs, tmp_path, monkeypatch
) -> None:
    from crucible_trainer.runtime.channel import LocalChannel
    from crucible_trainer.runtime.entry import execute

    monkeypatch.setenv("CRUCIBLE_DATA_ROOTS", str(tmp_path))
    rows = tmp_path / "rows.jsonl"
    rows.write_text(
        "".join(
            json.dumps({"prompt": f"# add {i} to x\ndef add{i}(x):\n", "completion": f"    return x + {i}\n"})
            + "\n"
            for i in range(4)
        )
    )
    spec = TrainJob.model_validate(
        {
            "kind": "train",
            "method": {"name": "sft", "path": str(rows), "max_steps": 6},
            "model": {"chat": False},
            "optim": {"lr": 1e-3, "micro_batch": 1},
            "eval": None,
            "checkpoint": {"every": 1},
            "logging": {"wandb_mode": "disabled"},
        }
    )
    settings = settings_for(stack_generator, sandbox, stack_dirs).model_copy(update={"cancel_poll_s": 0.05})
    run = stack_dirs["runs"] / "sft-cancel"
    events: list[tuple[str, dict]] = []

    class CancelAfterFirstCheckpoint(LocalChannel):
        """Asks to stop as soon as a checkpoint exists: mid-training, whatever the machine's speed."""

        def cancel_requested(self) -> bool:
            return any((run / "trainer").glob("checkpoint-*"))

    channel = CancelAfterFirstCheckpoint("sft-cancel", lambda kind, data: events.append((kind, data)))
    summary = execute(spec, "sft-cancel", settings, channel)  # the runner registry sends sft offline
    assert summary["status"] == "cancelled"
    stopped_at = max(d["step"] for k, d in events if k == "checkpoint")
    assert stopped_at < 6 and not (run / "adapter").exists()

    events.clear()
    summary = execute(
        spec, "sft-cancel", settings, LocalChannel("sft-cancel", lambda k, d: events.append((k, d)))
    )
    assert summary["status"] == "finished" and summary["steps"] == 6
    assert [d["step"] for k, d in events if k == "resumed"] == [stopped_at]
    logged = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert logged == [1, 2, 3, 4, 5, 6]  # nothing trained twice, nothing skipped
    assert lora_b_norm(run / "adapter") > 0


def test_stdio_problems_go_through_annotate(stack_generator, sandbox, stack_dirs) -> None:
    from crucible_shared.sandbox_client import SandboxClient
    from crucible_trainer import tasks

    problems = tasks.load_tasks(tasks.DataSpec(dataset="stdio", path=str(STDIO)))
    assert len(problems) >= 20

    async def references():
        async with SandboxClient(sandbox.url) as client:
            return await client.run_batch([t.reference_request() for t in problems])

    verdicts = asyncio.run(references())
    assert [
        (t.task_id, r.status.value) for t, r in zip(problems, verdicts, strict=True) if r.status != "passed"
    ] == []

    spec = pipeline_spec(
        stages=["generate", "annotate"],
        data={"dataset": "stdio", "path": str(STDIO), "ids": ["crucible-stdio/1", "crucible-stdio/9"]},
        generate={"k": 2, "max_tokens": 48},
    )
    summary, _ = run_pipeline(spec, "stdio-it", settings_for(stack_generator, sandbox, stack_dirs))
    assert summary["status"] == "finished", summary
    rows = [
        json.loads(line)
        for line in (Path(summary["run_dir"]) / "round-1" / "candidates_annotated.jsonl").open()
    ]
    cases = {t.task_id: len(t.tests.cases) for t in problems}
    assert len(rows) == 4
    for row in rows:
        assert row["status"] == "no_code" or row["tests_total"] == cases[row["task_id"]] == len(
            row["verdicts"]
        )
        assert row["status"] != "sandbox_error"


def test_rl_from_an_sft_adapter_keeps_that_adapter_as_kl_reference(sft_run) -> None:
    """GRPO from `model.init_adapter` with kl_beta > 0: the reference log-probs are the init
    adapter's, not the base model's, before and after the policy moves."""
    from crucible_shared.jobs import ModelSpec, OptimSpec
    from crucible_trainer.rl.policy import Policy
    from crucible_trainer.rl.rollout import Sample
    from crucible_trainer.rl.update import UpdateConfig, update

    adapter = Path(sft_run["summary"]["run_dir"]) / "round-1" / "adapter"
    policy = Policy(ModelSpec(init_adapter=str(adapter), device="cpu"), OptimSpec(lr=5e-3), seed=0)
    tok = policy.tokenizer
    prompts = [tok("def add(a, b):")["input_ids"], tok("def square(x):")["input_ids"]]
    comps = [tok("\n    return a + b")["input_ids"], tok("\n    return x * x")["input_ids"]]
    init = policy.score(prompts, comps)
    reference = policy.score(prompts, comps, reference=True)
    with policy.model.disable_adapter():
        base = policy.score(prompts, comps)
    flat = lambda rows: [x for r in rows for x in r]  # noqa: E731
    assert max(abs(a - b) for a, b in zip(flat(init), flat(reference), strict=True)) < 1e-5
    assert max(abs(a - b) for a, b in zip(flat(init), flat(base), strict=True)) > 1e-3

    samples = [
        Sample(i, i, p, c, "", "", None, "stop", reward=1.0, advantage=adv)
        for i, (p, c, adv) in enumerate(zip(prompts, comps, (1.0, -1.0), strict=True))
    ]
    metrics = update(policy, samples, UpdateConfig(kl_beta=0.5, micro_batch=2), seed=0)
    assert abs(metrics["kl"]) < 1e-5  # the starting policy is its own reference: no KL yet
    moved = policy.score(prompts, comps)
    assert max(abs(a - b) for a, b in zip(flat(moved), flat(init), strict=True)) > 1e-4
    still = policy.score(prompts, comps, reference=True)
    assert max(abs(a - b) for a, b in zip(flat(still), flat(init), strict=True)) < 1e-5


def test_pipeline_job_through_the_gateway(gateway, workers) -> None:
    from crucible_shared.gateway_client import GatewayClient

    workers.start()
    client = GatewayClient(gateway.url, timeout=120)
    spec = pipeline_spec(
        stages=["generate"],
        data={"dataset": "jsonl", "path": str(EASY), "ids": ["add"]},
        generate={"k": 1, "max_tokens": 16},
    )
    created = client.submit(spec.model_dump(mode="json"))
    events = list(client.events(created.id, timeout=900))
    assert events[-1][1] == "end" and events[-1][2]["status"] == "finished", events[-3:]
    job = client.job(created.id)
    assert (
        job.kind == "pipeline" and job.summary and job.summary.stages["round-1/generate"]["status"] == "ran"
    )
    files = {a.path for a in client.artifacts(created.id).artifacts}
    assert {"round-1/candidates.jsonl", "pipeline.json", "report.md"} <= files
