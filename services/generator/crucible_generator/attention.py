"""Decode-step attention for the fast path that never copies keys and values per query head.

With grouped-query attention (SmolLM2: 9 query heads share 3 key/value heads) and an attention
mask, transformers' SDPA path up to at least 5.17 expands every cached key and value to one copy
per query head (`repeat_kv`) before attending: at 256 rows x 512 slots that writes and reads
~0.6 GB more per layer and decode step than the attention itself reads, and it grows with the
window, not with the real sequence lengths. For one query token the query heads of a group can
instead stand in for query *positions* of their key/value head: `(batch, kv_heads, group, dim)`
attends to `(batch, kv_heads, slots, dim)` under the same `(batch, 1, 1, slots)` mask, with no
copy (later transformers releases do the same). Prefills (several query tokens) and models
without groups go to transformers' own SDPA function unchanged.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from transformers.integrations.sdpa_attention import sdpa_attention_forward

NAME = "crucible_decode_sdpa"
# Arguments that change the attention itself (soft-capping, sinks, biases, windows): transformers'
# function handles (or refuses) them, never silently dropped here.
SPECIAL = ("softcap", "s_aux", "sinks", "position_bias", "sliding_window")


def packed_gqa_sdpa(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature; returns `(batch, q_len, heads, dim)`."""
    groups = int(getattr(module, "num_key_value_groups", 1))
    batch, heads, q_len, dim = query.shape
    shared_mask = attention_mask is None or attention_mask.shape[1] == 1
    special = any(kwargs.get(k) is not None for k in SPECIAL)
    if q_len != 1 or groups == 1 or not shared_mask or dropout or special:
        return sdpa_attention_forward(
            module,
            query,
            key,
            value,
            attention_mask,
            dropout=dropout,
            scaling=scaling,
            is_causal=is_causal,
            **kwargs,
        )
    # Head h reads key/value head h // groups (transformers' repeat_kv order), so a reshape groups them.
    packed = query.reshape(batch, heads // groups, groups, dim)
    out = F.scaled_dot_product_attention(packed, key, value, attn_mask=attention_mask, scale=scaling)
    return out.reshape(batch, heads, 1, dim).transpose(1, 2).contiguous(), None


def use_packed_attention(model: torch.nn.Module) -> bool:
    """Switch `model` (a private copy: the setting is per config) from SDPA to the packed decode
    attention; False, leaving it as it was, if it does not use SDPA or this transformers has no
    attention registry."""
    config = model.config
    if getattr(config, "_attn_implementation", None) != "sdpa":
        return False
    try:
        from transformers import AttentionInterface
    except ImportError:
        return False
    AttentionInterface.register(NAME, packed_gqa_sdpa)
    try:  # the fast path passes its own 4-D masks; should a mask be built, build SDPA's
        from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

        AttentionMaskInterface.register(NAME, sdpa_mask)
    except ImportError:
        pass
    config._attn_implementation = NAME  # the setter also updates sub-configs
    return config._attn_implementation == NAME
