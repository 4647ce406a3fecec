"""Rollouts overlapping the update: the spec section, the truncated-importance-sampling loss
against a transliteration of TRL's formula, the schedule of the background collection (bounded
staleness, problems in order, the sampler state each checkpoint saves), the version claims and the
versions kept loaded for rollouts in flight."""

from __future__ import annotations

import asyncio
import itertools
import math
from pathlib import Path

import pytest
import torch
from crucible_shared.http import error_field
from crucible_shared.jobs import TrainJob
from crucible_trainer.rl.ahead import Ahead, Versions, check_claims
from crucible_trainer.rl.batch import make_batch
from crucible_trainer.rl.context import ProblemSampler
from crucible_trainer.rl.correction import Correction, MissingBehaviourLogprobs, tis_weights
from crucible_trainer.rl.publish import Publisher, StalePolicyError
from crucible_trainer.rl.rollout import Sample, Timing
from crucible_trainer.rl.update import UpdateConfig, update
from pydantic import ValidationError

from tests.unit.test_grpo_normaliser import GradientRecorder
from tests.unit.test_grpo_normaliser import batch as normaliser_batch

# --- the spec ------------------------------------------------------------------------------------


def _job(**overrides) -> TrainJob:
    spec = {"kind": "train", "method": {"name": "grpo"}, **overrides}
    return TrainJob.model_validate(spec)


def _refused(**overrides) -> tuple[str, str]:
    with pytest.raises(ValidationError) as caught:
        _job(**overrides)
    error = caught.value.errors()[0]
    return error_field(error), error["msg"]


def test_overlap_is_off_by_default_and_on_for_group_methods() -> None:
    assert _job().overlap.max_staleness == 0
    for method in ({"name": "grpo"}, {"name": "srrl"}):
        job = _job(method=method, overlap={"max_staleness": 2, "cap": 3.0})
        assert (job.overlap.max_staleness, job.overlap.correction, job.overlap.cap) == (2, "tis", 3.0)
    # A queued job is dumped with its defaults and parsed again.
    job = _job(overlap={"max_staleness": 1})
    assert TrainJob.model_validate(job.model_dump(mode="json")) == job


@pytest.mark.parametrize(
    "method",
    [
        {"name": "reinforce"},
        {"name": "ppo"},
        {"name": "spiral"},
        {"name": "sft", "path": "x.jsonl"},
        {"name": "dpo", "path": "x.jsonl"},
    ],
)
def test_methods_without_groups_refuse_overlap(method) -> None:
    overrides: dict = {"method": method, "overlap": {"max_staleness": 1}}
    field, message = _refused(**overrides)
    assert field == "overlap.max_staleness"
    assert f"method {method['name']} does not sample groups" in message and "grpo, srrl" in message


def test_overlap_needs_a_version_per_update_and_a_lag_to_correct() -> None:
    field, message = _refused(overlap={"max_staleness": 1}, publish={"every": 2})
    assert field == "overlap.max_staleness" and "publish.every" in message
    field, message = _refused(overlap={"cap": 4.0})
    assert field == "overlap.cap" and "max_staleness is 0" in message
    field, _ = _refused(overlap={"max_staleness": 9})
    assert field == "overlap.max_staleness"
    field, _ = _refused(overlap={"max_staleness": 1, "cap": 0.5})
    assert field == "overlap.cap"


# --- the loss ------------------------------------------------------------------------------------


def _with_behaviour(samples: list[Sample], shift: dict[int, list[float]]) -> list[Sample]:
    """Each sample's behaviour log-probs: the tiny policy's own plus `shift[i]` per token."""
    scorer = GradientRecorder()
    scores = scorer.score([s.prompt_ids for s in samples], [s.completion_ids for s in samples])
    for i, (s, lp) in enumerate(zip(samples, scores, strict=True)):
        d = shift.get(i, [0.0] * len(lp))
        s.gen_logprobs = [a + b for a, b in zip(lp, d, strict=True)]
    return samples


