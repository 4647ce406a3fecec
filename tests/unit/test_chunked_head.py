"""The chunked head (rl/head.py): the update's log-probabilities and gradients without the full logits.

`TokenLogprobs` against autograd through the full log-softmax (float64 `gradcheck`, and float32 /
bf16 values at every chunk size); the policy's log-probs and LoRA gradients with the chunked head
against the full logits for every family of `tests/families.py` (tiny random checkpoints, random
adapters); which families take it; and the output layer given back after a forward, failed or not.
"""

from __future__ import annotations

import pytest
import torch

from tests.families import FAMILIES, TINY, build_family, save_lora
from tests.unit.test_checkpoint_per_batch import make_policy
from tests.unit.test_update_buckets import batch


def full_logprobs(hidden, weight, bias, targets) -> torch.Tensor:
    logits = torch.nn.functional.linear(hidden.to(weight.dtype), weight, bias).float()
    return logits.log_softmax(-1).gather(-1, targets[:, None]).squeeze(-1)


def test_token_logprobs_passes_gradcheck_at_every_chunk_size() -> None:
    from crucible_trainer.rl.head import TokenLogprobs

    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(7, 5, dtype=torch.float64, generator=gen, requires_grad=True)
    weight = torch.randn(11, 5, dtype=torch.float64, generator=gen)
    bias = torch.randn(11, dtype=torch.float64, generator=gen)
    targets = torch.randint(0, 11, (7,), generator=gen)
    for chunk in (1, 3, 7, 100):
        # float64 in, the float32 logits the head computes: checked in float32's precision
        assert torch.autograd.gradcheck(
            lambda h, c=chunk: TokenLogprobs.apply(h, weight, bias, targets, c).double(),
            (hidden,),
            eps=1e-3,
            atol=1e-3,
            rtol=1e-3,
        )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_token_logprobs_equal_the_full_log_softmax(dtype) -> None:
    from crucible_trainer.rl.head import TokenLogprobs

    gen = torch.Generator().manual_seed(1)
    weight = torch.randn(300, 16, generator=gen).to(dtype)
    targets = torch.randint(0, 300, (29,), generator=gen)
    g = torch.randn(29, generator=gen)
    base = torch.randn(29, 16, generator=gen).to(dtype)

    ref_h = base.clone().requires_grad_(True)
    ref = full_logprobs(ref_h, weight, None, targets)
    (ref * g).sum().backward()
    for chunk in (1, 4, 29, 64):
        h = base.clone().requires_grad_(True)
        got = TokenLogprobs.apply(h, weight, None, targets, chunk)
        (got * g).sum().backward()
        assert got.dtype == torch.float32 and torch.allclose(got, ref, atol=1e-5, rtol=1e-5), chunk
        # float32: the products' sums in another order per chunk size (a matrix-vector product at a
        # chunk of 1) differ by a few units of the last place on some CPUs
        tol = 1e-5 if dtype == torch.float32 else 1e-2
        assert h.grad.dtype == dtype and torch.allclose(h.grad.float(), ref_h.grad.float(), atol=tol), chunk


def autograd_kept(logits, targets, mask) -> torch.Tensor:
    """What the policy computed from the kept logits before `kept_logprobs`."""
    x = logits[:, :-1, :].float()
    return (x.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(x, -1)) * mask


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kept_logprobs_give_autograd_s_values_and_gradient(dtype) -> None:
    """`kept_logprobs` (its functions eager: compiled on CUDA, tests/unit/test_fused_gpu.py) against
    autograd through the float32 copy: values, the logits' gradient (the last position's zero), and
    a float64 gradcheck of its backward's formula."""
    from crucible_trainer.rl.head import kept_logprobs

    gen = torch.Generator().manual_seed(0)
    logits = (torch.randn(3, 6, 50, generator=gen) * 4).to(dtype)
    targets = torch.randint(0, 50, (3, 5), generator=gen)
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1], [0, 0, 0, 0, 1]], dtype=torch.float32)
    weights = torch.randn(3, 5, generator=gen)
    want_in, got_in = logits.clone().requires_grad_(), logits.clone().requires_grad_()
    want = autograd_kept(want_in, targets, mask)
    got = kept_logprobs(got_in, targets, mask, compiled=False)
    assert got.dtype == torch.float32 and torch.equal(got == 0, mask == 0)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    (want * weights).sum().backward()
    (got * weights).sum().backward()
    assert got_in.grad.dtype == dtype and not got_in.grad[:, -1].any()
    torch.testing.assert_close(
        got_in.grad, want_in.grad, rtol=0, atol=1e-6 if dtype == torch.float32 else 1e-2
    )
    double = torch.randn(2, 4, 9, dtype=torch.float64, generator=gen, requires_grad=True)
    picks, keep = torch.randint(0, 9, (2, 3), generator=gen), torch.tensor([[1.0, 1, 0], [1, 1, 1]])
    assert torch.autograd.gradcheck(  # float64 in, float32 inside: checked in float32's precision
        lambda x: kept_logprobs(x, picks, keep, compiled=False).double(),
        (double,),
        eps=1e-3,
        atol=1e-3,
        rtol=1e-3,
    )


