"""The generator's memory: what it holds on a card, and the decode rows and key/value cache blocks
it sizes from that at start (`plan`).

**With a budget** (`CRUCIBLE_GENERATOR_GPU_MEMORY_FRACTION=f`, as vLLM's
`--gpu-memory-utilization`) the generator may take `f` of the card's memory. Out of that budget
come, in bytes (`Footprint`):

* the model's weights (its parameters and buffers, as loaded);
* the fast path's merged copy of them (`fastpath.MergedModel`; none with `fast_decode=off` or a
  model the fast path does not implement);
* the scratch caches of the captured prefills (`continuous.prefill_graph_shapes`: one static cache
  per shape, 40 shapes at rows of 2,048 tokens; none without prefill graphs);
* activations: one prefill of `PREFILL_TOKENS` tokens (a few hidden-sized and three
  MLP-sized tensors per token), which also covers a decode step's;
* LoRA adapters: `max_loras` adapters of `max_lora_rank` on every linear layer (the most a client
  may load);
* `CONTEXT_BYTES` for the CUDA context, cuBLAS workspaces and the allocator's slack;
* per row: its share of sampling (float32 logits, log-probabilities, probabilities and a sort over
  the vocabulary) and, on the fast path, of a decode step's gathered keys and values (one layer's,
  at full length: `paged.PagedCache.update`) and of the logits the captured decode steps keep
  (each window's graph its own: about two rows' worth per row and window length);
* the key/value cache: on the fast path, blocks of `block_size` tokens (`paged.py`) that rows take
  as they grow; on the eager path, each row's cache at `row_length` tokens.

The CUDA graphs' share (the captured prefills' scratch caches, the decode steps' logits) is
allocated later with `graph_capture: idle`, the default, than with `start`: one capture at a time in
the engine's idle time while the server already serves, not before its first batch. On a card
shared with a trainer that memory must still be free then: the plan keeps it out of the cache
(counted above with a budget; without one, it comes out of what the cache leaves free), and the
trainer must leave it (a capture that runs out of memory fails as any other: the eager path).

On the fast path, when what is left holds `CONTIGUOUS_ROWS` rows or more at full length, the
rows are the most that fit (a power of two, at most `MAX_ROWS`), each with its own blocks for good
(no gather: `paged.py`); otherwise the rows are the largest power of two (at most `MAX_ROWS`)
whose own share takes at most half of what is left and that leaves at least `MIN_AVERAGE` tokens
of blocks per row, and the blocks are the rest, handed out as rows grow. On the eager path (no fast path) the rows are the largest power of two whose
full-length caches fit. A budget the weights alone exceed, or that leaves no room for one row at
full length, refuses to start with a message that says what took the room. These are estimates of
what the generator allocates, not a cap PyTorch enforces: measured use (`nvidia-smi`) runs some
hundred MB either way.

**Without a budget** the cache takes `SHARE_OF_FREE` of the memory free once the model is loaded
(the rest is the activations of a step, the LoRA adapters and the allocator's slack): on the fast
path as blocks, with rows as above (at least `BOUNDS[0]`); on the eager path as the largest power
of two of rows (within `BOUNDS`) at a working length of `min(max_model_len, 2048)` tokens. On a
CPU: `CPU_BATCH` rows at full length.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import Any

from .paged import blocks_for

log = logging.getLogger(__name__)

GIB = 2**30
CONTEXT_BYTES = GIB
SAMPLING_BYTES = 16  # per row and vocabulary entry: logits, log-softmax, probabilities, sort (float32)
MAX_ROWS = 512  # the most rows `max_batch_size: auto` gives
MIN_AVERAGE = 256  # tokens of cache blocks per row, at least, that `auto` rows leave
# Rows at full length that make sharing blocks not worth a step's gather (vLLM's default
# `max_num_seqs` before its V1 engine).
CONTIGUOUS_ROWS = 256
CPU_BATCH = 64
SHARE_OF_FREE = 0.4
WORKING_LEN = 2048
BOUNDS = (8, 512)


class BudgetError(ValueError):
    """The generator cannot fit in its memory budget; the message says why and what would."""


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


@dataclass(frozen=True)
class Footprint:
    """What the generator holds on the card, in bytes: `fixed` whatever the rows, `per_row` each
    at full length (`row_length` tokens of cache, `kv_per_token` each, and sampling), `gather`
    per fast-path row (its share of a step's gathered keys and values and of the graphs' logits)."""

    weights: int
    merged_copy: int
    prefill_scratch: int
    activations: int
    adapters: int
    per_row: int
    row_length: int
    context: int = CONTEXT_BYTES
    kv_per_token: int = 0  # of `per_row`, what each token of the row costs (0: not known)
    gather: int = 0

    @property
    def fixed(self) -> int:
        return (
            self.weights
            + self.merged_copy
            + self.prefill_scratch
            + self.activations
            + self.adapters
            + self.context
        )

    @property
    def row_share(self) -> int:
        """A fast-path row's bytes besides its cache blocks: sampling and the gather."""
        return self.per_row - self.kv_per_token * self.row_length + self.gather

    def describe(self) -> str:
        parts = (
            ("weights", self.weights),
            ("merged copy", self.merged_copy),
            ("prefill graphs", self.prefill_scratch),
            ("activations", self.activations),
            ("adapters", self.adapters),
            ("CUDA context", self.context),
        )
        return ", ".join(f"{name} {gib(size)}" for name, size in parts if size)


