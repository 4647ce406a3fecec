"""A train job whose reward runs C++ through the sandbox, on CPU with the real SmolLM2 model
(the mechanism, not learning): the answers are compiled and run on each stdin case, and every
rollout's reward comes from the sandbox's verdict."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.integration.test_trainer import NO_STALE_CHECK, settings_for, tiny_job, train

pytestmark = pytest.mark.slow

CPP = str(Path(__file__).resolve().parents[2] / "data" / "stdio" / "crucible_stdio_cpp.jsonl")
GRADED = {"passed": None, "syntax_error": -0.5, "error": -1.0, "timeout": -1.0}


def test_grpo_step_rewarded_by_cpp_runs(stack_generator, sandbox, stack_dirs) -> None:
    spec = tiny_job(
        data={"dataset": "stdio", "path": CPP, "ids": ["crucible-stdio-cpp/1"]},
        optim={"steps": 1, "problems_per_step": 1},
        rollout={"max_tokens": 96},
        publish=NO_STALE_CHECK,
    )
    summary = train(spec, "grpo-cpp", settings_for(stack_generator, sandbox, stack_dirs))
    assert summary["status"] == "finished"
    run_dir = Path(summary["run_dir"])
    rows = [
        json.loads(line) for line in (run_dir / "rollouts" / "step-000001.jsonl").read_text().splitlines()
    ]
    assert len(rows) == 4
    assert {r["problem_id"] for r in rows} == {"crucible-stdio-cpp/1"}
    for row in rows:
        # Judged by the sandbox's C++ runs (a compile error is the graded reward's syntax error).
        assert row["status"] not in (None, "sandbox_error"), row
        expected = GRADED.get(row["status"])
        if expected is not None:
            assert row["reward"] == pytest.approx(expected), row
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1]
