"""Checkpoints and adapters appear whole or not at all: a refused lease (the gate) or a failed
write leaves neither the output nor its temporary folder behind."""

from __future__ import annotations

from pathlib import Path

import pytest
from crucible_trainer.online import checkpoint
from crucible_trainer.runtime.atomic import output_dir


class _Scheduler:
    def state_dict(self) -> dict:
        return {"last_epoch": 3}


class _Policy:
    """What a checkpoint reads of the policy."""

    scheduler = _Scheduler()

    def write_adapter(self, folder: Path) -> None:
        folder.mkdir(parents=True)
        (folder / "adapter_model.safetensors").write_bytes(b"weights")

    def optimizer_state(self) -> dict:
        return {"state": {}}


class _Channel:
    tag = "-r2"
    token = None

    def __init__(self, refuse: bool) -> None:
        self.refuse = refuse
        self.committed: list[str] = []

    def gate(self) -> None:
        if self.refuse:
            raise RuntimeError("superseded")

    def commit(self, checkpoint: str) -> None:
        self.committed.append(checkpoint)


def test_a_checkpoint_is_written_whole_and_committed(tmp_path: Path) -> None:
    channel = _Channel(refuse=False)
    final = checkpoint.save(_Policy(), tmp_path, 7, {"sampler": 1}, channel)  # type: ignore[arg-type]
    assert final == tmp_path / "checkpoints" / "step-000007-r2" and channel.committed == [final.name]
    assert sorted(p.name for p in final.iterdir()) == ["adapter", "state.pt"]
    assert [p.name for p in final.parent.iterdir()] == [final.name]  # no temporary folder left


def test_a_refused_gate_leaves_no_checkpoint(tmp_path: Path) -> None:
    channel = _Channel(refuse=True)
    with pytest.raises(RuntimeError, match="superseded"):
        checkpoint.save(_Policy(), tmp_path, 7, {}, channel)  # type: ignore[arg-type]
    assert list((tmp_path / "checkpoints").iterdir()) == [] and channel.committed == []


def test_a_failed_write_keeps_the_previous_output(tmp_path: Path) -> None:
    out = tmp_path / "adapter"
    with output_dir(out) as tmp:
        (tmp / "v").write_text("1")
    with pytest.raises(OSError), output_dir(out) as tmp:
        (tmp / "v").write_text("2")
        raise OSError("disk full")
    assert (out / "v").read_text() == "1" and [p.name for p in tmp_path.iterdir()] == ["adapter"]
