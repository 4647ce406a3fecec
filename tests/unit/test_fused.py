"""`rl/fused.py` swaps the norms and gated MLPs of the families it knows, instance by instance, and
back; here with reference functions in place of Liger's Triton kernels (CPU), so that what is
checked is which modules are swapped and with which weights and epsilon. Liger's kernels against
transformers are checked on CUDA (tests/unit/test_fused_gpu.py)."""

from __future__ import annotations

import pytest
import torch
from crucible_trainer.rl import fused

from tests.families import family_config

CALLS = {"norm": 0, "mlp": 0}


def rms_norm(x, weight, eps):
    CALLS["norm"] += 1
    h = x.float()
    return weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def silu_mul(gate, up):
    CALLS["mlp"] += 1
    return torch.nn.functional.silu(gate) * up


def tiny(name: str, lora: bool = False):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    config = family_config(name)
    config.rms_norm_eps = 1e-3  # not the default: a swapped norm must carry the module's own
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for module in model.modules():  # norms away from 1, so the weight used shows
            if type(module).__name__ in fused.NORMS:
                module.weight.uniform_(0.5, 1.5)
    if lora:
        model = get_peft_model(model, LoraConfig(r=4, target_modules="all-linear", init_lora_weights=False))
    return model


IDS = torch.tensor([[5, 17, 300, 42, 9, 1000, 77]])


@pytest.mark.parametrize(
    ("name", "norms_per_layer"), [("llama", 2), ("qwen2", 2), ("qwen3", 4), ("mistral", 2)]
)
@pytest.mark.parametrize("lora", [False, True])
def test_fused_modules_compute_what_transformers_computes(name, norms_per_layer, lora):
    model = tiny(name, lora)
    layers = model.config.num_hidden_layers
    with torch.no_grad():
        want = model(IDS).logits
    swapped = fused.fuse(model, (rms_norm, silu_mul))
    assert swapped == layers * (norms_per_layer + 1) + 1  # each layer's norms and MLP, and the final norm
    CALLS.update(norm=0, mlp=0)
    with torch.no_grad():
        got = model(IDS).logits
    assert CALLS["mlp"] == layers and CALLS["norm"] == layers * norms_per_layer + 1
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert fused.fuse(model, (rms_norm, silu_mul)) == 0  # already swapped: nothing twice
    assert fused.unfuse(model) == swapped
    CALLS.update(norm=0, mlp=0)
    with torch.no_grad():
        again = model(IDS).logits
    assert CALLS == {"norm": 0, "mlp": 0}
    torch.testing.assert_close(again, want, rtol=0, atol=0)


def test_gradients_reach_the_adapter_through_the_fused_mlp():
    model = tiny("llama", lora=True)
    model.train()
    model(IDS).logits.logsumexp(-1).sum().backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    fused.fuse(model, (rms_norm, silu_mul))
    model(IDS).logits.logsumexp(-1).sum().backward()
    got = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert got.keys() == want.keys() and any("mlp.gate_proj.lora_A" in n for n in got)
    for n in want:
        torch.testing.assert_close(got[n], want[n], rtol=1e-4, atol=1e-6)


def test_families_whose_modules_compute_otherwise_are_left_alone():
    """Gemma's norms scale by `1 + weight` and its MLPs use GELU: nothing is swapped."""
    assert fused.fuse(tiny("gemma2"), (rms_norm, silu_mul)) == 0


def test_nothing_is_swapped_without_the_kernels(monkeypatch):
    monkeypatch.setattr(fused, "kernels", lambda: None)
    model = tiny("llama")
    assert fused.fuse(model) == 0 and not any("forward" in vars(m) for m in model.modules())
