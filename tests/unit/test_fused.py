"""`rl/fused.py` swaps the norms, gated MLPs and rotary embeddings of the families it knows, instance
by instance, and back; here with reference functions in place of Liger's Triton kernels (CPU), so
that what is checked is which modules are swapped and with which weights and epsilon. Liger's kernels against
transformers are checked on CUDA (tests/unit/test_fused_gpu.py)."""

from __future__ import annotations

import pytest
import torch
from crucible_trainer.rl import fused

from tests.families import family_config

CALLS = {"norm": 0, "mlp": 0, "rope": 0}


def rms_norm(x, weight, eps):
    CALLS["norm"] += 1
    h = x.float()
    return weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def silu_mul(gate, up):
    CALLS["mlp"] += 1
    return torch.nn.functional.silu(gate) * up


def rope(q, k, cos, sin):
    CALLS["rope"] += 1
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)

    def rotated(x):
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((-x2, x1), dim=-1)

    return q * cos + rotated(q) * sin, k * cos + rotated(k) * sin


KERNELS = fused.Kernels(rms_norm, silu_mul, rope)


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
    swapped = fused.fuse(model, KERNELS)
    # each layer's norms, MLP and attention, and the final norm
    assert swapped == layers * (norms_per_layer + 2) + 1
    CALLS.update(norm=0, mlp=0, rope=0)
    with torch.no_grad():
        got = model(IDS).logits
    assert CALLS["mlp"] == layers and CALLS["norm"] == layers * norms_per_layer + 1
    assert CALLS["rope"] == layers
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert fused.fuse(model, KERNELS) == 0  # already swapped: nothing twice
    assert fused.unfuse(model) == swapped
    CALLS.update(norm=0, mlp=0, rope=0)
    with torch.no_grad():
        again = model(IDS).logits
    assert CALLS == {"norm": 0, "mlp": 0, "rope": 0}
    torch.testing.assert_close(again, want, rtol=0, atol=0)


def test_gradients_reach_the_adapter_through_the_fused_mlp():
    model = tiny("llama", lora=True)
    model.train()
    model(IDS).logits.logsumexp(-1).sum().backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    fused.fuse(model, KERNELS)
    model(IDS).logits.logsumexp(-1).sum().backward()
    got = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert got.keys() == want.keys() and any("mlp.gate_proj.lora_A" in n for n in got)
    for n in want:
        torch.testing.assert_close(got[n], want[n], rtol=1e-4, atol=1e-6)


def test_the_rotary_kernel_serves_only_the_attention_modules_swapped():
    """The dispatcher in the family's namespace takes the fused function inside a swapped attention
    module's call only: another model of the same family, its rotary function called directly and
    a call with more arguments compute transformers' own; without `rope` no attention is swapped."""
    from transformers.models.llama import modeling_llama

    model, other = tiny("llama"), tiny("llama")
    layers = model.config.num_hidden_layers
    assert fused.fuse(other, KERNELS, rope=False) == layers * 3 + 1  # norms and MLPs only
    fused.unfuse(other)
    fused.fuse(model, KERNELS)
    dispatcher = modeling_llama.apply_rotary_pos_emb
    assert dispatcher.dispatches and fused.fuse(tiny("llama"), KERNELS) > 0  # installed once
    assert modeling_llama.apply_rotary_pos_emb is dispatcher
    CALLS.update(rope=0)
    with torch.no_grad():
        want = other(IDS).logits
        q, k = torch.randn(1, 2, 7, 16), torch.randn(1, 2, 7, 16)
        cos, sin = torch.randn(1, 7, 16), torch.randn(1, 7, 16)
        direct = dispatcher(q, k, cos, sin)
    assert CALLS["rope"] == 0
    torch.testing.assert_close(direct[0], dispatcher.original(q, k, cos, sin)[0], rtol=0, atol=0)
    with torch.no_grad():
        got = model(IDS).logits
    assert CALLS["rope"] == layers
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)  # the same seed: the same weights


