"""What is read is what was checked: races against the containment rule (`crucible_shared.paths`)
and the generator's adapter snapshot, each attacked for a bounded time by a thread that swaps a
checked file for a link to a secret outside the roots and back. Each passes only with zero reads
of the secret; the old check-then-reopen code read it hundreds of times in the same loops."""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from crucible_shared.paths import (
    PathMissing,
    PathOutsideRoots,
    UnsafePath,
    open_file_inside,
    open_inside,
    resolve_inside,
)

SECRET = "SECRET-0123456789"
LOOP_S = 1.5


def _swapper(target: Path, good: bytes, secret: Path, stop: threading.Event) -> threading.Thread:
    """Flip `target` between a regular file holding `good` and a link to `secret` (atomic renames)."""
    regular, link = target.with_name(".regular"), target.with_name(".link")

    def loop() -> None:
        while not stop.is_set():
            regular.write_bytes(good)
            os.replace(regular, target)
            if link.is_symlink():
                link.unlink()
            link.symlink_to(secret)
            os.replace(link, target)

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    return thread


@pytest.fixture
def world(tmp_path: Path) -> dict[str, Path]:
    root, outside = tmp_path / "root", tmp_path / "outside"
    (root / "sub").mkdir(parents=True)
    outside.mkdir()
    (outside / "secret.jsonl").write_text(json.dumps({"secret": SECRET}) + "\n")
    (root / "sub" / "data.jsonl").write_text('{"ok": 1}\n')
    return {"root": root, "outside": outside, "target": root / "sub" / "data.jsonl"}


def _race(world: dict[str, Path], read) -> tuple[int, int]:
    """(reads that saw the secret, reads done) while the swapper runs for `LOOP_S` seconds."""
    stop = threading.Event()
    thread = _swapper(world["target"], b'{"ok": 1}\n', world["outside"] / "secret.jsonl", stop)
    leaks = reads = 0
    deadline = time.monotonic() + LOOP_S
    try:
        while time.monotonic() < deadline:
            try:
                text = read()
            except (PathOutsideRoots, PathMissing, UnsafePath):
                continue  # a refusal is fine; only a read of the secret is a failure
            reads += 1
            leaks += SECRET in text
    finally:
        stop.set()
        thread.join()
    return leaks, reads


def test_data_paths_are_read_through_the_checked_descriptor(world) -> None:
    def read() -> str:
        _, fd = open_inside("data.path", "sub/data.jsonl", [world["root"]], "data")
        with os.fdopen(fd) as file:
            return file.read()

    leaks, reads = _race(world, read)
    assert leaks == 0 and reads > 0, (leaks, reads)


def test_artifact_descriptors_never_reach_outside(world) -> None:
    def read() -> str:
        with os.fdopen(open_file_inside(world["root"], "sub/data.jsonl")) as file:
            return file.read()

    leaks, reads = _race(world, read)
    assert leaks == 0 and reads > 0, (leaks, reads)


def test_a_link_anywhere_below_a_root_is_refused_by_name(world) -> None:
    (world["root"] / "inside-link").symlink_to(world["target"])  # even one that stays inside
    (world["root"] / "dir-link").symlink_to(world["root"] / "sub", target_is_directory=True)
    for value in ("inside-link", "dir-link/data.jsonl"):
        with pytest.raises(PathOutsideRoots, match="symbolic link"):
            resolve_inside("data.path", value, [world["root"]], "data", real=True)
        with pytest.raises(PathOutsideRoots, match="symbolic link"):
            open_inside("data.path", value, [world["root"]], "data")


def test_missing_files_are_4xx_errors_never_file_not_found(world) -> None:
    # real=True lets a missing file through (check_present words what is missing) ...
    path = resolve_inside("data.path", "sub/nope/x.jsonl", [world["root"]], "data", real=True)
    assert path == world["root"] / "sub" / "nope" / "x.jsonl"
    # ... and a reader gets a JobPathError, not a bare FileNotFoundError (a 500).
    with pytest.raises(PathMissing, match="does not exist"):
        open_inside("data.path", "sub/nope/x.jsonl", [world["root"]], "data")
    fifo = world["root"] / "sub" / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(PathMissing):
        open_inside("data.path", "sub/fifo", [world["root"]], "data")


