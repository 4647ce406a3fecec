"""The update's attention: transformers' SDPA function, never on cuDNN's kernels.

cuDNN builds an execution plan for every new shape, and a job's micro-batches come in new lengths
every step: inside the benchmark's step on an H200 the 135M update took 1.32-1.52 s without cuDNN's
attention against 1.63-2.27 s with it, the 1.5B shape 4.70 against 5.61 s (docs/benchmarks.md).
PyTorch 2.11's cuDNN backward also returned NaN gradients for some masked shapes.

The choice is made inside each attention call (a function registered with transformers'
`AttentionInterface`, which each layer looks up by the config's `_attn_implementation`), not by a
context around the forward: SDPA's backend flags are process-wide and a context restores them on
exit, so a checkpointed layer's forward, run again inside the backward, would otherwise pick
cuDNN there, and non-reentrant checkpointing refuses a recompute whose saved tensors differ.
The context costs about 24 µs of host time a call on a small CPU (a layer's forward: about 240
calls in a 135M update of 4 micro-batches and its reference). A compiled graph traces it.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

NAME = "crucible_sdpa_no_cudnn"
WITHOUT_CUDNN = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def without_cudnn() -> AbstractContextManager:
    """SDPA with any backend but cuDNN's, for a while (process-wide flags, restored on exit)."""
    return sdpa_kernel(WITHOUT_CUDNN)


def sdpa_without_cudnn(module: torch.nn.Module, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, Any]:
    """transformers' SDPA attention function, with every backend but cuDNN's allowed."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    with without_cudnn():
        return sdpa_attention_forward(module, *args, **kwargs)


def choose(model: torch.nn.Module, cudnn: bool) -> bool:
    """Switch `model`'s attention (its config's, sub-configs' included) between transformers' SDPA
    (`cudnn`: SDPA's own choice of kernel) and `sdpa_without_cudnn`. Returns whether the model now
    attends without cuDNN: False for a model that uses neither (eager, flash-attention), or a
    transformers without an attention registry, left as it was."""
    config = model.config
    if config._attn_implementation not in ("sdpa", NAME):
        return False
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
    except ImportError:
        return False
    AttentionInterface.register(NAME, sdpa_without_cudnn)
    AttentionMaskInterface.register(NAME, sdpa_mask)  # the same masks as SDPA's
    config._attn_implementation = "sdpa" if cudnn else NAME
    return config._attn_implementation == NAME
