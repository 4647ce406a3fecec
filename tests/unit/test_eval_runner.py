"""The evaluation runner against scripted generator and sandbox services (httpx mock transports).

The scripted generator answers each problem's sample `j` with a correct or a broken program
depending on the request's seed, so pass@k is known in advance; the scripted sandbox "runs" a
program by looking at it. Real services are exercised in tests/integration/test_eval_e2e.py.
"""

from __future__ import annotations

import asyncio
import json
import re

import httpx
import pytest
from crucible_shared.generator_client import GeneratorClient
from crucible_shared.sandbox_client import SandboxClient
from crucible_trainer.evaluation import Category, EvalConfig, EvalProgress, evaluate, pass_at_k, task_seed
from crucible_trainer.tasks import Task

MODEL = "tiny"
RIGHT = "```python\ndef double(x):\n    return x * 2\n```"
WRONG = "```python\ndef double(x):\n    return x + 2\n```\nThis doubles x."
BROKEN = "```python\ndef double(x) return\n```"
RAISES = "```python\ndef double(x):\n    raise ValueError('no')\n```"
LOOPS = "```python\ndef double(x):\n    while True: pass\n```"
PROSE = "I am not sure how to do that."


def make_task(i: int) -> Task:
    return Task(
        task_id=f"t/{i}",
        dataset="jsonl",
        prompt=f"Problem {i}: write double(x).",
        tests={"kind": "asserts", "asserts": ["assert double(2) == 4", "assert double(3) == 6"]},
        entry_point="double",
        shown_test="assert double(2) == 4",
    )


class ScriptedGenerator:
    """Problem i, sample j: RIGHT when (i + j) % 3 == 0, else WRONG; greedy: RIGHT for even i.

    `answers` overrides the answers of a problem: {problem: [text, ...]} (cycled over samples).
    """

    def __init__(
        self, delay: float = 0.0, answers: dict[int, list[str]] | None = None, refuse: set[int] = frozenset()
    ):
        self.delay, self.answers, self.refuse = delay, answers or {}, refuse
        self.crash: set[int] = set()
        self.requests: list[dict] = []

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            return httpx.Response(
                200, json={"object": "list", "data": [{"id": MODEL, "root": "/models/tiny"}]}
            )
        body = json.loads(request.content)
        self.requests.append(body)
        await asyncio.sleep(self.delay)
        prompt = body["messages"][-1]["content"] if "messages" in body else body["prompt"]
        problem = int(re.search(r"Problem (\d+)", prompt).group(1))
        if problem in self.crash:
            return httpx.Response(
                422, json={"error": {"message": "bad field", "type": "BadRequestError", "code": 422}}
            )
        if problem in self.refuse:
            error = {
                "message": "This model's maximum context length is 8192 tokens.",
                "type": "BadRequestError",
                "code": 400,
            }
            return httpx.Response(400, json={"error": error})
        greedy = body["temperature"] == 0
        texts = []
        for j in range(body["n"]):
            if problem in self.answers:
                options = self.answers[problem]
                texts.append(options[j % len(options)])
            elif greedy:
                texts.append(RIGHT if problem % 2 == 0 else WRONG)
            else:
                texts.append(RIGHT if (problem + j) % 3 == 0 else WRONG)
        if "messages" in body:
            choices = [
                {
                    "index": j,
                    "message": {"role": "assistant", "content": t},
                    "finish_reason": "stop",
                    "token_ids": list(range(10 + j)),
                }
                for j, t in enumerate(texts)
            ]
            kind = "chat.completion"
        else:
            choices = [
                {"index": j, "text": t, "finish_reason": "length", "token_ids": [1] * 7}
                for j, t in enumerate(texts)
            ]
            kind = "text_completion"
        usage = {"prompt_tokens": 5, "completion_tokens": 10, "total_tokens": 15}
        return httpx.Response(
            200,
            json={"object": kind, "model": body.get("model") or MODEL, "choices": choices, "usage": usage},
        )


