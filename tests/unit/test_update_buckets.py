"""Length-bucketed micro-batches and the first pass's log p_old change no gradient.

On a tiny random Llama with a random LoRA adapter (so every adapter weight has a gradient), the
gradients `update` hands to the optimizer, with `length_buckets` on and off, are compared with a
reference computed sample by sample (one sequence per forward: no padding at all), each sample's
loss divided by the whole batch's published count (tests/unit/test_grpo_normaliser.py has TRL's
formulas). The batch mixes prompt and completion lengths and a zero-advantage group, and the
micro-batches are uneven (3, 3, 1), so a loss normalised per micro-batch would not match.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from tests.families import build_family, save_lora

MAX_TOKENS = 8


@pytest.fixture(scope="module")
def adapter_model(tmp_path_factory) -> tuple[Path, str]:
    root = tmp_path_factory.mktemp("buckets")
    model = build_family("llama", root)
    return model, save_lora(model, root / "adapter", seed=5, rank=4, scale=0.05)


def batch() -> list:
    from crucible_trainer.rl.rollout import Sample

    def sample(group: int, prompt: list[int], completion: list[int], advantage: float) -> Sample:
        return Sample(group, group, prompt, completion, "", "", None, None, reward=1.0, advantage=advantage)

    return [
        sample(0, [5, 6, 7, 8, 9], [10], 1.1),
        sample(0, [5, 6, 7, 8, 9], [11, 12, 13, 14, 15, 16, 17], -0.3),
        sample(0, [5, 6, 7, 8, 9], [18, 19], -0.8),
        sample(1, [20], [21, 22, 23, 24], 0.9),
        sample(1, [20], [25], -0.9),
        sample(2, [30, 31], [32, 33, 34], 0.0),  # zero advantage: counted, never run (beta 0)
        sample(2, [30, 31], [35, 36, 37, 38, 39, 40], 0.0),
        sample(3, [41, 42, 43, 44, 45, 46, 47, 48], [49, 50, 51, 52, 53, 54, 55, 56], 0.6),
        sample(3, [41, 42, 43, 44, 45, 46, 47, 48], [57, 58], -0.6),
    ]


def make_policy(model: Path, adapter: str):
    from crucible_shared.jobs import TrainJob
    from crucible_trainer.rl.policy import Policy

    spec = TrainJob.model_validate(
        {
            "model": {"base": str(model), "device": "cpu", "dtype": "float32", "init_adapter": adapter},
            "optim": {"lr": 1e-2, "micro_batch": 3, "max_grad_norm": 1.0},
            "seed": 3,
        }
    )
    return Policy(spec.model, spec.optim, spec.seed)


def recorded(
    policy, cfg, samples: list | None = None
) -> tuple[list[dict[str, torch.Tensor]], dict[str, float]]:
    """Every optimizer step's gradients of `update` on `policy` (the steps are taken), and its metrics."""
    from crucible_trainer.rl.update import update

    steps: list[dict[str, torch.Tensor]] = []
    inner = policy.step

    def step() -> float:
        steps.append(grads(policy))
        return inner()

    policy.step = step
    return steps, update(policy, samples or batch(), cfg, seed=7)


def recorded_update(model: Path, adapter: str, cfg) -> list[dict[str, torch.Tensor]]:
    """Every optimizer step's gradients of `update` on a fresh policy (the steps are taken)."""
    return recorded(make_policy(model, adapter), cfg)[0]


def grads(policy) -> dict[str, torch.Tensor]:
    return {
        n: p.grad.detach().clone()
        for n, p in policy.model.named_parameters()
        if p.requires_grad and p.grad is not None
    }


