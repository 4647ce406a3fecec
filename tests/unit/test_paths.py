"""`file_inside`: a request's relative path reaches a regular file inside its root, or nothing.

Written as an attacker would, one attack class per case; every refusal is the same `UnsafePath`.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from crucible_shared.paths import UnsafePath, file_inside


@pytest.fixture
def root(tmp_path: Path) -> Path:
    run = tmp_path / "run"
    (run / "sub").mkdir(parents=True)
    (run / "report.md").write_text("ok")
    (run / "sub" / "metrics.jsonl").write_text("{}")
    (tmp_path / "keys.txt").write_text("s3cret")
    return run


def test_files_inside_are_served(root: Path) -> None:
    assert file_inside(root, "report.md") == root / "report.md"
    assert file_inside(root, "sub/metrics.jsonl").read_text() == "{}"


@pytest.mark.parametrize(
    "rel",
    [
        "/etc/passwd",  # absolute
        "//etc/passwd",
        "../keys.txt",  # dot-dot
        "sub/../../keys.txt",
        "sub/../report.md",  # dot-dot that stays inside is refused too: one rule, no arithmetic
        "./report.md",
        "sub//metrics.jsonl",  # empty component
        "..\\keys.txt",  # backslash
        "report.md\x00.png",  # NUL
        "/proc/self/environ",  # /proc
        f"/proc/{os.getpid()}/environ",
        "",
        "sub",  # a directory
        "sub/",
        "missing.txt",
    ],
)
def test_escapes_are_refused(root: Path, rel: str) -> None:
    with pytest.raises(UnsafePath):
        file_inside(root, rel)


def test_links_anywhere_on_the_way_are_refused(root: Path) -> None:
    (root / "keys").symlink_to(root.parent / "keys.txt")
    (root / "up").symlink_to(root.parent, target_is_directory=True)
    (root / "proc").symlink_to("/proc", target_is_directory=True)
    (root / "inner").symlink_to(root / "report.md")  # even a link that stays inside
    for rel in ("keys", "up/keys.txt", "proc/self/environ", "inner"):
        with pytest.raises(UnsafePath):
            file_inside(root, rel)


def test_special_files_are_refused_without_blocking(root: Path) -> None:
    os.mkfifo(root / "pipe")  # opening a FIFO for reading would block without O_NONBLOCK
    with pytest.raises(UnsafePath):
        file_inside(root, "pipe")


def test_a_root_that_is_missing_refuses_everything(tmp_path: Path) -> None:
    with pytest.raises(UnsafePath):
        file_inside(tmp_path / "nope", "report.md")


def test_the_trainer_loads_the_model_paths_the_roots_checked(tmp_path: Path, monkeypatch) -> None:
    # A relative `./m` is checked under the first model root; the job must load that directory,
    # not `m` under whatever directory the worker happens to run in.
    from crucible_shared.jobs import TrainJob
    from crucible_shared.paths import PathOutsideRoots, PathRoots, with_checked_paths

    monkeypatch.setenv("CRUCIBLE_MODEL_ROOTS", str(tmp_path / "models"))
    monkeypatch.setenv("CRUCIBLE_ADAPTER_ROOTS", str(tmp_path / "adapters"))
    monkeypatch.chdir(tmp_path)
    roots = PathRoots()
    spec = TrainJob.model_validate({"model": {"base": "./qwen", "init_adapter": "./sft/v3"}})
    checked = with_checked_paths(spec, roots.check(spec))
    assert checked.model.base == str(tmp_path / "models" / "qwen")
    assert checked.model.init_adapter == str(tmp_path / "adapters" / "sft" / "v3")
    assert checked.model_dump(exclude={"model"}) == spec.model_dump(exclude={"model"})
    hub = TrainJob.model_validate({"model": {"base": "Qwen/Qwen2.5-Coder-1.5B-Instruct"}})
    assert with_checked_paths(hub, roots.check(hub)) == hub  # a hub id is not a path
    outside = TrainJob.model_validate({"model": {"base": "/etc"}})
    with pytest.raises(PathOutsideRoots, match=r"model\.base"):
        roots.check(outside)