class ScriptedSandbox:
    """Judges programs by their text; `down_once` answers the first batch holding it with 503s."""

    def __init__(self, delay: float = 0.0, flaky: int = 0):
        self.delay, self.flaky = delay, flaky
        self.batches: list[int] = []

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/health":
            return httpx.Response(200, json={"status": "ok", "workers": 2})
        runs = json.loads(request.content)["runs"]
        await asyncio.sleep(self.delay)
        if self.flaky:
            self.flaky -= 1
            return httpx.Response(503, json={"error": {"message": "restarting"}})
        self.batches.append(len(runs))
        return httpx.Response(200, json={"results": [self.judge(r["code"], r["tests"]) for r in runs]})

    @staticmethod
    def judge(code: str, tests: dict) -> dict:
        assert tests["kind"] == "asserts"  # the tests' kind tag reaches the sandbox
        total = len(tests["asserts"])
        if "def double(x) return" in code:
            return {
                "status": "syntax_error",
                "passed": 0,
                "total": total,
                "message": "SyntaxError: invalid syntax",
            }
        if "raise" in code:
            return {"status": "error", "passed": 0, "total": total, "message": "ValueError: no"}
        if "while True" in code:
            return {"status": "timeout", "passed": 0, "total": total, "message": "timed out"}
        if "x * 2" in code:
            return {"status": "passed", "passed": total, "total": total}
        return {"status": "failed", "passed": 0, "total": total, "message": "assert double(2) == 4 -> got 4"}


def run(tasks, generator: ScriptedGenerator, sandbox: ScriptedSandbox, config: EvalConfig, progress=None):
    async def go():
        gen = GeneratorClient("http://generator", transport=httpx.MockTransport(generator), backoff=0.01)
        box = SandboxClient("http://sandbox", retries=2)
        box.http = httpx.AsyncClient(base_url="http://sandbox", transport=httpx.MockTransport(sandbox))
        async with gen, box:
            return await evaluate(tasks, gen, box, config, progress)

    return asyncio.run(go())


def test_scores_pass_at_k_greedy_and_categories() -> None:
    tasks = [make_task(i) for i in range(6)]
    config = EvalConfig(n=3, ks=[1, 2, 3, 5], temperature=0.8)
    report = run(tasks, ScriptedGenerator(), ScriptedSandbox(), config)

    # Each problem has exactly one RIGHT among its 3 samples ((i + j) % 3 == 0 for one j).
    assert [(p.n, p.correct) for p in report.problems] == [(3, 1)] * 6
    assert report.pass_at_k == pytest.approx({1: pass_at_k(3, 1, 1), 2: pass_at_k(3, 1, 2), 3: 1.0})
    assert 5 not in report.pass_at_k  # k > n is not reported
    assert report.pass_at_k_curve == pytest.approx([1 / 3, 2 / 3, 1.0])
    assert report.greedy_pass_at_1 == pytest.approx(0.5)
    assert [p.greedy_passed for p in report.problems] == [True, False] * 3
    assert report.failures == {
        "greedy": {"passed": 3, "wrong_answer": 3},
        "sampled": {"passed": 6, "wrong_answer": 12},
    }
    assert report.mean_tokens == {"greedy": 10.0, "sampled": 11.0}
    assert report.model == MODEL and report.generator["root"] == "/models/tiny"
    assert report.num_problems == 6 and report.datasets == {"jsonl": 6}
    sample = report.problems[0].samples[1]
    assert sample.code == "def double(x):\n    return x + 2"
    assert sample.message == "assert double(2) == 4 -> got 4"
    assert sample.completion == WRONG


def test_requests_use_per_problem_seeds_and_greedy_decoding() -> None:
    generator = ScriptedGenerator()
    config = EvalConfig(n=2, seed=5, model=MODEL)
    run([make_task(i) for i in range(3)], generator, ScriptedSandbox(), config)
    greedy = [r for r in generator.requests if r["temperature"] == 0]
    sampled = [r for r in generator.requests if r["temperature"] != 0]
    assert len(greedy) == 3 and all(r["n"] == 1 for r in greedy)
    assert len(sampled) == 3 and all(
        r["n"] == 2 and r["temperature"] == 0.8 and r["top_p"] == 0.95 for r in sampled
    )
    assert sorted(r["seed"] for r in sampled) == sorted(task_seed(5, f"t/{i}") for i in range(3))
    assert len({r["seed"] for r in sampled}) == 3
    assert all(r["model"] == MODEL for r in generator.requests)


def test_same_seed_gives_the_same_report() -> None:
    tasks = [make_task(i) for i in range(4)]
    config = EvalConfig(n=2, seed=1)
    first = run(tasks, ScriptedGenerator(), ScriptedSandbox(), config)
    second = run(tasks, ScriptedGenerator(delay=0.01), ScriptedSandbox(), config)
    assert first.fingerprint == second.fingerprint
    assert first.model_dump(exclude={"timing", "started_at"}) == second.model_dump(
        exclude={"timing", "started_at"}
    )
    other = run(tasks, ScriptedGenerator(answers={0: [WRONG]}), ScriptedSandbox(), config)
    assert other.fingerprint != first.fingerprint


