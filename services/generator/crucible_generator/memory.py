"""The decode batch size from the memory a GPU has left once the model is loaded.

Each sequence of a batch holds a key/value cache of `2 * layers * kv_heads * head_dim` values per
token; at `max_batch_size: auto` the generator takes the largest power of two whose caches, at a
working length of `min(max_model_len, 2048)` tokens, fit in 40% of the free memory (the rest is
the activations of a step, the LoRA adapters and the allocator's slack). On a CPU: 64.
"""

from __future__ import annotations

from typing import Any

CPU_BATCH = 64
SHARE_OF_FREE = 0.4
WORKING_LEN = 2048
BOUNDS = (8, 512)


def kv_bytes_per_token(config: Any, element_bytes: int) -> int:
    """Key/value cache bytes one token of one sequence takes.

    >>> from types import SimpleNamespace
    >>> smol = SimpleNamespace(num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, hidden_size=576)
    >>> kv_bytes_per_token(smol, 2)  # 2 (k, v) * 30 layers * 3 heads * 64 dims * 2 bytes
    23040
    """
    heads = int(config.num_attention_heads)
    kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // heads)
    return 2 * int(config.num_hidden_layers) * kv_heads * head_dim * element_bytes


def batch_from_memory(free_bytes: int, per_token_bytes: int, max_model_len: int) -> int:
    """The largest power of two of sequences whose caches fit, within `BOUNDS`.

    >>> batch_from_memory(70 * 2**30, 23040, 8192)  # an H100 with SmolLM2 loaded
    512
    >>> batch_from_memory(2 * 2**30, 23040, 8192)
    16
    >>> batch_from_memory(10 * 2**20, 23040, 8192)  # next to nothing free: the floor
    8
    """
    per_sequence = per_token_bytes * min(max_model_len, WORKING_LEN)
    fits = int(free_bytes * SHARE_OF_FREE) // max(per_sequence, 1)
    batch = BOUNDS[0]
    while batch * 2 <= min(fits, BOUNDS[1]):
        batch *= 2
    return batch


def auto_batch_size(model: Any, max_model_len: int) -> int:
    """`max_batch_size: auto` for a loaded model: from free CUDA memory, else `CPU_BATCH`."""
    import torch

    if model.device.type != "cuda":
        return CPU_BATCH
    free, _total = torch.cuda.mem_get_info(model.device)
    element = torch.finfo(model.dtype).bits // 8
    return batch_from_memory(free, kv_bytes_per_token(model.config, element), max_model_len)
