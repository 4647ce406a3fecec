"""Fused kernels for the policy's passes: RMSNorms, SwiGLU MLPs and rotary embeddings on CUDA
(Liger-Kernel's Triton kernels), and LoRA layers on any device.

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
alternate the two. The fused MLP calls its projections (PEFT's LoRA layers on `gate_proj` /
`up_proj` / `down_proj`) as the original did.

The rotary embedding is a module-level function (`apply_rotary_pos_emb`) that the attention
modules of those families call by name: about ten elementwise kernels each way (two products, a
negation and a concatenation for each of the query and the key), a fifth of the 135M reference's
kernel time (docs/benchmarks.md). `fuse` swaps the `forward` of each attention module for one that
marks the call (a context variable) and calls the class's own, and puts in the module's namespace,
once, a dispatcher that takes Liger's kernel (which writes the rotated query and key over their
projections' outputs, which no backward keeps) only inside a marked call: an attention module that
was not swapped, of this model or another, computes transformers' own. Without CUDA, or without the
`liger-kernel` package and Triton (requirements-nodeps.txt installs the package; CUDA builds of
torch bring Triton; `pip install 'crucible-trainer[fused]'` elsewhere), no norm, MLP or attention
is swapped.
Under FSDP the ranks run transformers' modules (`distributed/parallel.py`: not measured there yet),
and so does a policy whose passes are compiled (`optim.compile`: the compiler fuses them itself).

`fuse_lora` swaps the forward of PEFT's LoRA layers on a plain `nn.Linear`. PEFT
computes `base(x) + lora_B(lora_A(x)) * scaling`, which writes the adapter's output, scales it, and
adds it: three passes over an output as large as the base layer's. Here the adapter's second
matrix multiply adds into the base output (`addmm_`, scaling as its alpha). It is one kernel with
nothing written beside the result, and its backward has no separate scaling. It needs no package.
A call in a state this forward does not compute takes PEFT's own: adapters disabled (the KL
reference of a job without `init_adapter`), merged or several at once, dropout, DoRA, a bias on the
adapter, hooks on the layers whose calls it skips, or PEFT's casting mode (a bf16 base with a
float32 adapter and no autocast, where PEFT adds in float32 and rounds once). `fuse_lora` counts the
layers swapped, not the calls that take the fused path.
"""

from __future__ import annotations

import logging
import sys
import weakref
from collections.abc import Callable
from contextvars import ContextVar
from typing import Any, NamedTuple

import torch

log = logging.getLogger(__name__)

# Module classes whose forward is Llama's RMSNorm (float32 statistics, `weight * x.to(dtype)`).
NORMS = frozenset({"LlamaRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm", "MistralRMSNorm"})
# Module classes whose forward is `down_proj(silu(gate_proj(x)) * up_proj(x))`.
MLPS = frozenset({"LlamaMLP", "Qwen2MLP", "Qwen3MLP", "MistralMLP"})
# Attention classes whose module calls Llama's `apply_rotary_pos_emb(q, k, cos, sin)` (the
# rotate-half form over the whole head) on [B, H, T, D] queries and keys.
ATTENTIONS = frozenset({"LlamaAttention", "Qwen2Attention", "Qwen3Attention", "MistralAttention"})

# The rotary function of the attention call running now on this thread: set by a swapped
# attention module's forward, read by the dispatcher in its family's namespace.
_ROPE: ContextVar[Callable[..., Any] | None] = ContextVar("crucible_fused_rope", default=None)


class Kernels(NamedTuple):
    """The fused functions `fuse` swaps in: `rms_norm(x, weight, eps)`, `silu_mul(gate, up)` and
    `rope(q, k, cos, sin) -> (q, k)`."""

    rms_norm: Callable[..., torch.Tensor]
    silu_mul: Callable[..., torch.Tensor]
    rope: Callable[..., tuple[torch.Tensor, torch.Tensor]]