def test_families_whose_modules_compute_otherwise_are_left_alone():
    """Gemma's norms scale by `1 + weight` and its MLPs use GELU: nothing is swapped."""
    assert fused.fuse(tiny("gemma2"), KERNELS) == 0


def test_nothing_is_swapped_without_the_kernels(monkeypatch):
    monkeypatch.setattr(fused, "kernels", lambda: None)
    model = tiny("llama")
    assert fused.fuse(model) == 0 and not any("forward" in vars(m) for m in model.modules())


# -- LoRA layers (`fuse_lora`, any device: no package needed) ----------------------------------------


def lora_model(name: str, dropout: float = 0.0):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(family_config(name))
    config = LoraConfig(
        r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=dropout, init_lora_weights=False
    )
    return get_peft_model(model, config).train()


def counted(monkeypatch) -> dict[str, int]:
    calls = {"n": 0}
    real = fused.lora_forward

    def spy(layer, x):
        calls["n"] += 1
        return real(layer, x)

    monkeypatch.setattr(fused, "lora_forward", spy)
    return calls


def logits_and_grads(model, ids):
    model.zero_grad()
    logits = model(ids).logits
    logits.float().logsumexp(-1).sum().backward()
    return logits.detach().float(), {
        n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None
    }


@pytest.mark.parametrize("name", ["llama", "qwen2", "qwen3", "mistral", "gemma2", "phi3", "gpt-oss"])
def test_fused_lora_layers_give_peft_s_logits_and_gradients(name, monkeypatch):
    from peft.tuners.lora.layer import Linear

    model = lora_model(name)
    ids = torch.randint(10, 1000, (3, 9))
    want, want_grads = logits_and_grads(model, ids)
    layers = sum(type(m) is Linear for m in model.modules())
    calls = counted(monkeypatch)
    assert fused.fuse_lora(model) == layers > 0
    got, got_grads = logits_and_grads(model, ids)
    assert calls["n"] == layers  # every adapted layer took the fused forward, once
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert got_grads.keys() == want_grads.keys() and any("lora_B" in n for n in got_grads)
    for n in want_grads:
        torch.testing.assert_close(got_grads[n], want_grads[n], rtol=1e-4, atol=1e-6)
    fused.unfuse(model)
    assert not any("forward" in vars(m) for m in model.modules())


def mixed(model):
    """The trainer's mixed precision (`Policy.mixed_precision`): a bf16 base, a float32 adapter,
    PEFT's input casting off, the passes under autocast."""
    from crucible_trainer.rl.policy import set_input_casting

    for name, p in model.named_parameters():
        if "lora_" not in name:
            p.data = p.data.to(torch.bfloat16)
    set_input_casting(model, enabled=False)
    return model


def flat(grads):
    return torch.cat([grads[n].float().flatten() for n in sorted(grads)])


def test_fused_lora_layers_in_the_trainer_s_mixed_precision_stay_near_peft_s(monkeypatch):
    """bf16 products of a bf16 base and a float32 adapter under autocast: the fused layer rounds
    once where PEFT rounds the product, its scaling and the sum. Within twice PEFT's distance to
    float32, and the gradients pointing PEFT's way."""
    model = lora_model("qwen2")  # q/k/v biases
    ids = torch.randint(10, 1000, (2, 12))
    exact, exact_grads = logits_and_grads(model, ids)
    model = mixed(model)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        plain, plain_grads = logits_and_grads(model, ids)
        fused.fuse_lora(model)
        calls = counted(monkeypatch)
        got, got_grads = logits_and_grads(model, ids)
    assert calls["n"] > 0
    assert (got - exact).abs().max() <= 2 * (plain - exact).abs().max() + 1e-3
    assert torch.nn.functional.cosine_similarity(flat(got_grads), flat(plain_grads), dim=0) > 0.99
    assert torch.nn.functional.cosine_similarity(flat(got_grads), flat(exact_grads), dim=0) > 0.99


