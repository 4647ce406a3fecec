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
        tol = 1e-6 if dtype == torch.float32 else 1e-2
        assert h.grad.dtype == dtype and torch.allclose(h.grad.float(), ref_h.grad.float(), atol=tol), chunk


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

    chunked_head, policy.head = policy.head, None
    full, full_grads = run()
    policy.head = chunked_head
    got, grads = run()
    assert (chunked_head is None) == (family == "gemma2")
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