@dataclass(frozen=True)
class CachePlan:
    """Decode rows and, on the fast path, its key/value cache blocks (None: rows at full length);
    `eager_rows`: the most sequences of one eager batch (dynamic caches at full length: the fast
    path's blocks leave no more room for them than rows reserved at full length had; None: `rows`)."""

    rows: int
    blocks: int | None = None
    block_size: int = 16
    eager_rows: int | None = None

    @property
    def tokens(self) -> int | None:
        return None if self.blocks is None else self.blocks * self.block_size

    def describe(self, row_length: int) -> str:
        """The plan in words, for the start-up log.

        >>> CachePlan(256, 32768).describe(2048)
        '256 rows x 2048 tokens, each in blocks of its own'
        >>> CachePlan(512, 40000).describe(2048)
        '512 rows sharing 40000 blocks of 16 tokens (640000 tokens)'
        """
        if self.blocks is None:
            return f"{self.rows} rows x {row_length} tokens"
        if self.blocks >= self.rows * blocks_for(row_length, self.block_size):
            return f"{self.rows} rows x {row_length} tokens, each in blocks of its own"
        return f"{self.rows} rows sharing {self.blocks} blocks of {self.block_size} tokens ({self.tokens} tokens)"


def gib(size: float) -> str:
    return f"{size / GIB:.1f} GiB"


def power_of_two_at_most(n: int) -> int:
    size = 1
    while size * 2 <= n:
        size *= 2
    return size


