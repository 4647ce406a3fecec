"""The update's batches: prompt + completion token ids left-padded into one tensor, the
completion tokens right-aligned in a tail (`Batch`), and per-token values placed like that tail
(`right_align`), so only the last `tail + 1` logits of a forward pass are needed; `padded` rounds a
batch's shape up for compiled forwards."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Batch:
    """Left-padded prompt+completion ids with the completion tokens right-aligned in a tail."""

    input_ids: torch.Tensor  # [B, T]
    attention_mask: torch.Tensor  # [B, T]
    position_ids: torch.Tensor  # [B, T]
    tail_mask: torch.Tensor  # [B, K]: 1 on completion tokens
    tail: int  # K = longest completion
    tokens: int = 0  # the real (unpadded) tokens of all rows


def make_batch(prompts: list[list[int]], completions: list[list[int]], pad_id: int, device: str) -> Batch:
    seqs = [p + c for p, c in zip(prompts, completions, strict=True)]
    width = max(len(s) for s in seqs)
    tail = max(1, max(len(c) for c in completions))
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    tail_mask = torch.zeros((len(seqs), tail), dtype=torch.float32)
    for i, (s, c) in enumerate(zip(seqs, completions, strict=True)):
        ids[i, width - len(s) :] = torch.tensor(s, dtype=torch.long)
        mask[i, width - len(s) :] = 1
        if c:
            tail_mask[i, tail - len(c) :] = 1
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    real = sum(len(seq) for seq in seqs)
    return Batch(ids.to(device), mask.to(device), positions.to(device), tail_mask.to(device), tail, real)


def padded(batch: Batch, multiple: int, pad_id: int, rows: int = 1) -> Batch:
    """`batch` with more left padding: its tail and its width rounded up to multiples of `multiple`
    (the width holds the tail and the position before it), so that batches of many lengths take a
    few shapes (a compiled forward is traced once per shape), and at least `rows` rows (copies of
    the last, their tails masked). The new positions are masked, like the padding already there:
    every real token's log-prob is unchanged, and the first rows and last `batch.tail` columns of
    the tail are the original tail.

    >>> b = padded(make_batch([[5, 6, 7, 8, 9]], [[10]], 0, "cpu"), 4, 0)
    >>> b.input_ids.tolist(), b.attention_mask.tolist()
    ([[0, 0, 5, 6, 7, 8, 9, 10]], [[0, 0, 1, 1, 1, 1, 1, 1]])
    >>> b.position_ids.tolist(), b.tail, b.tail_mask.tolist()
    ([[0, 0, 0, 1, 2, 3, 4, 5]], 4, [[0.0, 0.0, 0.0, 1.0]])
    >>> two = padded(make_batch([[5, 6, 7, 8, 9]], [[10]], 0, "cpu"), 4, 0, rows=2)
    >>> two.input_ids[1].tolist(), two.tail_mask.tolist()
    ([0, 0, 5, 6, 7, 8, 9, 10], [[0.0, 0.0, 0.0, 1.0], [0.0, 0.0, 0.0, 0.0]])
    """
    tail = -(-batch.tail // multiple) * multiple
    width = -(-max(batch.input_ids.shape[1], tail + 1) // multiple) * multiple
    left = width - batch.input_ids.shape[1]

    def pad(t: torch.Tensor, n: int, value: float) -> torch.Tensor:
        return torch.nn.functional.pad(t, (n, 0), value=value) if n else t

    extra = max(0, rows - batch.input_ids.shape[0])

    def more(t: torch.Tensor, masked: bool = False) -> torch.Tensor:
        copies = t[-1:].expand(extra, -1)
        return torch.cat([t, torch.zeros_like(copies) if masked else copies]) if extra else t

    return Batch(
        more(pad(batch.input_ids, left, pad_id)),
        more(pad(batch.attention_mask, left, 0)),
        more(pad(batch.position_ids, left, 0)),
        more(pad(batch.tail_mask, tail - batch.tail, 0.0), masked=True),
        tail,
        batch.tokens,
    )


def right_align(rows: list[list[float]], tail: int, device: str) -> torch.Tensor:
    """Per-token values (e.g. old log-probs) placed like `Batch.tail_mask`."""
    out = torch.zeros((len(rows), tail), dtype=torch.float32)
    for i, r in enumerate(rows):
        if r:
            out[i, tail - len(r) :] = torch.tensor(r, dtype=torch.float32)
    return out.to(device)
