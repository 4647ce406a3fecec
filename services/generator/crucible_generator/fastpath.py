"""Fast decoding for batches whose rows all use one adapter (or none): merged weights, a static KV
cache and, on CUDA, one CUDA graph per decode step.

At SmolLM2's size a decode step is launch-bound: the eager path issues well over a thousand small
kernels per token (every linear layer plus PEFT's LoRA branch around it), each with Python
overhead. This path removes both costs:

* **Merged weights.** A private copy of the base model (taken before PEFT touches it) whose linear
  layers hold `W + ΔW` of the batch's adapter. Switching adapters rewrites those tensors in place
  (one small matmul per layer), so their addresses never change and a captured graph stays valid.
  Adapters that cannot be merged exactly (DoRA, `modules_to_save`) keep using the PEFT path.
* **Static KV cache.** One preallocated `[B, kv_heads, L, head_dim]` buffer per layer for a
  bucket of batch size `B` and length `L`; rows are left-padded so every row writes the same
  slot at each step, and an additive 4-D mask hides the slots not written yet.
* **CUDA graphs.** The decode step (mask update, forward, slot advance) is captured once per
  bucket and replayed: one launch per token instead of thousands. Sampling stays outside.

Costs: one extra copy of the weights (fine for the small models this server targets; turn it off
with `fast_decode=off` for large ones) and a cache per bucket. Models with sliding-window or
other non-global attention layers are not handled here and use the eager path.
"""

from __future__ import annotations

import copy
import inspect
import logging
from collections import OrderedDict
from typing import Any

import torch

log = logging.getLogger(__name__)

LENGTH_BUCKET = 256  # cache lengths are rounded up to this, so similar batches share a graph
MAX_ENTRIES = 4  # buckets kept (each holds a KV cache and, on CUDA, a graph)
BASE = None  # the merged copy's state when it holds the plain base weights
STALE = "\0stale"  # ... when its adapter was unloaded: the next select merges again


def supports(config: Any) -> bool:
    """Whether every attention layer of `config` attends to the whole context (no sliding windows)."""
    types = getattr(config, "layer_types", None)
    if types is not None:
        return all(t == "full_attention" for t in types)
    window = getattr(config, "sliding_window", None)
    return window is None or getattr(config, "use_sliding_window", True) is False


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
        self.current: str | None = BASE
        self._touched: dict[str, torch.Tensor] = {}  # module name -> its pristine base weight

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
        if self.current == slot:
            self.current = STALE

    @staticmethod
    def _lora_layers(peft: Any, slot: str) -> dict[str, Any] | None:
        from peft.tuners.lora import LoraLayer

        config = peft.peft_config.get(slot)
        if config is None or getattr(config, "modules_to_save", None):
            return None
        prefix = "base_model.model."
        layers = {}
        for name, module in peft.named_modules():
            if not isinstance(module, LoraLayer) or slot not in module.lora_A:
                continue
            if module.use_dora.get(slot) or not hasattr(module.get_base_layer(), "weight"):
                return None
            layers[name.removeprefix(prefix)] = module
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


class _Entry:
    """Everything one (batch, length) bucket keeps between batches."""

    def __init__(self, batch: int, length: int, device: torch.device, dtype: torch.dtype) -> None:
        self.batch, self.length = batch, length
        self.cache = StaticKVCache(length, device)
        self.input_ids = torch.zeros((batch, 1), dtype=torch.long, device=device)
        self.positions = torch.zeros((batch, 1), dtype=torch.long, device=device)
        self.mask = torch.zeros((batch, 1, 1, length), dtype=dtype, device=device)
        self.graph: Any = None
        self.logits: torch.Tensor | None = None


