"""The fast path's paged key/value cache: fixed-size blocks handed to rows as their sequences grow.

A row no longer reserves the whole context: each layer's keys and values live in one pool of
`blocks` blocks of `block_size` token slots, and each row has a *block table* that maps its
logical slots to blocks (slot `j` of row `r` is slot `j % block_size` of block
`table[r, j // block_size]`). A sequence takes blocks as it grows, one at a time, and gives them
back when it ends, so the cache holds as many sequences as their real lengths allow instead of
`rows x context` slots.

Attention layers see what they saw with contiguous rows: `update` writes each row's new key and
value through its table, then gathers the window's blocks (`table[:b, :l / block_size]`) into
`[b, kv_heads, l, head_dim]` keys and values (a gather per layer and step, in plain torch ops, so
the step is still captured as a CUDA graph per window: the pool and the table never move and only
their contents change). The additive mask over logical slots is what it was with contiguous rows:
what a row may see is unchanged.

When the pool holds every row at full length (a small model, plenty of memory), nothing is
shared or handed out: row `r` owns blocks `r * n ..` (`n` blocks a row) for good, its table never
changes, and `update` returns views of the pool instead of gathering (`contiguous`: the cost of
the gather is then saved).

Two blocks are reserved. `ZERO` pads every table past a row's blocks and is never written: a
masked slot must hold a finite value (0 x NaN is NaN). `TRASH` takes the writes nobody reads: a
free row in a step's window writes its throwaway token there, and a prefill writes its padding
there.

`BlockPool` is the host's bookkeeping: free blocks (lowest first), reference counts (the full
blocks of one prompt are shared by the rows that prefilled it together: the samples of a GRPO
group), and blocks to zero once free (a row whose logits were not finite may have left NaN).
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable
from typing import Any

import torch

ZERO, TRASH = 0, 1
RESERVED = 2


def blocks_for(tokens: int, block_size: int) -> int:
    """Cache blocks that hold `tokens` slots.

    >>> blocks_for(0, 16), blocks_for(1, 16), blocks_for(16, 16), blocks_for(17, 16)
    (0, 1, 1, 2)
    """
    return -(-tokens // block_size)


class BlockPool:
    """Which blocks are free and how many rows hold each one (host side, engine thread only).

    >>> pool = BlockPool(4)
    >>> a = pool.take(2); a, pool.available
    ([2, 3], 2)
    >>> pool.share(a[:1]); pool.release(a), pool.available  # block 2 is still held once
    ([3], 3)
    >>> pool.release([2]), pool.take(3)  # freed blocks come back lowest first
    ([2], [2, 3, 4])
    """

    def __init__(self, count: int) -> None:
        self.count = count
        self._free = list(range(RESERVED, RESERVED + count))  # a heap (sorted: already one)
        self._refs = [0] * (RESERVED + count)
        self._dirty: set[int] = set()

    @property
    def available(self) -> int:
        return len(self._free)

    def take(self, n: int) -> list[int]:
        """`n` free blocks, each held once; the caller checked `available`."""
        if n > len(self._free):
            raise RuntimeError(f"{n} blocks asked for, {len(self._free)} free")
        blocks = [heapq.heappop(self._free) for _ in range(n)]
        for block in blocks:
            self._refs[block] = 1
        return blocks

    def share(self, blocks: Iterable[int]) -> None:
        """One more row holds each of `blocks`."""
        for block in blocks:
            self._refs[block] += 1

    def release(self, blocks: Iterable[int], dirty: bool = False) -> list[int]:
        """One row fewer holds each of `blocks`; returns those that became free. `dirty`: their
        contents must be zeroed before reuse (the caller zeroes the returned ones listed in
        `to_scrub`)."""
        freed = []
        for block in blocks:
            self._refs[block] -= 1
            if dirty:
                self._dirty.add(block)
            if self._refs[block] == 0:
                heapq.heappush(self._free, block)
                freed.append(block)
        return freed

    def to_scrub(self, freed: list[int]) -> list[int]:
        """Of `freed`, the blocks marked dirty (no longer marked once returned)."""
        scrub = [b for b in freed if b in self._dirty]
        self._dirty.difference_update(scrub)
        return scrub


class PagedCache:
    """Per-layer pools of `[blocks, block_size, kv_heads, head_dim]` keys and values, a block table
    per row and each row's next write slot. Attention layers call `update` only; the window
    `(b, l)` is what they see.

    Deliberately not a transformers `Cache`: with a 4-D mask supplied, transformers builds no mask
    of its own (as for `fastpath.StaticKVCache`).
    """

    def __init__(
        self,
        config: Any,
        *,
        rows: int,
        length: int,
        block_size: int,
        blocks: int,
        device: torch.device,
        dtype: torch.dtype,
        contiguous: bool = False,
    ) -> None:
        if length % block_size:
            raise ValueError(f"rows of {length} slots are not whole blocks of {block_size}")
        heads = int(config.num_attention_heads)
        kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
        head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // heads)
        layers = int(config.num_hidden_layers)
        shape = (RESERVED + blocks, block_size, kv_heads, head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        self.block_size = block_size
        self.width = length // block_size  # table entries per row
        self.free_row = torch.full((self.width,), ZERO, dtype=torch.long, device=device)
        self.free_row[0] = TRASH  # a free row's write slot (0) lands in TRASH
        self.contiguous = contiguous
        if contiguous:
            if blocks != rows * self.width:
                raise ValueError(f"contiguous rows take {rows * self.width} blocks, not {blocks}")
            owned = torch.arange(RESERVED, RESERVED + blocks, device=device)
            self.table = owned.view(rows, self.width)
            # Each layer's rows as `[rows, length, heads, dim]` views of its pool.
            self._keys_by_row = [k[RESERVED:].view(rows, length, *shape[2:]) for k in self.keys]
            self._values_by_row = [v[RESERVED:].view(rows, length, *shape[2:]) for v in self.values]
        else:
            self.table = self.free_row.repeat(rows, 1)
        self.write = torch.zeros(rows, dtype=torch.long, device=device)
        self.window = (rows, length)
        self._block = torch.zeros(rows, dtype=torch.long, device=device)  # this step's write block
        self._offset = torch.zeros(rows, dtype=torch.long, device=device)  # ... and slot in it

    def locate(self, b: int) -> None:
        """Where rows `0..b-1` write this step (once per step, not per layer)."""
        at = self.write[:b]
        self._block[:b] = self.table[:b].gather(1, (at // self.block_size).unsqueeze(1)).squeeze(1)
        self._offset[:b] = at % self.block_size

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *_: Any, **__: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        b, slots = self.window
        block, offset = self._block[:b], self._offset[:b]
        keys, values = self.keys[layer_idx], self.values[layer_idx]
        keys[block, offset] = key_states[:, :, -1]
        values[block, offset] = value_states[:, :, -1]
        if self.contiguous:
            return (
                self._keys_by_row[layer_idx][:b, :slots].transpose(1, 2),
                self._values_by_row[layer_idx][:b, :slots].transpose(1, 2),
            )
        table = self.table[:b, : slots // self.block_size]
        # [b, n, block, heads, dim] -> [b, slots, heads, dim] (a view) -> [b, heads, slots, dim]
        k = keys[table].view(b, slots, *keys.shape[2:]).transpose(1, 2)
        v = values[table].view(b, slots, *values.shape[2:]).transpose(1, 2)
        return k, v

    def get_seq_length(self, layer_idx: int = 0) -> int:  # asked by some versions; positions are given
        return 0

    def targets(
        self, rows: torch.Tensor, lengths: torch.Tensor, width: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Blocks and offsets of logical slots `0..width-1` of `rows` (`[rows, width]` each); slots
        at or past a row's length go to `TRASH` (a prefill writes its padding there)."""
        slots = torch.arange(width, device=rows.device)
        column = (slots // self.block_size).clamp(max=self.width - 1)
        blocks = self.table[rows][:, column]
        blocks = torch.where(slots.unsqueeze(0) < lengths.unsqueeze(1), blocks, TRASH)
        return blocks, (slots % self.block_size).expand(len(rows), width)

    def zero(self, blocks: list[int], device: torch.device) -> None:
        """Zero `blocks` in every layer."""
        if blocks:
            index = torch.tensor(blocks, device=device)
            for keys, values in zip(self.keys, self.values, strict=True):
                keys[index] = 0
                values[index] = 0
