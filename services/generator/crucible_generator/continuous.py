"""Continuous batching on the fast path: sequences join and leave the running decode batch between
two steps, each in a KV-cache row of its own.

The fast path (merged weights, see `fastpath.py`) decodes up to `rows` rows of up to `length` slots
in a paged cache (`paged.py`): blocks of `block_size` slots that a row takes as it grows and gives
back when it ends (the engine admits sequences while free blocks hold them and preempts when they
run out). A row is one sequence: its prompt fills slots `0..n-1` at admission and every decode
step writes its new token at its own next slot, so rows of different lengths and ages decode side
by side. A finished row is free at once and the next waiting sequence takes it at the
next step boundary; nobody waits for the longest row of a batch to end.

A decode step runs over a *window* of the cache: the first `b` rows (`b` a power of two covering
the highest live row) and the first `l` slots (`l` a multiple of `LENGTH_BUCKET` covering the
longest live row). Each window's step is captured once as a CUDA graph and replayed from then on:
the buffers never move, so a graph stays valid for the life of the server and steady-state decoding
captures nothing. When graphs are captured is `graph_capture`'s choice:

* `start`: `capture_all` takes every window and prefill shape before the first batch (a window
  still missing is captured when a step first needs it); the server answers meanwhile, but the
  first requests wait for all of it (13-18 s at 512 rows on an H200).
* `idle` (the default): the server decodes at once; a step or prefill whose graph is not captured
  yet runs eagerly (the same computation, uncaptured: the same tokens), and the engine captures the
  missing graphs one at a time (`capture_next`, in `capture_order`) whenever it has nothing to
  decode, so a new request waits at most one capture. Idle captures run only while no row is live,
  so they never touch a sequence's state. A decode window or prefill shape that serving has already
  run `CAPTURE_AFTER_EAGER_STEPS` times eagerly is captured at its next use, as `start` captures
  one it lacks: a large first request keeps a server busy for its whole length (an RL job's
  pre-filter: 1,496 sequences at 512 rows, sent a second after the server came up), and its
  admissions, a few prompts joining at almost every step, otherwise all prefilled eagerly (on an
  H200, 10-12k tokens/s while prompts still joined, 19-27k once they stopped).

A capture that fails (a forward that syncs with the host, ...) is recorded in `failure` and the
engine serves the model on its eager path instead. Rows inside the window that are free compute a
throwaway token (their write slot stays at 0, in the trash block or their own first block, so they
never run off the cache).

Admission prefills the new sequences together (eagerly: prompts vary in length) into a scratch
cache, then copies each prompt's keys and values into its row's blocks, shifted so the prompt starts
at slot 0. Identical prompts are prefilled once, and the rows that asked for them share the
prompt's full blocks: the samples of a GRPO group, or `n > 1`, share one prefill and its memory.
"""

from __future__ import annotations

import inspect
import logging
import time
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from typing import Any, Literal

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from .attention import use_packed_attention
from .fastpath import LENGTH_BUCKET, MergedModel, StaticKVCache, bucket, prefill_mask
from .paged import ZERO as ZERO_BLOCK
from .paged import BlockPool, PagedCache, blocks_for
from .transfer import to_device

log = logging.getLogger(__name__)

PREFILL_TOKENS = 16384  # most (padded) prompt tokens one prefill forward takes
# Prefills of up to PREFILL_GRAPH_ROWS distinct prompts of up to PREFILL_GRAPH_WIDTH tokens run as
# CUDA graphs too (padded to a power of two of prompts and a multiple of PREFILL_WIDTH_STEP): an
# eager prefill launches thousands of small kernels, ~10 ms whatever its size, which a busy batch
# would otherwise pay at every admission.
PREFILL_GRAPH_ROWS = 16
PREFILL_GRAPH_WIDTH = 512
PREFILL_WIDTH_STEP = 64
# `graph_capture: idle`: a window that serving has stepped through this many times eagerly (over the
# server's life), or a prefill shape it has prefilled this many times, is captured at its next use.
# A large batch keeps one window for hundreds of steps and admits joiners in a few prefill shapes:
# a capture (~0.12 s at 1.5B on an H200) pays for itself within a few uses (an eager 512-row step
# took ~40 ms, replayed ~20 ms). The few steps a draining batch spends in each smaller window are
# mostly left to idle time.
CAPTURE_AFTER_EAGER_STEPS = 8
# `attention_kernels: no_cudnn`: SDPA without cuDNN attention, which PyTorch >= 2.11 prefers on
# H100s and which has had NaN and out-of-bounds bugs for masked shapes like the fast path's.
WITHOUT_CUDNN = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]

