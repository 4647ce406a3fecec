"""Fused RMSNorms and SwiGLU MLPs for the policy's passes on CUDA (Liger-Kernel's Triton kernels).

At the sizes RL trains with LoRA the update's time goes mostly to memory-bound elementwise kernels,
not to matrix multiplies (docs/benchmarks.md, "Where the 135M update's time goes": `mul`, `copy_`
and `add` take half of the card's time). An RMSNorm is about six such kernels each way (cast,
square, mean, rsqrt, two products) and a SwiGLU three; Liger-Kernel fuses each into one kernel
forward and one backward, computing what transformers computes (the norm in float32, cast back
before the weight, as Llama does; `silu(gate) * up`).

`fuse` swaps the `forward` of those modules of a loaded model, instance by instance (never the
transformers classes: other models in the process keep theirs), for the families whose modules
compute exactly that (`NORMS`, `MLPS`; Gemma's `1 + weight` norms and GELU MLPs are left alone),
and `unfuse` swaps them back, so that a step can run again without them and a benchmark can
alternate the two. Adapter layers (PEFT's LoRA on `gate_proj` / `up_proj` / `down_proj`) are
untouched: the fused MLP calls them as the original did. Without CUDA, or without the
`liger-kernel` package and Triton (requirements-nodeps.txt installs the package; CUDA builds of
torch bring Triton; `pip install 'crucible-trainer[fused]'` elsewhere), nothing is swapped.
Under FSDP the ranks run transformers' modules (`distributed/parallel.py`: not measured there yet),
and so does a policy whose passes are compiled (`optim.compile`: the compiler fuses them itself).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

log = logging.getLogger(__name__)

# Module classes whose forward is Llama's RMSNorm (float32 statistics, `weight * x.to(dtype)`).
NORMS = frozenset({"LlamaRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm", "MistralRMSNorm"})
# Module classes whose forward is `down_proj(silu(gate_proj(x)) * up_proj(x))`.
MLPS = frozenset({"LlamaMLP", "Qwen2MLP", "Qwen3MLP", "MistralMLP"})


def kernels() -> tuple[Callable[..., torch.Tensor], Callable[..., torch.Tensor]] | None:
    """Liger's RMSNorm and SiLU-times-up functions (autograd functions of Triton kernels), or
    None when the package (or Triton) is not installed."""
    try:
        from liger_kernel.ops import LigerRMSNormFunction, LigerSiLUMulFunction
    except ImportError:  # also Triton missing, as on a CPU-only torch
        return None

    def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        # offset 0, Llama's casting, not in place (autograd may still need the input), rows by Liger
        return LigerRMSNormFunction.apply(x, weight, eps, 0.0, "llama", False, None)

    def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return LigerSiLUMulFunction.apply(gate, up, 1.0, 1.0)

    return rms_norm, silu_mul


def fuse(model: torch.nn.Module, impl: tuple[Callable, Callable] | None = None) -> int:
    """Swap in the fused forward of every module of `model` that `NORMS` or `MLPS` names; returns
    how many were swapped (0 when the kernels are not available). `impl`: the two functions to
    use (default Liger's, see `kernels`)."""
    impl = impl or kernels()
    if impl is None:
        return 0
    rms_norm, silu_mul = impl
    swapped = 0
    for module in model.modules():
        kind = type(module).__name__
        if kind in NORMS and "forward" not in vars(module):
            eps = float(getattr(module, "variance_epsilon", None) or getattr(module, "eps", 1e-6))

            def norm_forward(x: torch.Tensor, m: Any = module, e: float = eps) -> torch.Tensor:
                return rms_norm(x, m.weight, e)

            module.forward = norm_forward
            swapped += 1
        elif kind in MLPS and "forward" not in vars(module) and _silu(module):

            def mlp_forward(x: torch.Tensor, m: Any = module) -> torch.Tensor:
                return m.down_proj(silu_mul(m.gate_proj(x), m.up_proj(x)))

            module.forward = mlp_forward
            swapped += 1
    return swapped


def unfuse(model: torch.nn.Module) -> int:
    """Give every module `fuse` swapped its own forward back; returns how many."""
    restored = 0
    for module in model.modules():
        if type(module).__name__ in NORMS | MLPS and "forward" in vars(module):
            del module.forward
            restored += 1
    return restored


def _silu(mlp: Any) -> bool:
    """Whether a gated MLP's activation is SiLU (what the fused kernel computes)."""
    act = getattr(getattr(mlp, "config", None), "hidden_act", None)
    return act in ("silu", "swish") and all(hasattr(mlp, n) for n in ("gate_proj", "up_proj", "down_proj"))
