"""Stage bookkeeping: which stages of a run dir are up to date (`pipeline.json`).

A stage declares the spec sections it reads (`config`), the files it reads (`inputs`, each with
the stage that writes it) and the files it writes (`outputs`). After it runs, its record holds
the hash of its config, of each input and of each output. It is skipped when its record's config
and input hashes equal the current ones and every output is there with its recorded hash, so a
changed spec section, a rebuilt input or a deleted or edited output makes it run again; a missing
input stops the run, naming the stage that writes it.

Paths inside the run dir are recorded relative to it, so a run dir copied for `reuse` keeps its
records valid.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from crucible_trainer.offline.artifacts import content_hash, json_hash, write_json


class MissingInput(RuntimeError):
    """A stage's input is not there: an earlier stage has to run first."""


@dataclass(frozen=True)
class Input:
    path: Path
    producer: str  # who writes it, as said in errors: "the `build` stage of round 1"


@dataclass
class StagePlan:
    key: str  # "baseline", "round-2/train": unique within a run
    name: str  # the stage's name in `stages`
    config: dict[str, Any]
    inputs: list[Input] = field(default_factory=list)
    outputs: list[Path] = field(default_factory=list)


class StageBook:
    """The records of a run dir's stages, in `<run dir>/pipeline.json`."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        self.path = run_dir / "pipeline.json"
        self.records: dict[str, dict[str, Any]] = (
            json.loads(self.path.read_text())["stages"] if self.path.exists() else {}
        )

    def label(self, path: Path) -> str:
        try:
            return path.resolve().relative_to(self.run_dir.resolve()).as_posix()
        except ValueError:
            return str(path.resolve())

    def check_inputs(self, plan: StagePlan) -> None:
        for item in plan.inputs:
            if not item.path.exists():
                raise MissingInput(
                    f"stage {plan.key} needs {self.label(item.path)}, which {item.producer} writes: run that "
                    "first (add it to `stages`, or `reuse` a pipeline run that has it)"
                )

    def signature(self, plan: StagePlan) -> dict[str, Any]:
        """What the stage depends on, hashed: its config and every input."""
        return {
            "config": json_hash(plan.config),
            "inputs": {self.label(i.path): content_hash(i.path) for i in plan.inputs},
        }

    def fresh(self, plan: StagePlan, signature: dict[str, Any]) -> bool:
        """Whether the stage's outputs are there and were made from these very inputs."""
        record = self.records.get(plan.key)
        if record is None or record.get("config") != signature["config"]:
            return False
        if record.get("inputs") != signature["inputs"]:
            return False
        outputs = record.get("outputs", {})
        return set(outputs) == {self.label(p) for p in plan.outputs} and all(
            content_hash(p) == outputs[self.label(p)] for p in plan.outputs
        )

    def record(
        self, plan: StagePlan, signature: dict[str, Any], seconds: float, detail: dict[str, Any]
    ) -> dict[str, Any]:
        record = {
            **signature,
            "outputs": {self.label(p): content_hash(p) for p in plan.outputs},
            "seconds": round(seconds, 3),
            "finished_at": time.time(),
            "detail": detail,
        }
        self.records[plan.key] = record
        write_json(self.path, {"stages": self.records})
        return record