class FastDecoder:
    """Owns the merged copy, the buckets and their graphs; opens one session per batch."""

    def __init__(self, base: torch.nn.Module, *, use_graphs: bool, max_batch_size: int) -> None:
        self.merged = MergedModel(base)
        self.model = self.merged.model
        self.device = next(self.model.parameters()).device
        self.dtype = next(self.model.parameters()).dtype
        self.use_graphs = use_graphs and self.device.type == "cuda"
        self.max_batch_size = max_batch_size
        self.entries: OrderedDict[tuple[int, int], _Entry] = OrderedDict()
        self._pool = torch.cuda.graph_pool_handle() if self.use_graphs else None
        params = inspect.signature(type(self.model).forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        self._takes_cache_position = "cache_position" in params

    def open(
        self,
        peft: Any,
        slot: str | None,
        input_ids: torch.Tensor,
        mask: torch.Tensor,
        positions: torch.Tensor,
        max_new: int,
    ) -> FastSession | None:
        """A session for one left-padded batch, or None when `slot` cannot be merged."""
        if not self.merged.select(peft, slot):
            return None
        rows, width = input_ids.shape
        batch = bucket(rows, max(self.max_batch_size, rows))
        length = -(-(width + max_new) // LENGTH_BUCKET) * LENGTH_BUCKET
        return FastSession(self, self._entry(batch, length), input_ids, mask, positions)

    def _entry(self, batch: int, length: int) -> _Entry:
        key = (batch, length)
        entry = self.entries.pop(key, None)
        if entry is None:
            while len(self.entries) >= MAX_ENTRIES:
                self.entries.popitem(last=False)
            entry = _Entry(batch, length, self.device, self.dtype)
        self.entries[key] = entry
        return entry

    def forward(self, entry: _Entry, input_ids, mask, positions) -> torch.Tensor:
        kwargs: dict[str, Any] = {self._cache_kw: entry.cache, "use_cache": True, "logits_to_keep": 1}
        if self._takes_cache_position:  # older transformers derive slots from it
            kwargs["cache_position"] = entry.cache.position + torch.arange(
                input_ids.shape[1], device=self.device
            )
        out = self.model(input_ids=input_ids, attention_mask=mask, position_ids=positions, **kwargs)
        return out.logits[:, -1, :]


class FastSession:
    """Prefill and decode steps of one batch through a bucket's static cache (and graph)."""

    def __init__(
        self,
        decoder: FastDecoder,
        entry: _Entry,
        input_ids: torch.Tensor,
        mask: torch.Tensor,
        positions: torch.Tensor,
    ) -> None:
        self.decoder, self.entry = decoder, entry
        self.rows, self.width = input_ids.shape
        pad = entry.batch - self.rows
        # Padding rows: no prompt tokens; they attend only to what they themselves write.
        self.input_ids = torch.nn.functional.pad(input_ids, (0, 0, 0, pad))
        self.mask2d = torch.nn.functional.pad(mask, (0, 0, 0, pad)).bool()
        self.positions = torch.nn.functional.pad(positions, (0, 0, 0, pad))

    def prefill(self) -> torch.Tensor:
        entry, width = self.entry, self.width
        hidden = torch.finfo(entry.mask.dtype).min
        mask = prefill_mask(self.mask2d, entry.length, entry.mask.dtype)
        entry.cache.position.zero_()
        logits = self.decoder.forward(entry, self.input_ids, mask, self.positions)
        # Decode state: the next token of every row goes to slot `width`, one position past its last.
        entry.cache.position.fill_(width)
        entry.positions.copy_(self.positions[:, -1:] + 1)
        entry.mask.fill_(hidden)
        entry.mask[:, 0, 0, :width].masked_fill_(self.mask2d, 0.0)
        return logits[: self.rows]

    def step(self, tokens: torch.Tensor, still: list[int] | None = None) -> tuple[torch.Tensor, None]:
        """Feed one token per row (finished rows: anything) and return the next logits.

        Rows are never dropped (the graph's shapes are fixed), hence no list of kept rows.
        """
        entry = self.entry
        entry.input_ids[: self.rows, 0].copy_(tokens)
        if not self.decoder.use_graphs:
            return self._step()[: self.rows], None
        if entry.graph is None:
            try:
                self._capture()
            except Exception:
                # Some models do host syncs inside forward; they still get the static path.
                log.exception("CUDA graph capture failed; decoding without graphs from now on")
                self.decoder.use_graphs = False
                torch.cuda.synchronize()
                return self._step()[: self.rows], None
        entry.graph.replay()
        return entry.logits[: self.rows], None

    def _step(self) -> torch.Tensor:
        entry = self.entry
        entry.mask.index_fill_(3, entry.cache.position, 0.0)
        logits = self.decoder.forward(entry, entry.input_ids, entry.mask, entry.positions)
        entry.cache.position.add_(1)
        entry.positions.add_(1)
        return logits

    def _capture(self) -> None:
        """Record `_step` as a CUDA graph, leaving the decode state as it was before."""
        entry = self.entry
        saved = (entry.mask.clone(), entry.cache.position.clone(), entry.positions.clone())
        try:
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(2):  # warm-up (allocator, kernels' lazy init) off the capture
                    self._step()
                    self._restore(saved)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.decoder._pool):
                entry.logits = self._step()
        finally:
            self._restore(saved)
        entry.graph = graph
        log.info("captured a decode graph for batch %d, cache length %d", entry.batch, entry.length)

    def _restore(self, saved: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> None:
        self.entry.mask.copy_(saved[0])
        self.entry.cache.position.copy_(saved[1])
        self.entry.positions.copy_(saved[2])