def kernels() -> Kernels | None:
    """Liger's RMSNorm, SiLU-times-up and rotary functions (autograd functions of Triton kernels),
    or None when the package (or Triton) is not installed."""
    try:
        from liger_kernel.ops import LigerRMSNormFunction, LigerRopeFunction, LigerSiLUMulFunction
    except ImportError:  # also Triton missing, as on a CPU-only torch
        return None

    def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        # offset 0, Llama's casting, not in place (autograd may still need the input), rows by Liger
        return LigerRMSNormFunction.apply(x, weight, eps, 0.0, "llama", False, None)

    def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return LigerSiLUMulFunction.apply(gate, up, 1.0, 1.0)

    def rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> Any:
        return LigerRopeFunction.apply(q, k, cos, sin)

    return Kernels(rms_norm, silu_mul, rope)


def fuse(model: torch.nn.Module, impl: Kernels | None = None, rope: bool = True) -> int:
    """Swap in the fused forward of every module of `model` that `NORMS`, `MLPS` or (with `rope`)
    `ATTENTIONS` names; returns how many were swapped (0 when the kernels are not available).
    `impl`: the functions to use (default Liger's, see `kernels`)."""
    impl = impl or kernels()
    if impl is None:
        return 0
    rms_norm, silu_mul = impl.rms_norm, impl.silu_mul
    swapped = 0
    for module in model.modules():
        kind = type(module).__name__
        if kind in NORMS and "forward" not in vars(module):
            eps = float(getattr(module, "variance_epsilon", None) or getattr(module, "eps", 1e-6))

            def norm_forward(x: torch.Tensor, m: Any = module, e: float = eps) -> torch.Tensor:
                return rms_norm(x, m.weight, e)

            module.forward = _mark(norm_forward)
            swapped += 1
        elif kind in MLPS and "forward" not in vars(module) and _silu(module):

            def mlp_forward(x: torch.Tensor, m: Any = module) -> torch.Tensor:
                return m.down_proj(silu_mul(m.gate_proj(x), m.up_proj(x)))

            module.forward = _mark(mlp_forward)
            swapped += 1
        elif rope and kind in ATTENTIONS and "forward" not in vars(module) and _dispatching(module):
            attention = weakref.ref(module)  # not the module itself: no cycle through its own __dict__

            def attention_forward(*args: Any, m: Any = attention, f: Any = impl.rope, **kwargs: Any) -> Any:
                token, module = _ROPE.set(f), m()
                try:
                    return type(module).forward(module, *args, **kwargs)
                finally:
                    _ROPE.reset(token)

            module.forward = _mark(attention_forward)
            swapped += 1
    return swapped


def _dispatching(attention: torch.nn.Module) -> bool:
    """Put the rotary dispatcher in the namespace of `attention`'s family (once); False where that
    namespace has no `apply_rotary_pos_emb` to stand in for."""
    namespace = sys.modules[type(attention).__module__]
    original = getattr(namespace, "apply_rotary_pos_emb", None)
    if original is None:
        return False
    if not getattr(original, "dispatches", False):
        namespace.apply_rotary_pos_emb = _dispatcher(original)
    return True


def _dispatcher(original: Callable[..., Any]) -> Callable[..., Any]:
    """`original` (transformers' `apply_rotary_pos_emb`), or the fused function of the attention
    call running now (`_ROPE`) where the call is the attention's own: four tensors, nothing else."""

    def apply_rotary_pos_emb(q: Any, k: Any, cos: Any, sin: Any, *args: Any, **kwargs: Any) -> Any:
        # Compiled passes (`optim.compile`, which never fuses) trace transformers' own.
        if args or kwargs or torch.compiler.is_compiling() or (rope := _ROPE.get()) is None:
            return original(q, k, cos, sin, *args, **kwargs)
        return rope(q, k, cos, sin)

    apply_rotary_pos_emb.dispatches = True  # type: ignore[attr-defined]
    apply_rotary_pos_emb.original = original  # type: ignore[attr-defined]
    return apply_rotary_pos_emb


