"""The update's batches: prompt + completion token ids left-padded into one tensor, the
completion tokens right-aligned in a tail (`Batch`), and per-token values placed like that tail
(`right_align`), so only the last `tail + 1` logits of a forward pass are needed."""

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
    return Batch(ids.to(device), mask.to(device), positions.to(device), tail_mask.to(device), tail)


def right_align(rows: list[list[float]], tail: int, device: str) -> torch.Tensor:
    """Per-token values (e.g. old log-probs) placed like `Batch.tail_mask`."""
    out = torch.zeros((len(rows), tail), dtype=torch.float32)
    for i, r in enumerate(rows):
        if r:
            out[i, tail - len(r) :] = torch.tensor(r, dtype=torch.float32)
    return out.to(device)
