"""The fast path's fused RMSNorm: the same function as the model's own norm, or left alone."""

from __future__ import annotations

import copy

import pytest
import torch
from crucible_generator.norms import fuse_rms_norms


class GemmaStyleRMSNorm(torch.nn.Module):
    """Scales by `1 + weight`: not what `F.rms_norm` computes, so it must keep its own forward."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(dim))
        self.variance_epsilon = 1e-6

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        out = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return (out * (1.0 + self.weight.float())).to(x.dtype)


@pytest.fixture(scope="module")
def smollm2():
    import crucible_models as models

    model, tokenizer = models.load_model(device="cpu")
    return model, tokenizer


def test_every_smollm2_norm_is_fused_and_the_logits_do_not_move(smollm2) -> None:
    model, tokenizer = smollm2
    ids = torch.tensor([tokenizer.encode("def max_of_three(a, b, c):\n    return")])
    fused = copy.deepcopy(model)
    assert fuse_rms_norms(fused) == model.config.num_hidden_layers * 2 + 1
    assert fused.model.norm.forward.__func__.__name__ == "_fused"
    with torch.no_grad():
        assert torch.allclose(fused(ids).logits, model(ids).logits, atol=1e-4, rtol=1e-4)


def test_a_norm_of_another_form_keeps_its_own_forward() -> None:
    norm = GemmaStyleRMSNorm(64)
    own = norm.forward
    assert fuse_rms_norms(torch.nn.Sequential(norm)) == 0
    assert norm.forward == own
    x = torch.randn(3, 64)
    assert torch.allclose(norm(x), x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6), atol=1e-6)


def test_the_merged_copy_of_the_fast_path_uses_fused_norms(smollm2) -> None:
    from crucible_generator.fastpath import MergedModel

    model, _ = smollm2
    merged = MergedModel(model)
    assert merged.fused_norms == model.config.num_hidden_layers * 2 + 1
    # The served base model itself is untouched (the eager path and the trainer's view of it).
    assert "forward" not in vars(model.model.norm)
