"""The update's normaliser is the published one: zero-advantage samples are never run through the
model, yet they count in the denominator exactly as in TRL's `GRPOTrainer._compute_loss`.

The reference below is a direct transliteration of TRL's formulas (loss types `grpo`, `dapo`,
`dr_grpo`), computed sample by sample over the *whole* batch, zero-advantage groups included,
with TRL's split into micro-batches and accumulation steps; its gradients are compared with the
ones `update` hands to the optimizer, on the bigram policy of `test_rl_math`.
"""

from __future__ import annotations

import math

import pytest
import torch
from crucible_trainer.rl.batch import make_batch
from crucible_trainer.rl.rollout import Sample
from crucible_trainer.rl.update import UpdateConfig, update

from tests.unit.test_rl_math import TinyPolicy

MAX_TOKENS = 6
TRL_LOSS = {"sequence": "grpo", "token": "dapo", "dr_grpo": "dr_grpo"}


class GradientRecorder(TinyPolicy):
    """Keeps the gradient of every optimizer step and never moves, so every step sees the same
    policy as the reference does."""

    def __init__(self) -> None:
        super().__init__()
        self.steps: list[torch.Tensor] = []

    def step(self) -> float:
        assert self.table.grad is not None
        self.steps.append(self.table.grad.detach().clone())
        self.table.grad = None
        return 0.0


def batch() -> list[Sample]:
    """Three groups of four: one informative, two of equal rewards (zero advantage everywhere);
    completions of 1 to 5 tokens, so the three normalisers differ."""

    def sample(group: int, completion: list[int], reward: float, advantage: float) -> Sample:
        return Sample(
            group, group, [1, 2 + group], completion, "", "", None, None, reward=reward, advantage=advantage
        )

    return [
        sample(0, [3, 4, 5], 1.0, 1.5),
        sample(0, [6], 0.0, -0.5),
        sample(0, [7, 8, 9, 10, 2], 0.0, -0.5),
        sample(0, [4, 4], 0.0, -0.5),
        sample(1, [5, 6, 7, 8], 0.0, 0.0),
        sample(1, [9], 0.0, 0.0),
        sample(1, [3, 3, 3], 0.0, 0.0),
        sample(1, [2, 9], 0.0, 0.0),
        sample(2, [8, 7, 6, 5, 4], 1.0, 0.0),
        sample(2, [10], 1.0, 0.0),
        sample(2, [6, 6], 1.0, 0.0),
        sample(2, [7, 3, 9], 1.0, 0.0),
    ]


def trl_gradient(
    samples: list[Sample], loss_type: str, micro_batch: int, grad_accum: int, clip_eps: float = 0.2
) -> list[torch.Tensor]:
    """TRL's per-optimizer-step gradients of the GRPO objective (num_iterations 1, beta 0): the
    batch in slices of `micro_batch * grad_accum`, each slice's micro-batches accumulated."""
    policy = TinyPolicy()
    total_tokens = sum(len(s.completion_ids) for s in samples)  # num_items_in_batch
    step_size = micro_batch * grad_accum
    grads = []
    for start in range(0, len(samples), step_size):
        policy.table.grad = None
        chunk = samples[start : start + step_size]
        for m in range(0, len(chunk), micro_batch):
            rows = chunk[m : m + micro_batch]
            per_sequence = []  # (sum over tokens of the per-token loss, completion length)
            for s in rows:
                b = make_batch([s.prompt_ids], [s.completion_ids], 0, "cpu")
                logp = policy.token_logprobs(b)[0]
                terms = []
                for t in range(len(s.completion_ids)):
                    ratio = torch.exp(logp[t] - logp[t].detach())
                    clipped = torch.clamp(ratio, 1 - clip_eps, 1 + clip_eps)
                    terms.append(-torch.minimum(ratio * s.advantage, clipped * s.advantage))
                per_sequence.append((torch.stack(terms).sum(), len(s.completion_ids)))
            if loss_type == "grpo":
                loss = torch.stack([total / length for total, length in per_sequence]).mean() / grad_accum
            elif loss_type == "dapo":
                loss = torch.stack([total for total, _ in per_sequence]).sum() / total_tokens
            else:  # dr_grpo
                loss = torch.stack([total for total, _ in per_sequence]).sum() / (len(rows) * MAX_TOKENS)
                loss = loss / grad_accum
            loss.backward()
        grads.append(policy.table.grad.detach().clone())
    return grads


@pytest.mark.parametrize("aggregation", ["sequence", "token", "dr_grpo"])
def test_one_optimizer_step_has_the_published_gradient(aggregation) -> None:
    samples = batch()
    policy = GradientRecorder()
    cfg = UpdateConfig(aggregation=aggregation, micro_batch=2, max_tokens=MAX_TOKENS)
    metrics = update(policy, samples, cfg)
    assert metrics["update/sequences"] == 4  # only the informative group ran through the model
    assert len(policy.steps) == 1
    # TRL, one generation batch per optimizer step: 6 micro-batches of 2 accumulated.
    (want,) = trl_gradient(samples, TRL_LOSS[aggregation], micro_batch=2, grad_accum=6)
    assert float(want.abs().sum()) > 0
    torch.testing.assert_close(policy.steps[0], want, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("aggregation", ["sequence", "token", "dr_grpo"])
def test_accumulation_steps_are_normalised_as_trl_normalises_them(aggregation) -> None:
    # Several optimizer steps per batch: TRL's steps cover slices of the batch (zero-advantage
    # samples among them), Crucible's only the trained samples, so the steps differ one by one;
    # their sum (the policy does not move between them here) must not.
    samples = batch()
    policy = GradientRecorder()
    cfg = UpdateConfig(aggregation=aggregation, micro_batch=1, grad_accum=2, max_tokens=MAX_TOKENS)
    update(policy, samples, cfg)
    assert len(policy.steps) == 2  # 4 trained samples, 2 micro-batches per step
    want = trl_gradient(samples, TRL_LOSS[aggregation], micro_batch=1, grad_accum=2)
    assert len(want) == math.ceil(len(samples) / 2)
    torch.testing.assert_close(sum(policy.steps), sum(want), rtol=1e-5, atol=1e-7)


def test_a_step_with_one_informative_group_moves_less_than_one_with_several() -> None:
    # The example: one informative group of three no longer gets a full step's gradient.
    alone = GradientRecorder()
    update(alone, batch()[:4], UpdateConfig(aggregation="token", micro_batch=16))
    diluted = GradientRecorder()
    update(diluted, batch(), UpdateConfig(aggregation="token", micro_batch=16))
    tokens_alone = sum(len(s.completion_ids) for s in batch()[:4])
    tokens_all = sum(len(s.completion_ids) for s in batch())
    torch.testing.assert_close(diluted.steps[0], alone.steps[0] * tokens_alone / tokens_all)


def test_reinforce_and_sequence_ratios_count_every_sample() -> None:
    samples = batch()
    trained = [s for s in samples if s.advantage != 0]
    for cfg in (
        UpdateConfig(objective="reinforce", micro_batch=3),
        UpdateConfig(ratio="sequence", micro_batch=3),
    ):
        full, part = GradientRecorder(), GradientRecorder()
        update(full, samples, cfg)
        update(part, trained, cfg)
        torch.testing.assert_close(full.steps[0], part.steps[0] * len(trained) / len(samples))
