"""The generator's share of a GPU (`gpu_memory_fraction`, as vLLM's `--gpu-memory-utilization`):
the row caches are sized at start so that everything the generator holds fits in it.

With `CRUCIBLE_GENERATOR_GPU_MEMORY_FRACTION=f` the generator may take `f` of the card's memory.
Out of that budget come, in bytes (`Footprint`):

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
* the rows: each holds the key/value cache of `row_length` tokens (every layer) plus its share of
  sampling (float32 logits, log-probabilities, probabilities and a sort over the vocabulary).

The rows are the largest power of two that fits beside the rest (at most `MAX_ROWS`); a budget the
weights alone exceed, or that leaves no room for one row, refuses to start with a message that
says what took the room. These are estimates of what the generator allocates, not a cap PyTorch
enforces: measured use (`nvidia-smi`) runs some hundred MB either way.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import Any

log = logging.getLogger(__name__)

GIB = 2**30
CONTEXT_BYTES = GIB
SAMPLING_BYTES = 16  # per row and vocabulary entry: logits, log-softmax, probabilities, sort (float32)
MAX_ROWS = 512  # as `max_batch_size: auto` from free memory (memory.BOUNDS)
HINT_LENGTH = 512  # a short RL job's prompt + completion (MBPP: prompts under 300 tokens, 256 new)


class BudgetError(ValueError):
    """The generator cannot fit in its memory budget; the message says why and what would."""


@dataclass(frozen=True)
class Footprint:
    """What the generator holds on the card, in bytes: `fixed` whatever the rows, `per_row` each."""

    weights: int
    merged_copy: int
    prefill_scratch: int
    activations: int
    adapters: int
    per_row: int
    row_length: int
    context: int = CONTEXT_BYTES
    kv_per_token: int = 0  # of `per_row`, what each token of the row costs (0: not known)

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


def gib(size: float) -> str:
    return f"{size / GIB:.1f} GiB"


def rows_within(budget: int, footprint: Footprint, ceiling: int = MAX_ROWS) -> int:
    """The most rows (a power of two, at most `ceiling`) that fit in `budget` beside the fixed part;
    0 when not one does.

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
    rows = 1
    while rows * 2 <= ceiling and rows * 2 * footprint.per_row <= room:
        rows *= 2
    return rows


def plan_rows(total: int, fraction: float, footprint: Footprint, requested: int | None = None) -> int:
    """The rows for `fraction` of a card of `total` bytes: `requested` (a set `max_batch_size`) if
    it fits, else the most that fit (`rows_within`); raises `BudgetError` when nothing fits.

    >>> f = Footprint(weights=10 * GIB, merged_copy=10 * GIB, prefill_scratch=0, activations=GIB,
    ...               adapters=0, per_row=GIB // 8, row_length=2048, context=GIB)
    >>> plan_rows(80 * GIB, 0.3, f)
    16
    >>> plan_rows(80 * GIB, 0.1, f)
    Traceback (most recent call last):
      ...
    crucible_generator.budget.BudgetError: the model's weights (10.0 GiB) exceed the generator's memory budget: gpu_memory_fraction 0.1 of 80.0 GiB is 8.0 GiB
    """
    budget = int(total * fraction)
    share = f"gpu_memory_fraction {fraction:g} of {gib(total)} is {gib(budget)}"
    if footprint.weights > budget:
        raise BudgetError(
            f"the model's weights ({gib(footprint.weights)}) exceed the generator's memory budget: {share}"
        )
    rows = rows_within(budget, footprint)
    if rows == 0:
        least = (footprint.fixed + footprint.per_row) / total
        raise BudgetError(
            f"no room for one cache row of {footprint.row_length} tokens ({gib(footprint.per_row)}): "
            f"{share} and the generator holds {gib(footprint.fixed)} without rows ({footprint.describe()}); "
            f"raise it to at least {least:.2f}"
            + (", or set fast_decode=off (no merged copy)" if footprint.merged_copy else "")
        )
    if requested is not None:
        if footprint.fixed + requested * footprint.per_row > budget:
            raise BudgetError(
                f"max_batch_size {requested} needs {gib(requested * footprint.per_row)} of cache rows; "
                f"{share}, which leaves {gib(budget - footprint.fixed)} for rows ({rows} rows): "
                "lower max_batch_size, set it to auto, or raise gpu_memory_fraction"
            )
        return requested
    return rows


