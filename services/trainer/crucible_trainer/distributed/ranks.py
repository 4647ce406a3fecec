"""Rank 0 leads, the other ranks follow: every operation on the policy that needs all ranks is a
command rank 0 broadcasts and every rank then runs.

Rank 0 runs the job (`leader.LeaderRun`: rollouts, rewards, the channel, checkpoints, publishing,
the stale-policy check); the others wait in `follow` for its next command. Commands travel on a
`gloo` group of their own with a long timeout, because followers wait there through whole
rollouts and evaluations; the tensors of the update travel on the default group, whose timeout is
the spec's `distributed.timeout_s`, which also bounds how long rank 0 waits to hand a command
over. A rank that dies makes `torchrun` stop the others; a rank that hangs fails the job at that
timeout.

Which operations are commands depends on the strategy. Both: `init` (build the policy), `update`,
`restore` (every replica loads the checkpoint). FSDP also: `score` (a forward gathers weights on
every rank), `write_adapter` and `optimizer_state` (the shards are gathered into rank 0's files).
Under DDP rank 0's replica is the whole policy: scoring and saving stay on rank 0.
"""

from __future__ import annotations

import pickle
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from crucible_shared.jobs import ModelSpec, OptimSpec

from crucible_trainer.distributed.parallel import DataParallel
from crucible_trainer.online.checkpoint import load_state
from crucible_trainer.rl.policy import Policy
from crucible_trainer.rl.update import UpdateConfig, update

COMMAND_TIMEOUT = timedelta(days=7)


class Control:
    """The command channel: rank 0 sends `(op, args)`, every other rank receives them.

    A follower waits as long as rank 0 needs (`COMMAND_TIMEOUT`); rank 0 waits at most `timeout`
    for a send, so a follower that hangs (alive, not receiving) fails the job instead of holding
    it forever."""

    def __init__(self, timeout: timedelta = timedelta(seconds=600)) -> None:
        self.group = dist.new_group(backend="gloo", timeout=COMMAND_TIMEOUT)
        self.timeout = timeout

    def send(self, op: str, *args: Any) -> None:
        data = pickle.dumps((op, args))
        size = torch.tensor([len(data)], dtype=torch.long)
        payload = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        for tensor in (size, payload):
            work = dist.broadcast(tensor, src=0, group=self.group, async_op=True)
            if work is None or work.wait(timeout=self.timeout) is False:
                raise TimeoutError(f"a rank did not take command {op!r} within {self.timeout}")

    def receive(self) -> tuple[str, tuple[Any, ...]]:
        size = torch.zeros(1, dtype=torch.long)
        dist.broadcast(size, src=0, group=self.group)
        payload = torch.empty(int(size.item()), dtype=torch.uint8)
        dist.broadcast(payload, src=0, group=self.group)
        op, args = pickle.loads(payload.numpy().tobytes())
        return op, args


