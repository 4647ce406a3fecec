"""The eager decode path: the general one, for every sequence the continuous path does not take.

Up to `rows` sequences decode together: a left-padded prefill, then one token per step with
transformers' dynamic KV cache, dropping finished rows as it goes. Rows of different adapters share
a batch through PEFT's `adapter_names` (mixed-adapter LoRA), with `"__base__"` for the base model.
Adapter operations run between two steps (`Host.run_control_ops`).
"""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, Any

import torch
from transformers import DynamicCache

from .sequences import Readback

if TYPE_CHECKING:
    from .decoding import Host
    from .sequences import Sequence

BASE_ADAPTER = "__base__"  # PEFT's name for "no adapter" in a mixed batch


class EagerPath:
    """Decodes batches of any adapters (mixed included) on the PEFT model; a `DecodePath`."""

    def __init__(self, host: Host, *, rows: int, pad_id: int, device: torch.device) -> None:
        self.host, self.rows, self.pad_id, self.device = host, rows, pad_id, device
        # transformers renamed `past_key_values` to `cache`; pass whichever this version takes.
        params = inspect.signature(type(host.base).forward).parameters
        self.cache_kw = "cache" if "cache" in params else "past_key_values"

    def fits(self, seq: Sequence) -> bool:
        return True

    def joins(self, head: Sequence, seq: Sequence) -> bool:
        return True  # any adapters share an eager batch

    def ready(self, slot: str | None) -> bool:
        return True

    def decode(self, batch: list[Sequence]) -> None:
        """Prefill `batch` together, then decode one token per step until every row has finished."""
        host, metrics = self.host, self.host.metrics
        metrics.running.set(len(batch))
        inputs = self._prepare(batch)
        session = EagerSession(self, batch, *inputs)
        logits = session.prefill()
        metrics.prompt_tokens.inc(int(inputs[1].sum()))

        rows = batch
        done = [False] * len(rows)
        while True:
            live = [i for i, d in enumerate(done) if not d]
            metrics.batch_size.observe(len(live))
            live_logits = logits if len(live) == len(rows) else logits[torch.tensor(live, device=self.device)]
            seqs = [rows[i] for i in live]
            picked = host.sample(live_logits, seqs)
            ended = host.record(seqs, Readback(picked), list(range(len(seqs))))
            for i, end in zip(live, ended, strict=True):
                done[i] = end
            # Between two steps: the one safe moment to change adapters.
            host.run_control_ops()
            still = [i for i, d in enumerate(done) if not d]
            if not still:
                break
            next_tokens = torch.full((len(rows),), self.pad_id, dtype=torch.long, device=self.device)
            next_tokens[torch.tensor(live, device=self.device)] = picked.tokens
            logits, keep = session.step(next_tokens, still)
            if keep is not None:
                rows = [rows[i] for i in keep]
                done = [False] * len(rows)
                metrics.running.set(len(rows))
        metrics.running.set(0)

    def forward(self, input_ids, attention_mask, position_ids, cache, adapters: list[str]) -> torch.Tensor:
        """The last position's logits of each row, each row on its adapter (`BASE_ADAPTER`: none)."""
        base, peft = self.host.base, self.host.peft
        kwargs: dict[str, Any] = {self.cache_kw: cache, "use_cache": True, "logits_to_keep": 1}
        inputs = {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids}
        if peft is None:
            return base(**inputs, **kwargs).logits[:, -1, :]
        first = adapters[0]
        if any(a != first for a in adapters):
            # Rows of several adapters: PEFT's mixed-batch LoRA (slower: it splits every layer's batch).
            return peft(**inputs, adapter_names=adapters, **kwargs).logits[:, -1, :]
        if first == BASE_ADAPTER:
            with peft.disable_adapter():
                return peft(**inputs, **kwargs).logits[:, -1, :]
        if peft.active_adapter != first:
            peft.set_adapter(first)
        return peft(**inputs, **kwargs).logits[:, -1, :]

    def _prepare(self, seqs: list[Sequence]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Left-padded prompt ids, their attention mask and position ids, on the device."""
        width = max(len(s.prompt_ids) for s in seqs)
        input_ids = torch.full((len(seqs), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(seqs), width), dtype=torch.long)
        for i, seq in enumerate(seqs):
            input_ids[i, width - len(seq.prompt_ids) :] = torch.tensor(seq.prompt_ids)
            mask[i, width - len(seq.prompt_ids) :] = 1
        input_ids, mask = input_ids.to(self.device), mask.to(self.device)
        return input_ids, mask, (mask.cumsum(-1) - 1).clamp(min=0)


class EagerSession:
    """One eager batch: its rows' adapters, attention mask, positions and dynamic KV cache.

    Tensor rows stay in place while they finish; only once half of them are done are the caches
    compacted (copying every layer's KV cache at each finish costs more than the wasted rows).
    Finished rows are never sampled, so seeded draws do not depend on it.
    """

    def __init__(self, path: EagerPath, seqs: list[Sequence], input_ids, mask, positions) -> None:
        self.path = path
        self.input_ids, self.mask, self.positions = input_ids, mask, positions
        self.adapters = [s.slot or BASE_ADAPTER for s in seqs]
        self.cache = DynamicCache(config=path.host.base.config)
        self.next_pos = positions[:, -1:] + 1

    def prefill(self) -> torch.Tensor:
        return self.path.forward(self.input_ids, self.mask, self.positions, self.cache, self.adapters)

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
        logits = self.path.forward(tokens.unsqueeze(1), self.mask, self.next_pos, self.cache, self.adapters)
        self.next_pos = self.next_pos + 1
        return logits, keep