def _trl_tis_gradient(samples: list[Sample], cap: float, clip_eps: float = 0.2) -> torch.Tensor:
    """TRL's `dapo` loss with `vllm_importance_sampling_correction` (token level, truncated at
    `vllm_importance_sampling_cap`): per-token loss times min(exp(old - sampling), cap), summed
    over the batch's tokens / the batch's tokens (one optimizer step)."""
    policy = GradientRecorder()
    total_tokens = sum(len(s.completion_ids) for s in samples)
    terms = []
    for s in samples:
        b = make_batch([s.prompt_ids], [s.completion_ids], 0, "cpu")
        logp = policy.token_logprobs(b)[0]
        for t in range(len(s.completion_ids)):
            ratio = torch.exp(logp[t] - logp[t].detach())
            clipped = torch.clamp(ratio, 1 - clip_eps, 1 + clip_eps)
            per_token = -torch.minimum(ratio * s.advantage, clipped * s.advantage)
            assert s.gen_logprobs is not None
            weight = min(math.exp(float(logp[t].detach()) - s.gen_logprobs[t]), cap)
            terms.append(per_token * weight)
    (torch.stack(terms).sum() / total_tokens).backward()
    assert policy.table.grad is not None
    return policy.table.grad.detach().clone()


def test_tis_gradient_is_trls_with_truncation() -> None:
    # Sample 0: behaviour less likely than the trainer (weight e^0.25, one truncated at cap 1.5);
    # sample 1: more likely (weight e^-0.3); sample 2 on-policy.
    shift = {0: [-0.25, -2.0, 0.0], 1: [0.3, 0.3, 0.3, 0.3, 0.3]}
    samples = _with_behaviour(normaliser_batch()[:4], {0: shift[0], 2: shift[1]})
    policy = GradientRecorder()
    metrics = update(policy, samples, UpdateConfig(aggregation="token", micro_batch=2, tis_cap=1.5))
    want = _trl_tis_gradient(samples, cap=1.5)
    torch.testing.assert_close(policy.steps[0], want, rtol=1e-5, atol=1e-7)
    weights = samples[0].is_weights
    assert weights is not None
    assert weights == pytest.approx([math.exp(0.25), 1.5, 1.0], rel=1e-5)
    assert samples[2].is_weights == pytest.approx([math.exp(-0.3)] * 5, rel=1e-5)
    assert samples[1].is_weights == pytest.approx([1.0], rel=1e-5)
    tokens = sum(len(s.completion_ids) for s in samples)  # 11 tokens, one truncated
    assert metrics["tis/tokens"] == tokens
    assert metrics["tis/truncated_fraction"] == pytest.approx(1 / tokens)
    assert metrics["tis/weight_max"] == pytest.approx(1.5)
    mean = (math.exp(0.25) + 1.5 + 1.0 + 5 * math.exp(-0.3) + 1.0 + 2.0) / tokens
    assert metrics["tis/weight_mean"] == pytest.approx(mean, rel=1e-5)
    assert samples[0].info["is_weight_max"] == pytest.approx(1.5)


def test_staleness_zero_is_todays_loss_exactly() -> None:
    # Off (max_staleness 0, the default): no correction at all, today's update bit for bit.
    samples = normaliser_batch()
    today, off = GradientRecorder(), GradientRecorder()
    a = update(today, samples, UpdateConfig(aggregation="token", micro_batch=2))
    b = update(off, samples, UpdateConfig(aggregation="token", micro_batch=2, tis_cap=None))
    figures = [{k: v for k, v in m.items() if not k.startswith("time/")} for m in (a, b)]  # wall times differ
    assert torch.equal(today.steps[0], off.steps[0]) and figures[0] == figures[1]
    assert not any(k.startswith("tis/") for k in a)
    # On, with samples the current policy produced exactly: every weight is 1, same gradient.
    exact = _with_behaviour(normaliser_batch(), {})
    corrected = GradientRecorder()
    c = update(corrected, exact, UpdateConfig(aggregation="token", micro_batch=2, tis_cap=2.0))
    torch.testing.assert_close(corrected.steps[0], today.steps[0], rtol=0, atol=1e-7)
    assert c["loss"] == pytest.approx(a["loss"], abs=1e-7)
    assert c["tis/weight_mean"] == pytest.approx(1.0) and c["tis/truncated_fraction"] == 0.0


