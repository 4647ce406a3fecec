"""Rewards, advantages, losses and the update loop against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch
from crucible_shared.jobs import SRRLConfig
from crucible_shared.sandbox import RunResult
from crucible_trainer.methods import srrl
from crucible_trainer.methods.groups import assign_group_advantages
from crucible_trainer.rl import advantages, losses, rewards
from crucible_trainer.rl.policy import PassCounts
from crucible_trainer.rl.rollout import Sample
from crucible_trainer.rl.update import UpdateConfig, update


def result(status: str, passed: int = 0, total: int = 2, stdout: str = "") -> RunResult:
    return RunResult(status=status, passed=passed, total=total, stdout=stdout)


def test_graded_reward_table() -> None:
    assert rewards.graded(result("passed", 2, stdout="hi\n")) == 1.0
    assert rewards.graded(result("failed", 1)) == 0.5
    assert rewards.graded(result("syntax_error")) == -0.5
    for status in ("error", "timeout", "memory_exceeded", "output_exceeded"):
        assert rewards.graded(result(status)) == -1.0


def test_length_penalty() -> None:
    # r - alpha * tokens / 100
    assert rewards.reward(
        result("passed", 2), "all_pass", generated_tokens=250, length_penalty=0.2
    ) == pytest.approx(0.5)
    assert rewards.reward(
        result("failed", 1), "fraction", generated_tokens=100, length_penalty=0.1
    ) == pytest.approx(0.4)


def test_group_advantages_hand_computed() -> None:
    # group [1, 0]: mean 0.5, std 0.5 -> [1, -1]; group [1, 1, 0, 0, 0, 0]: mean 1/3, std sqrt(2)/3
    out = advantages.group_advantages([[1.0, 0.0], [1, 1, 0, 0, 0, 0]], scale="group")
    assert out[0] == pytest.approx([1.0, -1.0], abs=1e-3)
    s = math.sqrt(2) / 3
    assert out[1][0] == pytest.approx((2 / 3) / s, abs=1e-3)
    assert out[1][2] == pytest.approx((-1 / 3) / s, abs=1e-3)
    assert advantages.group_advantages([[1.0, 0.0]], scale="none") == [[0.5, -0.5]]
    # batch scale: divide by the std of all rewards [1, 0, 0, 0] = sqrt(3)/4
    batch = advantages.group_advantages([[1.0, 0.0], [0.0, 0.0]], scale="batch")
    assert batch[0][0] == pytest.approx(0.5 / (math.sqrt(3) / 4), abs=1e-3)
    assert batch[1] == [0.0, 0.0]


def test_srrl_advantages_are_normalised_per_problem() -> None:
    def s(group: int, reward: float, phase: str) -> Sample:
        return Sample(0, group, [1], [2], "", "", None, None, phase=phase, reward=reward)

    # Problem 0: c1 both fail, one of four refinements passes; problem 1: all pass (no signal).
    batch = [
        s(0, 0.0, "c1"),
        s(0, 0.0, "c1"),
        s(0, 1.0, "c2"),
        s(0, 0.0, "c2"),
        s(0, 0.0, "c2"),
        s(0, 0.0, "c2"),
        s(1, 1.0, "c1"),
        s(1, 1.0, "c1"),
    ]
    groups, zero = assign_group_advantages(batch, "group")
    assert (groups, zero) == (2, 1)
    mean, std = 1 / 6, math.sqrt(5) / 6
    assert batch[2].advantage == pytest.approx((1 - mean) / std, abs=1e-3)
    assert batch[0].advantage == pytest.approx(-mean / std, abs=1e-3)
    assert batch[6].advantage == batch[7].advantage == 0.0
    assert srrl.refinements_per_failure(SRRLConfig(), 1) == 4


def test_ppo_and_reinforce_advantages() -> None:
    assert advantages.batch_normalised([0.0, 1.0]) == pytest.approx([-1.0, 1.0], abs=1e-3)
    assert advantages.mean_baseline([1.0, 0.0, 0.5]) == [0.5, -0.5, 0.0]


def test_clipped_surrogate_hand_computed() -> None:
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    adv = torch.tensor([1.0, -2.0])
    logp = torch.zeros(2, 2)
    # ratio 1 everywhere: loss = -mean over tokens of A = -(1 + 1 - 2) / 3
    out = losses.clipped_surrogate(logp, logp, adv, mask, clip_eps=0.2, aggregation="token")
    assert float(out.loss) == pytest.approx(-(1 + 1 - 2) / 3)
    assert out.ratio_mean == pytest.approx(1.0) and out.clip_fraction == 0.0
    seq = losses.clipped_surrogate(logp, logp, adv, mask, clip_eps=0.2, aggregation="sequence")
    assert float(seq.loss) == pytest.approx(-(1 + -2) / 2)
    dr = losses.clipped_surrogate(logp, logp, adv, mask, clip_eps=0.2, aggregation="dr_grpo", max_tokens=4)
    assert float(dr.loss) == pytest.approx(-((2 / 4) + (-2 / 4)) / 2)
    # ratio e^0.5 > 1.2 with A > 0 is clipped to 1.2
    new = torch.full((1, 1), 0.5)
    clipped = losses.clipped_surrogate(
        new, torch.zeros(1, 1), torch.tensor([1.0]), torch.ones(1, 1), clip_eps=0.2
    )
    assert float(clipped.loss) == pytest.approx(-1.2) and clipped.clip_fraction == 1.0
    higher = losses.clipped_surrogate(
        new, torch.zeros(1, 1), torch.tensor([1.0]), torch.ones(1, 1), clip_eps=0.2, clip_eps_high=0.28
    )
    assert float(higher.loss) == pytest.approx(-1.28)


def test_kl_k3_estimator() -> None:
    logp, ref = torch.tensor([[-1.0]]), torch.tensor([[-1.5]])
    out = losses.clipped_surrogate(
        logp, logp, torch.tensor([0.0]), torch.ones(1, 1), clip_eps=0.2, ref_logp=ref, kl_beta=0.1
    )
    d = -0.5
    assert out.kl == pytest.approx(math.exp(d) - d - 1)
    assert float(out.loss) == pytest.approx(0.1 * (math.exp(d) - d - 1))


def test_reinforce_loss() -> None:
    logp = torch.tensor([[-1.0, -2.0], [-0.5, 0.0]])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    out = losses.reinforce(logp, torch.tensor([2.0, -1.0]), mask)
    assert float(out.loss) == pytest.approx(-(2 * -3.0 + -1 * -0.5) / 2)


class TinyPolicy:
    """A real autograd policy without transformers: a bigram table over a small vocabulary."""

    def __init__(self, vocab: int = 11) -> None:
        torch.manual_seed(0)
        self.table = torch.nn.Parameter(torch.randn(vocab, vocab) * 0.1)
        self.opt = torch.optim.SGD([self.table], lr=0.5)
        self.pad_id, self.device = 0, "cpu"
        self.fallbacks: list = []  # kernels to run a non-finite step again with (none on a CPU)
        self.passes = PassCounts()  # what `Policy` counts of its forwards (none go through it here)
        self.memory_margin = 1  # what `Policy` multiplies its memory estimates by (none here)

    def token_logprobs(self, batch, reference: bool = False) -> torch.Tensor:
        k = batch.tail
        prev = batch.input_ids[:, -(k + 1) : -1]
        tgt = batch.input_ids[:, -k:]
        logits = self.table[prev]
        lp = torch.gather(logits.log_softmax(-1), -1, tgt.unsqueeze(-1)).squeeze(-1)
        return lp * batch.tail_mask

    @torch.no_grad()
    def score(self, prompts, comps, micro_batch=16, reference=False):
        from crucible_trainer.rl.batch import make_batch

        b = make_batch(prompts, comps, 0, "cpu")
        lp = self.token_logprobs(b)
        return [row[b.tail - len(c) :].tolist() for row, c in zip(lp, comps, strict=True)]

    def step(self) -> float:
        norm = float(self.table.grad.norm())
        self.opt.step()
        self.opt.zero_grad()
        return norm


def _batch() -> list[Sample]:
    return [
        Sample(0, 0, [1, 2], [3, 4, 5], "", "", None, None, reward=1.0, advantage=1.0),
        Sample(0, 0, [1, 2], [6, 7], "", "", None, None, reward=0.0, advantage=-1.0),
        Sample(1, 1, [8], [9], "", "", None, None, reward=0.0, advantage=0.0),  # no signal: skipped
    ]


def test_ppo_ratio_is_one_on_the_first_epoch_and_moves_after() -> None:
    # One optimizer step per epoch (one micro-batch): epoch 0 runs on the policy that produced log p_old.
    fresh = TinyPolicy()
    one = update(
        fresh, _batch(), UpdateConfig(iterations=2, clip_eps=0.2, micro_batch=16, always_score_old=True)
    )
    assert one["update/ratio_mean_iter0"] == pytest.approx(1.0, abs=1e-6)
    assert one["update/ratio_mean_iter1"] != pytest.approx(1.0, abs=1e-6)
    assert one["update/sequences"] == 2.0  # the zero-advantage sample carries no gradient


def test_update_raises_good_and_lowers_bad_completions() -> None:
    policy = TinyPolicy()
    before = policy.score([[1, 2], [1, 2]], [[3, 4, 5], [6, 7]])
    update(policy, _batch(), UpdateConfig(iterations=1, micro_batch=1))
    after = policy.score([[1, 2], [1, 2]], [[3, 4, 5], [6, 7]])
    assert sum(after[0]) > sum(before[0])
    assert sum(after[1]) < sum(before[1])
    reinforce_policy = TinyPolicy()
    before = reinforce_policy.score([[1, 2]], [[3, 4, 5]])
    update(reinforce_policy, _batch(), UpdateConfig(objective="reinforce", micro_batch=2))
    assert sum(reinforce_policy.score([[1, 2]], [[3, 4, 5]])[0]) > sum(before[0])


def test_a_non_finite_gradient_never_reaches_the_weights() -> None:
    # One NaN in the adapter would be published and make every later rollout NaN (issue 24).
    from crucible_trainer.rl.policy import Policy

    layer = torch.nn.Linear(2, 1)
    policy = Policy.__new__(Policy)  # the optimisation part only: no model to load
    policy.model, policy.max_grad_norm = layer, 1.0
    policy.optimizer = torch.optim.SGD(layer.parameters(), lr=0.1)
    policy.scheduler = torch.optim.lr_scheduler.LambdaLR(policy.optimizer, lambda step: 1.0)
    before = layer.weight.detach().clone()
    layer(torch.tensor([[float("nan"), 1.0]])).sum().backward()
    assert math.isnan(policy.step())
    assert torch.equal(layer.weight, before) and layer.weight.grad is None
    layer(torch.tensor([[2.0, 1.0]])).sum().backward()
    assert math.isfinite(policy.step()) and not torch.equal(layer.weight, before)