def reference_gradient(policy, cfg, old: list[torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """One optimizer step's gradient over the whole batch, one sample per forward: the clipped
    objective (or REINFORCE) summed over samples and divided by the published count."""
    from crucible_trainer.rl.batch import make_batch

    samples = batch()
    tokens = sum(len(s.completion_ids) for s in samples)
    policy.model.zero_grad(set_to_none=True)
    ran = 0
    for i, s in enumerate(samples):
        if s.advantage == 0 and cfg.kl_beta == 0:
            continue
        b = make_batch([s.prompt_ids], [s.completion_ids], policy.pad_id, "cpu")
        # (before the graph: scoring the reference swaps the adapter's starting weights in)
        ref = policy.token_logprobs(b, reference=True)[0] if cfg.kl_beta else None
        logp = policy.token_logprobs(b)[0]
        if cfg.objective == "reinforce":
            loss = -s.advantage * logp.sum() / len(samples)
        else:
            ratio = torch.exp(logp - (old[i] if old is not None else logp.detach()))
            clipped = torch.clamp(ratio, 1 - cfg.clip_eps, 1 + cfg.clip_eps)
            per_token = -torch.minimum(ratio * s.advantage, clipped * s.advantage)
            if ref is not None:
                per_token = per_token + cfg.kl_beta * (torch.exp(ref - logp) - (ref - logp) - 1)
            n = len(samples)
            loss = {
                "sequence": per_token.mean() / n,
                "token": per_token.sum() / tokens,
                "dr_grpo": per_token.sum() / (MAX_TOKENS * n),
            }[cfg.aggregation]
        loss.backward()  # one sample at a time: the reference's weight swap must not meet a live graph
        ran += 1
    assert ran
    return grads(policy)


def assert_close(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys() and got
    scale = max(float(g.abs().max()) for g in want.values())
    assert scale > 0
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-4, atol=1e-5 * scale, msg=name)


CASES = {
    "sequence": {"aggregation": "sequence"},
    "token": {"aggregation": "token"},
    "dr_grpo": {"aggregation": "dr_grpo"},
    "token-kl": {"aggregation": "token", "kl_beta": 0.05},
    "reinforce": {"objective": "reinforce"},
}


@pytest.mark.parametrize("buckets", [True, False], ids=["buckets", "batch-order"])
@pytest.mark.parametrize("case", CASES)
def test_update_gradient_equals_the_sample_by_sample_reference(case, buckets, adapter_model) -> None:
    from crucible_trainer.rl.update import UpdateConfig

    cfg = UpdateConfig(micro_batch=3, max_tokens=MAX_TOKENS, length_buckets=buckets, **CASES[case])
    (got,) = recorded_update(*adapter_model, cfg)
    want = reference_gradient(make_policy(*adapter_model), cfg)
    assert_close(got, want)


def test_later_passes_use_the_first_pass_log_probs_as_p_old(adapter_model) -> None:
    # Two passes, one optimizer step each: p_old comes from the first pass's own forwards (no
    # scoring pass). The second step's gradient must be the one of the clipped objective with
    # p_old from the starting policy, at the weights after the first step.
    from crucible_trainer.rl.update import UpdateConfig

    cfg = UpdateConfig(
        micro_batch=3, max_tokens=MAX_TOKENS, iterations=2, clip_eps=0.001, aggregation="token"
    )
    first, second = recorded_update(*adapter_model, cfg)
    ref = make_policy(*adapter_model)
    start = ref.score([s.prompt_ids for s in batch()], [s.completion_ids for s in batch()])
    assert_close(first, reference_gradient(ref, cfg))
    # The same first step on the reference policy, from the update's own gradients.
    params = dict(ref.model.named_parameters())
    for name, g in first.items():
        params[name].grad = g.clone()
    ref.step()
    want = reference_gradient(ref, cfg, old=[torch.tensor(row) for row in start])
    assert_close(second, want)
    # The tiny clip range clips some tokens in the second pass: the ratios did move.
    assert any(not math.isclose(float(g.abs().sum()), 0.0) for g in want.values())


@pytest.mark.parametrize("reference", [False, True], ids=["policy", "reference"])
def test_scoring_in_length_order_returns_each_sample_its_own_log_probs(reference, adapter_model) -> None:
    policy = make_policy(*adapter_model)
    prompts = [s.prompt_ids for s in batch()]
    comps = [s.completion_ids for s in batch()]
    together = policy.score(prompts, comps, micro_batch=3, reference=reference)
    alone = [
        policy.score([p], [c], micro_batch=1, reference=reference)[0]
        for p, c in zip(prompts, comps, strict=True)
    ]
    assert [len(r) for r in together] == [len(c) for c in comps]
    for got, want in zip(together, alone, strict=True):
        assert got == pytest.approx(want, abs=1e-5)
