"""The continuous decode path: rows of the fast path's paged KV cache (`continuous.py`) that
sequences of one adapter join and leave between decode steps, with one step of lookahead (the
engine's docstring says when the engine takes this path). Sequences are admitted while the cache has
free blocks for them, and preempted (back to the queue, their tokens kept) when it runs out
mid-decode.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import torch

from .sequences import Launched, Sequence
from .transfer import to_device

if TYPE_CHECKING:
    from .continuous import ContinuousDecoder
    from .decoding import Host

log = logging.getLogger(__name__)

# A running batch admits joiners once this share of its rows (1/JOIN_FRACTION) waits: an admission is
# one eager prefill (thousands of small kernels), too dear to pay for each sequence alone at scale.
JOIN_FRACTION = 8


class ContinuousPath:
    """Decodes batches of one adapter in the rows of a `ContinuousDecoder`; a `DecodePath`.

    `max_model_len`: the server's limit on prompt and output together; `join_wait_s`: the longest a
    waiting sequence waits for others before joining a running batch alone."""

    def __init__(
        self, host: Host, decoder: ContinuousDecoder, *, max_model_len: int, join_wait_s: float
    ) -> None:
        self.host, self.decoder = host, decoder
        self.rows = decoder.rows
        self.max_model_len, self.join_wait_s = max_model_len, join_wait_s
        self._live: tuple[list[int], torch.Tensor | None] = ([], None)  # the batch's row index

    def capture(self, idle: bool) -> None:
        """Capture CUDA graphs: every one before serving (`graph_capture: start`, called with
        `idle=False` at the engine's start), or the next missing one (`idle`, called while no row
        is live and nothing waits: its memory is taken now, `sizing.py` reserves it all the same)."""
        with torch.inference_mode():
            if idle:
                self.decoder.capture_next()
            elif self.decoder.graph_capture == "start":
                self.decoder.capture_all()

    def fits(self, seq: Sequence) -> bool:
        """Whether `seq` can decode in a row. (The lookahead step after its last token writes that
        token's keys, at slot `longest - 1`: nothing past the row.)"""
        longest = min(len(seq.prompt_ids) + seq.params.max_tokens, self.max_model_len)
        return longest <= self.decoder.length

    def joins(self, head: Sequence, seq: Sequence) -> bool:
        return seq.slot == head.slot  # one adapter per batch: it is merged into the weights

    def ready(self, slot: str | None) -> bool:
        """Merge `slot`'s adapter into the fast path's weights; False when it cannot be merged
        (raises when merging failed part-way)."""
        return self.decoder.merged.select(self.host.peft, slot)

    def forget(self, slot: str) -> None:
        """Adapter `slot` is gone: drop its merged weights."""
        self.decoder.merged.forget(slot)

    def decode(self, first: list[Sequence]) -> None:
        """Decode `first` in rows of the fast path, admitting later sequences of the same adapter
        between steps, until no row is left.

        One step of lookahead keeps the GPU busy while the host works: step t+1 is launched (its
        input tokens are step t's samples, still on the device) before step t's tokens are read
        back and checked for stops. A row that ended at step t computes one throwaway token in
        step t+1, which is then discarded. Admissions, adapter operations, preemptions and the end
        of the batch first settle the outstanding step.

        Rows take cache blocks as they grow (`paged.py`). When a step needs more blocks than are
        free, the most recently queued sequences give theirs back and wait at the head of the
        queue, to be prefilled again (prompt and tokens so far) once blocks are free."""
        fast = self.decoder
        slot = first[0].slot
        rows: dict[int, Sequence] = {}
        free = list(range(fast.rows - 1, -1, -1))  # popped from the end: lowest rows first
        pending: Launched | None = None
        joining = self._within_blocks(first)
        try:
            while True:
                if joining:
                    self._settle(pending, rows, free)
                    pending = None
                    self._admit(joining, rows, free)
                if rows and fast.paged and not fast.grow(self._needs(rows, pending is not None)):
                    self._settle(pending, rows, free)
                    pending = None
                    self._preempt_for_room(rows, free)
                    grown = fast.grow(self._needs(rows, False))
                    assert grown, "preemption left the step short of blocks"
                if rows:
                    launched = self._launch(rows, pending is not None)
                    self._settle(pending, rows, free)
                    pending = launched
                if self.host.control_pending():
                    # Between two steps: the one safe moment to change adapters.
                    self._settle(pending, rows, free)
                    pending = None
                    self.host.run_control_ops()
                joining = self._joiners(slot, len(rows), len(free))
                if not joining and not rows:
                    break
            self._settle(pending, rows, free)
        except Exception as exc:
            log.exception("continuous batch failed")
            for seq in list(rows.values()):
                if seq.finish_reason is None:
                    self.host.fail(seq, exc)
            fast.release(list(rows))
        finally:
            self.host.metrics.running.set(0)
            self._update_block_gauge()

    def _update_block_gauge(self) -> None:
        self.host.metrics.cache_usage.set(1 - self.decoder.free_blocks / self.decoder.pool.count)

    def _needs(self, rows: dict[int, Sequence], lagging: bool) -> dict[int, int]:
        """The slots each row fills by the end of the next step (`lagging`: one token more than
        the host has read back)."""
        extra = int(lagging)
        return {r: len(s.prompt_ids) + len(s.output_ids) + extra for r, s in rows.items()}

    def _preempt_for_room(self, rows: dict[int, Sequence], free: list[int]) -> None:
        """Free the blocks the next step lacks: the most recently queued sequences leave their rows
        and go back to the head of the queue (oldest first), keeping what they generated."""
        fast = self.decoder
        preempted = []
        while rows and fast.shortfall(self._needs(rows, False)):
            row, seq = max(rows.items(), key=lambda item: (item[1].enqueued, item[0]))
            del rows[row]
            fast.release([row])
            free.append(row)
            seq.cache_row = None
            preempted.append(seq)
        free.sort(reverse=True)
        if preempted:
            self.host.requeue(preempted)
            self.host.metrics.preempted.inc(len(preempted))
            log.debug("preempted %d sequences: the cache's blocks ran out", len(preempted))

    def _within_blocks(self, seqs: list[Sequence]) -> list[Sequence]:
        """The head of `seqs` whose prompts (and tokens so far) fit in the free blocks, with a
        block's headroom each for the next step; the rest go back to the head of the queue."""
        fast = self.decoder
        left, fits = fast.free_blocks, 0
        seen: set[tuple[int, ...]] = set()
        for seq in seqs:
            need = self._blocks_to_admit(seq, seen)
            if need > left:
                break
            left, fits = left - need, fits + 1
        if fits < len(seqs):
            self.host.requeue(seqs[fits:])
        return seqs[:fits]

    def _blocks_to_admit(self, seq: Sequence, seen: set[tuple[int, ...]]) -> int:
        """Blocks `seq` takes when admitted with the sequences whose prompts are in `seen` (its
        tokens so far and the next step's): a prompt admitted twice shares its full blocks
        (`ContinuousDecoder.prefill`), so the second takes only its partial block."""
        fast = self.decoder
        need = fast.blocks_for(len(seq.prompt_ids) + len(seq.output_ids) + 1)
        if fast.paged and not seq.output_ids:
            prompt = tuple(seq.prompt_ids)
            if prompt in seen:
                return need - len(prompt) // fast.block_size
            seen.add(prompt)
        return need

    def _joiners(self, slot: str | None, running: int, free: int) -> list[Sequence]:
        """Waiting sequences that join the running batch now (FIFO, same adapter, rows to spare)."""
        if free == 0:
            return []
        fast = self.decoder
        if fast.merged.current != slot:
            # The batch's adapter was unloaded as its last row ended and its slot may already hold
            # the next version's weights: a new batch merges them before anything decodes.
            return []

        def due(waiting: int, oldest: float) -> bool:
            return waiting >= running // JOIN_FRACTION or time.monotonic() - oldest >= self.join_wait_s

        # A block of headroom per running row (each may cross into a new block in the next
        # `block_size` steps): a joiner admitted into the last free blocks would be preempted
        # again at once, its prefill wasted.
        left = fast.free_blocks - (running if fast.paged else 0)
        seen: set[tuple[int, ...]] = set()

        def joins(seq: Sequence) -> bool:
            nonlocal left
            if seq.slot != slot or not self.fits(seq):
                return False
            need = self._blocks_to_admit(seq, seen)
            if need > left:  # admission by free blocks; FIFO: nobody overtakes it
                return False
            left -= need
            return True

        joining = self.host.take_joiners(joins, free, due)
        if joining and running:
            self.host.metrics.joined.inc(len(joining))
        return joining

    def _admit(self, seqs: list[Sequence], rows: dict[int, Sequence], free: list[int]) -> None:
        """Prefill `seqs` into free rows and sample their first tokens (settled at once)."""
        fast, began = self.decoder, time.perf_counter()
        placed = [free.pop() for _ in seqs]
        # A preempted sequence comes back with its tokens so far: they are prefilled with its prompt.
        logits, reused = fast.prefill(placed, [s.prompt_ids + s.output_ids for s in seqs])
        self.host.metrics.prompt_tokens.inc(sum(len(s.prompt_ids) for s in seqs))
        self.host.metrics.prefix_reused_tokens.inc(reused)
        for row, seq in zip(placed, seqs, strict=True):
            rows[row], seq.cache_row = seq, row
        index = to_device(placed, fast.device)
        launched = Launched(list(zip(placed, seqs, strict=True)), self.host.sample(logits, seqs))
        fast.feed(index, launched.picked.tokens)
        self._settle(launched, rows, free)
        self.host.metrics.admissions.inc()
        self.host.metrics.admission_seconds.inc(time.perf_counter() - began)

    def _launch(self, rows: dict[int, Sequence], lagging: bool) -> Launched:
        """Queue one decode step of every live row and the sampling of its tokens (not read back).

        `lagging`: the previous step's tokens are not on the host yet, so every row is one token
        further than its `output_ids` say."""
        fast = self.decoder
        live = sorted(rows)
        longest = max(len(s.prompt_ids) + len(s.output_ids) for s in rows.values()) + int(lagging)
        window = fast.window(live[-1], longest)
        if self._live[0] != live:
            # Built only when the rows change (admissions and ends), not at every step.
            self._live = (live, to_device(live, fast.device))
        index = self._live[1]
        self.host.metrics.batch_size.observe(len(live))
        self.host.metrics.running.set(len(live))
        self._update_block_gauge()
        logits = fast.step(window)
        seqs = [rows[r] for r in live]
        launched = Launched(list(zip(live, seqs, strict=True)), self.host.sample(logits[index], seqs))
        fast.feed(index, launched.picked.tokens)  # the next step's input, without a trip to the host
        return launched

    def _settle(self, launched: Launched | None, rows: dict[int, Sequence], free: list[int]) -> None:
        """Read back a launched step's tokens, record them, free the rows whose sequence ended.

        Sequences that had already ended (the step ran one token past them) are skipped."""
        if launched is None:
            return
        current = [(i, row, seq) for i, (row, seq) in enumerate(launched.rows) if seq.finish_reason is None]
        ended = self.host.record(
            [seq for _, _, seq in current], launched.readback, [i for i, _, _ in current]
        )
        done = [row for (_, row, _), end in zip(current, ended, strict=True) if end]
        for row in done:
            del rows[row]
        if done:
            free.extend(done)
            free.sort(reverse=True)
            self.decoder.release(done, faulted=[row for _, row, seq in current if seq.faulted])
