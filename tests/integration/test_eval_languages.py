"""Evaluation in another language than Python: C++ stdin/stdout problems through the adapters, the
sandbox's compile step and `crucible eval` with pass@k (spawned generator and sandbox)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from crucible_cli import eval_cmd as _eval_cmd  # noqa: F401  (registers `crucible eval`)
from crucible_cli.app import app
from crucible_shared.sandbox import RunStatus
from crucible_shared.sandbox_client import SandboxClient
from crucible_trainer.evaluation import Category, load_report
from crucible_trainer.tasks import DataSpec, load_tasks
from typer.testing import CliRunner

from tests.integration.test_eval_e2e import smollm2  # noqa: F401  (the spawned generator)
from tests.servers import Service

CPP = str(Path(__file__).resolve().parents[2] / "data" / "stdio" / "crucible_stdio_cpp.jsonl")


def test_cpp_references_pass_and_wrong_answers_fail(sandbox: Service) -> None:
    tasks = load_tasks(DataSpec(dataset="stdio", path=CPP))
    assert len(tasks) == 6 and {t.language for t in tasks} == {"cpp"}

    async def run() -> list:
        async with SandboxClient(sandbox.url) as client:
            good = [t.reference_request() for t in tasks]
            # Another problem's reference: compiles, answers the wrong question.
            wrong = [tasks[(i + 1) % len(tasks)].run_request(t.reference or "") for i, t in enumerate(tasks)]
            broken = [tasks[0].run_request("int main() { return }")]
            return await client.run_batch(good + wrong + broken)

    results = asyncio.run(run())
    good, wrong, broken = results[:6], results[6:12], results[12]
    assert all(r.status is RunStatus.passed for r in good), [r.message for r in good]
    assert all(r.compile is not None and r.compile.status == "ok" for r in good)
    assert all(r.status is not RunStatus.passed for r in wrong)
    assert broken.status is RunStatus.syntax_error and broken.compile is not None


@pytest.mark.slow
def test_crucible_eval_in_cpp_end_to_end(smollm2: Service, sandbox: Service, tmp_path) -> None:  # noqa: F811
    out = tmp_path / "cpp"
    args = ["eval", "--dataset", "stdio", "--path", CPP, "--ids", "crucible-stdio-cpp/1,crucible-stdio-cpp/6"]
    args += ["--n", "2", "--k", "1", "--k", "2", "--max-tokens", "160", "--temperature", "0.8"]
    args += ["--generator", smollm2.url, "--sandbox", sandbox.url, "--out", str(out), "--quiet"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    report = load_report(out)
    assert [p.task_id for p in report.problems] == ["crucible-stdio-cpp/1", "crucible-stdio-cpp/6"]
    assert set(report.pass_at_k) == {1, 2} and report.greedy_pass_at_1 is not None
    for problem in report.problems:
        assert problem.n == 2 and len(problem.samples) == 2
        for answer in [problem.greedy, *problem.samples]:
            assert answer.category is not Category.generation_error
            # Every answer with code was compiled and judged by the sandbox, never dropped.
            if answer.category is not Category.no_code:
                assert answer.status and answer.status != "sandbox_error"
    assert report.dropped == 0
