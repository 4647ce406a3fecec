"""The update's forwards without a padding mask (`rl.head.unmasked_hidden`), on every family's tiny
checkpoint: each row's padding moved to its end gives the log-probs and gradients of the
left-padded, masked forward, through the chunked head and through the full logits, for training
passes and for scoring; the families whose logits are not the output layer's alone keep the
masked forward.
"""

from __future__ import annotations

import pytest
import torch

from tests.families import FAMILIES, build_family
from tests.unit.test_update_attention import make_policy
from tests.unit.test_update_buckets import batch


def logprobs_and_grads(policy, checkpoint: bool = False):
    from crucible_trainer.rl.batch import make_batch

    samples = batch()
    b = make_batch(
        [s.prompt_ids for s in samples], [s.completion_ids for s in samples], policy.pad_id, policy.device
    )
    assert (b.attention_mask == 0).any()  # rows of several lengths: padding to move
    policy.model.zero_grad(set_to_none=True)
    logp = policy.token_logprobs(b)
    unmasked = policy._unmasked_now
    # Weighted unevenly, so that a gradient reaching the wrong position would show.
    (logp * torch.linspace(0.5, 2.0, logp.shape[1], device=logp.device)).sum().backward()
    grads = {n: p.grad.clone() for n, p in policy.model.named_parameters() if p.grad is not None}
    return logp.detach(), grads, unmasked


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_the_unmasked_forward_gives_the_masked_forwards_logprobs_and_gradients(family, tmp_path) -> None:
    policy = make_policy(build_family(family, tmp_path), checkpointing=False)
    for head_mode in ("chunked", "full"):
        policy.head_mode, policy.unmasked = head_mode, True
        got, got_grads, unmasked = logprobs_and_grads(policy)
        if policy.head is None:  # soft-capped logits (Gemma-2): the masked forward, as before
            assert not unmasked
            continue
        assert unmasked, head_mode
        policy.unmasked = False
        want, want_grads, unmasked = logprobs_and_grads(policy)
        assert not unmasked
        assert (want != 0).sum() == sum(len(s.completion_ids) for s in batch())
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        assert got_grads.keys() == want_grads.keys() and got_grads
        for name in got_grads:
            torch.testing.assert_close(got_grads[name], want_grads[name], rtol=1e-4, atol=1e-6)


def test_scoring_and_the_reference_take_the_unmasked_forward_with_the_same_values(
    tmp_path, monkeypatch
) -> None:
    policy = make_policy(build_family("qwen2", tmp_path), checkpointing=False)
    samples = batch()
    prompts, completions = [s.prompt_ids for s in samples], [s.completion_ids for s in samples]
    masks = []
    plain = policy.runner.forward

    def recording(*args, **kwargs):
        masks.append(kwargs.get("attention_mask"))
        return plain(*args, **kwargs)

    monkeypatch.setattr(policy.runner, "forward", recording)
    got = policy.score(prompts, completions, micro_batch=4)
    assert len(masks) == 3 and all(m is None for m in masks)
    policy.unmasked = False
    want = policy.score(prompts, completions, micro_batch=4)
    assert len(masks) == 6 and all(m is not None for m in masks[3:])
    for g, w, c in zip(got, want, completions, strict=True):
        assert len(g) == len(c)
        torch.testing.assert_close(torch.tensor(g), torch.tensor(w), rtol=1e-5, atol=1e-5)


def test_a_checkpointed_unmasked_pass_gives_the_same_gradients(tmp_path) -> None:
    policy = make_policy(build_family("llama", tmp_path), checkpointing=True)
    got, got_grads, unmasked = logprobs_and_grads(policy)
    assert unmasked
    policy.unmasked = False
    want, want_grads, _ = logprobs_and_grads(policy)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for name in got_grads:
        torch.testing.assert_close(got_grads[name], want_grads[name], rtol=1e-4, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("family", ["llama", "qwen2-tied", "qwen3", "mistral"])
def test_on_cuda_the_unmasked_forward_takes_the_flash_kernel_with_the_masked_values(family, tmp_path) -> None:
    """In bf16 on a GPU: the masked forward runs SDPA's memory-efficient kernel, the unmasked one
    its flash kernel, forward and backward, and the log-probs agree as two bf16 kernels do."""
    from crucible_shared.jobs import TrainJob
    from crucible_trainer.rl.policy import Policy
    from torch.profiler import ProfilerActivity, profile

    model = build_family(family, tmp_path)
    spec = TrainJob.model_validate(
        {"model": {"base": str(model), "device": "cuda", "dtype": "bfloat16"}, "optim": {"micro_batch": 4}}
    )
    policy = Policy(spec.model, spec.optim, 3)
    runs = {}
    for unmasked in (True, False):
        policy.unmasked = unmasked
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            logp, _grads, _ = logprobs_and_grads(policy)
        names = {e.name for e in prof.events()}
        runs[unmasked] = logp, names
    got, flash = runs[True]
    want, masked = runs[False]
    assert "aten::_flash_attention_forward" in flash and "aten::_flash_attention_backward" in flash
    assert "aten::_flash_attention_forward" not in masked
    assert "aten::_efficient_attention_forward" in masked
    torch.testing.assert_close(got, want, rtol=0, atol=0.05)
