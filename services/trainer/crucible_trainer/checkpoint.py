"""Checkpoints: adapter + optimizer + scheduler + step + RNG states, written atomically; resume picks the newest."""

from __future__ import annotations

import os
import random
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from crucible_trainer.policy import Policy


def save(policy: Policy, run_dir: Path, step: int, extra: dict[str, Any]) -> Path:
    root = run_dir / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step-{step:06d}"
    tmp = Path(tempfile.mkdtemp(prefix=".ckpt-", dir=root))
    try:
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
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    for old in sorted(root.glob("step-*"))[:-2]:  # keep the two newest
        shutil.rmtree(old, ignore_errors=True)
    return final


def latest(run_dir: Path) -> Path | None:
    found = sorted((run_dir / "checkpoints").glob("step-*"))
    return found[-1] if found else None


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