def test_peft_s_casting_mode_keeps_peft_s_forward(monkeypatch):
    """A bf16 base and a float32 adapter without autocast (`mixed_precision(False)`): PEFT adds
    in float32 and rounds once, which the fused layer would not, so PEFT's forward runs."""
    from crucible_trainer.rl.policy import set_input_casting

    model = mixed(lora_model("llama"))
    set_input_casting(model, enabled=True)
    ids = torch.randint(10, 1000, (2, 9))
    want, want_grads = logits_and_grads(model, ids)
    fused.fuse_lora(model)
    calls = counted(monkeypatch)
    got, got_grads = logits_and_grads(model, ids)
    assert calls["n"] == 0
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    for n in want_grads:
        torch.testing.assert_close(got_grads[n], want_grads[n], rtol=0, atol=0)


@pytest.mark.parametrize("reentrant", [False, True])
def test_fused_lora_layers_under_gradient_checkpointing_give_peft_s_gradients(reentrant, monkeypatch):
    model = lora_model("qwen3")
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    model.enable_input_require_grads()
    ids = torch.randint(10, 1000, (2, 9))
    want, want_grads = logits_and_grads(model, ids)
    fused.fuse_lora(model)
    calls = counted(monkeypatch)
    got, got_grads = logits_and_grads(model, ids)
    assert calls["n"] > 0
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert got_grads.keys() == want_grads.keys()
    for n in want_grads:
        torch.testing.assert_close(got_grads[n], want_grads[n], rtol=1e-4, atol=1e-6)


def test_hooks_on_the_skipped_layers_keep_peft_s_forward(monkeypatch):
    """The fused layer does not call its base layer or `lora_B`: a hook there (or a global one)
    must still run, so those calls take PEFT's forward."""
    from peft.tuners.lora.layer import Linear

    model = lora_model("llama")
    ids = torch.randint(10, 1000, (1, 5))
    layers = [m for m in model.modules() if type(m) is Linear]
    fused.fuse_lora(model)
    calls = counted(monkeypatch)
    seen = []
    handles = [layers[0].base_layer.register_forward_hook(lambda *a: seen.append("base"))]
    handles.append(layers[1].lora_B["default"].register_forward_pre_hook(lambda *a: seen.append("lora_B")))
    with torch.no_grad():
        model(ids)
    assert sorted(seen) == ["base", "lora_B"] and calls["n"] == len(layers) - 2
    for handle in handles:
        handle.remove()
    calls["n"] = 0
    handle = torch.nn.modules.module.register_module_forward_hook(lambda *a: None)
    try:
        with torch.no_grad():
            model(ids)
    finally:
        handle.remove()
    assert calls["n"] == 0


def test_fused_lora_layers_leave_other_states_to_peft(monkeypatch):
    """Adapters disabled (the KL reference's scoring without `init_adapter`), dropout in training, a
    merged adapter: PEFT's own forward, with PEFT's answer."""
    ids = torch.randint(10, 1000, (2, 7))
    model = lora_model("llama")
    with torch.no_grad(), model.disable_adapter():
        plain = model(ids).logits
    fused.fuse_lora(model)
    calls = counted(monkeypatch)
    with torch.no_grad(), model.disable_adapter():
        disabled = model(ids).logits
    assert calls["n"] == 0
    torch.testing.assert_close(disabled, plain, rtol=0, atol=0)

    dropped = lora_model("llama", dropout=0.5)
    torch.manual_seed(1)
    with torch.no_grad():
        draw = dropped(ids).logits
    fused.fuse_lora(dropped)
    torch.manual_seed(1)
    with torch.no_grad():
        again = dropped(ids).logits
    assert calls["n"] == 0  # dropout in training: PEFT's forward draws the same mask
    torch.testing.assert_close(again, draw, rtol=0, atol=0)

    with torch.no_grad():
        want = model(ids).logits
        assert calls["n"] > 0
        model.merge_adapter()
        calls["n"] = 0
        merged = model(ids).logits
    assert calls["n"] == 0
    torch.testing.assert_close(merged, want, rtol=1e-4, atol=1e-4)
