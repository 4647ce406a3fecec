"""Rank 0's job: the training loop of `online/train.py`, unchanged, over a policy every rank updates.

`LeaderRun` is `TrainRun` with two differences: its policy is a `RankPolicy` (made on every rank,
from the spec rank 0 resolved for its hardware), and its update is a command every rank runs on
its share of the batch rank 0 generated. Rollouts, rewards, the channel, checkpoints, publishing
and the stale-policy check stay on rank 0, as in one process.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from crucible_shared.jobs import TrainJob
from crucible_shared.paths import PathRoots

from crucible_trainer.distributed.parallel import DataParallel
from crucible_trainer.distributed.ranks import Control, RankPolicy
from crucible_trainer.online.train import TrainRun
from crucible_trainer.rl.policy import name_base
from crucible_trainer.rl.rollout import Sample
from crucible_trainer.rl.update import UpdateConfig
from crucible_trainer.runtime.channel import JobChannel, LocalChannel
from crucible_trainer.runtime.jobrun import drop_snapshots, loaded_model, take_snapshots
from crucible_trainer.settings import Settings


def make_rank_policy(
    spec_json: str,
    device: str,
    parallel: DataParallel,
    control: Control | None,
    roots: PathRoots | None = None,
    into: Path | None = None,
) -> RankPolicy:
    """This rank's policy from rank 0's resolved spec, on this rank's device. With `roots` (a
    follower, perhaps on another node), the spec's local model directories are checked and
    snapshotted here, loaded from the snapshots, and the snapshots dropped once loaded."""
    spec = TrainJob.model_validate_json(spec_json)
    model = spec.model.model_copy(update={"device": device})
    if roots is None:
        return RankPolicy(model, spec.optim, spec.seed, parallel, control)
    loaded = take_snapshots(spec, roots, into=into)
    try:
        return RankPolicy(loaded_model(model, loaded), spec.optim, spec.seed, parallel, control)
    finally:
        drop_snapshots(loaded)


class LeaderRun(TrainRun):
    def __init__(
        self,
        spec: TrainJob,
        job_id: str,
        settings: Settings,
        channel: JobChannel,
        control: Control,
        parallel: DataParallel,
        ranks_ready_s: float | None = None,
    ) -> None:
        super().__init__(spec, job_id, settings, channel)
        self.control, self.parallel = control, parallel
        if ranks_ready_s is not None:  # standby ranks: how long they had waited, cold start taken
            self.summary["ranks_ready_s"] = round(ranks_ready_s, 3)

    def make_policy(self) -> RankPolicy:  # type: ignore[override]
        # The followers get the checked paths (a follower on another node has no access to this
        # node's snapshots) and snapshot them themselves; rank 0 loads its own snapshots.
        self.control.send("init", self.spec.model_dump_json())
        spec_json = self.spec.model_copy(update={"model": self.loaded_model()}).model_dump_json()
        policy = make_rank_policy(spec_json, str(self.spec.model.device), self.parallel, self.control)
        if "model.base" in self.loaded:  # saved adapters name the job's model, not the snapshot
            name_base(policy.model, self.spec.model.base)
        return policy

    def update_policy(  # type: ignore[override]
        self, policy: RankPolicy, samples: list[Sample], cfg: UpdateConfig, seed: int
    ) -> dict[str, float]:
        # The samples travel pickled to every rank; their sandbox results are not needed there.
        light = [_without_result(s) for s in samples]
        metrics = policy.run_update(light, cfg, seed)
        metrics["update/ranks"] = float(self.parallel.world)
        return metrics


def _without_result(sample: Sample) -> Sample:
    from dataclasses import replace

    return replace(sample, result=None)


class RankChannel(JobChannel):
    """Rank 0's view of the job's channel: the worker's channel for everything it says, and the
    files the worker writes when it is asked to stop (its SIGTERM does not reach the ranks) or the
    job to cancel (a cancel without Redis: Ctrl-C in `crucible train --local`)."""

    def __init__(self, inner: JobChannel, stop_file: Path) -> None:
        self.inner, self.stop_file = inner, stop_file
        self.job_id = inner.job_id

    def progress(self, step: int, total_steps: int, metrics: dict[str, float], policy_version: str) -> None:
        self.inner.progress(step, total_steps, metrics, policy_version)

    def emit(self, kind: str, **data: Any) -> None:
        self.inner.emit(kind, **data)

    def cancel_requested(self) -> bool:
        return self.inner.cancel_requested() or self.stop_file.with_name("cancel").exists()

    # Fencing is the worker's channel's: rank 0 writes the run dir, adapters and generators.
    @property
    def token(self) -> int | None:  # type: ignore[override]
        return self.inner.token

    def gate(self) -> None:
        self.inner.gate()

    def commit(self, **fields: Any) -> bool:
        return self.inner.commit(**fields)

    def committed(self, field: str) -> str | None:
        return self.inner.committed(field)

    def stream_data(self) -> list[str] | None:
        return self.inner.stream_data()

    def undelivered(self, after: int = 0) -> list[tuple[int, str]]:
        return self.inner.undelivered(after)

    def resend(self, data: str) -> None:
        self.inner.resend(data)

    def superseded(self) -> bool:
        return self.inner.superseded()

    def stop_requested(self) -> bool:
        return self.stop_file.exists()


def rank_channel(settings: Settings, job_id: str, stop_file: Path) -> RankChannel:
    """The job's Redis channel where the worker has Redis; else events on rank 0's output
    (benchmarks, `torchrun` by hand)."""
    if settings.redis_url:
        from redis import Redis

        from crucible_trainer.runtime.channel import RedisChannel

        inner = RedisChannel(Redis.from_url(settings.redis_url), job_id)
        lease = os.environ.get("CRUCIBLE_JOB_LEASE", "")
        if lease.isdigit():  # the worker's run: its fencing token, not one of rank 0's own
            inner.token, inner.lease = int(lease), lease
            inner.outbox.lease = lease
        return RankChannel(inner, stop_file)
    return RankChannel(LocalChannel(job_id, _print_event), stop_file)


def _print_event(kind: str, record: dict[str, Any]) -> None:
    """Events as JSON lines on rank 0's output (the worker keeps it in `ranks/torchrun.log`)."""
    print(json.dumps(record, default=str), flush=True)
