"""This rank's share of an update, and how its gradients meet the other ranks' (DDP or FSDP2).

Every rank holds the whole batch (rank 0 broadcasts it), so the normaliser, the shuffles and the
split into optimizer steps are the one-process ones (`rl/update.py`). Each optimizer step's
trained samples are cut into `world` contiguous shares (sizes differ by one at most); a rank runs
its share in micro-batches of `micro_batch`, padded with empty ones to the longest share's count,
because every rank must run as many forwards (FSDP gathers weights in each) and backwards (DDP
and FSDP reduce gradients in the last one) as the others. An empty micro-batch is a zero loss
through the whole model.

Each micro-batch's loss is normalised by the whole batch and DDP / FSDP average gradients over
the ranks, so the loss is scaled by `world` before its backward: the reduced gradient is the sum
over ranks, the one-process gradient. Under FSDP only the last micro-batch of an optimizer step
synchronises (`set_requires_gradient_sync`). Under DDP no backward does (`no_sync`'s switch
stays off): after the step's last micro-batch `reduce` all-reduces the adapter's gradients in one
flat buffer and averages them as DDP would. For a LoRA adapter (a few MB) DDP's overlap of the
reduction with the backward saves little, and the step's all-reduce becomes a part the update
times on its own (`time/update_allreduce_s`).
"""

from __future__ import annotations

import inspect
import math
from typing import Any, Literal

import torch
import torch.distributed as dist

from crucible_trainer.rl.batch import make_batch
from crucible_trainer.rl.parallel import Parallel

Strategy = Literal["ddp", "fsdp"]


def shares(items: list[int], world: int) -> list[list[int]]:
    """`items` in `world` contiguous parts whose sizes differ by one at most.

    >>> shares([1, 2, 3, 4, 5], 2)
    [[1, 2, 3], [4, 5]]
    >>> shares([7], 3)
    [[7], [], []]
    """
    q, r = divmod(len(items), world)
    out, start = [], 0
    for rank in range(world):
        size = q + (rank < r)
        out.append(items[start : start + size])
        start += size
    return out


class DataParallel(Parallel):
    """The update of one of `world` ranks; `wrap` puts the policy under DDP or FSDP2."""

    def __init__(self, strategy: Strategy, rank: int, world: int) -> None:
        self.strategy, self.rank, self.world = strategy, rank, world
        self.runner: Any = None

    # -- wrapping -----------------------------------------------------------------------------
    def wrap(self, policy: Any) -> None:
        if policy.compile_mode is not None:  # the spec refuses it (TrainJob._check_compile)
            raise ValueError("optim.compile runs in one process: DDP and FSDP are not compiled yet")
        if any(getattr(m, "gradient_checkpointing", False) is True for m in policy.model.modules()):
            # Reentrant checkpointing runs backward hooks twice, which DDP's reducer refuses.
            policy.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if self.strategy == "ddp":
            from torch.nn.parallel import DistributedDataParallel

            device = torch.device(policy.device)
            # No buffer sync in forward: a forward on rank 0 alone (the stale check) stays local.
            # (torch 2.13 renames the switch; 2.11, on the GPU hosts, knows only the old name.)
            params = inspect.signature(DistributedDataParallel.__init__).parameters
            local = (
                {"forward_sync_buffers": False}
                if "forward_sync_buffers" in params
                else {"broadcast_buffers": False}
            )
            policy.runner = DistributedDataParallel(
                policy.model, device_ids=[device.index] if device.type == "cuda" else None, **local
            )
        else:
            # The fused norms, MLPs, rotary embeddings and LoRA layers (rl/fused.py) have not run under
            # FSDP's gathered weights yet (the kept logits' log-probs read no weight: they stay).
            policy.fused_kernels(False)
            # Nor the chunked head (rl/head.py): it reads the output layer's weight after the
            # forward, when FSDP has sharded it again. The full logits, computed inside the forward.
            policy.head = None
            shard(policy.model)
        self.runner = policy.runner if self.strategy == "ddp" else policy.model

    # -- the update's hooks -------------------------------------------------------------------
    def plan(self, order: list[int], micro_batch: int, grad_accum: int | None) -> list[list[list[int]]]:
        out = []
        for step in super().plan(order, micro_batch, grad_accum):
            parts = shares([i for m in step for i in m], self.world)
            count = max(1, math.ceil(max(len(p) for p in parts) / micro_batch))
            mine = parts[self.rank]
            micro = [mine[i : i + micro_batch] for i in range(0, len(mine), micro_batch)]
            out.append(micro + [[] for _ in range(count - len(micro))])
        return out

    def begin(self, last: bool) -> None:
        if self.strategy == "ddp":
            self.runner.require_backward_grad_sync = False  # what DDP's no_sync() sets: see `reduce`
        else:
            self.runner.set_requires_gradient_sync(last)

    def reduce(self, policy: Any) -> None:
        if self.strategy != "ddp":
            return  # FSDP reduce-scattered them in the step's last backward
        params = [p for p in policy.model.parameters() if p.requires_grad]
        for p in params:  # every rank reduces the same buffer, whatever its micro-batches touched
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for p in params:
            by_dtype.setdefault(p.grad.dtype, []).append(p.grad)
        for grads in by_dtype.values():  # one buffer per dtype (an adapter has one, mostly)
            flat = torch._utils._flatten_dense_tensors(grads)
            dist.all_reduce(flat)
            flat /= self.world
            for g, reduced in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads), strict=True):
                g.copy_(reduced)

    def backward(self, loss: torch.Tensor) -> None:
        (loss * self.world).backward()

    def idle_loss(self, policy: Any) -> torch.Tensor:
        b = make_batch([[policy.pad_id]], [[policy.pad_id]], policy.pad_id, policy.device)
        return policy.token_logprobs(b).sum() * 0.0

    def score(
        self,
        policy: Any,
        prompts: list[list[int]],
        completions: list[list[int]],
        micro_batch: int,
        reference: bool = False,
    ) -> list[list[float]]:
        """Each rank scores its share; every rank gets all of it, in order."""
        parts = shares(list(range(len(prompts))), self.world)
        count = math.ceil(max(len(p) for p in parts) / micro_batch)
        mine = parts[self.rank]
        # The whole share at once: the policy scores it in length-sorted micro-batches.
        scored = (
            policy.score([prompts[i] for i in mine], [completions[i] for i in mine], micro_batch, reference)
            if mine
            else []
        )
        if self.strategy == "fsdp":  # each forward gathers weights: every rank runs as many
            for _ in range(count - math.ceil(len(mine) / micro_batch)):
                policy.score([[policy.pad_id]], [[policy.pad_id]], 1, reference)
        gathered: list[Any] = [None] * self.world
        dist.all_gather_object(gathered, scored)
        return [row for part in gathered for row in part]

    def sum(self, values: list[float]) -> list[float]:
        device = "cuda" if dist.get_backend() == "nccl" else "cpu"
        t = torch.tensor([float(v) for v in values], dtype=torch.float64, device=device)
        dist.all_reduce(t)
        return t.tolist()


def shard(model: Any) -> None:
    """FSDP2: every decoder layer its own unit (gathered for its forward and backward, freed
    after), then the rest (embeddings, norm, head) at the root."""
    from torch.distributed.fsdp import fully_shard

    base = model.get_base_model()
    names = set(getattr(base, "_no_split_modules", None) or [])
    layers = [m for m in base.modules() if type(m).__name__ in names]
    if not layers:
        raise ValueError(f"fsdp: no decoder layers found in {type(base).__name__} (_no_split_modules)")
    for layer in layers:
        fully_shard(layer)
    fully_shard(base)
