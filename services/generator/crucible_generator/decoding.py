"""The one interface between the engine and the ways it decodes a batch.

The engine (`engine.py`) owns the queue, the LoRA adapters and what becomes of each sampled token.
A *decode path* owns the model state a batch decodes in: the eager path (PEFT adapters, mixed
batches included, and transformers' dynamic KV cache; `eager.py`) and the continuous path (the fast
path's merged weights in a paged KV cache, rows joining and leaving between steps; `batching.py`
over `continuous.py`). For each batch the engine picks the path the queue's head `fits`, takes the
FIFO run of sequences that `joins` it (at most `rows`), asks the path to get `ready` for the
batch's adapter and hands it the batch to `decode`.

A path reaches back into the engine only through `Host`: sampling and recording tokens, failing a
sequence, the queue (requeue, joiners) and the adapter operations that run between two steps.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch

    from .metrics import Metrics
    from .sampling import SampleOutput
    from .sequences import Readback, Sequence


class DecodePath(Protocol):
    """A way to decode batches of sequences; the engine holds one per path and picks per batch."""

    rows: int  # the most sequences one batch of this path takes

    def fits(self, seq: Sequence) -> bool:
        """Whether `seq` can decode on this path."""
        ...

    def joins(self, head: Sequence, seq: Sequence) -> bool:
        """Whether `seq` (which `fits`) shares the batch that `head` opens."""
        ...

    def ready(self, slot: str | None) -> bool:
        """Prepare to decode rows of adapter `slot` (None: the base model); False when this path
        cannot serve it, and the batch goes to the eager path."""
        ...

    def decode(self, batch: list[Sequence]) -> None:
        """Decode `batch` until every sequence has ended (completed, dropped, failed or requeued)."""
        ...


class Host(Protocol):
    """What the engine offers a decode path: the models, the metrics, the fate of each token and
    the queue. Called on the engine thread only."""

    metrics: Metrics
    base: Any  # the transformers model
    peft: Any  # a PeftModel wrapping `base` while at least one adapter is loaded, else None

    def sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> SampleOutput:
        """Sample the next token of each sequence (rows of `logits`), on the device."""
        ...

    def record(self, seqs: list[Sequence], readback: Readback, index: list[int]) -> list[bool]:
        """Append row `index[j]` of a sampling result to `seqs[j]`; complete or drop those that end
        and return which ended."""
        ...

    def fail(self, seq: Sequence, exc: Exception) -> None:
        """End `seq`, failing its request with `exc`."""
        ...

    def requeue(self, seqs: list[Sequence]) -> None:
        """Put `seqs` back at the head of the queue, in queue order."""
        ...

    def control_pending(self) -> bool:
        """Whether an adapter operation waits for the next step boundary."""
        ...

    def run_control_ops(self) -> None:
        """Run the adapter operations that wait (only ever between two decode steps)."""
        ...

    def take_joiners(
        self, joins: Callable[[Sequence], bool], limit: int, due: Callable[[int, float], bool]
    ) -> list[Sequence]:
        """Pop up to `limit` waiting sequences from the head while `joins` accepts them, once
        `due(waiting, oldest_enqueued)` says joining now is worth it; none while an adapter
        operation waits."""
        ...