class RankPolicy(Policy):
    """One rank's policy; on rank 0 (`control` given) the collective operations broadcast
    themselves to the followers first."""

    def __init__(
        self, spec: ModelSpec, optim: OptimSpec, seed: int, parallel: DataParallel, control: Control | None
    ) -> None:
        if parallel.strategy == "fsdp" and spec.init_adapter:
            # Its starting weights are swapped in to score the reference: full tensors, not shards.
            raise ValueError("distributed.strategy fsdp does not start from model.init_adapter yet: use ddp")
        super().__init__(spec, optim, seed)
        self.parallel, self.control = parallel, control
        self.fsdp = parallel.strategy == "fsdp"
        parallel.wrap(self)
        if self.fsdp:  # sharding replaced the parameters the optimizer was made with
            self.make_optimizer(optim)
        self._lock = threading.Lock()
        self._inside = threading.local()
        self.command_s = 0.0  # how long rank 0's last command took to send

    def collective(self, op: str, *args: Any) -> Any:
        """Run `op` on every rank (sent by rank 0; run by a follower as it receives it)."""
        if self.control is None or getattr(self._inside, "active", False):
            return getattr(self, f"do_{op}")(*args)
        with self._lock:
            self._inside.active = True
            try:
                t0 = time.perf_counter()
                self.control.send(op, *args)
                self.command_s = time.perf_counter() - t0
                return getattr(self, f"do_{op}")(*args)
            finally:
                self._inside.active = False

    # -- what TrainRun calls on rank 0 ----------------------------------------------------------
    def run_update(self, batch: list[Any], cfg: UpdateConfig, seed: int) -> dict[str, float]:
        metrics = self.collective("update", batch, cfg, seed)
        # Pickling the batch and handing it to every follower, before any rank starts.
        metrics["time/update_command_s"] = self.command_s
        return metrics

    def score(
        self,
        prompts: list[list[int]],
        completions: list[list[int]],
        micro_batch: int = 16,
        reference: bool = False,
    ) -> list[list[float]]:
        if self.fsdp:
            return self.collective("score", prompts, completions, micro_batch, reference)
        return super().score(prompts, completions, micro_batch, reference)

    def write_adapter(self, folder: Path) -> None:
        if self.fsdp:
            return self.collective("write_adapter", folder)
        return super().write_adapter(folder)

    def optimizer_state(self) -> dict:
        if self.fsdp:
            return self.collective("optimizer_state")
        return super().optimizer_state()

    def restore(self, folder: Path, state: dict) -> None:
        self.collective("restore", folder)

    def step(self) -> float:
        return fsdp_step(self) if self.fsdp else super().step()

    # -- what every rank runs -------------------------------------------------------------------
    def do_update(self, batch: list[Any], cfg: UpdateConfig, seed: int) -> dict[str, float]:
        return update(self, batch, cfg, seed, self.parallel)

    def do_score(
        self, prompts: list[list[int]], completions: list[list[int]], micro_batch: int, reference: bool
    ) -> list[list[float]]:
        return Policy.score(self, prompts, completions, micro_batch, reference)

    def do_write_adapter(self, folder: Path) -> None:
        full = self.full_adapter()
        if self.parallel.rank == 0:
            self.model.save_pretrained(folder, state_dict=full)

    def do_optimizer_state(self) -> dict:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        return get_optimizer_state_dict(self.model, self.optimizer, options=options)

    def do_restore(self, folder: Path) -> None:
        state = load_state(folder)
        if not self.fsdp:
            return Policy.restore(self, folder, state)
        from safetensors.torch import load_file
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict
        from torch.distributed.tensor import distribute_tensor

        saved = load_file(str(folder / "adapter" / "adapter_model.safetensors"))
        adapter = f".{self.model.active_adapter}"
        with torch.no_grad():
            for name, p in self.model.named_parameters():
                if p.requires_grad:
                    full = saved[name.replace(adapter, "")].to(p.dtype)
                    p.copy_(distribute_tensor(full.to(p.device), p.device_mesh, p.placements))
        options = StateDictOptions(full_state_dict=True)
        set_optimizer_state_dict(self.model, self.optimizer, state["optimizer"], options=options)
        self.scheduler.load_state_dict(state["scheduler"])

    def full_adapter(self) -> dict[str, torch.Tensor]:
        """The trainable weights, gathered from their shards (a collective: every rank calls it)."""
        return {
            name: p.full_tensor().detach().cpu()
            for name, p in self.model.named_parameters()
            if p.requires_grad
        }


def fsdp_step(policy: RankPolicy) -> float:
    """`Policy.step` over sharded gradients: the norm is the whole gradient's, on every rank."""
    from torch.distributed.tensor import DTensor

    grads = [p.grad for p in policy.model.parameters() if p.requires_grad and p.grad is not None]
    norm_t = torch.nn.utils.get_total_norm(grads)
    if isinstance(norm_t, DTensor):
        norm_t = norm_t.full_tensor()
    norm = float(norm_t)
    if not torch.isfinite(norm_t):
        policy.optimizer.zero_grad(set_to_none=True)
        return norm
    if policy.max_grad_norm and norm > policy.max_grad_norm:
        coef = policy.max_grad_norm / (norm + 1e-6)
        for g in grads:
            g.mul_(coef)
    policy.optimizer.step()
    policy.scheduler.step()
    policy.optimizer.zero_grad(set_to_none=True)
    return norm


def follow(control: Control, make: Any) -> None:
    """A follower's life: build the policy on `init`, run each command, return on `stop`."""
    policy: RankPolicy | None = None
    while True:
        op, args = control.receive()
        if op == "stop":
            return
        if op == "init":
            policy = make(*args)
            continue
        assert policy is not None, f"command {op!r} before init"
        policy.collective(op, *args)
