"""Gradient checkpointing decided per micro-batch (`model.gradient_checkpointing: auto`).

A one-GPU job keeps `auto` and the policy checkpoints only the micro-batches whose own estimate
(`hardware.checkpoint_needed`) does not fit in the memory free when they run. Here, on a CPU, the
policy's free memory is set by hand to a budget between the estimates of a step's longest and
shorter micro-batches: the longest is checkpointed (every decoder layer goes through
`torch.utils.checkpoint`, as transformers binds it) and the others are not, and the gradients handed to the optimizer equal
those of the same update with checkpointing never on and always on; and so for every family of
`tests/families.py` (tiny random checkpoints, random adapters).
"""

from __future__ import annotations

import weakref
from pathlib import Path

import pytest
import torch

from tests.families import FAMILIES, build_family, save_lora
from tests.unit.test_update_buckets import batch, recorded


@pytest.fixture(scope="module")
def adapter_model(tmp_path_factory) -> tuple[Path, str]:
    root = tmp_path_factory.mktemp("ckpt")
    model = build_family("llama", root)
    return model, save_lora(model, root / "adapter", seed=5, rank=4, scale=0.05)


def make_policy(model: Path, adapter: str, checkpointing: bool | str = "auto"):
    from crucible_shared.jobs import TrainJob
    from crucible_trainer.rl.policy import Policy

    spec = TrainJob.model_validate(
        {
            "model": {
                "base": str(model),
                "device": "cpu",
                "dtype": "float32",
                "init_adapter": adapter,
                "gradient_checkpointing": checkpointing,
            },
            "optim": {"lr": 1e-2, "micro_batch": 3, "max_grad_norm": 1.0},
            "seed": 3,
        }
    )
    return Policy(spec.model, spec.optim, spec.seed)


def first_step(policy) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    from crucible_trainer.rl.update import UpdateConfig

    steps, metrics = recorded(policy, UpdateConfig(micro_batch=3, aggregation="token"))
    return steps[0], metrics


def estimate(policy, rows: int, width: int, tail: int) -> int:
    """A micro-batch's estimate at its smallest without checkpointing, as the policy decides
    it: its attention kernel, and through the chunked head (with its workspace) where the family
    takes it (rl/head.py: the policy takes it where the full logits do not fit)."""
    from crucible_trainer.runtime.hardware import bytes_per_sequence, head_workspace

    config = policy.model.get_base_model().config
    head = "full" if policy.head is None else "chunked"
    per_sequence = bytes_per_sequence(config, width, tail, 4, config._attn_implementation, head)
    return rows * per_sequence + (head_workspace(config, rows * tail) if policy.head is not None else 0)


def test_only_the_micro_batches_that_do_not_fit_are_checkpointed(adapter_model, monkeypatch) -> None:
    from crucible_trainer.runtime.hardware import MICRO_BATCH_SHARE
    from transformers import modeling_utils

    reference, _ = first_step(make_policy(*adapter_model, checkpointing=False))
    always, always_metrics = first_step(make_policy(*adapter_model, checkpointing=True))

    policy = make_policy(*adapter_model)
    assert policy.free_memory() is None  # on a CPU `auto` decides nothing: off
    # Longest first (`bucketed`), micro-batches of 3, 3 and 1: widths 16, 7 and 2 tokens, completion
    # tails 8, 4 and 1 (test_update_buckets.batch). A budget between the first two estimates:
    longest, next_one = estimate(policy, 3, 16, 8), estimate(policy, 3, 7, 4)
    budget = int((longest + next_one) / 2 / MICRO_BATCH_SHARE)
    policy.free_memory = lambda: budget
    layers = policy.model.get_base_model().config.num_hidden_layers
    calls: list[int] = []
    real = modeling_utils.checkpoint  # what transformers binds to each layer when checkpointing is enabled

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(modeling_utils, "checkpoint", counted)
    mixed, metrics = first_step(policy)

    assert metrics["update/checkpointed_micro_batches"] == 1.0
    # 48 + 21 + 2 token slots (3 rows of 16, 3 of 7, 1 of 2) holding 38 + 18 + 2 real tokens
    assert metrics["update/micro_batches"] == 3.0 and metrics["update/padding_fraction"] == 0.1831
    assert len(calls) == layers  # the longest micro-batch's layers, once each
    assert always_metrics["update/checkpointed_micro_batches"] == 3.0
    assert not policy._checkpointing_on  # the last (short) micro-batch ran without it
    for name, g in reference.items():
        assert torch.allclose(mixed[name], g, atol=1e-6, rtol=1e-5), name
        assert torch.allclose(always[name], g, atol=1e-6, rtol=1e-5), name


def test_every_micro_batch_is_checkpointed_when_memory_is_short(adapter_model) -> None:
    policy = make_policy(*adapter_model)
    policy.free_memory = lambda: 1
    _, metrics = first_step(policy)
    assert metrics["update/checkpointed_micro_batches"] == 3.0
    policy.free_memory = lambda: 2**50
    _, metrics = first_step(policy)
    assert metrics["update/checkpointed_micro_batches"] == 0.0 and not policy._checkpointing_on