def test_kept_kernels_that_fail_to_compile_run_eager_and_out_of_memory_propagates() -> None:
    from crucible_trainer.rl.head import _or_eager

    calls = {"compiled": 0, "eager": 0}

    def broken(*args):
        calls["compiled"] += 1
        raise RuntimeError("inductor: no C compiler")

    def eager(x):
        calls["eager"] += 1
        return x + 1

    run = _or_eager(broken, eager)
    assert run(1) == 2 and run(2) == 3
    assert calls == {"compiled": 1, "eager": 2}  # the compiler is not tried again

    def out_of_memory(*args):
        raise torch.OutOfMemoryError("CUDA out of memory")

    with pytest.raises(torch.OutOfMemoryError):
        _or_eager(out_of_memory, eager)(1)


def test_which_families_take_the_chunked_head() -> None:
    from crucible_trainer.rl.head import plain_head
    from transformers import AutoConfig

    taken = {
        name: plain_head(AutoConfig.for_model(kind, **(TINY | cfg))) for name, (kind, cfg) in FAMILIES.items()
    }
    # Gemma-2 soft-caps its logits after the head: the full logits. Every other family: the chunked head.
    assert taken == {name: name != "gemma2" for name in FAMILIES}
    assert not plain_head(AutoConfig.for_model("cohere"))  # scaled logits (`logit_scale`)
    assert not plain_head(AutoConfig.for_model("granite"))  # divided logits (`logits_scaling`)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_family_gets_the_full_logits_log_probs_and_gradients(family, tmp_path) -> None:
    """Each family users train, its tiny random checkpoint with a random adapter (float32 on a CPU):
    the policy's log-probs and the LoRA gradients of a loss on them, chunked head against full logits."""
    from crucible_trainer.rl.batch import make_batch

    model = build_family(family, tmp_path)
    policy = make_policy(model, save_lora(model, tmp_path / "adapter", seed=5, rank=4, scale=0.05))
    samples = batch()
    made = make_batch(
        [s.prompt_ids for s in samples], [s.completion_ids for s in samples], policy.pad_id, policy.device
    )
    weights = torch.linspace(-1.0, 1.0, made.tail_mask.numel()).view_as(made.tail_mask)

    def run() -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        policy.optimizer.zero_grad(set_to_none=True)
        logp = policy.token_logprobs(made)
        (logp * weights).sum().backward()
        grads = {n: p.grad.clone() for n, p in policy.model.named_parameters() if p.grad is not None}
        return logp.detach(), grads

    policy.head_mode = "full"
    full, full_grads = run()
    policy.head_mode = "auto"  # on a CPU: the chunked head wherever the family takes it
    got, grads = run()
    assert (policy.head is None) == (family == "gemma2")
    assert torch.equal(got == 0, made.tail_mask == 0) or family == "gemma2"
    assert torch.allclose(got, full, atol=1e-5, rtol=1e-5)
    assert grads.keys() == full_grads.keys() and grads
    for name, g in full_grads.items():
        assert torch.allclose(grads[name], g, atol=1e-6, rtol=1e-4), name


def test_the_output_layer_is_given_back_after_a_forward_that_failed(tmp_path) -> None:
    from crucible_trainer.rl.batch import make_batch

    model = build_family("qwen2", tmp_path)
    policy = make_policy(model, save_lora(model, tmp_path / "adapter", seed=5, rank=4, scale=0.05))
    head = policy.head
    assert head is not None and "forward" not in vars(head)
    made = make_batch([[5, 6, 7]], [[8, 9]], policy.pad_id, policy.device)
    bad = make_batch([[5, 6, 7]], [[8, 10**7]], policy.pad_id, policy.device)  # an id past the vocabulary
    with pytest.raises((IndexError, RuntimeError)):
        policy.token_logprobs(bad)
    assert "forward" not in vars(head)  # the layer computes logits again
    logits = policy.model(input_ids=made.input_ids, attention_mask=made.attention_mask).logits
    assert logits.shape[-1] == head.out_features


