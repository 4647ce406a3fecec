"""The eager decode path's session: one batch of the general path (PEFT adapters, mixed batches
included, and transformers' dynamic KV cache); `Engine._decode` drives it step by step."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from transformers import DynamicCache

if TYPE_CHECKING:
    from .engine import Engine
    from .sequences import Sequence

BASE_ADAPTER = "__base__"  # PEFT's name for "no adapter" in a mixed batch


class EagerSession:
    """The general decode path: PEFT adapters (mixed batches included) and a dynamic KV cache.

    Tensor rows stay in place while they finish; only once half of them are done are the caches
    compacted (copying every layer's KV cache at each finish costs more than the wasted rows).
    Finished rows are never sampled, so seeded draws do not depend on it.
    """

    def __init__(self, engine: Engine, seqs: list[Sequence], input_ids, mask, positions) -> None:
        self.engine = engine
        self.input_ids, self.mask, self.positions = input_ids, mask, positions
        self.adapters = [s.slot or BASE_ADAPTER for s in seqs]
        self.cache = DynamicCache(config=engine.base.config)
        self.next_pos = positions[:, -1:] + 1

    def prefill(self) -> torch.Tensor:
        return self.engine._forward(self.input_ids, self.mask, self.positions, self.cache, self.adapters)

    def step(self, tokens: torch.Tensor, still: list[int]) -> tuple[torch.Tensor, list[int] | None]:
        """Feed one token per row; returns the logits and, when rows were dropped, which stayed."""
        keep = None
        if len(still) <= len(self.adapters) // 2:
            keep = still
            index = torch.tensor(still, device=tokens.device)
            self.cache.batch_select_indices(index)
            self.mask, self.next_pos, tokens = self.mask[index], self.next_pos[index], tokens[index]
            self.adapters = [self.adapters[i] for i in still]
        self.mask = torch.cat([self.mask, self.mask.new_ones((len(self.adapters), 1))], dim=1)
        logits = self.engine._forward(
            tokens.unsqueeze(1), self.mask, self.next_pos, self.cache, self.adapters
        )
        self.next_pos = self.next_pos + 1
        return logits, keep
