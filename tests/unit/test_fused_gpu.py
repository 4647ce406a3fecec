"""On CUDA: Liger's fused norms and MLPs and the fused LoRA layers (`rl/fused.py`) against
transformers' and PEFT's own, on tiny random-weight checkpoints of every family they are swapped
into, in bfloat16 with a LoRA adapter on every linear layer (as the trainer runs them):
log-probabilities as close to float32's as transformers' own bf16 ones are, and the adapter's
gradients pointing the same way.

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
