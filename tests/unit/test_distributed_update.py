"""The data-parallel update (2 processes on `gloo`) gives the one-process gradients and adapter, and
resumes exactly from a checkpoint.

Rank 0 drives rank 1 through the command channel exactly as a job does (`init`, `update`,
`stop`); every optimizer step's gradient (gathered from its shards under FSDP) and the adapter
after the update are compared with one process running `rl/update.py` on the same batch. The
batch has a zero-advantage group and five trained samples, so with a micro-batch of 2 the ranks'
shares differ and one rank runs an empty micro-batch. DDP ranks decide gradient checkpointing and the
chunked head per micro-batch, each from its own free memory, as one process does: one case gives
the ranks budgets that make rank 0 checkpoint every micro-batch and rank 1 none.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.families import build_family

pytestmark = pytest.mark.slow  # two processes that each load torch, transformers and PEFT


def batch() -> list:
    from crucible_trainer.rl.rollout import Sample

    def sample(group: int, prompt: list[int], completion: list[int], advantage: float) -> Sample:
        return Sample(group, group, prompt, completion, "", "", None, None, reward=1.0, advantage=advantage)

    return [
        sample(0, [5, 6, 7], [8, 9, 10, 11], 1.2),
        sample(0, [5, 6, 7], [12], -0.4),
        sample(0, [5, 6, 7], [13, 14], -0.8),
        sample(1, [20, 21], [22, 23, 24], 0.0),
        sample(1, [20, 21], [25], 0.0),
        sample(2, [30], [31, 32, 33, 34, 35], 0.7),
        sample(2, [30], [36, 37], -0.7),
    ]


def spec_json(model: Path) -> str:
    from crucible_shared.jobs import TrainJob

    spec = TrainJob.model_validate(
        {
            "model": {"base": str(model), "device": "cpu", "dtype": "float32", "lora_r": 4},
            "optim": {"lr": 1e-2, "micro_batch": 2, "max_grad_norm": 1.0},
            "seed": 3,
        }
    )
    return spec.model_dump_json()


def recording(policy, record: list) -> None:
    """Keep each optimizer step's full gradient (a collective under FSDP: every rank records)."""
    inner = policy.step

    def step() -> float:
        grads = {}
        for name, p in policy.model.named_parameters():
            if p.requires_grad and p.grad is not None:
                g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
                grads[name] = g.detach().clone()
        record.append(grads)
        return inner()

    policy.step = step


def one_process(model: Path, cfg, out: Path) -> tuple[list, dict]:
    from crucible_shared.jobs import TrainJob
    from crucible_trainer.rl.policy import Policy
    from crucible_trainer.rl.update import update

    spec = TrainJob.model_validate_json(spec_json(model))
    policy = Policy(spec.model, spec.optim, spec.seed)
    record: list = []
    recording(policy, record)
    update(policy, batch(), cfg, seed=11)
    policy.write_adapter(out)
    return record, load_file(str(out / "adapter_model.safetensors"))


def rank_main(
    rank: int, world: int, port: int, model: Path, strategy: str, cfg, out: Path, free: tuple[int, ...] = ()
) -> None:
    import torch.distributed as dist
    from crucible_trainer.distributed.leader import make_rank_policy
    from crucible_trainer.distributed.parallel import DataParallel
    from crucible_trainer.distributed.ranks import Control, follow
    from crucible_trainer.online import checkpoint

    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    control = Control()
    parallel = DataParallel(strategy, rank, world)
    record: list = []

    def make(spec: str, leader: Control | None = None):
        policy = make_rank_policy(spec, "cpu", parallel, leader)
        if free:  # the memory this rank's `auto` decisions see (a CPU reports none)
            policy.free_memory = lambda: free[rank]
        recording(policy, record)
        return policy

    if rank == 0:
        control.send("init", spec_json(model))
        policy = make(spec_json(model), control)
        metrics = policy.run_update(batch(), cfg, 11)
        grads = list(record)
        policy.write_adapter(out / "adapter")  # gathered from the shards under FSDP
        # Exact resume: a checkpoint, a second update, back to the checkpoint, the same update again.
        saved = checkpoint.save(policy, out / "run", 1, {})
        policy.run_update(batch(), cfg, 12)
        policy.write_adapter(out / "second")
        checkpoint.restore(policy, saved)
        policy.run_update(batch(), cfg, 12)
        policy.write_adapter(out / "again")
        control.send("stop")
        torch.save({"grads": grads, "metrics": metrics}, out / "rank0.pt")
    else:
        follow(control, make)
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> Path:
    return build_family("llama", tmp_path_factory.mktemp("models"))


CASES = {  # strategy, update options, each rank's free memory (none: a CPU's)
    "ddp-one-step": ("ddp", {}, ()),
    "ddp-accumulation-iterations": ("ddp", {"grad_accum": 1, "iterations": 2}, ()),
    "ddp-checkpointing-per-rank": ("ddp", {}, (1, 2**50)),
    "fsdp-one-step": ("fsdp", {}, ()),
}


