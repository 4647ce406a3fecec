"""On CUDA: Liger's fused norms, MLPs and rotary embeddings and the fused LoRA layers
(`rl/fused.py`) against transformers' and PEFT's own, on tiny random-weight checkpoints of every
family they are swapped into, in bfloat16 with a LoRA adapter on every linear layer (as the trainer
runs them): log-probabilities as close to float32's as transformers' own bf16 ones are, and the
adapter's gradients pointing the same way. And the kept logits' compiled log-prob kernels
(`rl/head.py`) against autograd's float32 log-softmax.

Run on a GPU machine with liger-kernel installed: `pytest -m gpu tests/unit/test_fused_gpu.py`.
"""

from __future__ import annotations

import pytest
import torch

from tests.families import family_config

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def logprobs_and_grads(model, ids):
    model.zero_grad()
    logprobs = torch.log_softmax(model(ids).logits.float(), -1)
    picked = logprobs[:, :-1].gather(-1, ids[:, 1:, None])[..., 0]
    picked.sum().backward()
    grads = torch.cat([p.grad.float().flatten() for n, p in model.named_parameters() if "lora_" in n])
    return picked.detach(), grads


@pytest.mark.parametrize("name", ["llama", "qwen2", "qwen3", "mistral"])
def test_fused_kernels_match_transformers_in_bf16(name):
    from crucible_trainer.rl import fused
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    assert fused.kernels() is not None, (
        "liger-kernel is not installed (pip install 'crucible-trainer[fused]')"
    )
    torch.manual_seed(0)
    config = family_config(name)
    reference = AutoModelForCausalLM.from_config(config).cuda()
    lora = LoraConfig(r=8, target_modules="all-linear", init_lora_weights=False)
    reference = get_peft_model(reference, lora)
    ids = torch.randint(10, config.vocab_size, (4, 96), device="cuda")
    exact, exact_grads = logprobs_and_grads(reference, ids)  # float32
    model = reference.to(torch.bfloat16)
    plain, plain_grads = logprobs_and_grads(model, ids)
    layers = fused.fuse_lora(model)
    assert layers > 0 and fused.fuse(model) > 0
    got, got_grads = logprobs_and_grads(model, ids)
    assert fused.unfuse(model) > layers
    plain_error = (plain - exact).abs().max().item()
    assert (got - exact).abs().max().item() <= 2 * plain_error + 1e-3
    cosine = torch.nn.functional.cosine_similarity(got_grads, plain_grads, dim=0).item()
    assert cosine > 0.99, cosine
    assert torch.nn.functional.cosine_similarity(got_grads, exact_grads, dim=0).item() > 0.98


def test_compiled_kept_logprobs_match_autograd_s():
    """`kept_logprobs` compiled (dynamic shapes: several batch shapes and vocabularies) against
    autograd through the float32 copy, from the same bf16 logits: values to float32's rounding of
    the log-sum-exp, the logits' gradient to one bf16 rounding; without a gradient too."""
    from crucible_trainer.rl.head import kept_logprobs

    def autograd_kept(logits, targets, mask):
        x = logits[:, :-1, :].float()
        return (x.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(x, -1)) * mask

    gen = torch.Generator(device="cuda").manual_seed(0)
    for rows, tail, vocab in [(4, 97, 49152), (3, 33, 151936), (1, 5, 1000), (8, 256, 49152)]:
        logits = (torch.randn(rows, tail + 1, vocab, device="cuda", generator=gen) * 6).bfloat16()
        targets = torch.randint(0, vocab, (rows, tail), device="cuda", generator=gen)
        mask = (torch.arange(tail, device="cuda") >= torch.arange(rows, device="cuda")[:, None] * 2).float()
        weights = torch.randn(rows, tail, device="cuda", generator=gen)
        want_in, got_in = logits.clone().requires_grad_(), logits.clone().requires_grad_()
        want = autograd_kept(want_in, targets, mask)
        got = kept_logprobs(got_in, targets, mask)
        torch.testing.assert_close(got, want, rtol=0, atol=1e-4)
        assert torch.equal(got == 0, mask == 0)
        (want * weights).sum().backward()
        (got * weights).sum().backward()
        assert got_in.grad.dtype == torch.bfloat16 and not got_in.grad[:, -1].any()
        torch.testing.assert_close(got_in.grad.float(), want_in.grad.float(), rtol=1e-2, atol=1e-6)
        with torch.no_grad():
            torch.testing.assert_close(kept_logprobs(logits, targets, mask), want.detach(), rtol=0, atol=1e-4)
