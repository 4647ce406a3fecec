"""The fast path's building blocks: merged weights, the prefill's static KV cache and its mask.

At SmolLM2's size a decode step is launch-bound: the eager path issues well over a thousand small
kernels per token (every linear layer plus PEFT's LoRA branch around it), each with Python
overhead. The fast path (`continuous.py` decodes with it) removes both costs:

* **Merged weights.** A private copy of the base model (taken before PEFT touches it) whose linear
  layers hold `W + ΔW` of the batch's adapter. Switching adapters rewrites those tensors in place
  (one small matmul per layer), so their addresses never change and a captured graph stays valid.
  Adapters that cannot be merged exactly (DoRA, `modules_to_save`, LoRA biases, a delta on a
  tied weight: `features.py`) keep using the PEFT path.
* **Static KV caches.** Preallocated buffers with an additive 4-D mask instead of transformers'
  dynamic cache: `StaticKVCache` for a left-padded prefill (every row writes the same slots),
  `paged.PagedCache` for decoding (every row writes its own next slot, through its block table).
* **CUDA graphs.** A decode step is captured once per window and replayed: one launch per token
  instead of thousands. Sampling stays outside.

Costs: one extra copy of the weights (fine for the small models this server targets; turn it off
with `fast_decode=off` for large ones) and the paged cache. What a model or an adapter computes
beyond this picture (short sliding windows, non-attention layers, other attention kernels, ...)
is detected by `features.py` and served by the eager path.
"""

from __future__ import annotations

import copy
import logging
from typing import Any

import torch

from .features import adapter_gap, tied_weights
from .norms import fuse_rms_norms

log = logging.getLogger(__name__)

LENGTH_BUCKET = 256  # decode windows are rounded up to this many slots, so steps share a graph
BASE = None  # the merged copy's state when it holds the plain base weights
STALE = "\0stale"  # ... when its adapter was unloaded: the next select merges again


def bucket(n: int, ceiling: int) -> int:
    """The smallest power of two ≥ `n`, capped at `ceiling` (≥ n)."""
    size = 1
    while size < n:
        size *= 2
    return max(n, min(size, ceiling))


class StaticKVCache:
    """A fixed-size KV cache that writes every row's new keys at one shared slot (`position`).

    It implements the one method attention layers call (`update`), and is deliberately not a
    transformers `Cache`: with a 4-D mask supplied, transformers then builds no mask of its own.
    """

    def __init__(self, length: int, device: torch.device) -> None:
        self.length = length
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.position = torch.zeros(1, dtype=torch.long, device=device)
        self._offsets = torch.arange(length, device=device)

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *_: Any, **__: Any
    ):
        if layer_idx == len(self.keys):  # first prefill: allocate with the shapes the layer produces
            batch, heads, _, dim = key_states.shape
            shape = (batch, heads, self.length, dim)
            self.keys.append(torch.zeros(shape, dtype=key_states.dtype, device=key_states.device))
            self.values.append(
                torch.zeros(
                    shape[:3] + value_states.shape[3:], dtype=value_states.dtype, device=value_states.device
                )
            )
        index = self.position + self._offsets[: key_states.shape[-2]]
        self.keys[layer_idx].index_copy_(2, index, key_states)
        self.values[layer_idx].index_copy_(2, index, value_states)
        return self.keys[layer_idx], self.values[layer_idx]

    # Asked by some transformers versions when no positions are given (we always give them).
    def get_seq_length(self, layer_idx: int = 0) -> int:
        return int(self.position.item())


class MergedModel:
    """A copy of the base model whose LoRA-targeted weights hold one adapter merged in."""

    def __init__(self, base: torch.nn.Module) -> None:
        self.model = copy.deepcopy(base).eval()
        self.fused_norms = fuse_rms_norms(self.model)
        self.current: str | None = BASE
        self._touched: dict[str, torch.Tensor] = {}  # module name -> its pristine base weight
        self._tied = tied_weights(self.model)
        self.refused: dict[str, str] = {}  # slot -> why it cannot be merged (logged once)

    def select(self, peft: Any, slot: str | None) -> bool:
        """Make the copy compute `slot`'s adapter (None: the base); False if it cannot be merged."""
        if slot == self.current:
            return True
        layers = {} if slot is None else self._lora_layers(peft, slot)
        if layers is None:
            return False
        with torch.no_grad():
            for name in list(self._touched):
                if name not in layers:
                    self.model.get_submodule(name).weight.copy_(self._touched.pop(name))
            for name, layer in layers.items():
                base = layer.get_base_layer().weight
                merged = base.float() + layer.get_delta_weight(slot).float()
                self.model.get_submodule(name).weight.copy_(merged.to(base.dtype))
                self._touched[name] = base
        self.current = slot
        return True

    def forget(self, slot: str) -> None:
        """`slot` is gone: a later adapter may reuse its name for other weights."""
        self.refused.pop(slot, None)
        if self.current == slot:
            self.current = STALE

    def _lora_layers(self, peft: Any, slot: str) -> dict[str, Any] | None:
        """`slot`'s LoRA layers by module name in the base model; None (and one log line per
        slot) when merging them would not compute what PEFT computes (`features.adapter_gap`)."""
        from peft.tuners.lora import LoraLayer

        if slot in self.refused:
            return None
        prefix = "base_model.model."
        layers = {}
        for name, module in peft.named_modules():
            if isinstance(module, LoraLayer) and (
                slot in module.lora_A or slot in getattr(module, "lora_embedding_A", {})
            ):
                layers[name.removeprefix(prefix)] = module
        gap = adapter_gap(peft.peft_config.get(slot), layers, slot, self._tied)
        if gap is not None:
            self.refused[slot] = gap
            log.info(
                "adapter %s: the fast path does not merge %s; its requests use the eager path", slot, gap
            )
            return None
        return layers


def prefill_mask(mask2d: torch.Tensor, length: int, dtype: torch.dtype) -> torch.Tensor:
    """The additive `[B, 1, width, length]` mask of a left-padded prefill into a static cache.

    Real tokens see the real tokens up to themselves. A padding position sees only itself: a query
    row with every key masked makes fused attention kernels return NaN, and that NaN, stored in
    the cache as the padding position's key, would poison every later query of the row even
    through the mask (NaN times a zero weight is still NaN).
    """
    batch, width = mask2d.shape
    causal = torch.ones((width, width), dtype=torch.bool, device=mask2d.device).tril()
    allowed = causal.unsqueeze(0) & mask2d.unsqueeze(1)  # [B, q, k]
    allowed |= torch.eye(width, dtype=torch.bool, device=mask2d.device)
    mask = torch.full((batch, 1, width, length), torch.finfo(dtype).min, dtype=dtype, device=mask2d.device)
    mask[:, 0, :, :width].masked_fill_(allowed, 0.0)
    return mask
