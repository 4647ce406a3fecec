"""TRL's output folder under fencing: one per run of the job, the checkpoint to resume from named
by the job's record.

A queued job's runs never share TRL's `output_dir`: each writes `<folder><tag>` (`trainer`,
`trainer-r2`, ...; `channel.tag`), so a superseded run still training cannot write a checkpoint
into the folder the live run resumes from or rotates. Each checkpoint TRL saves counts only once
the record points at it (`channel.commit(checkpoint="<folder><tag>/checkpoint-N")`, fenced by the
run's lease, as online checkpoints are); then the other runs' folders are removed. A resumed run
starts from the checkpoint the record points at, never from the newest folder on disk. In-process
runs (no record) keep one folder and resume from its newest checkpoint.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path
from typing import Any


def work_dir(run_dir: Path, base: Path, channel: Any) -> tuple[Path, Path | None]:
    """(this run's TRL folder for `base`, the committed checkpoint of an earlier run to resume
    from: None in-process, before any commit, or when the pointer names another folder)."""
    own = base.with_name(base.name + channel.tag)
    if channel.token is None:
        return own, None
    name = channel.committed("checkpoint")
    if not name or name.startswith("/") or ".." in Path(name).parts:
        return own, None
    path = run_dir / name
    same_folder = re.fullmatch(rf"{re.escape(base.name)}(-r\d+)?", path.parent.name) is not None
    if path.parent.parent != base.parent or not same_folder or not (path / "trainer_state.json").is_file():
        return own, None
    return own, path


def commit(run_dir: Path, base: Path, checkpoint: Path, channel: Any) -> None:
    """Point the job's record at a checkpoint this run saved (`Superseded` if the job is no longer
    this run's), then remove the other runs' folders: none of them is resumed from any more."""
    if not channel.commit(checkpoint=str(checkpoint.relative_to(run_dir))):
        return  # in-process: no record
    channel.gate()
    for other in base.parent.glob(f"{base.name}*"):
        if other != checkpoint.parent and re.fullmatch(rf"{re.escape(base.name)}(-r\d+)?", other.name):
            shutil.rmtree(other, ignore_errors=True)