def rows_within(budget: int, footprint: Footprint, ceiling: int = MAX_ROWS) -> int:
    """The most full-length rows (a power of two, at most `ceiling`) that fit in `budget` beside
    the fixed part; 0 when not one does.

    >>> f = Footprint(weights=10 * GIB, merged_copy=10 * GIB, prefill_scratch=0, activations=GIB,
    ...               adapters=0, per_row=GIB // 8, row_length=2048, context=GIB)
    >>> rows_within(24 * GIB, f), rows_within(23 * GIB, f), rows_within(22 * GIB, f)
    (16, 8, 0)
    >>> rows_within(200 * GIB, f)  # plenty: the ceiling
    512
    """
    room = budget - footprint.fixed
    if room < footprint.per_row:
        return 0
    return power_of_two_at_most(min(ceiling, room // footprint.per_row))


def paged_within(
    room: int, footprint: Footprint, block_size: int, rows: int | None = None
) -> CachePlan | None:
    """Rows (`rows` if given, else as the module says) and the cache blocks that fit in `room`
    bytes beside them; None when the blocks would not hold one row at full length.

    Qwen2.5-Coder-7B's shape: 6 GiB of room holds 256 rows and 82k tokens of blocks
    (rows reserved at 2,048 tokens: 32 rows, 65k tokens).

    >>> f = Footprint(weights=0, merged_copy=0, prefill_scratch=0, activations=0, adapters=0,
    ...               per_row=57_344 * 2048 + 152_064 * SAMPLING_BYTES, row_length=2048,
    ...               kv_per_token=57_344, gather=2048 * 2048)
    >>> plan = paged_within(6 * GIB, f, 16); plan.rows, plan.tokens
    (256, 82752)
    >>> paged_within(100 * 2**20, f, 16) is None  # less than one row of 2,048 tokens
    True
    """
    share = footprint.row_share
    per_block = footprint.kv_per_token * block_size
    # Rows at full length, each with blocks of its own, are counted as rows reserved at full length
    # always were (`rows_within`): as many as before, and no gather.
    if rows is None and room // footprint.per_row >= CONTIGUOUS_ROWS:
        rows = power_of_two_at_most(min(MAX_ROWS, room // footprint.per_row))
        return CachePlan(
            rows=rows, blocks=rows * blocks_for(footprint.row_length, block_size), block_size=block_size
        )
    if rows is None:
        rows = MAX_ROWS
        while rows > 1 and (
            rows * share > room // 2 or rows * MIN_AVERAGE > (room - rows * share) // footprint.kv_per_token
        ):
            rows //= 2
    blocks = (room - rows * share) // per_block
    if blocks < blocks_for(footprint.row_length, block_size):
        return None
    return CachePlan(rows=rows, blocks=blocks, block_size=block_size)


def plan_rows(total: int, fraction: float, footprint: Footprint, requested: int | None = None) -> int:
    """Full-length rows (the eager path) for `fraction` of a card of `total` bytes: `requested` (a
    set `max_batch_size`) if it fits, else the most that fit (`rows_within`); raises
    `BudgetError` when nothing fits.

    >>> f = Footprint(weights=10 * GIB, merged_copy=10 * GIB, prefill_scratch=0, activations=GIB,
    ...               adapters=0, per_row=GIB // 8, row_length=2048, context=GIB)
    >>> plan_rows(80 * GIB, 0.3, f)
    16
    >>> plan_rows(80 * GIB, 0.1, f)
    Traceback (most recent call last):
      ...
    crucible_generator.sizing.BudgetError: the model's weights (10.0 GiB) exceed the generator's memory budget: gpu_memory_fraction 0.1 of 80.0 GiB is 8.0 GiB
    """
    budget, share = _check_weights(total, fraction, footprint)
    rows = rows_within(budget, footprint)
    if rows == 0:
        raise _no_row(total, fraction, footprint, share)
    if requested is not None:
        if footprint.fixed + requested * footprint.per_row > budget:
            raise BudgetError(
                f"max_batch_size {requested} needs {gib(requested * footprint.per_row)} of cache rows; "
                f"{share}, which leaves {gib(budget - footprint.fixed)} for rows ({rows} rows): "
                "lower max_batch_size, set it to auto, or raise gpu_memory_fraction"
            )
        return requested
    return rows


def plan_paged(
    total: int, fraction: float, footprint: Footprint, block_size: int, requested: int | None = None
) -> CachePlan:
    """Rows and cache blocks (the fast path) for `fraction` of a card of `total` bytes (`requested`
    rows if set); raises `BudgetError` when the blocks would not hold one row at full length."""
    budget, share = _check_weights(total, fraction, footprint)
    plan = paged_within(budget - footprint.fixed, footprint, block_size, requested)
    if plan is not None:
        return plan
    if requested is not None and paged_within(budget - footprint.fixed, footprint, block_size):
        raise BudgetError(
            f"max_batch_size {requested} needs {gib(requested * footprint.row_share)} beside the cache; "
            f"{share}, which leaves {gib(budget - footprint.fixed)} for rows and cache: "
            "lower max_batch_size, set it to auto, or raise gpu_memory_fraction"
        )
    raise _no_row(total, fraction, footprint, share)


def _check_weights(total: int, fraction: float, footprint: Footprint) -> tuple[int, str]:
    budget = int(total * fraction)
    share = f"gpu_memory_fraction {fraction:g} of {gib(total)} is {gib(budget)}"
    if footprint.weights > budget:
        raise BudgetError(
            f"the model's weights ({gib(footprint.weights)}) exceed the generator's memory budget: {share}"
        )
    return budget, share


def _no_row(total: int, fraction: float, footprint: Footprint, share: str) -> BudgetError:
    least = (footprint.fixed + footprint.per_row + footprint.gather) / total
    return BudgetError(
        f"no room for one cache row of {footprint.row_length} tokens ({gib(footprint.per_row)}): "
        f"{share} and the generator holds {gib(footprint.fixed)} without rows ({footprint.describe()}); "
        f"raise it to at least {least:.2f}"
        + (", or set fast_decode=off (no merged copy)" if footprint.merged_copy else "")
    )


def footprint_of(
    model: Any,
    *,
    row_length: int,
    fast: bool,
    prefill_graphs: bool,
    max_loras: int,
    max_lora_rank: int,
    graphs: bool = True,
) -> Footprint:
    """`Footprint` of serving the loaded `model` with rows of `row_length` tokens (`graphs`: the
    fast path's decode steps are captured)."""
    import torch

    from .continuous import PREFILL_TOKENS, prefill_graph_shapes
    from .fastpath import LENGTH_BUCKET

    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    tensors = list(model.parameters()) + list(model.buffers())
    weights = sum(t.numel() * t.element_size() for t in tensors)
    element = torch.finfo(model.dtype).bits // 8
    per_token = kv_bytes_per_token(config, element)
    hidden = int(config.hidden_size)
    intermediate = int(getattr(config, "intermediate_size", None) or 4 * hidden)
    output = model.get_output_embeddings()
    linear_sides = sum(
        m.in_features + m.out_features
        for m in model.modules()
        if isinstance(m, torch.nn.Linear) and m is not output
    )
    scratch = sum(count * width for count, width in prefill_graph_shapes(row_length)) * per_token
    vocab = int(model.get_input_embeddings().weight.shape[0])
    return Footprint(
        weights=weights,
        merged_copy=weights if fast else 0,
        prefill_scratch=scratch if fast and prefill_graphs else 0,
        activations=PREFILL_TOKENS * (4 * hidden + 3 * intermediate) * element,
        adapters=max_loras * max_lora_rank * linear_sides * element,
        per_row=per_token * row_length + vocab * SAMPLING_BYTES,
        row_length=row_length,
        kv_per_token=per_token,
        gather=(per_token // int(config.num_hidden_layers) * row_length if fast else 0)
        + (2 * -(-row_length // LENGTH_BUCKET) * vocab * element if fast and graphs else 0),
    )


def budget_plan(
    model: Any, fraction: float, footprint: Footprint, requested: int | None, block_size: int
) -> CachePlan:
    """The plan for `fraction` of the CUDA device `model` is on (paged when the footprint has a
    merged copy, i.e. the fast path), logged: the budget, what it holds, the rows and the cache."""
    import torch

    free, total = torch.cuda.mem_get_info(model.device)
    if footprint.merged_copy:
        plan = plan_paged(total, fraction, footprint, block_size, requested)
        eager = max(1, rows_within(int(total * fraction), footprint))
        plan = replace(plan, eager_rows=min(plan.rows, eager))
        cache = (plan.tokens or 0) * footprint.kv_per_token
        layout = plan.describe(footprint.row_length)
        cache += plan.rows * footprint.row_share
    else:
        plan = CachePlan(rows=plan_rows(total, fraction, footprint, requested))
        cache = plan.rows * footprint.per_row
        layout = f"{plan.rows} rows x {footprint.row_length} tokens"
    log.info(
        "memory budget %s (gpu_memory_fraction %g of %s): %s; %s of cache (%s)",
        gib(int(total * fraction)), fraction, gib(total), footprint.describe(), layout, gib(cache),
    )  # fmt: skip
    held = torch.cuda.memory_reserved(model.device)
    if footprint.fixed + cache - held > free:
        log.warning(
            "the card has %s free, less than the rest of the budget: other processes hold it", gib(free)
        )
    return plan


def batch_from_memory(free_bytes: int, per_token_bytes: int, max_model_len: int) -> int:
    """Full-length rows from free memory (the eager path): the largest power of two of sequences
    whose caches fit, within `BOUNDS`.

    >>> batch_from_memory(70 * 2**30, 23040, 8192)  # an H100 with SmolLM2 loaded
    512
    >>> batch_from_memory(2 * 2**30, 23040, 8192)
    16
    >>> batch_from_memory(10 * 2**20, 23040, 8192)  # next to nothing free: the floor
    8
    """
    per_sequence = per_token_bytes * min(max_model_len, WORKING_LEN)
    fits = int(free_bytes * SHARE_OF_FREE) // max(per_sequence, 1)
    return max(BOUNDS[0], power_of_two_at_most(min(fits, BOUNDS[1])))


def paged_from_memory(
    free_bytes: int,
    per_token_bytes: int,
    block_size: int,
    requested: int | None,
    row_length: int = WORKING_LEN,
) -> CachePlan:
    """Cache blocks in `SHARE_OF_FREE` of `free_bytes`, and `requested` rows, or as many at full
    length (`row_length`) as fit when that is `CONTIGUOUS_ROWS` or more, else as many (a power of
    two within `BOUNDS`) as leave `MIN_AVERAGE` tokens of blocks each.

    >>> plan = paged_from_memory(70 * 2**30, 23040, 16, None)  # an H100 with SmolLM2 loaded
    >>> plan.rows, plan.tokens, plan.rows * 2048 <= plan.tokens  # each row owns its blocks
    (512, 1304880, True)
    >>> plan = paged_from_memory(50 * 2**30, 57_344, 16, None)  # 7B: 374k tokens, 182 rows at 2,048
    >>> plan.rows, plan.tokens
    (512, 374480)
    >>> paged_from_memory(2**30, 57_344, 16, None).rows  # 7.5k tokens: 29 rows of 256
    16
    """
    tokens = int(free_bytes * SHARE_OF_FREE) // per_token_bytes
    if requested:
        rows = requested
    elif tokens // row_length >= CONTIGUOUS_ROWS:
        rows = power_of_two_at_most(min(tokens // row_length, BOUNDS[1]))
    else:
        rows = max(BOUNDS[0], power_of_two_at_most(min(tokens // MIN_AVERAGE, BOUNDS[1])))
    return CachePlan(rows=rows, blocks=tokens // block_size, block_size=block_size)


def free_memory_plan(
    model: Any, max_model_len: int, requested: int | None, block_size: int, paged: bool
) -> CachePlan:
    """The plan without a budget: from the CUDA memory free now, else `CPU_BATCH` rows at full
    length (`requested` rows, if set)."""
    import torch

    if model.device.type != "cuda":
        return CachePlan(rows=requested or CPU_BATCH)
    free, _total = torch.cuda.mem_get_info(model.device)
    element = torch.finfo(model.dtype).bits // 8
    per_token = kv_bytes_per_token(model.config, element)
    if paged:
        plan = paged_from_memory(free, per_token, block_size, requested, min(max_model_len, WORKING_LEN))
        least = blocks_for(min(max_model_len, WORKING_LEN), block_size)
        eager = min(plan.rows, requested or batch_from_memory(free, per_token, max_model_len))
        return replace(plan, blocks=max(plan.blocks or 0, least), eager_rows=eager)
    return CachePlan(rows=requested or batch_from_memory(free, per_token, max_model_len))


def rows_for_blocks(blocks: int, block_size: int) -> int:
    """`auto` rows for a set number of blocks: a power of two within `BOUNDS` that leaves
    `MIN_AVERAGE` tokens each.

    >>> rows_for_blocks(100, 16), rows_for_blocks(100_000, 16)
    (8, 512)
    """
    return max(BOUNDS[0], power_of_two_at_most(min(blocks * block_size // MIN_AVERAGE, BOUNDS[1])))