def test_the_trainer_reads_dataset_files_through_the_checked_descriptor(world, monkeypatch) -> None:
    from crucible_trainer.tasks.files import read_jsonl
    from crucible_trainer.tasks.task import DatasetError

    monkeypatch.setenv("CRUCIBLE_DATA_ROOTS", str(world["root"]))

    def read() -> str:
        try:
            return json.dumps([row for _, row in read_jsonl(world["target"])])
        except DatasetError:
            raise PathMissing("data.path", "refused") from None

    leaks, reads = _race(world, read)
    assert leaks == 0 and reads > 0, (leaks, reads)
    with pytest.raises(DatasetError, match="file not found"):
        list(read_jsonl(world["root"] / "nope.jsonl"))


class _Stop(Exception):
    """Ends the attacked run once its loader has read what it was given."""


def test_the_trainer_loads_the_model_and_adapter_it_checked(tmp_path, monkeypatch) -> None:
    """The attacker swaps, after the worker's check, every file of the local `model.base` and of
    `model.init_adapter` for a link to a secret outside the roots, and then the directories
    themselves: the loaders must still read the files the check saw."""
    from crucible_shared.jobs import TrainJob
    from crucible_trainer.online import train
    from crucible_trainer.runtime.channel import LocalChannel
    from crucible_trainer.settings import Settings

    models, adapters, outside = tmp_path / "models", tmp_path / "adapters", tmp_path / "outside"
    for folder in (models / "m", adapters / "a", outside):
        folder.mkdir(parents=True)
    (outside / "config.json").write_text(json.dumps({"secret": SECRET}))
    (outside / "adapter_config.json").write_text(json.dumps({"secret": SECRET}))
    (models / "m" / "config.json").write_text('{"model": "checked"}')
    (adapters / "a" / "adapter_config.json").write_text('{"adapter": "checked"}')
    (adapters / "a" / "adapter_model.safetensors").write_bytes(b"weights")
    monkeypatch.setenv("CRUCIBLE_MODEL_ROOTS", str(models))
    monkeypatch.setenv("CRUCIBLE_ADAPTER_ROOTS", str(adapters))
    spec = TrainJob.model_validate(
        {
            "model": {"base": str(models / "m"), "init_adapter": str(adapters / "a")},
            "logging": {"wandb_mode": "disabled"},
        }
    )
    read: dict[str, str] = {}

    class Loader:  # stands in for `Policy`: reads the files as `from_pretrained` would, by path
        def __init__(self, model, optim, seed) -> None:
            read["base"] = (Path(model.base) / "config.json").read_text()
            read["adapter"] = (Path(model.init_adapter) / "adapter_config.json").read_text()
            self.model = None  # nothing to name

    class Attacked(train.TrainRun):
        async def setup(self) -> None:
            for folder, name in ((models / "m", "config.json"), (adapters / "a", "adapter_config.json")):
                (folder / name).unlink()
                (folder / name).symlink_to(outside / name)
            self.make_policy()
            for folder in (models / "m", adapters / "a"):  # then the whole directories
                folder.rename(folder.with_name("old"))
                folder.symlink_to(outside, target_is_directory=True)
            self.make_policy()
            raise _Stop

    monkeypatch.setattr(train, "Policy", Loader)
    (tmp_path / "snapshots").mkdir()
    settings = Settings(runs_dir=tmp_path / "runs", cancel_poll_s=0.01, snapshot_dir=tmp_path / "snapshots")
    run = Attacked(spec, "job-1", settings, LocalChannel("job-1"))
    with pytest.raises(_Stop):
        asyncio.run(run.run())
    assert sorted(run.loaded) == ["model.base", "model.init_adapter"]
    assert all(p.parent == tmp_path / "snapshots" for p in run.loaded.values())
    assert read == {"base": '{"model": "checked"}', "adapter": '{"adapter": "checked"}'}
    assert not any(p.exists() for p in run.loaded.values()), "the snapshots outlive the run"
    assert json.loads((tmp_path / "runs" / "job-1" / "spec.json").read_text())["model"]["base"] == str(
        models / "m"
    )


def test_the_trainer_refuses_a_link_in_a_checked_model_directory(tmp_path, monkeypatch) -> None:
    from crucible_shared.jobs import TrainJob
    from crucible_trainer.online.train import TrainRun
    from crucible_trainer.runtime.channel import LocalChannel
    from crucible_trainer.settings import Settings

    (tmp_path / "models" / "m").mkdir(parents=True)
    (tmp_path / "secret.json").write_text(SECRET)
    (tmp_path / "models" / "m" / "config.json").symlink_to(tmp_path / "secret.json")
    monkeypatch.setenv("CRUCIBLE_MODEL_ROOTS", str(tmp_path / "models"))
    spec = TrainJob.model_validate({"model": {"base": str(tmp_path / "models" / "m")}})
    run = TrainRun(spec, "job-1", Settings(runs_dir=tmp_path / "runs"), LocalChannel("job-1"))
    with pytest.raises(PathOutsideRoots, match=r"config\.json is a symbolic link") as caught:
        asyncio.run(run.run())
    assert SECRET not in str(caught.value)