def test_a_floored_behaviour_logprob_gives_the_cap_not_inf() -> None:
    old = torch.tensor([[-1.0, -2.0]])
    weights, truncated = tis_weights(old, torch.tensor([[-9999.0, -2.0]]), torch.ones(1, 2), cap=2.0)
    assert weights.tolist() == [[2.0, 1.0]] and truncated.tolist() == [[True, False]]


def test_a_pass_run_again_counts_its_samples_once_in_the_tis_figures() -> None:
    # A step whose pass ran out of memory, or whose gradient was not finite, runs its micro-batches
    # again with `record` on: the figures are the samples', each once.
    def sample(behaviour: list[float]) -> Sample:
        return Sample(0, 0, [1], [2] * len(behaviour), "", "", behaviour, None, reward=1.0)

    first, second = sample([-1.0, -9.0]), sample([-0.5])
    old = torch.tensor([[-1.0, -2.0], [0.0, -0.5]])
    mask = torch.tensor([[1.0, 1.0], [0.0, 1.0]])
    once, twice = Correction(cap=2.0), Correction(cap=2.0)
    once.weights(old, [first, second], mask, 2, record=True)
    for _ in range(2):
        twice.weights(old, [first, second], mask, 2, record=True)
    assert twice.metrics() == once.metrics()
    assert once.metrics() == {
        "tis/weight_mean": (1.0 + 2.0 + 1.0) / 3,  # the second token of `first` truncated at the cap
        "tis/weight_max": 2.0,
        "tis/truncated_fraction": 1 / 3,
        "tis/tokens": 3.0,
    }


def test_a_sample_without_behaviour_logprobs_is_refused() -> None:
    samples = normaliser_batch()[:4]
    with pytest.raises(MissingBehaviourLogprobs, match="has none behaviour log-probs"):
        update(GradientRecorder(), samples, UpdateConfig(micro_batch=2, tis_cap=2.0))


# --- the schedule --------------------------------------------------------------------------------


class FakePool:
    """What Publisher calls on the generators, recorded."""

    def __init__(self) -> None:
        self.loaded: set[str] = set()
        self.log: list[str] = []

    async def load_adapter(self, name: str, path: str) -> None:
        self.loaded.add(name)
        self.log.append(f"load {name}")

    async def unload_adapter(self, name: str, missing_ok: bool = False) -> None:
        self.loaded.discard(name)
        self.log.append(f"unload {name}")


class FakePolicy:
    def save_adapter(self, path):
        return path

    async def call(self, fn, *args):
        return fn(*args)


def test_a_version_in_use_stays_loaded_until_its_rollout_ends(tmp_path) -> None:
    async def go() -> list[str]:
        pool = FakePool()
        pub = Publisher(pool, tmp_path, "job", window=0, base_name="base")  # type: ignore[arg-type]
        await pub.publish(FakePolicy(), 1)  # type: ignore[arg-type]
        pub.pin("job-v1")
        await pub.publish(FakePolicy(), 2)  # type: ignore[arg-type]
        assert pool.loaded == {"job-v1", "job-v2"}  # window 0, but a rollout samples from v1
        await pub.release("job-v1")
        assert pool.loaded == {"job-v2"}
        await pub.publish(FakePolicy(), 3)  # type: ignore[arg-type]
        return pool.log

    assert asyncio.run(go()) == [
        "load job-v1",
        "load job-v2",
        "unload job-v1",
        "load job-v3",
        "unload job-v2",
    ]


def _sample(version: int) -> Sample:
    return Sample(0, 0, [1], [2], "", "", [-0.1], None, reward=1.0, version=version)