def shorter_rows_hint(total: int, fraction: float, footprint: Footprint, rows: int) -> str | None:
    """Where rows reserved at the model's context leave few of them, what rows of `HINT_LENGTH`
    tokens would give in the same budget (a line for the start-up log), else None. Conservative:
    the prefill graphs' scratch, which also shrinks with the row, is counted at full length.

    Qwen2.5-Coder-7B's shape in bf16 at 0.55 of an 80 GB card (measured on an H100: 32 rows of
    2,048 tokens, 128 of 512):

    >>> f = Footprint(weights=int(14.2 * GIB), merged_copy=int(14.2 * GIB), prefill_scratch=int(3.8 * GIB),
    ...               activations=int(2.2 * GIB), adapters=int(1.2 * GIB), row_length=2048,
    ...               per_row=57_344 * 2048 + 152_064 * SAMPLING_BYTES, kv_per_token=57_344)
    >>> rows_within(int(79.2 * GIB * 0.55), f)
    32
    >>> print(shorter_rows_hint(int(79.2 * GIB), 0.55, f, 32))
    rows reserve 2048 tokens each: a job whose prompts and completions fit in 512 tokens gets 128 rows with CRUCIBLE_GENERATOR_MAX_MODEL_LEN=512 (longer requests are then refused)
    """
    if not footprint.kv_per_token or footprint.row_length <= HINT_LENGTH or rows >= MAX_ROWS:
        return None
    saved = footprint.kv_per_token * (footprint.row_length - HINT_LENGTH)
    shorter = replace(footprint, per_row=footprint.per_row - saved, row_length=HINT_LENGTH)
    more = rows_within(int(total * fraction), shorter)
    if more <= rows:
        return None
    return (
        f"rows reserve {footprint.row_length} tokens each: a job "
        f"whose prompts and completions fit in {HINT_LENGTH} tokens gets {more} rows with "
        f"CRUCIBLE_GENERATOR_MAX_MODEL_LEN={HINT_LENGTH} (longer requests are then refused)"
    )


def footprint_of(
    model: Any,
    *,
    row_length: int,
    fast: bool,
    prefill_graphs: bool,
    max_loras: int,
    max_lora_rank: int,
) -> Footprint:
    """`Footprint` of serving the loaded `model` with rows of `row_length` tokens."""
    import torch

    from .continuous import PREFILL_TOKENS, prefill_graph_shapes
    from .memory import kv_bytes_per_token

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
    )


def budget_rows(model: Any, fraction: float, footprint: Footprint, requested: int | None) -> int:
    """`plan_rows` for the CUDA device `model` is on, logged: the budget, what it holds, the rows."""
    import torch

    free, total = torch.cuda.mem_get_info(model.device)
    rows = plan_rows(total, fraction, footprint, requested)
    budget = int(total * fraction)
    log.info(
        "memory budget %s (gpu_memory_fraction %g of %s): %s; %d rows x %d tokens of cache (%s)",
        gib(budget), fraction, gib(total), footprint.describe(), rows, footprint.row_length,
        gib(rows * footprint.per_row),
    )  # fmt: skip
    if requested is None and (hint := shorter_rows_hint(total, fraction, footprint, rows)):
        log.info(hint)
    held = torch.cuda.memory_reserved(model.device)
    if footprint.fixed + rows * footprint.per_row - held > free:
        log.warning(
            "the card has %s free, less than the rest of the budget: other processes hold it", gib(free)
        )
    return rows