GraphKind = Literal["decode", "prefill"]  # a decode window (rows, slots) or a prefill (prompts, width)


class ContinuousDecoder:
    """The merged model, its paged cache and one CUDA graph per window; the engine drives it.

    `rows`: the most sequences decoded at once; `length`: the most slots one may fill; `blocks`:
    the cache's blocks of `block_size` slots (default: enough for every row at full length);
    `graph_capture`: when graphs are captured (the module's docstring)."""

    def __init__(
        self,
        base: torch.nn.Module,
        *,
        rows: int,
        length: int,
        use_graphs: bool,
        block_size: int = 16,
        blocks: int | None = None,
        prefill_graphs: bool = True,
        on_capture: Callable[[], Any] | None = None,
        attention_kernels: Literal["auto", "no_cudnn"] = "auto",
        capture: Callable[..., tuple[Any, torch.Tensor]] | None = None,
        graph_capture: Literal["idle", "start"] = "idle",
    ) -> None:
        self.merged = MergedModel(base)
        self.model = self.merged.model
        self.packed_attention = use_packed_attention(self.model)
        self.device = next(self.model.parameters()).device
        self.dtype = next(self.model.parameters()).dtype
        self.rows, self.length = rows, -(-length // LENGTH_BUCKET) * LENGTH_BUCKET
        self.use_graphs = use_graphs and self.device.type == "cuda"
        self.block_size = block_size
        per_row = blocks_for(self.length, block_size)
        blocks = rows * per_row if blocks is None else blocks
        if blocks < per_row:
            raise ValueError(f"{blocks} blocks of {block_size} slots cannot hold one row of {self.length}")
        # Blocks for every row at full length: each row owns its own for good (`paged.py`).
        self.paged = blocks < rows * per_row
        blocks = min(blocks, rows * per_row)
        self.cache = PagedCache(
            self.model.config,
            rows=rows,
            length=self.length,
            block_size=block_size,
            blocks=blocks,
            device=self.device,
            dtype=self.dtype,
            contiguous=not self.paged,
        )
        self.pool = BlockPool(blocks)
        self.row_blocks: list[list[int]] = [[] for _ in range(rows)]  # each row's blocks, in order
        self.hidden = torch.finfo(self.dtype).min
        self.mask = torch.full((rows, self.length), self.hidden, dtype=self.dtype, device=self.device)
        self.input_ids = torch.zeros((rows, 1), dtype=torch.long, device=self.device)
        self.positions = torch.zeros((rows, 1), dtype=torch.long, device=self.device)
        self.live = torch.zeros(rows, dtype=torch.long, device=self.device)  # 1: the row decodes
        self._slots = torch.arange(self.length, device=self.device)
        self._rows = torch.arange(rows, device=self.device)
        self._graphs: dict[tuple[int, int], tuple[Any, torch.Tensor]] = {}
        # `idle`: eager uses of each graph not captured yet (decode windows, prefill shapes)
        self._eager_uses: dict[tuple[GraphKind, tuple[int, int]], int] = {}
        self._prefill_graphs: dict[tuple[int, int], _PrefillGraph] = {}
        # Prefill in fixed shapes (and, with graphs, replay them); tests turn it on without CUDA.
        self.bucket_prefill = self.use_graphs and prefill_graphs
        self._pool = torch.cuda.graph_pool_handle() if self.use_graphs else None
        self.captures = 0  # graphs captured so far (steady state adds none)
        # Why capturing failed, in words (None: it has not): the engine then serves the model on the
        # eager path (engine.py). `capture` stands in for `capture_graph` in tests.
        self.failure: str | None = None
        self._on_capture = on_capture
        self._capture_graph = capture or capture_graph
        self.graph_capture = graph_capture
        self._idle_capture_s = 0.0  # time spent in idle captures so far
        self._serving_captures = 0  # graphs captured at their use while serving (`_capture_now`)
        self._complete_told = False  # the line that says every graph is in, logged once
        params = inspect.signature(type(self.model).forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        self._takes_cache_position = "cache_position" in params
        self._zero = torch.zeros(1, dtype=torch.long, device=self.device)
        self._open = torch.zeros((), dtype=self.dtype, device=self.device)  # a visible slot's mask value
        self._kernels = WITHOUT_CUDNN if attention_kernels == "no_cudnn" else None

    def window(self, highest_row: int, longest: int) -> tuple[int, int]:
        """The step window covering rows `0..highest_row` and `longest` slots."""
        length = min(-(-longest // LENGTH_BUCKET) * LENGTH_BUCKET, self.length)
        return bucket(highest_row + 1, self.rows), length

    def _forward(self, cache: Any, input_ids, mask, positions) -> torch.Tensor:
        kwargs: dict[str, Any] = {self._cache_kw: cache, "use_cache": True, "logits_to_keep": 1}
        if self._takes_cache_position:  # older transformers derive slots from it; ours ignore it
            kwargs["cache_position"] = self._zero + torch.arange(input_ids.shape[1], device=self.device)
        with sdpa_kernel(self._kernels) if self._kernels else nullcontext():  # also while capturing
            out = self.model(input_ids=input_ids, attention_mask=mask, position_ids=positions, **kwargs)
        return out.logits[:, -1, :]

    # --- blocks ---------------------------------------------------------------------------------

    @property
    def free_blocks(self) -> int:
        return self.pool.available

    def blocks_for(self, tokens: int) -> int:
        """Blocks that hold `tokens` slots of one row."""
        return blocks_for(tokens, self.block_size)

    def shortfall(self, needs: dict[int, int]) -> int:
        """How many blocks short the cache is of giving each row `r` in `needs` `needs[r]` slots
        (0: it has enough)."""
        if not self.paged:  # every row holds its full length already
            return 0
        missing = sum(max(0, self.blocks_for(n) - len(self.row_blocks[r])) for r, n in needs.items())
        return max(0, missing - self.pool.available)

    def grow(self, needs: dict[int, int]) -> bool:
        """Give each row `r` in `needs` blocks for `needs[r]` slots; False (and nothing given) when
        there are not enough free blocks (`shortfall` says how many more)."""
        if not self.paged:
            return True
        size, holding = self.block_size, self.row_blocks
        # One pass over the rows, at every step: most rows need no block (one step in `size`).
        short = [(r, -(-n // size) - len(holding[r])) for r, n in needs.items() if n > len(holding[r]) * size]
        if not short:
            return True
        if sum(more for _, more in short) > self.pool.available:
            return False
        rows: list[int] = []
        columns: list[int] = []
        blocks: list[int] = []
        for row, more in short:
            held = self.row_blocks[row]
            if more > 0:
                new = self.pool.take(more)
                rows += [row] * more
                columns += range(len(held), len(held) + more)
                blocks += new
                held += new
        at = to_device([rows, columns, blocks], self.device)
        self.cache.table[at[0], at[1]] = at[2]
        return True

    def _place(self, rows: Sequence[int], prompts: Sequence[Sequence[int]], source: list[int]) -> None:
        """Blocks for `rows` to hold their prompts; rows prefilled from one prompt (`source`) share
        its full blocks, each with a last partial block of its own (decoding writes there)."""
        if not self.paged:  # the row's own blocks (counted, so that admission sees free rows)
            for row in rows:
                self.row_blocks[row] = self.pool.take(self.cache.width)
            return
        first: dict[int, int] = {}  # distinct prompt -> the row that took its blocks
        table = torch.full((len(rows), self.cache.width), ZERO_BLOCK, dtype=torch.long)
        for i, (row, prompt, s) in enumerate(zip(rows, prompts, source, strict=True)):
            assert not self.row_blocks[row], f"row {row} still holds blocks"
            need = self.blocks_for(len(prompt))
            owner = first.setdefault(s, row)
            shared = self.row_blocks[owner][: len(prompt) // self.block_size] if owner != row else []
            self.pool.share(shared)
            self.row_blocks[row] = shared + self.pool.take(need - len(shared))
            table[i, :need] = torch.tensor(self.row_blocks[row])
        self.cache.table[to_device(list(rows), self.device)] = to_device(table, self.device)

    # --- admission ------------------------------------------------------------------------------

    def prefill(self, rows: Sequence[int], prompts: Sequence[Sequence[int]]) -> tuple[torch.Tensor, int]:
        """Fill `rows` with `prompts` (one each), taking their blocks (the caller checked there are
        enough: `blocks_for` each prompt); returns each row's next-token logits and how many
        prompt tokens were not prefilled again (identical prompts share one prefill)."""
        unique: dict[tuple[int, ...], int] = {}
        source = [unique.setdefault(tuple(p), len(unique)) for p in prompts]
        distinct = list(unique)
        self._place(rows, prompts, source)
        logits: list[torch.Tensor | None] = [None] * len(distinct)
        start = 0
        while start < len(distinct):  # chunks of at most PREFILL_TOKENS padded tokens
            end, width = start, 0
            while end < len(distinct):
                wider = max(width, len(distinct[end]))
                if end > start and wider * (end - start + 1) > PREFILL_TOKENS:
                    break
                width, end = wider, end + 1
            members = [i for i, s in enumerate(source) if start <= s < end]
            chunk = self._prefill_chunk(
                distinct[start:end], [rows[i] for i in members], [source[i] - start for i in members]
            )
            for k in range(start, end):
                logits[k] = chunk[k - start]
            start = end
        reused = sum(map(len, prompts)) - sum(map(len, distinct))
        return torch.stack([logits[s] for s in source]), reused  # type: ignore[misc]

    def _prefill_chunk(
        self, prompts: list[tuple[int, ...]], rows: list[int], source: list[int]
    ) -> torch.Tensor:
        count, width = len(prompts), max(len(p) for p in prompts)
        fixed = self.bucket_prefill and count <= PREFILL_GRAPH_ROWS and width <= PREFILL_GRAPH_WIDTH
        if fixed:
            # A fixed shape (padding rows, a rounded width): one captured graph per shape. Other
            # shapes prefill eagerly: a graph per arbitrary shape would be captured mid-serving,
            # each holding a scratch cache of its own (up to ~0.9 GB at 128 prompts x 300 tokens).
            count = bucket(count, PREFILL_GRAPH_ROWS)
            width = -(-width // PREFILL_WIDTH_STEP) * PREFILL_WIDTH_STEP
        ids = torch.zeros((count, width), dtype=torch.long)
        mask2d = torch.zeros((count, width), dtype=torch.bool)  # padding rows: nothing real
        for i, prompt in enumerate(prompts):  # left-padded, as `fastpath` prefills
            ids[i, width - len(prompt) :] = torch.tensor(prompt)
            mask2d[i, width - len(prompt) :] = True
        ids, mask2d = to_device(ids, self.device), to_device(mask2d, self.device)
        graph = self._prefill_graph((count, width)) if self.use_graphs and fixed else None
        if graph is not None:
            graph.ids.copy_(ids)
            graph.mask2d.copy_(mask2d)
            graph.graph.replay()
            # A copy: a later chunk of the same prefill may replay this graph before they are read.
            scratch, logits = graph.scratch, graph.logits.clone()
        else:
            scratch = StaticKVCache(width, self.device)
            logits = self._prefill_forward(scratch, ids, mask2d)
        # Copy each prompt into its rows' blocks shifted left so that it starts at slot 0.
        src = to_device(source, self.device)
        lengths = to_device([len(prompts[s]) for s in source], self.device)
        shift = (self._slots[:width].unsqueeze(0) + (width - lengths).unsqueeze(1)).clamp(max=width - 1)
        target = to_device(rows, self.device)
        blocks, offsets = self.cache.targets(target, lengths, width)
        for layer, (k, v) in enumerate(zip(scratch.keys, scratch.values, strict=True)):
            index = shift[:, None, :, None].expand(len(rows), k.shape[1], width, k.shape[3])
            self.cache.keys[layer][blocks, offsets] = k[src].gather(2, index).transpose(1, 2)
            self.cache.values[layer][blocks, offsets] = v[src].gather(2, index).transpose(1, 2)
        self.mask[target] = torch.where(
            self._slots.unsqueeze(0) < lengths.unsqueeze(1), self._open, self.hidden
        )
        self.cache.write[target] = lengths
        self.positions[target, 0] = lengths
        self.live[target] = 1
        return logits[: len(prompts)]

    def _prefill_forward(
        self, scratch: StaticKVCache, ids: torch.Tensor, mask2d: torch.Tensor
    ) -> torch.Tensor:
        positions = (mask2d.long().cumsum(-1) - 1).clamp(min=0)
        scratch.position.zero_()
        return self._forward(scratch, ids, prefill_mask(mask2d, ids.shape[1], self.dtype), positions)

    def _prefill_graph(self, shape: tuple[int, int]) -> _PrefillGraph | None:
        """The captured prefill of `shape` (rows, width), captured now if `_capture_now` says so;
        None when it is not captured (yet) or capture failed (prefills then run eagerly from now on)."""
        graph = self._prefill_graphs.get(shape)
        if graph is None and self._capture_now("prefill", shape) and self._capture_one("prefill", shape):
            graph = self._prefill_graphs[shape]
            self._captured_while_serving()
        return graph

    def release(self, rows: Sequence[int], faulted: Sequence[int] = ()) -> None:
        """Free `rows` and give back their blocks: the rows stop advancing (their writes go to the
        trash block, or their own first slot when rows own their blocks, until a prompt fills them). The blocks of `faulted` rows are zeroed once no row
        holds them: whatever a fault left there (`faults.py`) must not reach the next sequence
        placed in them."""
        if not rows:
            return
        freed = []
        for row in rows:
            freed += self.pool.release(self.row_blocks[row], dirty=row in faulted and self.paged)
            self.row_blocks[row] = []
        self.cache.zero(self.pool.to_scrub(freed), self.device)
        target = to_device(list(rows), self.device)
        self.live[target] = 0
        self.cache.write[target] = 0
        if self.paged:
            self.cache.table[target] = self.cache.free_row
        elif faulted:  # the row's own blocks
            self.cache.zero(
                self.cache.table[to_device(list(faulted), self.device)].flatten().tolist(), self.device
            )
        if faulted:
            self.mask[to_device(list(faulted), self.device)] = self.hidden

    # --- decoding -------------------------------------------------------------------------------

    def feed(self, rows: torch.Tensor, tokens: torch.Tensor) -> None:
        """Set the token each of `rows` feeds to the next step (device tensors: no host sync)."""
        self.input_ids[rows, 0] = tokens

    def step(self, window: tuple[int, int]) -> torch.Tensor:
        """One decode step of the window's rows; returns their next-token logits."""
        if not self.use_graphs:
            return self._step(window)
        entry = self._graphs.get(window)
        if entry is None and not self._capture_now("decode", window):
            return self._step(window)  # the same computation, uncaptured
        if entry is None:
            try:
                entry = self._capture(window)
            except Exception as exc:
                # This step still runs (the same computation, uncaptured) so that the running
                # batch completes; the engine leaves the fast path once it has.
                self._graphs_failed(exc)
                return self._step(window)
            self._captured_while_serving()
        entry[0].replay()
        return entry[1]

    def _capture_now(self, kind: GraphKind, shape: tuple[int, int]) -> bool:
        """Whether a graph that is not captured is captured at this use: always with `start`; with
        `idle` once serving has run it eagerly `CAPTURE_AFTER_EAGER_STEPS` times (it has proved it
        lasts: a pre-filter's admissions reuse a few prefill shapes hundreds of times), else the
        engine captures it once idle. Counts this use."""
        if self.graph_capture == "start":
            return True
        uses = self._eager_uses.get((kind, shape), 0) + 1
        if uses <= CAPTURE_AFTER_EAGER_STEPS:
            self._eager_uses[(kind, shape)] = uses
            return False
        return True

    def _step(self, window: tuple[int, int]) -> torch.Tensor:
        b, slots = window
        self.cache.window = window
        self.cache.locate(b)
        # Open the slot each row writes now (a tensor value: nothing leaves the device in a graph).
        self.mask.index_put_((self._rows[:b], self.cache.write[:b]), self._open)
        mask = self.mask[:b, :slots][:, None, None, :]
        logits = self._forward(self.cache, self.input_ids[:b], mask, self.positions[:b])
        self.cache.write[:b] += self.live[:b]
        self.positions[:b, 0] += self.live[:b]
        return logits

    # --- capturing ------------------------------------------------------------------------------

    def capture_order(self) -> list[tuple[GraphKind, tuple[int, int]]]:
        """Every graph the fast path replays (none without graphs), in the order they are captured.

        Decode windows first: a batch takes a step per token and an admission one prefill. Of the
        windows, the most rows first, each from the shortest to the longest: a training job's
        requests are the large ones (a step's samples at once: hundreds to thousands of sequences,
        filling the rows from the lowest up, so their steps run in the windows of the most rows),
        and every batch starts short and grows, so it needs a row count's short windows before its
        long ones (at ~0.1 s a capture on an H200, the 8 windows of 512 rows x 2,048 slots are in
        within a second). Small row counts (a lone request, a batch's last stragglers) come last.
        Then the prefill shapes, fewest prompts first: joiners come a few prompts at a time."""
        if not self.use_graphs:
            return []
        sizes = sorted({bucket(n, self.rows) for n in range(1, self.rows + 1)}, reverse=True)
        lengths = range(LENGTH_BUCKET, self.length + 1, LENGTH_BUCKET)
        order: list[tuple[GraphKind, tuple[int, int]]] = [
            ("decode", (b, slots)) for b in sizes for slots in lengths
        ]
        if self.bucket_prefill:
            order += [("prefill", shape) for shape in prefill_graph_shapes(self.length)]
        return order

    def uncaptured(self) -> list[tuple[GraphKind, tuple[int, int]]]:
        """The graphs of `capture_order` not captured yet, in that order."""
        return [
            (kind, shape)
            for kind, shape in self.capture_order()
            if shape not in (self._graphs if kind == "decode" else self._prefill_graphs)
        ]

    @property
    def live_rows(self) -> bool:
        """Whether a row holds a sequence (it holds blocks from its prefill until its release)."""
        return any(self.row_blocks)

    @property
    def idle_captures_left(self) -> bool:
        """Whether `capture_next` would capture a graph now (`graph_capture: idle`, graphs on, one
        missing, no row live)."""
        return bool(self._idle_missing())

    def _idle_missing(self) -> list[tuple[GraphKind, tuple[int, int]]]:
        """What an idle capture may take now: the missing graphs (`graph_capture: idle`, no row live)."""
        return self.uncaptured() if self.graph_capture == "idle" and not self.live_rows else []

    def capture_next(self) -> bool:
        """Capture the first missing graph of `capture_order` (the engine calls this when it has
        nothing to decode); returns whether one was captured. Nothing is captured while a row is
        live: the capture's warm-up steps run over every row of its window. A failed capture is
        recorded in `failure` (and nothing is left to capture). Logs one line when the last graph
        is in, here or at its use while serving."""
        missing = self._idle_missing()
        if not missing:
            return False
        started = time.perf_counter()
        captured = self._capture_one(*missing[0])
        self._idle_capture_s += time.perf_counter() - started
        if captured and len(missing) == 1:
            self._tell_complete()
        return captured

    def _captured_while_serving(self) -> None:
        """A graph was captured at its use (`graph_capture: idle`): counted, and if it was the last
        one missing, the line that says every graph is in."""
        self._serving_captures += 1
        if self.graph_capture == "idle" and not self.uncaptured():
            self._tell_complete()

    def _tell_complete(self) -> None:
        """Log, once, that every graph is captured (in idle time, and at their use while serving)."""
        if self._complete_told:
            return
        self._complete_told = True
        serving = f", {self._serving_captures} of them while serving" if self._serving_captures else ""
        line = "captured %d CUDA graphs in the idle time of %.1f s%s"
        log.info(line, self.captures, self._idle_capture_s, serving)

    def capture_all(self) -> None:
        """Capture every graph now (`graph_capture: start`: at start-up, before any row is used), so
        that serving never pauses for a capture. The captured steps write only into free rows."""
        if not self.use_graphs:
            return
        started = time.perf_counter()
        for kind, shape in self.uncaptured():
            if not self._capture_one(kind, shape):
                return
        log.info("captured %d CUDA graphs in %.1f s", self.captures, time.perf_counter() - started)

    def _capture_one(self, kind: GraphKind, shape: tuple[int, int]) -> bool:
        """Capture one decode window or prefill shape; False when capture failed (`failure`)."""
        try:
            if kind == "decode":
                self._capture(shape)
            else:
                self._prefill_graphs[shape] = _PrefillGraph(shape, self)
                self._count_capture(f"a prefill graph for {shape[0]} prompts x {shape[1]} tokens")
        except Exception as exc:
            self._graphs_failed(exc)
            return False
        return True

    def _graphs_failed(self, exc: Exception) -> None:
        """Capturing a graph raised `exc`: record why (`failure`), capture nothing more and free
        what was captured. The engine logs the one line that says so (its traceback: debug)."""
        log.debug("CUDA graph capture failed", exc_info=exc)
        first = str(exc).strip().splitlines()
        self.failure = f"{type(exc).__name__}: {first[0]}" if first else type(exc).__name__
        self.use_graphs = self.bucket_prefill = False
        self._graphs.clear()
        self._prefill_graphs.clear()
        if self.device.type == "cuda":
            try:  # let the failed capture's work settle; an error it left is already recorded
                torch.cuda.synchronize(self.device)
            except Exception:
                log.debug("synchronising after the failed capture", exc_info=True)

    def _capture(self, window: tuple[int, int]) -> tuple[Any, torch.Tensor]:
        """Record `_step(window)` as a CUDA graph, leaving the decode state as it was before."""
        saved = (self.mask.clone(), self.cache.write.clone(), self.positions.clone())

        def warm_up() -> None:
            self._step(window)
            self._restore(saved)

        try:
            graph, logits = self._capture_graph(lambda: self._step(window), warm_up, self._pool)
        finally:
            self._restore(saved)
        self._graphs[window] = (graph, logits)
        self._count_capture(f"a decode graph for {window[0]} rows x {window[1]} slots")
        return graph, logits

    def _count_capture(self, what: str) -> None:
        self.captures += 1
        if self._on_capture is not None:
            self._on_capture()
        log.debug("captured %s", what)

    def _restore(self, saved: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> None:
        self.mask.copy_(saved[0])
        self.cache.write.copy_(saved[1])
        self.positions.copy_(saved[2])


def prefill_graph_shapes(length: int) -> list[tuple[int, int]]:
    """Every (prompts, width) shape of a captured prefill for rows of `length` slots.

    >>> len(prefill_graph_shapes(2048)), prefill_graph_shapes(2048)[:2], prefill_graph_shapes(2048)[-1]
    (40, [(1, 64), (1, 128)], (16, 512))
    """
    counts = sorted({bucket(n, PREFILL_GRAPH_ROWS) for n in range(1, PREFILL_GRAPH_ROWS + 1)})
    widths = range(PREFILL_WIDTH_STEP, min(PREFILL_GRAPH_WIDTH, length) + 1, PREFILL_WIDTH_STEP)
    return [(count, width) for count in counts for width in widths]


class _PrefillGraph:
    """One captured prefill shape: static inputs, its scratch cache and its logits."""

    def __init__(self, shape: tuple[int, int], decoder: ContinuousDecoder) -> None:
        width = shape[1]
        self.ids = torch.zeros(shape, dtype=torch.long, device=decoder.device)
        self.mask2d = torch.zeros(shape, dtype=torch.bool, device=decoder.device)
        self.mask2d[:, -1] = True  # warm-up rows: one real token each
        self.scratch = StaticKVCache(width, decoder.device)

        def forward() -> torch.Tensor:
            return decoder._prefill_forward(self.scratch, self.ids, self.mask2d)

        # The warm-up also allocates the scratch cache, before the capture.
        self.graph, self.logits = decoder._capture_graph(forward, forward, decoder._pool)


def capture_graph(
    fn: Callable[[], torch.Tensor], warm_up: Callable[[], Any], pool: Any
) -> tuple[Any, torch.Tensor]:
    """Capture `fn` as a CUDA graph in `pool` after running `warm_up` twice on a side stream
    (allocator and kernels' lazy initialisation stay out of the graph); returns the graph and the
    output it refills at every replay. Thread-local capture: another thread's CUDA calls (another
    engine, a test) must not invalidate it."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            warm_up()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
        out = fn()
    return graph, out