def test_a_follower_rank_loads_its_own_snapshot_of_the_checked_model(tmp_path, monkeypatch) -> None:
    """A rank on another node gets rank 0's checked paths, not its snapshots: it checks and
    snapshots them itself, and a link planted in the model directory is refused there too."""
    from crucible_shared.jobs import TrainJob
    from crucible_shared.paths import PathRoots
    from crucible_trainer.distributed import leader

    models = tmp_path / "models"
    (models / "m").mkdir(parents=True)
    (models / "m" / "config.json").write_text('{"model": "checked"}')
    (tmp_path / "secret.json").write_text(SECRET)
    roots = PathRoots(model_roots=[models])
    seen: dict[str, str] = {}

    def loader(model, optim, seed, parallel, control) -> None:
        seen["path"], seen["text"] = model.base, (Path(model.base) / "config.json").read_text()

    monkeypatch.setattr(leader, "RankPolicy", loader)
    spec = TrainJob.model_validate({"model": {"base": str(models / "m")}}).model_dump_json()
    leader.make_rank_policy(spec, "cpu", None, None, roots)  # type: ignore[arg-type]
    assert seen["text"] == '{"model": "checked"}' and seen["path"] != str(models / "m")
    assert not Path(seen["path"]).exists(), "the follower's snapshot outlives its load"
    (models / "m" / "config.json").unlink()
    (models / "m" / "config.json").symlink_to(tmp_path / "secret.json")
    with pytest.raises(PathOutsideRoots, match="symbolic link"):
        leader.make_rank_policy(spec, "cpu", None, None, roots)  # type: ignore[arg-type]


def test_a_snapshot_links_or_copies_regular_files_only(tmp_path) -> None:
    from crucible_shared.snapshot import SnapshotRefused, snapshot_dir

    source, into = tmp_path / "m", tmp_path / "snap"
    (source / "sub").mkdir(parents=True)
    into.mkdir()
    (source / "config.json").write_text("{}")
    (source / "sub" / "x").write_text("left out")
    fd = os.open(source, os.O_RDONLY | os.O_DIRECTORY)
    try:
        assert snapshot_dir(fd, into) == ["config.json"]  # subdirectories are left out
        # Same file system: linked, not copied (a large checkpoint costs no copy).
        assert (into / "config.json").stat().st_ino == (source / "config.json").stat().st_ino
        os.mkfifo(source / "pipe")
        with pytest.raises(SnapshotRefused, match="pipe"):
            snapshot_dir(fd, tmp_path)
    finally:
        os.close(fd)


def test_an_adapter_trained_from_a_snapshot_names_the_jobs_model(tmp_path, monkeypatch) -> None:
    """The snapshot is gone once the run ends: a saved adapter's base_model_name_or_path must be
    the path the job named, as before snapshots."""
    from crucible_shared.jobs import TrainJob
    from crucible_trainer.online.train import TrainRun
    from crucible_trainer.runtime.channel import LocalChannel
    from crucible_trainer.settings import Settings

    from tests.families import build_family

    model = build_family("llama", tmp_path / "models")
    monkeypatch.setenv("CRUCIBLE_MODEL_ROOTS", str(tmp_path / "models"))
    spec = TrainJob.model_validate(
        {"model": {"base": str(model), "device": "cpu", "dtype": "float32", "lora_r": 4}}
    )
    saved: dict[str, Any] = {}

    class Saving(TrainRun):
        async def setup(self) -> None:
            policy = self.make_policy()
            assert "model.base" in self.loaded
            policy.write_adapter(tmp_path / "adapter")
            saved.update(json.loads((tmp_path / "adapter" / "adapter_config.json").read_text()))
            raise _Stop

    run = Saving(spec, "job-1", Settings(runs_dir=tmp_path / "runs"), LocalChannel("job-1"))
    with pytest.raises(_Stop):
        asyncio.run(run.run())
    assert saved["base_model_name_or_path"] == str(model)
