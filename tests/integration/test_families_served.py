"""Every model family served over HTTP, trained and evaluated, on its tiny random checkpoint.

Per family, the generator's real app serves the checkpoint directory with the fast path on (from a
thread of this process: the same routes over real HTTP, without a Python start-up per family), and:

* a greedy `/v1/completions` answer and one with a rank-8 all-linear LoRA adapter loaded through
  `/v1/load_lora_adapter` equal transformers' (PEFT's) greedy `generate` on the same directory;
* a one-step GRPO job with `model.base` set to the directory trains, publishes its adapter to the
  generator under a new name, and passes the stale-policy check (the trainer's log-probs equal the
  generator's within the job's tolerance) on the base and on the published version;
* an evaluation of two MBPP tasks completes (random weights write garbage; it must not crash).

Gemma-2, which did not start before (transformers refuses SDPA for it), is also served by a spawned
`python -m crucible_generator` with the default settings (`FAST_DECODE=auto`: off on a CPU).
In-process engine checks of every family: tests/unit/test_families.py.
"""

from __future__ import annotations

import asyncio
import json
import math

import httpx
import pytest
from crucible_shared.jobs import TrainJob

from tests.families import FAMILIES, PROMPTS, hf_greedy, hf_model
from tests.servers import generator_in_thread, spawn

pytestmark = pytest.mark.slow

TOKENS = 12


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def served(request, family_checkpoints, tmp_path_factory):
    path = family_checkpoints.get(request.param)
    settings = {"model": str(path), "device": "cpu", "fast_decode": "on", "max_batch_size": 8, "max_loras": 4}
    settings["adapter_roots"] = [tmp_path_factory.getbasetemp()]  # family_checkpoints' adapters
    with generator_in_thread(**settings, batch_wait_ms=20) as url:
        yield request.param, path, url


def complete(url: str, model: str, prompt: str) -> dict:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]


def test_served_greedy_answers_equal_transformers_base_and_adapter(served, family_checkpoints):
    name, path, url = served
    adapter = family_checkpoints.adapter(name, 1)
    loaded = httpx.post(
        f"{url}/v1/load_lora_adapter", json={"lora_name": f"{name}-v1", "lora_path": adapter}, timeout=120
    )
    assert loaded.status_code == 200, loaded.text
    try:
        for model, reference in ((str(path), hf_model(path)), (f"{name}-v1", hf_model(path, adapter))):
            for prompt in PROMPTS[:2]:
                choice = complete(url, model, prompt)
                want = hf_greedy(reference, choice["prompt_token_ids"], TOKENS)
                assert choice["token_ids"] == want, f"{name} as {model}: {prompt!r}"
    finally:
        httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": f"{name}-v1"}, timeout=60)


def test_a_grpo_step_trains_publishes_and_passes_the_stale_policy_check(
    served, sandbox, family_checkpoints, tmp_path, monkeypatch
):
    from crucible_trainer.online.train import run_train_job
    from crucible_trainer.runtime.channel import LocalChannel
    from crucible_trainer.settings import Settings

    name, path, url = served
    monkeypatch.setenv("CRUCIBLE_MODEL_ROOTS", str(path.parent))
    monkeypatch.setenv("CRUCIBLE_ADAPTER_ROOTS", str(path.parent))
    # Random weights earn every answer the same reward: no advantage, no gradient. Starting from a
    # random adapter (published as v0 before the first rollout) and a KL term, the step still runs
    # the update's forward and backward passes, and both stale-policy checks compare a real adapter.
    spec = TrainJob.model_validate(
        {
            "kind": "train",
            "model": {
                "base": str(path),
                "dtype": "float32",
                "init_adapter": family_checkpoints.adapter(name, 1),
            },
            "method": {"name": "grpo", "group_size": 2, "kl_beta": 0.05},
            "data": {"dataset": "mbpp", "ids": [601]},
            "rollout": {"max_tokens": 16, "temperature": 1.0},
            "optim": {"lr": 1e-2, "steps": 1, "problems_per_step": 1, "micro_batch": 4},
            "eval": None,
            "logging": {"wandb_mode": "disabled"},
            "seed": 3,
        }
    )
    runs = tmp_path / "runs"
    settings = Settings(
        generator_urls=[url], sandbox_url=sandbox.url, adapter_dir=tmp_path / "adapters", runs_dir=runs
    )
    summary = asyncio.run(run_train_job(spec, f"{name}-grpo", settings, LocalChannel(f"{name}-grpo")))
    assert summary["status"] == "finished", summary
    assert summary["model_name"] == f"{name}-grpo-v1"  # published under a new name, hot-swapped in
    final = summary["stale_check"]  # the generator serving v1 against the trainer's policy
    assert final["stale/diff"] <= spec.publish.stale_tolerance, final
    step = json.loads((runs / f"{name}-grpo" / "metrics.jsonl").read_text().splitlines()[0])
    assert step["stale/diff"] <= spec.publish.stale_tolerance, step  # v0, before the rollouts
    assert step["update/sequences"] == 2 and math.isfinite(step["loss"]), step
    expected = "eager" if name in ("gemma2", "gpt-oss") else "sdpa"  # no SDPA in transformers
    assert summary["settings"]["attn_implementation"] == expected


def test_a_small_evaluation_completes(served, sandbox):
    from crucible_shared.generator_client import GeneratorClient
    from crucible_shared.sandbox_client import SandboxClient
    from crucible_trainer.evaluation import EvalConfig, evaluate
    from crucible_trainer.tasks import DataSpec, load_tasks

    _, _, url = served

    async def run():
        tasks = load_tasks(DataSpec(ids=[11, 17]))
        async with GeneratorClient(url) as generator, SandboxClient(sandbox.url) as box:
            return await evaluate(tasks, generator, box, EvalConfig(n=1, ks=[1], max_tokens=24))

    report = asyncio.run(run())
    assert [p.task_id for p in report.problems] == ["MBPP/11", "MBPP/17"]
    assert all(p.greedy is not None and p.greedy.tokens > 0 for p in report.problems)
    assert report.dropped == 0 and report.greedy_pass_at_1 is not None


def test_gemma2_starts_as_a_spawned_generator(family_checkpoints):
    path = family_checkpoints.get("gemma2")
    env = {"CRUCIBLE_GENERATOR_MODEL": str(path), "CRUCIBLE_GENERATOR_DEVICE": "cpu"}
    with spawn("crucible_generator", env, "CRUCIBLE_GENERATOR_PORT", timeout=300) as service:
        choice = complete(service.url, str(path), PROMPTS[0])
    assert choice["token_ids"] == hf_greedy(hf_model(path), choice["prompt_token_ids"], TOKENS)