def test_one_gpu_and_ddp_ranks_keep_auto_and_fsdp_or_compiled_decide_for_the_job(
    adapter_model, monkeypatch
) -> None:
    import crucible_models
    from crucible_shared.events import SettingsEvent
    from crucible_shared.jobs import TrainJob
    from crucible_trainer.runtime import hardware

    monkeypatch.setattr(crucible_models, "pick_device", lambda device=None: "cuda:0")
    monkeypatch.setattr(crucible_models, "pick_dtype", lambda device, dtype=None: torch.bfloat16)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (2**36, 2**37))
    model, _ = adapter_model
    one = TrainJob.model_validate({"model": {"base": str(model)}, "optim": {"micro_batch": 4}})
    resolved, chosen = hardware.resolve(one)
    assert resolved.model.gradient_checkpointing == "auto" and chosen["gradient_checkpointing"] == "auto"
    SettingsEvent(**chosen)  # the event takes it

    def ranks(strategy: str) -> TrainJob:
        return one.model_copy(
            update={"distributed": one.distributed.model_copy(update={"train_gpus": 2, "strategy": strategy})}
        )

    compiled = one.model_copy(update={"optim": one.optim.model_copy(update={"compile": True})})
    # DDP ranks run no collective in their backwards: each decides per micro-batch, as one process does.
    assert hardware.resolve(ranks("ddp"))[0].model.gradient_checkpointing == "auto"
    for job in (ranks("fsdp"), compiled):
        assert hardware.resolve(job)[0].model.gradient_checkpointing is False  # a tiny model fits in 64 GiB
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (2**10, 2**37))
    for job in (ranks("fsdp"), compiled):
        assert hardware.resolve(job)[0].model.gradient_checkpointing is True
    assert hardware.resolve(ranks("ddp"))[0].model.gradient_checkpointing == "auto"


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_family_trains_the_same_with_checkpointing_switched(family, tmp_path) -> None:
    """Each family users train, its tiny random checkpoint with a random adapter: the update's
    gradient with the longest micro-batch checkpointed (switched on, then off, within one update)
    equals the gradient with checkpointing never on."""
    model = build_family(family, tmp_path)
    policy = make_policy(model, save_lora(model, tmp_path / "adapter", seed=5, rank=4, scale=0.05))

    def gradient(free: int) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
        from crucible_trainer.rl.update import UpdateConfig, update

        seen: list[dict[str, torch.Tensor]] = []

        def record() -> float:  # the gradient, no step: both updates start from the same weights
            seen.append(
                {n: p.grad.detach().clone() for n, p in policy.model.named_parameters() if p.grad is not None}
            )
            policy.optimizer.zero_grad(set_to_none=True)
            return 0.0

        policy.free_memory, policy.step = (lambda: free), record
        metrics = update(policy, batch(), UpdateConfig(micro_batch=3))
        return seen[0], metrics

    from crucible_trainer.runtime.hardware import MICRO_BATCH_SHARE

    longest, next_one = estimate(policy, 3, 16, 8), estimate(policy, 3, 7, 4)
    plain, plain_metrics = gradient(2**50)
    mixed, metrics = gradient(int((longest + next_one) / 2 / MICRO_BATCH_SHARE))
    assert plain_metrics["update/checkpointed_micro_batches"] == 0.0
    assert metrics["update/checkpointed_micro_batches"] == 1.0
    assert plain.keys() == mixed.keys() and plain
    for name, g in plain.items():
        assert torch.allclose(mixed[name], g, atol=1e-6, rtol=1e-5), name


class _Node:
    """Held by a graph node of the failed pass: alive while any of that graph is."""


