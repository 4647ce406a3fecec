"""The KL reference scored as the completions arrive (`rl/reference.py`) is the update's own.

On test_update_buckets.py's tiny random Llama and batch, with the adapter moved away from its
starting weights (so the reference differs from the policy and the KL term has a gradient):
samples handed to `ReferenceAhead` one at a time, shortest first as a stream delivers them, get
the log-probs the update's own scoring gives, the update then scores none of them again, and its
gradient and figures equal those of an update that scored the reference itself; so do they when
only some samples were scored ahead. The spec refuses `optim.reference_ahead: true` where nothing
would be scored ahead.
"""

from __future__ import annotations

import asyncio

import pytest
import torch
from crucible_shared.jobs import TrainJob
from pydantic import ValidationError

from tests.unit.test_update_buckets import (
    MAX_TOKENS,
    adapter_model,  # noqa: F401  (the fixture)
    assert_close,
    batch,
    make_policy,
    recorded,
)


def moved_policy(model, adapter):
    """A policy whose adapter is no longer its starting one (the KL reference)."""
    policy = make_policy(model, adapter)
    noise = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for p in (p for p in policy.model.parameters() if p.requires_grad):
            p.add_(torch.randn(p.shape, generator=noise) * 0.05)
    return policy


def reference_calls(policy) -> list[int]:
    """How many sequences each reference scoring of `policy` took, from now on."""
    calls: list[int] = []
    inner = policy.score

    def score(prompts, completions, micro_batch=16, reference=False):
        if reference:
            calls.append(len(prompts))
        return inner(prompts, completions, micro_batch, reference=reference)

    policy.score = score
    return calls


def scored_ahead(policy, samples, micro_batch: int, *, end: bool = True) -> dict[str, float]:
    """`ReferenceAhead` fed `samples` shortest first, as a stream delivers them, on an event loop."""
    from crucible_trainer.rl.reference import ReferenceAhead

    async def feed() -> dict[str, float]:
        ahead = ReferenceAhead(policy, micro_batch)
        for sample in sorted(samples, key=lambda s: len(s.completion_ids)):
            ahead.add(sample)
            await asyncio.sleep(0)
        if end:
            ahead.generated()
            return await ahead.finish()
        await asyncio.gather(*ahead._runs)  # what was sent, without the remainder
        return {"update/reference_ahead_sequences": float(ahead.sequences)}

    return asyncio.run(feed())


def test_the_reference_scored_ahead_is_the_update_s_own(adapter_model) -> None:  # noqa: F811
    from crucible_trainer.rl.update import UpdateConfig

    cfg = UpdateConfig(micro_batch=3, max_tokens=MAX_TOKENS, kl_beta=0.2, aggregation="token")
    itself = moved_policy(*adapter_model)
    samples = batch()
    want = itself.score(
        [s.prompt_ids for s in samples], [s.completion_ids for s in samples], 16, reference=True
    )
    (want_grad,), want_metrics = recorded(itself, cfg, samples)
    assert want_metrics["kl"] > 0

    ahead = moved_policy(*adapter_model)
    samples = batch()
    figures = scored_ahead(ahead, samples, micro_batch=2)
    assert figures["update/reference_ahead_sequences"] == len(samples) == 9
    assert figures["time/reference_ahead_s"] > 0
    for sample, values in zip(samples, want, strict=True):
        assert sample.ref_logprobs is not None and len(sample.ref_logprobs) == len(sample.completion_ids)
        torch.testing.assert_close(torch.tensor(sample.ref_logprobs), torch.tensor(values), rtol=0, atol=1e-6)
    calls = reference_calls(ahead)
    (got_grad,), got_metrics = recorded(ahead, cfg, samples)
    assert calls == []  # the update scored no reference of its own
    assert_close(got_grad, want_grad)
    assert got_metrics["kl"] == pytest.approx(want_metrics["kl"], rel=1e-5)
    assert got_metrics["loss"] == pytest.approx(want_metrics["loss"], rel=1e-5)


def test_the_update_scores_only_what_was_not_scored_ahead(adapter_model) -> None:  # noqa: F811
    from crucible_trainer.rl.update import UpdateConfig

    cfg = UpdateConfig(micro_batch=3, max_tokens=MAX_TOKENS, kl_beta=0.2, aggregation="sequence")
    (want_grad,), want_metrics = recorded(moved_policy(*adapter_model), cfg, batch())

    policy, samples = moved_policy(*adapter_model), batch()
    # Micro-batches of 4 and no end of generation: 8 of the 9 scored ahead, the longest left.
    assert scored_ahead(policy, samples, micro_batch=4, end=False)["update/reference_ahead_sequences"] == 8
    left = [s for s in samples if s.ref_logprobs is None]
    assert len(left) == 1 and len(left[0].completion_ids) == max(len(s.completion_ids) for s in samples)
    calls = reference_calls(policy)
    (got_grad,), got_metrics = recorded(policy, cfg, samples)
    assert calls == [1]
    assert_close(got_grad, want_grad)
    assert got_metrics["kl"] == pytest.approx(want_metrics["kl"], rel=1e-5)


def test_a_failed_scoring_fails_finish_and_close_waits_quietly() -> None:
    from crucible_trainer.rl.reference import ReferenceAhead

    class Broken:
        def __init__(self) -> None:
            self.thread_calls = 0

        async def call(self, fn, *args):
            self.thread_calls += 1
            return fn(*args)

        def score(self, *args, **kwargs):
            raise RuntimeError("CUDA out of memory")

    async def run() -> None:
        policy = Broken()
        ahead = ReferenceAhead(policy, 1)
        ahead.add(batch()[0])
        with pytest.raises(RuntimeError, match="out of memory"):
            await ahead.finish()
        ahead.add(batch()[1])
        await ahead.close()  # the step's own error is the one reported
        assert policy.thread_calls == 2 and ahead.sequences == 0

    asyncio.run(run())


def job(**fields) -> dict:
    return {
        "kind": "train",
        "method": {"name": "grpo", "kl_beta": 0.01},
        "optim": {"reference_ahead": True},
        **fields,
    }


@pytest.mark.parametrize(
    ("fields", "reason"),
    [
        ({"method": {"name": "grpo"}}, "no KL term"),
        ({"method": {"name": "reinforce"}}, "no KL term"),
        ({"method": {"name": "spiral", "kl_beta": 0.01}}, "plays games"),
        ({"distributed": {"train_gpus": 2}}, "train_gpus is 2"),
        ({"overlap": {"max_staleness": 1}, "publish": {"staleness_window": 2}}, "max_staleness"),
    ],
)
def test_reference_ahead_true_is_refused_where_nothing_would_be_scored_ahead(fields, reason) -> None:
    spec = job(**fields)
    with pytest.raises(ValidationError, match=r"optim\.reference_ahead") as caught:
        TrainJob.model_validate(spec)
    assert reason in str(caught.value)
    for mode in ("auto", False):  # the default and off are accepted everywhere
        TrainJob.model_validate({**spec, "optim": {"reference_ahead": mode}})


def test_reference_ahead_is_accepted_with_a_kl_term_and_unused_offline() -> None:
    assert TrainJob.model_validate(job()).optim.reference_ahead is True
    srrl = TrainJob.model_validate(job(method={"name": "srrl", "kl_beta": 0.05}))
    assert srrl.optim.reference_ahead is True
    with pytest.raises(ValidationError, match=r"optim\.reference_ahead"):
        TrainJob.model_validate(
            {
                "kind": "train",
                "method": {"name": "sft", "path": "x.jsonl"},
                "optim": {"reference_ahead": False},
            }
        )
