"""`python -m torch.distributed.run ... -m crucible_trainer.distributed.rank`: one rank of a job.

The worker (`launch.py`) starts `train_gpus` of these with `torchrun --standby DIR`: they take
their cold start, then wait for the job in DIR (`standby.py`). Multi-node, Kubernetes starts one
`torchrun` per node with a rendezvous and `--job-id`/`--spec` (docs/deploy.md). Rank 0 runs the
job and writes `<run dir>/ranks/result.json`; any rank that fails writes `rank-<r>.error` (its
traceback) first, so the worker can say which rank failed and why, and exits at once.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any


def ranks_dir(run_dir: Path) -> Path:
    return run_dir / "ranks"


def main() -> None:
    parser = argparse.ArgumentParser(description="One rank of a Crucible train job (started by torchrun).")
    parser.add_argument("--job-id")
    parser.add_argument("--spec", type=Path, help="the job's spec (JSON)")
    parser.add_argument("--standby", type=Path, help="instead: wait in this folder for the job (standby.py)")
    parser.add_argument("--owner", type=int, help="with --standby: the worker's pid (gone: stop waiting)")
    args = parser.parse_args()
    if args.standby is None and (args.job_id is None or args.spec is None):
        parser.error("give --job-id and --spec, or --standby")

    ready_s = None  # how long the ranks had been ready when the job came
    if args.standby is not None:
        from crucible_trainer.distributed.standby import await_job

        args.job_id, args.spec, ready_s = await_job(args.standby, args.owner)

    from crucible_shared.jobs import TrainJob

    from crucible_trainer.settings import Settings

    spec = TrainJob.model_validate_json(args.spec.read_text())
    settings = Settings()
    folder = ranks_dir(Path(settings.runs_dir) / args.job_id)
    rank = int(os.environ.get("RANK", "0"))
    (folder / f"rank-{rank}.pid").write_text(str(os.getpid()))
    try:
        outcome = run_rank(spec, args.job_id, settings, folder, ready_s)
        if outcome is not None:
            (folder / "result.json").write_text(json.dumps(outcome, default=str))
    except BaseException as exc:
        (folder / f"rank-{rank}.error").write_text(f"{type(exc).__name__}: {exc}\n\n{traceback.format_exc()}")
        traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
        # Not a normal exit: the process group's threads may still wait on a peer that hangs, and
        # joining them would hold this rank (and the job) as long. torchrun stops the others.
        os._exit(1)
    # The outcome is written and the process group destroyed: leave without the interpreter's
    # teardown, where the collectives' C++ threads can still abort the process ("terminate called
    # without an active exception", seen on a loaded machine after a finished job), which torchrun
    # would report as this rank failing.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_rank(
    spec: Any, job_id: str, settings: Any, folder: Path, ready_s: float | None = None
) -> dict[str, Any] | None:
    """Join the job's process group and lead (rank 0: the outcome) or follow (None); `ready_s`: how
    long the ranks had waited for the job, cold start taken (standby ranks), for rank 0's summary."""
    import torch
    import torch.distributed as dist

    from crucible_trainer.distributed.leader import LeaderRun, make_rank_policy, rank_channel
    from crucible_trainer.distributed.parallel import DataParallel
    from crucible_trainer.distributed.ranks import Control, follow
    from crucible_trainer.runtime.cancel import Interrupted

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local = int(os.environ.get("LOCAL_RANK", "0"))
    cuda = torch.cuda.is_available() and spec.model.device != "cpu"
    if cuda:
        torch.cuda.set_device(local)
    device = f"cuda:{local}" if cuda else "cpu"
    timeout = timedelta(seconds=spec.distributed.timeout_s)
    dist.init_process_group("nccl" if cuda else "gloo", timeout=timeout)
    control = Control(timeout)
    parallel = DataParallel(spec.distributed.strategy, rank, world)
    if rank != 0:
        roots = settings.path_roots()
        follow(
            control,
            lambda spec_json: make_rank_policy(
                spec_json, device, parallel, None, roots, settings.snapshot_dir
            ),
        )
        dist.destroy_process_group()
        return None
    spec = spec.model_copy(update={"model": spec.model.model_copy(update={"device": device})})
    channel = rank_channel(settings, job_id, folder / "stop")
    run = LeaderRun(spec, job_id, settings, channel, control, parallel, ready_s)
    try:
        summary = asyncio.run(run.run())
        outcome = {"status": summary.get("status", "finished"), "summary": summary}
    except Interrupted as stop:
        outcome = {"status": "interrupted", "step": stop.step}
    control.send("stop")  # followers wait for commands between collectives: let them go
    # Only after a clean run: after a failure a peer may hang, and this would wait on it.
    dist.destroy_process_group()
    return outcome


if __name__ == "__main__":
    main()