def test_failure_categories() -> None:
    answers = {0: [BROKEN], 1: [RAISES], 2: [LOOPS], 3: [PROSE], 4: [RIGHT, WRONG]}
    report = run(
        [make_task(i) for i in range(5)],
        ScriptedGenerator(answers=answers),
        ScriptedSandbox(),
        EvalConfig(n=2, greedy=False),
    )
    categories = {p.task_id: [s.category for s in p.samples] for p in report.problems}
    assert categories == {
        "t/0": [Category.syntax_error] * 2,
        "t/1": [Category.runtime_error] * 2,
        "t/2": [Category.timeout] * 2,
        "t/3": [Category.no_code] * 2,
        "t/4": [Category.passed, Category.wrong_answer],
    }
    assert report.greedy_pass_at_1 is None
    assert report.failures["sampled"] == {
        "passed": 1,
        "wrong_answer": 1,
        "runtime_error": 2,
        "syntax_error": 2,
        "timeout": 2,
        "no_code": 2,
    }


def test_refused_prompt_counts_as_failure_not_crash() -> None:
    report = run(
        [make_task(i) for i in range(3)], ScriptedGenerator(refuse={1}), ScriptedSandbox(), EvalConfig(n=2)
    )
    refused = report.problems[1]
    assert refused.n == 2 and refused.correct == 0 and refused.greedy_passed is False
    assert all(s.category is Category.generation_error for s in refused.samples)
    assert "maximum context length" in refused.samples[0].message
    assert report.failures["sampled"]["generation_error"] == 2


def test_sandbox_outage_is_retried_then_dropped_not_scored() -> None:
    # Two 503s: the client retries them away.
    report = run([make_task(0)], ScriptedGenerator(), ScriptedSandbox(flaky=2), EvalConfig(n=3))
    assert report.dropped == 0 and report.problems[0].n == 3
    # More failures than the client and the runner retry: the runs are dropped, not failed.
    report = run([make_task(0)], ScriptedGenerator(), ScriptedSandbox(flaky=100), EvalConfig(n=3))
    problem = report.problems[0]
    assert report.dropped == 4
    assert problem.n == 0 and problem.greedy_passed is None
    assert report.pass_at_k == {} and report.greedy_pass_at_1 is None


def test_execution_overlaps_generation_and_progress_is_reported() -> None:
    updates: list[EvalProgress] = []
    config = EvalConfig(n=2, concurrency=2)
    generator, sandbox = ScriptedGenerator(delay=0.1), ScriptedSandbox(delay=0.05)
    report = run([make_task(i) for i in range(8)], generator, sandbox, config, progress=updates.append)
    t = report.timing
    assert t.generation_s > 0.7  # 16 requests, 2 at a time, 0.1 s each
    assert t.execution_s > 0 and t.overlap_s > 0
    # Batches ran while later requests were generating: most execution is hidden.
    assert t.execution_hidden > 0.5, t
    assert t.wall_s < t.generation_s + t.execution_s
    assert len(sandbox.batches) > 1
    assert updates[-1] == EvalProgress(generated=24, executed=24, total=24)
    assert all(u.executed <= u.generated for u in updates)


def test_completion_style_prompts() -> None:
    generator = ScriptedGenerator()
    report = run([make_task(0)], generator, ScriptedSandbox(), EvalConfig(n=1, chat=False, ks=[1]))
    assert all("prompt" in r and r["stop"] for r in generator.requests)
    assert report.problems[0].greedy_passed is True
    assert report.truncated_fraction == 1.0


def test_unknown_model_is_refused() -> None:
    with pytest.raises(ValueError, match="not served"):
        run([make_task(0)], ScriptedGenerator(), ScriptedSandbox(), EvalConfig(n=1, model="missing"))


def test_config_checks() -> None:
    with pytest.raises(ValueError, match="nothing to evaluate"):
        EvalConfig(n=0, greedy=False)
    assert EvalConfig(ks=[10, 1, 10]).ks == [1, 10]
    assert EvalConfig(n=4, ks=[1, 5]).reported_ks == [1]
    assert EvalConfig.model_validate_json(EvalConfig(n=3).model_dump_json()) == EvalConfig(n=3)


def test_a_generator_error_stops_the_evaluation_with_that_error() -> None:
    from crucible_shared.generator_client import GeneratorAPIError

    generator = ScriptedGenerator()
    generator.crash = {2}
    with pytest.raises(GeneratorAPIError, match="bad field"):
        run([make_task(i) for i in range(4)], generator, ScriptedSandbox(), EvalConfig(n=1))
