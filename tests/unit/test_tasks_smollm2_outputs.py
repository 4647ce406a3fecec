"""Code extraction on real SmolLM2-135M-Instruct answers (tests/fixtures/smollm2_outputs)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from crucible_trainer.tasks import DataSpec, Task, answer_to_code, load_tasks

ANSWERS = Path(__file__).resolve().parents[1] / "fixtures" / "smollm2_outputs" / "answers.jsonl"
ROWS = [json.loads(line) for line in ANSWERS.read_text().splitlines() if line.strip()]


@pytest.fixture(scope="module")
def tasks() -> dict[str, Task]:
    every = load_tasks(DataSpec(dataset="mbpp", split="all")) + load_tasks(DataSpec(dataset="humaneval"))
    return {t.task_id: t for t in every}


def test_fixture_covers_the_answer_shapes() -> None:
    assert len(ROWS) >= 20
    assert {r["style"] for r in ROWS} == {"chat", "completion"}
    assert {r["temperature"] for r in ROWS} == {0.0, 0.8}
    assert any(r["finish_reason"] == "length" for r in ROWS)
    assert any(r["completion"].count("```") > 2 for r in ROWS)  # several blocks


@pytest.mark.parametrize("row", ROWS, ids=[f"{r['task_id']}-{r['style']}-{i}" for i, r in enumerate(ROWS)])
def test_extraction_matches_the_reviewed_code(row: dict, tasks: dict[str, Task]) -> None:
    task = tasks[row["task_id"]]
    code = answer_to_code(task, row["completion"], chat=row["style"] == "chat")
    assert code == row["code"]
    # Never any of the chatter or fences around it.
    assert "```" not in code
    assert not any(line.startswith(("This function", "Example usage", "Here")) for line in code.splitlines())
    if row["style"] == "chat" and code:
        assert task.entry_point is None or f"def {task.entry_point}" in code or "def " in code