@pytest.mark.parametrize("case", list(CASES))
def test_two_ranks_give_the_one_process_gradients_and_adapter(case, tiny_llama, tmp_path) -> None:
    import torch.multiprocessing as mp
    from crucible_trainer.rl.update import UpdateConfig

    strategy, options, free = CASES[case]
    cfg = UpdateConfig(micro_batch=2, **options)
    want_grads, want_adapter = one_process(tiny_llama, cfg, tmp_path / "one")
    mp.spawn(rank_main, args=(2, free_port(), tiny_llama, strategy, cfg, tmp_path, free), nprocs=2, join=True)
    got = torch.load(tmp_path / "rank0.pt", weights_only=False)

    assert len(got["grads"]) == len(want_grads) >= 1
    for got_step, want_step in zip(got["grads"], want_grads, strict=True):
        assert got_step.keys() == want_step.keys()
        assert sum(float(g.abs().sum()) for g in want_step.values()) > 0
        for name, want in want_step.items():
            torch.testing.assert_close(got_step[name], want, rtol=1e-4, atol=1e-6, msg=name)
    got_adapter = load_file(str(tmp_path / "adapter" / "adapter_model.safetensors"))
    assert got_adapter.keys() == want_adapter.keys()
    # Two ranks sum a micro-batch's products in another order than one process: the gradients
    # differ in float32's last bits, which AdamW's normalised steps (lr 1e-2) carry into the
    # adapter as a few 1e-6 (measured up to 5.4e-6 after two steps); a wrong gradient moves an
    # entry by about the learning rate.
    for name, want in want_adapter.items():
        torch.testing.assert_close(got_adapter[name], want, rtol=1e-4, atol=2e-5, msg=name)
    assert got["metrics"]["update/sequences"] == 5
    # Rank 0's micro-batches: all checkpointed on its budget of one byte, none on a CPU's.
    assert got["metrics"]["update/checkpointed_micro_batches"] == (2.0 if free else 0.0)
    # Rank 0 times the update's parts: handing the batch over, scoring, the passes.
    m = got["metrics"]
    assert m["time/update_command_s"] > 0 and m["time/update_passes_s"] > 0
    assert m["time/update_score_s"] >= 0
    second = load_file(str(tmp_path / "second" / "adapter_model.safetensors"))
    again = load_file(str(tmp_path / "again" / "adapter_model.safetensors"))
    assert any(not torch.equal(second[n], got_adapter[n]) for n in second)  # the second update moved it
    for name, want in second.items():  # and the one after the restore moved it the same way
        torch.testing.assert_close(again[name], want, rtol=0, atol=1e-7, msg=name)


def hung_rank_main(rank: int, port: int, model: str, out: str) -> None:
    """Rank 1 stops (SIGSTOP: alive, silent); rank 0 must fail at the collective timeout."""
    import signal
    import time
    from datetime import timedelta

    import torch.distributed as dist
    from crucible_trainer.distributed.leader import make_rank_policy
    from crucible_trainer.distributed.parallel import DataParallel
    from crucible_trainer.distributed.ranks import Control
    from crucible_trainer.rl.update import UpdateConfig

    os.environ["OMP_NUM_THREADS"] = "1"
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2, timeout=timedelta(seconds=10)
    )
    control = Control(timedelta(seconds=10))
    if rank == 1:
        os.kill(os.getpid(), signal.SIGSTOP)
        return
    started = time.monotonic()
    try:
        control.send("init", spec_json(Path(model)))
        policy = make_rank_policy(spec_json(Path(model)), "cpu", DataParallel("ddp", 0, 2), control)
        policy.run_update(batch(), UpdateConfig(micro_batch=2), 0)
        Path(out).write_text("no error")
    except Exception as exc:
        Path(out).write_text(f"{type(exc).__name__} after {time.monotonic() - started:.0f}s: {exc}")
    # As rank.py does after a failure: gloo's threads still wait on the stopped peer.
    os._exit(0)


def test_a_hung_rank_fails_the_update_at_the_collective_timeout(tiny_llama, tmp_path) -> None:
    import multiprocessing
    import signal

    ctx = multiprocessing.get_context("spawn")
    port, out = free_port(), tmp_path / "rank0.txt"
    procs = [ctx.Process(target=hung_rank_main, args=(r, port, str(tiny_llama), str(out))) for r in (0, 1)]
    for p in procs:
        p.start()
    try:
        procs[0].join(timeout=300)
        assert not procs[0].is_alive(), "rank 0 hung with its peer"
    finally:
        for p in procs:
            if p.is_alive():
                os.kill(p.pid, signal.SIGKILL)
            p.join(10)
    text = out.read_text()
    assert text != "no error" and ("timed out" in text.lower() or "timeout" in text.lower()), text
    assert int(text.split(" after ")[1].split("s")[0]) < 120, text
