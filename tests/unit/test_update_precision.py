"""The update's mixed precision and its second attempt at a step whose gradient is not finite.

Mixed precision (on every family's tiny checkpoint): a bf16 base model with a float32 adapter computes under autocast with PEFT's
input casting off (`rl/policy.py`). Its gradient must still reach the float32 adapter weights and
be as close to the float32 model's gradient as PEFT's own path (activations cast to float32 in
every adapted layer) is.

Second attempt: a step whose gradient is not finite runs again under `Policy.fallbacks` (on CUDA,
without the fused kernels), and is skipped only if that is not finite either. A forward hook that
poisons the activations outside the fallback plays the faulty kernel.
"""

from __future__ import annotations

import logging
import math
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from tests.families import FAMILIES, build_family, save_lora
from tests.unit.test_update_buckets import MAX_TOKENS, batch, grads


def family_with_adapter(root: Path, family: str) -> tuple[Path, str]:
    model = build_family(family, root)
    return model, save_lora(model, root / "adapter", seed=5, rank=4, scale=0.05)


@pytest.fixture(scope="module")
def adapter_model(tmp_path_factory) -> tuple[Path, str]:
    return family_with_adapter(tmp_path_factory.mktemp("precision"), "qwen2")


def make_policy(model: Path, adapter: str, dtype: str):
    from crucible_shared.jobs import TrainJob
    from crucible_trainer.rl.policy import Policy

    spec = TrainJob.model_validate(
        {
            "model": {"base": str(model), "device": "cpu", "dtype": dtype, "init_adapter": adapter},
            "optim": {"lr": 1e-2, "micro_batch": 3, "max_grad_norm": 1.0},
            "seed": 3,
        }
    )
    return Policy(spec.model, spec.optim, spec.seed)


def one_gradient(policy) -> torch.Tensor:
    """The flattened float32 gradient of the summed log-probs of the test batch (one forward)."""
    from crucible_trainer.rl.batch import make_batch

    samples = batch()
    b = make_batch([s.prompt_ids for s in samples], [s.completion_ids for s in samples], policy.pad_id, "cpu")
    policy.model.zero_grad(set_to_none=True)
    policy.token_logprobs(b).sum().backward()
    got = grads(policy)
    return torch.cat([got[n].float().flatten() for n in sorted(got)])


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_bf16_base_trains_a_float32_adapter_as_closely_as_peft_casting(family, tmp_path) -> None:
    adapter_model = family_with_adapter(tmp_path, family)
    exact = one_gradient(make_policy(*adapter_model, "float32"))
    mixed_policy = make_policy(*adapter_model, "bfloat16")
    assert mixed_policy.compute_dtype is torch.bfloat16
    adapter = [p for p in mixed_policy.model.parameters() if p.requires_grad]
    assert adapter and all(p.dtype == torch.float32 for p in adapter)  # master weights stay float32
    mixed = one_gradient(mixed_policy)
    # PEFT's own path on the same bf16 policy: inputs cast to the adapter's float32, no autocast.
    mixed_policy.mixed_precision(False)
    casting = one_gradient(mixed_policy)

    def error(g: torch.Tensor) -> float:
        return float((g - exact).norm() / exact.norm())

    assert exact.norm() > 0 and torch.isfinite(mixed).all()
    assert float(torch.nn.functional.cosine_similarity(mixed, exact, dim=0)) > 0.99
    assert error(mixed) < max(2 * error(casting), 0.02), (error(mixed), error(casting))


def test_float32_base_computes_without_autocast(adapter_model) -> None:
    policy = make_policy(*adapter_model, "float32")
    assert policy.compute_dtype is None
    assert policy.fallbacks == []  # nothing is fused on a CPU: no other kernels to fall back to
    with policy.precision():
        assert not torch.is_autocast_enabled("cpu")


class Poison:
    """A forward hook on the embeddings that makes every activation NaN while `on`."""

    def __init__(self, policy) -> None:
        self.on = True
        embeddings = policy.model.get_input_embeddings()
        embeddings.register_forward_hook(lambda _m, _i, out: out * math.nan if self.on else out)

    @contextmanager
    def cured(self):
        self.on = False
        try:
            yield
        finally:
            self.on = True


def adapter_state(policy) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in policy.model.named_parameters() if p.requires_grad}


def run_update(kind: str, policy, cfg) -> dict[str, float]:
    """`update` over the test batch, or the update started on scored groups (`rl/early.py`) over
    it with every group already scored."""
    from crucible_trainer.rl.early import EarlyGroups, update_early
    from crucible_trainer.rl.update import update

    if kind == "update":
        return update(policy, batch(), cfg, seed=7)
    samples = batch()
    groups = EarlyGroups()
    groups.generated(samples)
    groups.close(samples)
    return update_early(policy, groups, cfg)


@pytest.mark.parametrize("kind", ["update", "early"])
@pytest.mark.parametrize("cured", [True, False], ids=["fallback-finite", "fallback-not-finite"])
def test_a_non_finite_step_runs_again_under_the_fallback_kernels(cured, kind, adapter_model, caplog) -> None:
    from crucible_trainer.rl.update import UpdateConfig

    policy = make_policy(*adapter_model, "float32")
    poison = Poison(policy)
    policy.fallbacks = [poison.cured if cured else contextmanager(lambda: (yield))]
    before = adapter_state(policy)
    cfg = UpdateConfig(micro_batch=3, max_tokens=MAX_TOKENS, aggregation="token")
    with caplog.at_level(logging.WARNING, logger="crucible_trainer.rl.update"):
        metrics = run_update(kind, policy, cfg)
    after = adapter_state(policy)
    assert metrics["update/retried_nonfinite_steps"] == 1.0
    # The log says what happened: a retry, and "skipped" only when the retry did not cure it.
    said = [r.getMessage() for r in caplog.records]
    assert said[0] == "gradient norm nan is not finite: running the step again with fallback kernels"
    assert said[1:] == ([] if cured else ["gradient norm nan is not finite: optimizer step skipped"])
    if cured:
        assert metrics["update/optimizer_steps"] == 1.0 and metrics["update/skipped_nonfinite_steps"] == 0
        # The poisoned attempt's figures are not counted; the step moved the adapter, finitely.
        assert math.isfinite(metrics["loss"]) and math.isfinite(metrics["grad_norm"])
        assert all(torch.isfinite(p).all() for p in after.values())
        assert any(not torch.equal(before[n], after[n]) for n in before)
    else:
        assert metrics["update/optimizer_steps"] == 0 and metrics["update/skipped_nonfinite_steps"] == 1
        assert all(torch.equal(before[n], after[n]) for n in before)


def test_a_finite_step_runs_once(adapter_model) -> None:
    from crucible_trainer.rl.update import UpdateConfig, update

    policy = make_policy(*adapter_model, "float32")
    calls = []

    @contextmanager
    def fallback():
        calls.append(1)
        yield

    policy.fallbacks = [fallback]
    cfg = UpdateConfig(micro_batch=3, max_tokens=MAX_TOKENS, aggregation="token")
    metrics = update(policy, batch(), cfg, seed=7)
    assert calls == [] and metrics["update/retried_nonfinite_steps"] == 0.0
    assert metrics["update/optimizer_steps"] == 1.0