def test_claims_outside_the_bound_or_unchecked_are_refused() -> None:
    figures = check_claims([_sample(2), _sample(1)], step=3, max_staleness=1, checked={1, 2})
    assert figures == {
        "overlap/staleness_mean": 0.5,
        "overlap/staleness_max": 1.0,
        "overlap/version_min": 1.0,
    }
    with pytest.raises(StalePolicyError, match="claims version 0"):
        check_claims([_sample(0)], step=3, max_staleness=1, checked=None)
    with pytest.raises(StalePolicyError, match="claims version 3"):
        check_claims([_sample(3)], step=3, max_staleness=1, checked=None)
    with pytest.raises(StalePolicyError, match="never passed"):
        check_claims([_sample(1)], step=3, max_staleness=1, checked={2})


def _run_schedule(max_staleness: int, steps: int, update_s: float, rollout_s: float):
    """A fake loop: each update takes `update_s`, each collection `rollout_s`; returns each step's
    (version, problems, sampler state) and the order things started in."""

    async def go():
        sampler = ProblemSampler(list(range(5)), seed=3)
        pool = FakePool()
        pub = Publisher(pool, Path("/nonexistent"), "j", window=0, base_name="base")  # type: ignore[arg-type]
        versions = Versions(0, "base")
        log: list[str] = []

        async def collect(step: int, version: int, name: str):
            log.append(f"collect {step} from v{version}")
            assert name in ("base", f"j-v{version}") and (name == "base" or name in pool.loaded)
            batch = sampler.draw(2)
            await asyncio.sleep(rollout_s)
            return [_sample(version)], {"problems": batch}, Timing()

        ahead = Ahead(collect, sampler, pub, versions, 1, steps, max_staleness)
        ahead.start()
        out = []
        for step in range(1, steps + 1):
            got = await ahead.next()
            assert got.step == step
            log.append(f"update {step}")
            await asyncio.sleep(update_s)
            await pub.publish(FakePolicy(), step)  # type: ignore[arg-type]
            await versions.advance(step, f"j-v{step}")
            out.append((got.version, got.metrics["problems"], got.sampler_state))
        await ahead.close()
        return out, log, pool

    return asyncio.run(go())


def test_the_next_rollouts_run_during_the_update_within_the_bound() -> None:
    out, log, pool = _run_schedule(max_staleness=1, steps=4, update_s=0.05, rollout_s=0.02)
    # Step 2 is collected from v0 while step 1 updates; step j from v(j-2) after that.
    assert [v for v, _, _ in out] == [0, 0, 1, 2]
    assert log.index("collect 2 from v0") < log.index("update 1")
    # Synchronous: one after the other, each step from the version before it.
    sync, sync_log, _ = _run_schedule(max_staleness=0, steps=4, update_s=0.01, rollout_s=0.01)
    assert [v for v, _, _ in sync] == [0, 1, 2, 3]
    assert sync_log == [
        x for step in range(1, 5) for x in (f"collect {step} from v{step - 1}", f"update {step}")
    ]
    # The same problems in the same order, and the state each checkpoint saves is the sampler's
    # right after that step's draw: a sampler restored from it draws the next step's problems.
    assert [p for _, p, _ in out] == [p for _, p, _ in sync]
    for (_, _, state), (_, problems, _) in itertools.pairwise(out):
        restored = ProblemSampler([], seed=0)
        restored.load(state)
        assert restored.draw(2) == problems
    assert pool.loaded == {"j-v4"}  # the old versions were unloaded once their rollouts ended


def test_a_failed_collection_fails_the_step() -> None:
    async def go() -> None:
        async def collect(step: int, version: int, name: str):
            raise RuntimeError("sandbox down")

        pub = Publisher(FakePool(), Path("/x"), "j", 0, "base")  # type: ignore[arg-type]
        ahead = Ahead(collect, ProblemSampler([0], 0), pub, Versions(0, "base"), 1, 2, 1)
        ahead.start()
        try:
            await ahead.next()
        finally:
            await ahead.close()

    with pytest.raises(RuntimeError, match="sandbox down"):
        asyncio.run(go())
