"""RMSNorm as one fused kernel in the fast path's copy of the model.

transformers writes the Llama family's RMSNorm as eight tensor operations (two casts, pow, mean,
add, rsqrt, two multiplies), each its own kernel. A decode step of a small model is bound by how
many kernels it launches, not by arithmetic: SmolLM2's 61 norms are about a third of the ~1,200
kernels of one step. `torch.nn.functional.rms_norm` computes the same function in one kernel on
CUDA. A module's forward is replaced only where the two agree on a probe input (checked on the
module itself), so norms of another form (Gemma's `1 + weight`, say) keep their own code.
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _agree(got: torch.Tensor, expected: torch.Tensor) -> bool:
    """Equal up to about one rounding of the output (the fused kernel multiplies by the weight
    before rounding to the dtype, transformers after)."""
    tol = max(2 * torch.finfo(expected.dtype).eps, 1e-5)
    return got.dtype == expected.dtype and torch.allclose(got.float(), expected.float(), rtol=tol, atol=tol)


def _fused(self: torch.nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    return F.rms_norm(hidden_states, self.weight.shape, self.weight, self._crucible_eps)


def fuse_rms_norms(model: torch.nn.Module) -> int:
    """Give each RMSNorm of `model` the fused forward where it computes the same; how many."""
    fused = 0
    for module in model.modules():
        weight = getattr(module, "weight", None)
        eps = getattr(module, "variance_epsilon", None)
        if not type(module).__name__.endswith("RMSNorm") or not isinstance(weight, torch.Tensor):
            continue
        if weight.dim() != 1 or not isinstance(eps, float) or weight.dtype not in DTYPES:
            continue
        module._crucible_eps = eps
        candidate = types.MethodType(_fused, module)
        with torch.no_grad():
            probe = torch.randn(
                (4, weight.shape[0]), generator=torch.Generator().manual_seed(0), dtype=torch.float32
            ).to(device=weight.device, dtype=weight.dtype)
            expected, got = module(probe), candidate(probe)
        if _agree(got, expected):
            module.forward = candidate
            fused += 1
    return fused
