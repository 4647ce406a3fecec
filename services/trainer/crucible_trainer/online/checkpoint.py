"""Checkpoints: adapter + optimizer + scheduler + step + RNG states, written atomically; resume
picks the newest.

Fenced (docs/jobs.md, "Fencing"): a run writes `checkpoints/step-NNNNNN<tag>` (its own name:
`channel.tag`), and a queued job's checkpoint counts only once the run has pointed the job's
record at it (`channel.commit(checkpoint=...)`, checked against the run's lease in Redis). A
resumed run reads that pointer, so a checkpoint a superseded run wrote after losing the job is
never resumed from. In-process runs (no record) resume from the newest directory.
"""

from __future__ import annotations

import random
import re
import shutil
from pathlib import Path
from typing import Any

import torch

from crucible_trainer.rl.policy import Policy
from crucible_trainer.runtime.atomic import output_dir
from crucible_trainer.runtime.channel import JobChannel

_NAME = re.compile(r"^step-(\d+)(-r\d+)?$")


def save(
    policy: Policy, run_dir: Path, step: int, extra: dict[str, Any], channel: JobChannel | None = None
) -> Path:
    root = run_dir / "checkpoints"
    tag = channel.tag if channel is not None else ""
    final = root / f"step-{step:06d}{tag}"
    with output_dir(final) as tmp:
        policy.write_adapter(tmp / "adapter")
        state = {
            "step": step,
            "optimizer": policy.optimizer_state(),
            "scheduler": policy.scheduler.state_dict(),
            "rng": {"python": random.getstate(), "torch": torch.get_rng_state()},
            "extra": extra,
        }
        if torch.cuda.is_available():
            state["rng"]["cuda"] = torch.cuda.get_rng_state_all()
        torch.save(state, tmp / "state.pt")
        if channel is not None:
            channel.gate()
    if channel is not None:
        channel.commit(checkpoint=final.name)  # Superseded if the job is no longer this run's
    # Keep this run's two newest. Another run's are garbage once this run committed (it holds
    # the job); a superseded run never gets here (its commit is refused), so it deletes nothing.
    mine = sorted(p for p in root.glob("step-*") if (m := _NAME.match(p.name)) and (m.group(2) or "") == tag)
    others = [p for p in root.glob("step-*") if _NAME.match(p.name) and p not in mine]
    for old in [*mine[:-2], *(others if channel is not None and channel.token is not None else [])]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def step_of(path: Path) -> int:
    found = _NAME.match(path.name)
    return int(found.group(1)) if found else -1


def latest(run_dir: Path) -> Path | None:
    found = [p for p in (run_dir / "checkpoints").glob("step-*") if _NAME.match(p.name)]
    return max(found, key=lambda p: (step_of(p), p.name)) if found else None


def resumable(run_dir: Path, channel: JobChannel) -> Path | None:
    """The checkpoint to resume from: the one the job's record points at (a queued job), else
    (in-process) the newest. Checkpoints of other runs are removed (the caller holds the job)."""
    if channel.token is None:
        return latest(run_dir)
    name = channel.committed("checkpoint")
    root = run_dir / "checkpoints"
    chosen = root / name if name and _NAME.match(name) and (root / name).is_dir() else None
    channel.gate()
    for other in root.glob("step-*"):
        if other != chosen:  # not committed, or older than the pointer: never resumed from
            shutil.rmtree(other, ignore_errors=True)
    return chosen


def restore(policy: Policy, path: Path) -> dict[str, Any]:
    """Load a checkpoint into `policy`; returns its state (step, extra)."""
    state = load_state(path)
    policy.restore(path, state)
    random.setstate(state["rng"]["python"])
    torch.set_rng_state(state["rng"]["torch"])
    if "cuda" in state["rng"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["rng"]["cuda"])
    return state


def load_state(path: Path) -> dict[str, Any]:
    """A checkpoint's optimizer, schedule, RNG and job state (`state.pt`)."""
    return torch.load(path / "state.pt", map_location="cpu", weights_only=False)