class _FailsBackward(torch.autograd.Function):
    """The identity, whose backward runs out of memory (an error in the middle of a backward)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, node: _Node) -> torch.Tensor:
        ctx.node = node
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 778.00 MiB (backward)")


def out_of_memory_at(policy, forward: int, backward: bool = False) -> list[bool]:
    """Training forwards of `policy` counted; the `forward`-th raises CUDA's out-of-memory error
    (`backward`: in its backward instead). Each later forward adds whether the failed pass's
    log-probs are still alive (a retry must not hold the graph of the pass it replaces)."""
    calls: list[bool] = []
    failed: list[weakref.ref] = []
    inner = policy._logprobs

    def logprobs(*args, **kwargs):
        if torch.is_grad_enabled():
            calls.append(bool(failed) and failed[0]() is not None)
            if len(calls) == forward and not backward:
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 778.00 MiB")
            if len(calls) == forward:
                node = _Node()
                failed.append(weakref.ref(node))
                return _FailsBackward.apply(inner(*args, **kwargs), node)
        return inner(*args, **kwargs)

    policy._logprobs = logprobs
    return calls


@pytest.mark.parametrize("backward", [False, True], ids=["forward", "backward"])
def test_a_step_out_of_memory_runs_again_holding_less_with_the_same_gradient(adapter_model, backward) -> None:
    from crucible_trainer.rl.update import UpdateConfig

    reference, _ = first_step(make_policy(*adapter_model, checkpointing=False))
    policy = make_policy(*adapter_model)
    policy.free_memory = lambda: 2**50  # every estimate fits: neither checkpointing nor the chunked head
    # The second micro-batch runs out (in its forward, or in its backward), after the first's
    # backward added its gradient: a retry that kept that gradient would count it twice.
    calls = out_of_memory_at(policy, 2, backward)
    steps, metrics = recorded(policy, UpdateConfig(micro_batch=3, aggregation="token"))

    assert metrics["update/out_of_memory_retries"] == 1.0 and len(steps) == 1
    assert calls == [False] * 5  # two forwards, then all three again; nothing of the failed pass alive
    # The margin grew until the micro-batch that failed no longer fitted without the chunked head:
    # the retry held less where it failed.
    assert metrics["update/memory_margin"] == policy.memory_margin > 2
    assert metrics["update/chunked_head_micro_batches"] >= 2
    for name, g in reference.items():
        assert torch.allclose(steps[0][name], g, atol=1e-6, rtol=1e-5), name


def test_several_ranks_do_not_retry_a_step_out_of_memory(adapter_model) -> None:
    from crucible_trainer.rl.parallel import Parallel
    from crucible_trainer.rl.update import _fitting

    class Ranks(Parallel):
        world = 2  # the other rank would wait in a collective for this one's retry

    def fails() -> tuple[list, int]:
        raise torch.OutOfMemoryError("CUDA out of memory")

    policy = make_policy(*adapter_model)
    counts = {"oom": 0}
    with pytest.raises(torch.OutOfMemoryError):
        _fitting(fails, policy, Ranks(), counts)
    assert counts["oom"] == 0 and policy.memory_margin == 1


def test_the_doubled_margin_checkpoints_the_micro_batch_near_the_line(adapter_model) -> None:
    from crucible_trainer.runtime.hardware import MICRO_BATCH_SHARE

    policy = make_policy(*adapter_model)
    policy.head_mode = "chunked"  # the estimate below is the chunked head's (`estimate`)
    longest = estimate(policy, 3, 16, 8)
    policy.free_memory = lambda: int(1.5 * longest / MICRO_BATCH_SHARE)  # fits, but not twice over
    out_of_memory_at(policy, 1)
    _, metrics = first_step(policy)
    # The failed first forward and the retried three: only the retried longest is checkpointed.
    assert metrics["update/out_of_memory_retries"] == 1.0
    assert metrics["update/micro_batches"] == 4.0 and metrics["update/checkpointed_micro_batches"] == 1.0


@pytest.mark.parametrize("checkpointing", [True, "auto"])
def test_out_of_memory_with_nothing_left_to_spare_is_raised(adapter_model, checkpointing) -> None:
    policy = make_policy(*adapter_model, checkpointing=checkpointing)
    policy.head_mode = "chunked"
    policy.free_memory = lambda: 1  # `auto` checkpoints every micro-batch: the failed pass held the least
    out_of_memory_at(policy, 1)
    with pytest.raises(torch.OutOfMemoryError):
        first_step(policy)
    assert policy.memory_margin == 1


def test_auto_micro_batch_sizes_the_logits_as_the_update_holds_them(adapter_model, monkeypatch) -> None:
    """On CUDA an eager update keeps the logits through the kept logits' kernels (2 x 2 bytes an
    entry in bf16), a compiled one through autograd's float32 copies (16 bytes)."""
    import crucible_models
    from crucible_shared.jobs import TrainJob
    from crucible_trainer.runtime import hardware
    from transformers import AutoConfig

    monkeypatch.setattr(crucible_models, "pick_device", lambda device=None: "cuda:0")
    monkeypatch.setattr(crucible_models, "pick_dtype", lambda device, dtype=None: torch.bfloat16)
    free = 2**33
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free, 2**37))
    model, _ = adapter_model
    config = AutoConfig.from_pretrained(model)
    for compile_, head in ((False, "kept"), ("default", "full")):
        job = TrainJob.model_validate({"model": {"base": str(model)}, "optim": {"compile": compile_}})
        resolved, chosen = hardware.resolve(job)
        tokens, completion = hardware.PROMPT_TOKENS + job.rollout.max_tokens, job.rollout.max_tokens
        per_sequence = hardware.bytes_per_sequence(
            config, tokens, completion, 2, chosen["attn_implementation"], head
        )
        assert chosen["sequence_mb"] == round(per_sequence / 2**20), head
        fits = int(hardware.MEMORY_SHARE * free // per_sequence)
        assert resolved.optim.micro_batch == min(256, 1 << (fits.bit_length() - 1)), head
