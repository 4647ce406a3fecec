"""What the fast path implements, checked before it takes a model or an adapter.

The fast path (`fastpath.py`, `continuous.py`) runs the model's own transformers forward, but with
its own key/value caches and additive 4-D masks over whole rows, and with adapters merged into a
copy of the weights. Whatever a model or an adapter computes outside that picture would come out
wrong, so it is detected here and served by the eager path instead (one log line names it):

Models (`model_gap`, `config_gap`; `fast_length` decides and logs):
* an attention kernel other than SDPA or eager (flash-attention and flex attention do not read a
  4-D additive mask);
* a composite (multimodal) config, layers that are not attention layers (state-space, linear or
  chunked attention), key/value caches shared across layers;
* sliding-window layers whose window is shorter than one row bucket (`fastpath.LENGTH_BUCKET`). A longer
  window is honoured by capping rows at it (`row_limit`): within a window, sliding attention is
  full attention, and longer requests take the eager path, whose cache slides.

What the fast path handles as transformers does (the family tests compare them token for token):
soft-capped attention scores and logits (Gemma-2: eager attention applies them under any mask),
attention sinks, biases and experts (gpt-oss: the model's own layers), fused qkv and gate/up
projections (Phi-3: their deltas merge like any other), `1 + weight` norms (`norms.py` fuses only
norms it reproduces exactly), scaled embeddings, tied embeddings (the merged copy keeps them tied).

Adapters (`adapter_gap`): anything but plain LoRA deltas on plain weights: LoRA variants (DoRA,
aLoRA, ...), LoRA biases (`lora_bias`), `modules_to_save`, trainable tokens, LoRA on parameters or
on layer replicas, and a delta on a weight another module shares (tied embeddings: merging it
would change the output layer too, which PEFT leaves alone). Adapters that train the base model's
own biases (`bias="all"` or `"lora_only"`) are refused at load (`adapters.py`): PEFT writes those
biases into layers every adapter shares.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

log = logging.getLogger(__name__)

KERNELS = ("sdpa", "eager")
LAYERS = ("full_attention", "sliding_attention")


def sliding_window(config: Any) -> int | None:
    """The window of the model's sliding-window layers, or None when every layer attends to all."""
    window = getattr(config, "sliding_window", None)
    if not window:
        return None
    types = getattr(config, "layer_types", None)
    if types is not None:
        return int(window) if "sliding_attention" in types else None
    if getattr(config, "use_sliding_window", True) is False:
        return None
    return int(window)


def row_limit(config: Any, bucket: int) -> int | None:
    """The most tokens a fast-path row may hold (a multiple of `bucket`), or None: no limit."""
    window = sliding_window(config)
    return None if window is None else window // bucket * bucket


def fast_length(model: torch.nn.Module, length: int, bucket: int) -> int | None:
    """The row length (at most `length` tokens) the fast path decodes `model` with, or None when the
    model has a feature it does not implement; either way one log line says why."""
    gap = model_gap(model, bucket)
    if gap is not None:
        log.info("fast decoding does not implement %s; this model uses the eager path", gap)
        return None
    limit = row_limit(model.config, bucket)
    if limit is not None and limit < length:
        log.info(
            "sliding-window attention: fast-path rows hold at most %d tokens (the window); "
            "longer requests use the eager path",
            limit,
        )
        return limit
    return length


def model_gap(model: torch.nn.Module, bucket: int) -> str | None:
    """The feature of `model` the fast path (rows in multiples of `bucket` slots) does not
    implement, in words; None when it has none."""
    import inspect

    if "logits_to_keep" not in inspect.signature(type(model).forward).parameters:
        return "a forward without logits_to_keep"
    return config_gap(model.config, bucket)


def config_gap(config: Any, bucket: int) -> str | None:
    """`model_gap` as far as the model's config tells."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    if text is not config:
        return "a multimodal model (its text model runs inside another)"
    kernel = getattr(config, "_attn_implementation", None)
    if kernel not in KERNELS:
        return f"the {kernel} attention kernel (it does not read the fast path's 4-D masks)"
    other = sorted(set(getattr(config, "layer_types", None) or ()) - set(LAYERS))
    if other:
        return f"{other[0]} layers"
    if getattr(config, "num_kv_shared_layers", 0):
        return "key/value caches shared across layers"
    window = sliding_window(config)
    if window is not None and window < bucket:
        return f"sliding-window attention with a {window}-token window"
    return None


def tied_weights(model: torch.nn.Module) -> set[str]:
    """Names of the modules whose weight another module shares (tied embeddings)."""
    holders: dict[int, list[str]] = {}
    for name, module in model.named_modules(remove_duplicate=False):
        weight = getattr(module, "weight", None)
        if isinstance(weight, torch.Tensor):
            holders.setdefault(id(weight), []).append(name)
    return {name for names in holders.values() if len(names) > 1 for name in names}


def adapter_gap(config: Any, layers: dict[str, Any], slot: str, tied: set[str]) -> str | None:
    """What adapter `slot` (its PEFT `config`, its LoRA `layers` by module name in the base model)
    computes beyond `W + ΔW` of plain weights, in words; None when merging it is exact."""
    if config is None:
        return "an adapter PEFT does not know"
    for attr, words in (
        ("modules_to_save", "modules_to_save (whole trained modules)"),
        ("trainable_token_indices", "trainable token embeddings"),
        ("target_parameters", "LoRA on parameters (target_parameters)"),
        ("layer_replication", "replicated layers (layer_replication)"),
        ("alora_invocation_tokens", "activated LoRA (aLoRA)"),
        ("lora_bias", "LoRA biases (lora_bias)"),
        ("use_dora", "DoRA"),
    ):
        if getattr(config, attr, None):
            return words
    if getattr(config, "bias", "none") != "none":  # refused at load (adapters.py); never merged
        return f"trained biases (bias={config.bias!r})"
    for name, layer in layers.items():
        variant = getattr(layer, "lora_variant", {}).get(slot)
        if variant is not None:
            return f"a LoRA variant ({type(variant).__name__})"
        base = layer.get_base_layer()
        if not isinstance(getattr(base, "weight", None), torch.Tensor):
            return f"LoRA on {type(base).__name__} layers"
        if name in tied:
            return f"LoRA on a tied weight ({name}: tied embeddings)"
    return None
