"""An overlapped GRPO run (max_staleness 1) on CPU with the real SmolLM2 model, a spawned generator
and sandbox: every sample's version, behaviour log-probs and importance weights are checked against
the published adapters scored by a policy of the test's own, and a resumed run consumes the same
problems in the same order."""

from __future__ import annotations

import copy
import json
import math
import shutil
from pathlib import Path

import pytest
from crucible_shared.jobs import OptimSpec

from tests.integration.test_trainer import settings_for, step_problems, tiny_job, train

pytestmark = pytest.mark.slow

STALE_TOLERANCE = 0.05  # the stale-policy check's default: mean |log-prob difference| per token
CAP = 2.0


def _versions_scorer(spec, adapters: Path):
    """score(version, prompt_ids, completion_ids) -> per-token log-probs of that published version."""
    from crucible_trainer.rl.policy import Policy
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    policy = Policy(spec.model, OptimSpec(), 0)
    policy.model.eval()
    loaded: list[int | None] = [None]

    def score(version: int, prompt: list[int], completion: list[int]) -> list[float]:
        if version == 0:  # the base model: the adapter disabled
            return policy.score([prompt], [completion], reference=True)[0]
        if loaded[0] != version:
            weights = load_file(str(adapters / f"v{version}" / "adapter_model.safetensors"))
            set_peft_model_state_dict(policy.model, weights)
            loaded[0] = version
        return policy.score([prompt], [completion])[0]

    return score


def test_overlapped_run_samples_are_claimed_scored_and_weighted(
    stack_generator, sandbox, stack_dirs, monkeypatch
) -> None:
    from crucible_trainer.online import train as train_module

    trained: dict[int, list] = {}  # step -> its samples, as the update left them
    real_update = train_module.update  # what TrainRun.update_policy runs (one process)

    def spying_update(policy, samples, cfg, seed=0):
        out = real_update(policy, samples, cfg, seed)
        assert cfg.tis_cap == CAP
        trained[seed - spec.seed] = copy.deepcopy(samples)
        return out

    monkeypatch.setattr(train_module, "update", spying_update)
    spec = tiny_job(
        data={"dataset": "mbpp", "ids": [601, 602, 603]},
        rollout={"max_tokens": 48},  # this test runs four jobs' worth of model: keep them short
        optim={"steps": 3, "lr": 3e-3},
        publish={"staleness_window": 0},  # only versions in use stay loaded
        overlap={"max_staleness": 1, "cap": CAP},
    )
    settings = settings_for(stack_generator, sandbox, stack_dirs)
    summary = train(spec, "overlap-it", settings)
    assert summary["status"] == "finished"
    run_dir = Path(summary["run_dir"])
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    # Step 2's rollouts ran from v0 while step 1 updated; step 3's from v1 while step 2 did.
    want_versions = {1: 0, 2: 0, 3: 1}
    for r in rows:
        assert r["overlap/staleness_max"] == float(r["step"] - 1 - want_versions[r["step"]])
        assert r["stale/diff"] <= STALE_TOLERANCE  # each version checked as it was published
        assert "time/rollout_wait_s" in r and r["policy_version"] == r["step"]
    assert summary["stale_check_start"]["stale/diff"] <= STALE_TOLERANCE
    assert sorted(trained) == [1, 2, 3]
    for step, samples in trained.items():
        assert {s.version for s in samples} == {want_versions[step]}, step
    rollout_versions = {
        int(p.stem.split("-")[1]): {json.loads(x)["version"] for x in p.read_text().splitlines()}
        for p in (run_dir / "rollouts").glob("step-*.jsonl")
    }
    assert rollout_versions == {step: {v} for step, v in want_versions.items()}

    # Behaviour log-probs are those of the claimed version; the weights are min(exp(old - behaviour),
    # cap) with `old` the version the update started from (step - 1).
    score = _versions_scorer(spec, stack_dirs["adapters"] / "overlap-it")
    weighted = 0
    for step, samples in sorted(trained.items()):
        for s in samples:
            if not s.completion_ids:
                continue
            behaviour = score(s.version, s.prompt_ids, s.completion_ids)
            assert len(s.gen_logprobs) == len(s.completion_ids)
            diff = sum(abs(a - b) for a, b in zip(behaviour, s.gen_logprobs, strict=True)) / len(behaviour)
            assert diff <= STALE_TOLERANCE, (step, s.version, diff)
            if abs(s.advantage) <= 1e-8:  # never run through the model, never weighted
                assert s.is_weights is None
                continue
            old = score(step - 1, s.prompt_ids, s.completion_ids)
            want = [min(math.exp(o - g), CAP) for o, g in zip(old, s.gen_logprobs, strict=True)]
            assert s.is_weights == pytest.approx(want, rel=2e-3, abs=2e-3), step
            weighted += 1
    assert weighted > 0, "no sample was trained: no group had a learning signal"
    trained_rows = [r for r in rows if r["update/sequences"] > 0]
    for r in trained_rows:
        assert 0 < r["tis/weight_mean"] <= CAP and r["tis/weight_max"] <= CAP
        assert 0 <= r["tis/truncated_fraction"] <= 1
    # Every version the run published is unloaded once it is over.
    import httpx

    served = {m["id"] for m in httpx.get(f"{stack_generator.url}/v1/models").json()["data"]}
    assert not {n for n in served if n.startswith("overlap-it-")}

    # Resumed from step 2's checkpoint, step 3 trains on the problems the uninterrupted run gave it
    # (three problems, two per step: step 3's draw crosses an epoch, and was drawn ahead before
    # step 2's checkpoint was written).
    resumed = stack_dirs["runs"] / "overlap-resumed"
    shutil.copytree(run_dir, resumed)
    shutil.rmtree(resumed / "checkpoints" / "step-000003")
    shutil.copytree(stack_dirs["adapters"] / "overlap-it", stack_dirs["adapters"] / "overlap-resumed")
    again = train(spec, "overlap-resumed", settings)
    assert again["status"] == "finished"
    assert step_problems(resumed) == step_problems(run_dir)
    assert [json.loads(x)["step"] for x in (resumed / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3]