def fuse_lora(model: torch.nn.Module) -> int:
    """Swap in `lora_forward` on every PEFT LoRA layer of `model` whose base is a plain
    `nn.Linear`; returns how many were swapped (whether a call takes it is decided per call)."""
    try:
        from peft.tuners.lora.layer import Linear as LoraLinear
    except ImportError:
        return 0
    swapped = 0
    for module in model.modules():
        if (
            type(module) is LoraLinear
            and type(module.base_layer) is torch.nn.Linear
            and "forward" not in vars(module)
        ):
            layer = weakref.ref(module)  # not the module itself: no cycle through its own __dict__

            def forward(x: torch.Tensor, *args: Any, layer: Any = layer, **kwargs: Any) -> torch.Tensor:
                m = layer()
                if args or kwargs or not _plain_lora(m, x):
                    return type(m).forward(m, x, *args, **kwargs)
                return lora_forward(m, x)

            module.forward = _mark(forward)
            swapped += 1
    return swapped


def lora_forward(layer: Any, x: torch.Tensor) -> torch.Tensor:
    """`layer.base_layer(x) + lora_B(lora_A(x)) * scaling` for a layer and input `_plain_lora`
    accepts: the adapter's second product added into the base layer's output by one `addmm_`."""
    name = layer.active_adapters[0]
    base, a, b = layer.base_layer, layer.lora_A[name], layer.lora_B[name]
    flat = x.reshape(-1, x.shape[-1])
    out = torch.nn.functional.linear(flat, base.weight, base.bias)  # 2-D: no view is written in place
    cast = getattr(layer, "_cast_input_dtype", None)  # what PEFT does to the adapter's input
    h = a(cast(flat, a.weight.dtype) if cast else flat)
    # In place is safe: a linear layer's backward keeps its inputs, not its output. Under autocast
    # these casts are the ones it would make (it does not see in-place ops); without it they are
    # no-ops (`_plain_lora`: one dtype throughout).
    out.addmm_(h.to(out.dtype), b.weight.t().to(out.dtype), alpha=layer.scaling[name])
    return out.view(*x.shape[:-1], out.shape[-1])


def _plain_lora(layer: Any, x: torch.Tensor) -> bool:
    """Whether `lora_forward` computes what PEFT's forward would for `layer` on `x` now."""
    names = layer.active_adapters
    if layer.disable_adapters or layer.merged or len(names) != 1 or names[0] not in layer.lora_A:
        return False
    name, base = names[0], layer.base_layer
    a, b = layer.lora_A[name], layer.lora_B[name]
    # PEFT's casting mode (a bf16 base, a float32 adapter, no autocast) computes the adapter and
    # the sum in float32 and rounds once: not this forward's product in the output's dtype.
    one_dtype = base.weight.dtype == a.weight.dtype == b.weight.dtype
    return (
        (one_dtype or torch.is_autocast_enabled(x.device.type))
        and isinstance(layer.lora_dropout[name], torch.nn.Identity)
        and name not in getattr(layer, "lora_variant", {})
        and not getattr(layer, "use_dora", {}).get(name, False)
        and a.bias is None
        and b.bias is None
        and not any(_hooked(m) for m in (base, b))  # the two whose calls this forward skips
    )


def _hooked(module: torch.nn.Module) -> bool:
    """Whether calling `module` does more than its class's forward: hooks of its own or global
    ones, or a forward of its own (as accelerate's offloading sets)."""
    nn = torch.nn.modules.module
    own = (
        module._forward_hooks,
        module._forward_pre_hooks,
        module._backward_hooks,
        module._backward_pre_hooks,
    )
    shared = (nn._global_forward_hooks, nn._global_forward_pre_hooks, nn._global_backward_hooks,
              nn._global_backward_pre_hooks)  # fmt: skip
    return any(own) or any(shared) or "forward" in vars(module)


def unfuse(model: torch.nn.Module) -> int:
    """Give every module `fuse` swapped its own forward back; returns how many."""
    restored = 0
    for module in model.modules():
        if getattr(vars(module).get("forward"), "fused", False):
            del module.forward
            restored += 1
    return restored


def _mark(forward: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """`forward`, marked as one `unfuse` gives back."""
    forward.fused = True  # type: ignore[attr-defined]
    return forward


def _silu(mlp: Any) -> bool:
    """Whether a gated MLP's activation is SiLU (what the fused kernel computes)."""
    act = getattr(getattr(mlp, "config", None), "hidden_act", None)
    return act in ("silu", "swish") and all(hasattr(mlp, n) for n in ("gate_proj", "up_proj", "down_proj"))