def test_a_gpu_takes_the_chunked_head_only_where_the_full_logits_do_not_fit(tmp_path, monkeypatch) -> None:
    """`head_mode: auto` with the free memory known (a GPU's; set here by hand): a micro-batch whose
    full logits fit keeps them, one that fits only through the chunked head takes it, one that
    fits neither way is checkpointed too; the gradient is the same every way."""
    from crucible_trainer.runtime import hardware
    from crucible_trainer.runtime.hardware import MICRO_BATCH_SHARE, bytes_per_sequence, head_workspace

    model = build_family("qwen2", tmp_path)
    policy = make_policy(model, save_lora(model, tmp_path / "adapter", seed=5, rank=4, scale=0.05))
    config = policy.model.get_base_model().config
    # Chunks of 2 tokens: this batch's micro-batches hold a few completion tokens where a real one
    # holds thousands, more than a chunk (883 at Qwen2.5's vocabulary), as here.
    monkeypatch.setattr(hardware, "CHUNK_ELEMENTS", 2 * config.vocab_size)

    def need(rows: int, width: int, tail: int, head: str) -> int:
        extra = head_workspace(config, rows * tail) if head == "chunked" else 0
        return rows * bytes_per_sequence(config, width, tail, 4, "sdpa", head) + extra

    # The longest micro-batch (3 rows of 16 tokens, tails of 8: test_update_buckets.batch) against
    # the next (3 rows of 7, tails of 4) and the last (1 row of 2, tail 1).
    longest_full, longest_chunked = need(3, 16, 8, "full"), need(3, 16, 8, "chunked")
    assert longest_chunked < need(3, 7, 4, "full") < longest_full
    cases = {  # free memory -> (micro-batches through the chunked head, checkpointed)
        2**50: (0.0, 0.0),
        int((need(3, 7, 4, "full") + longest_full) / 2 / MICRO_BATCH_SHARE): (1.0, 0.0),
        1: (3.0, 3.0),
    }

    def gradient(free: int) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
        from crucible_trainer.rl.update import UpdateConfig, update

        seen: list[dict[str, torch.Tensor]] = []

        def record() -> float:  # the gradient, no step: every update starts from the same weights
            seen.append({n: p.grad.clone() for n, p in policy.model.named_parameters() if p.grad is not None})
            policy.optimizer.zero_grad(set_to_none=True)
            return 0.0

        policy.free_memory, policy.step = (lambda: free), record
        return seen, update(policy, batch(), UpdateConfig(micro_batch=3))

    reference = gradient(2**50)[0][0]
    for free, (chunked, checkpointed) in cases.items():
        seen, metrics = gradient(free)
        grads = seen[0]
        assert metrics["update/micro_batches"] == 3.0
        assert metrics["update/chunked_head_micro_batches"] == chunked, free
        assert metrics["update/checkpointed_micro_batches"] == checkpointed, free
        for name, g in reference.items():
            assert torch.allclose(grads[name], g, atol=1e-6, rtol=1e-5), name


def test_an_output_layer_that_trains_or_is_wrapped_keeps_the_full_logits(tmp_path) -> None:
    """A head with trainable weights (an adapter or `modules_to_save` on it) or one that is not a
    plain `nn.Linear` (PEFT's wrappers): the chunked head would compute another gradient, so none."""
    from crucible_trainer.rl.head import output_layer

    model = build_family("llama", tmp_path)
    policy = make_policy(model, save_lora(model, tmp_path / "adapter", seed=5, rank=4, scale=0.05))
    base = policy.model.get_base_model()
    head = base.get_output_embeddings()
    assert output_layer(base) is head
    head.weight.requires_grad_(True)
    assert output_layer(base) is None
    head.weight.requires_grad_(False)

    class Wrapped(torch.nn.Module):
        def __init__(self, inner: torch.nn.Linear) -> None:
            super().__init__()
            self.inner, self.weight = inner, inner.weight

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.inner(x)

    base.set_output_embeddings(Wrapped(head))
    assert output_layer(base) is None
