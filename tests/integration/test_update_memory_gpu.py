"""On CUDA: the update's memory estimate (`hardware.bytes_per_sequence`) covers what a training
micro-batch really takes, without checkpointing, and not by a wide margin: with the full logits
(through autograd's float32 log-softmax and through the kept logits' kernels) and with the chunked
head (rl/head.py).

Gradient checkpointing on `auto` is decided per micro-batch from that estimate against the free
memory (`Policy._plan`), so an estimate below the real peak would run a micro-batch out
of memory, and one far above it would recompute forwards for nothing. Two geometries in bf16 with
a rank-16 float32 adapter on every linear layer, each micro-batch's peak over what was allocated
before its forward: SmolLM2-135M's (the built-in model) and Qwen2.5-Coder-1.5B's widths and
vocabulary on 8 layers (the estimate is linear in layers). The figures print as JSON lines.
First, the policy's kernel warm-up (`Policy.warm_kernels`) on the same geometries.

Run on the GPU machine: `bash bench/gpu.sh gpu-tests tests/integration/test_update_memory_gpu.py`.
"""

from __future__ import annotations

import json

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

QWEN_1P5B = {"hidden_size": 1536, "intermediate_size": 8960, "num_hidden_layers": 8}
QWEN_1P5B |= {"num_attention_heads": 12, "num_key_value_heads": 2, "vocab_size": 151936}
SMOLLM2 = {"hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30}
SMOLLM2 |= {"num_attention_heads": 9, "num_key_value_heads": 3, "vocab_size": 49152}
SHAPES = [(8, 200, 128), (8, 200, 384), (32, 200, 256)]  # rows, prompt tokens, completion tokens


@pytest.fixture(
    scope="module", params=[("qwen2", QWEN_1P5B), ("llama", SMOLLM2)], ids=["qwen-1p5b", "smollm2"]
)
def policy(request, tmp_path_factory):
    from crucible_shared.jobs import TrainJob
    from crucible_trainer.rl.policy import Policy
    from transformers import AutoConfig

    from bench.model_shapes import shape_tokenizer
    from tests.families import save_checkpoint

    family, geometry = request.param
    root = tmp_path_factory.mktemp(f"memory-{family}")
    tokenizer = shape_tokenizer()  # the built-in model's, or Qwen's where only Qwen is installed
    ids = {f"{k}_token_id": getattr(tokenizer, f"{k}_token_id") for k in ("bos", "eos", "pad")}
    # Every special id inside the vocabulary whichever tokenizer is installed (the estimate reads the config's).
    vocab = max(geometry["vocab_size"], len(tokenizer))
    config = AutoConfig.for_model(family, **(geometry | {"vocab_size": vocab}), **ids)
    model = save_checkpoint(config, root / "model", tokenizer, seed=0, dtype=torch.bfloat16)
    spec = TrainJob.model_validate(
        {
            "model": {
                "base": str(model),
                "device": "cuda",
                "dtype": "bfloat16",
                "gradient_checkpointing": False,
            },
            "optim": {"lr": 1e-5, "micro_batch": 8},
        }
    )
    return Policy(spec.model, spec.optim, spec.seed)


def estimate(policy, rows: int, width: int, tail: int, head: str = "full") -> int:
    """A micro-batch's estimate, its logits held as `head` says (chunked: with its workspace)."""
    from crucible_trainer.runtime.hardware import bytes_per_sequence, head_workspace

    config = policy.model.get_base_model().config
    if head in ("full", "kept"):
        return rows * bytes_per_sequence(config, width, tail, 2, head=head)
    chunked = rows * bytes_per_sequence(config, width, tail, 2, head="chunked")
    return chunked + head_workspace(config, rows * tail)


def test_the_kernel_warm_up_leaves_the_gradient_and_the_generators_as_they_were(policy) -> None:
    """First in this file, so its first call is the process's first use of the policy's kernels
    on this geometry (the fused ones compile unless Triton's cache has them): `warm_kernels` at a
    micro-batch of 32, 200 prompt and 384 completion tokens, twice (both times print), leaves
    the card's and the host's random generators and the gradients as they were, and a training
    pass after it has the gradient of one before it (bf16: cosine > 0.9999)."""
    from crucible_trainer.rl.batch import make_batch

    device = torch.device(policy.device)
    batch = make_batch([[11] * 200, [13] * 90], [[12] * 384, [14] * 20], policy.pad_id, policy.device)

    def gradient() -> torch.Tensor:
        (policy.token_logprobs(batch).sum() * 1e-3).backward()
        grad = flat_grad(policy)
        policy.optimizer.zero_grad(set_to_none=True)
        return grad

    host, card = torch.get_rng_state(), torch.cuda.get_rng_state(device)
    first = policy.warm_kernels(32, 200, 384)
    again = policy.warm_kernels(32, 200, 384)
    before = gradient()
    policy.warm_kernels(32, 200, 384)
    after = gradient()
    assert torch.equal(torch.get_rng_state(), host) and torch.equal(torch.cuda.get_rng_state(device), card)
    assert all(p.grad is None for p in policy.model.parameters())
    cosine = torch.nn.functional.cosine_similarity(before, after, dim=0)
    layers = policy.model.get_base_model().config.num_hidden_layers
    print(
        json.dumps({"layers": layers, "warm_up_first_s": round(first, 2), "warm_up_again_s": round(again, 2)})
    )
    assert cosine > 0.9999


@pytest.mark.parametrize("head", ["full", "kept", "chunked"])
@pytest.mark.parametrize(("rows", "prompt", "tail"), SHAPES)
def test_the_estimate_covers_a_micro_batchs_peak(
    policy, rows: int, prompt: int, tail: int, head: str
) -> None:
    from crucible_trainer.rl.batch import make_batch

    batch = make_batch([[11] * prompt] * rows, [[12] * tail] * rows, policy.pad_id, policy.device)
    assert policy.head is not None  # both geometries' families take the chunked head
    policy.head_mode = "full" if head == "kept" else head
    policy.logprob_kernel = head == "kept"  # "full": autograd's float32 log-softmax
    try:
        policy.optimizer.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        (policy.token_logprobs(batch).sum() * 1e-6).backward()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - before
        policy.optimizer.zero_grad(set_to_none=True)
        expected = estimate(policy, rows, prompt + tail, tail, head)
    finally:
        policy.head_mode, policy.logprob_kernel = "auto", True
    config = policy.model.get_base_model().config
    row = {"head": head, "layers": config.num_hidden_layers, "hidden": config.hidden_size, "rows": rows}
    row |= {"prompt": prompt, "tail": tail, "peak_gib": round(peak / 2**30, 3)}
    print(json.dumps(row | {"estimate_gib": round(expected / 2**30, 3), "ratio": round(expected / peak, 3)}))
    assert peak <= expected <= 1.3 * peak


def test_checkpointing_switched_between_micro_batches_keeps_the_gradient(policy) -> None:
    """`auto` on the card, with the fused kernels: the free memory set between the estimates of a
    step's longest and shorter micro-batches checkpoints the longest only (the non-reentrant form,
    switched on and off within one update), and the gradient points where the update without
    checkpointing points (bf16: cosine > 0.999)."""
    from crucible_trainer.rl.rollout import Sample
    from crucible_trainer.rl.update import UpdateConfig, update
    from crucible_trainer.runtime.hardware import MICRO_BATCH_SHARE

    def sample(group: int, prompt: int, completion: int, advantage: float) -> Sample:
        return Sample(
            group,
            group,
            [11] * prompt,
            [12] * completion,
            "",
            "",
            None,
            None,
            reward=1.0,
            advantage=advantage,
        )

    batch = [
        sample(0, 200, 384, 1.0),
        sample(0, 200, 300, -1.0),
        sample(1, 100, 40, 1.0),
        sample(1, 100, 30, -1.0),
    ]
    cfg = UpdateConfig(micro_batch=2, aggregation="token")

    def gradient(free) -> tuple[torch.Tensor, dict[str, float]]:
        policy.free_memory = free
        seen: list[torch.Tensor] = []
        inner, policy.step = policy.step, lambda: seen.append(flat_grad(policy)) or 0.0
        try:
            metrics = update(policy, batch, cfg)
        finally:
            policy.step = inner
            policy.optimizer.zero_grad(set_to_none=True)
        return seen[0], metrics

    config = policy.model.get_base_model().config
    # The longest at its smallest without checkpointing (through the chunked head or the kept
    # logits, whichever holds less), the short one with its kept logits: between them, only the
    # longest is checkpointed.
    longest = min(estimate(policy, 2, 584, 384, head) for head in ("chunked", "kept"))
    short = estimate(policy, 2, 140, 40, "kept")
    policy.checkpointing = "auto"
    try:
        plain, plain_metrics = gradient(lambda: 2**50)
        mixed, metrics = gradient(lambda: int((longest + short) / 2 / MICRO_BATCH_SHARE))
    finally:
        policy.checkpointing, policy.free_memory = False, policy._free_memory
        policy.model.gradient_checkpointing_disable()
        policy._checkpointing_on = False
    assert plain_metrics["update/checkpointed_micro_batches"] == 0.0
    assert metrics["update/checkpointed_micro_batches"] == 1.0 and metrics["update/micro_batches"] == 2.0
    cosine = torch.nn.functional.cosine_similarity(plain, mixed, dim=0)
    print(json.dumps({"layers": config.num_hidden_layers, "gradient_cosine": round(float(cosine), 6)}))
    assert cosine > 0.999


def flat_grad(policy) -> torch.Tensor:
    return torch.cat([p.grad.float().flatten() for p in policy.model.parameters() if p.grad is not None])


def two_ways(policy, seed: int, first: dict, second: dict) -> tuple[float, float]:
    """A made-up batch's log-probs and adapter gradient with the policy's attributes set as `first`
    says, then as `second` says (put back after): the largest log-prob gap and the gradients' cosine."""
    from crucible_trainer.rl.batch import make_batch

    gen = torch.Generator().manual_seed(seed)
    vocab = policy.head.out_features
    prompts = [torch.randint(10, vocab, (n,), generator=gen).tolist() for n in (200, 120, 60, 30)]
    completions = [torch.randint(10, vocab, (n,), generator=gen).tolist() for n in (384, 200, 40, 1)]
    batch = make_batch(prompts, completions, policy.pad_id, policy.device)
    before = {name: getattr(policy, name) for name in first | second}

    def run(settings: dict) -> tuple[torch.Tensor, torch.Tensor]:
        for name, value in settings.items():
            setattr(policy, name, value)
        policy.optimizer.zero_grad(set_to_none=True)
        logp = policy.token_logprobs(batch)
        (logp.sum() * 1e-3).backward()
        grad = flat_grad(policy)
        policy.optimizer.zero_grad(set_to_none=True)
        return logp.detach(), grad

    try:
        (want, want_grad), (got, grad) = run(first), run(second)
    finally:
        for name, value in before.items():
            setattr(policy, name, value)
    cosine = torch.nn.functional.cosine_similarity(want_grad, grad, dim=0)
    return float((got - want).abs().max()), float(cosine)


def test_the_chunked_head_keeps_log_probs_and_gradient(policy) -> None:
    """On the card, bf16 with the fused kernels: the chunked head's log-probs equal the full
    logits' (within bf16's rounding of one product) and its gradient points the same way."""
    gap, cosine = two_ways(policy, 0, {"head_mode": "full"}, {"head_mode": "chunked"})
    print(json.dumps({"head_logprob_gap": round(gap, 5), "head_gradient_cosine": round(cosine, 6)}))
    assert gap < 0.05 and cosine > 0.999


def test_the_kept_logprobs_keep_log_probs_and_gradient(policy) -> None:
    """On the card, bf16 with the fused kernels, the full logits kept: the log-probs through the
    kept logits' compiled kernels (rl/head.py `kept_logprobs`) equal autograd's float32
    log-softmax of the same logits, and so do the adapter's gradients, to float32's rounding."""
    assert policy.logprob_kernel
    full = {"head_mode": "full"}
    gap, cosine = two_ways(policy, 1, full | {"logprob_kernel": False}, full | {"logprob_kernel": True})
    print(json.dumps({"kept_logprob_gap": round(gap, 6), "kept_gradient_cosine": round(cosine, 7)}))
    assert gap < 1e-3 and cosine > 0.9999


def test_a_step_out_of_memory_runs_again_holding_less(policy, monkeypatch) -> None:
    """Last in this file (it takes an optimizer step). The card runs out for real: its free memory
    filled but for half what a micro-batch takes unchecked, and the estimate believed at an
    eighth (another process may grow beside the trainer, as a generator's graphs do). The step
    runs again, its margin grown each time until the micro-batch would not fit as it ran, until it
    is checkpointed, and trains."""
    from crucible_trainer.rl.rollout import Sample
    from crucible_trainer.rl.update import UpdateConfig, update
    from crucible_trainer.runtime import hardware

    rows, prompt, tail = 32, 200, 256
    gen = torch.Generator().manual_seed(2)
    vocab = policy.head.out_features
    samples = [
        Sample(i // 8, i // 8, torch.randint(10, vocab, (prompt,), generator=gen).tolist(),
               torch.randint(10, vocab, (tail,), generator=gen).tolist(), "", "", None, None,
               reward=float(i % 2), advantage=1.0 if i % 2 else -1.0)
        for i in range(rows)
    ]  # fmt: skip
    unchecked = estimate(policy, rows, prompt + tail, tail, "kept")
    policy.optimizer.zero_grad(set_to_none=True)
    torch.cuda.empty_cache()
    ballast = torch.empty(policy.free_memory() - unchecked // 2, dtype=torch.uint8, device=policy.device)
    monkeypatch.setattr(hardware, "MICRO_BATCH_SHARE", 8.0)
    policy.checkpointing = "auto"
    try:
        metrics = update(policy, samples, UpdateConfig(micro_batch=rows, kl_beta=0.0))
    finally:
        del ballast
        policy.checkpointing, policy.memory_margin = False, 1
        policy._checkpoint(False)
    print(json.dumps({k: v for k, v in metrics.items() if "memory" in k or "micro_batches" in k}))
    assert metrics["update/out_of_memory_retries"] >= 1
    assert metrics["update/checkpointed_micro_batches"] >= 1 and metrics["update/optimizer_steps"] == 1
    assert metrics["grad_norm"] > 0
