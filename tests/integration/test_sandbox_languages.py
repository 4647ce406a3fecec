"""The languages beside Python on the real service: stdio cases on /v1/runs, /run_code through the
`sandbox-fusion` client, the compile step (errors, its time limit, its cache), exit statuses and
signals, and a toolchain that is missing. Compiled programs are few and shared (the compile cache
makes the second use of a program a cache hit)."""

from __future__ import annotations

import uuid

import httpx
import pytest
from sandbox_fusion import (
    CommandRunStatus,
    RunCodeRequest,
    RunStatus,
    SummaryMapping,
    run_code,
    summary_run_code_result,
)

from tests.integration.conftest import UID_BASE
from tests.servers import spawn

# One program per language: print the sum of the two numbers on stdin.
SUM = {
    "python": "a, b = map(int, input().split())\nprint(a + b)\n",
    "cpp": "#include <iostream>\nint main() { long a, b; std::cin >> a >> b; std::cout << a + b << std::endl; }\n",
    "java": (
        "import java.util.*;\npublic class Solution {\n  public static void main(String[] args) {\n"
        "    Scanner s = new Scanner(System.in);\n    System.out.println(s.nextLong() + s.nextLong());\n  }\n}\n"
    ),
    "nodejs": "const [a, b] = require('fs').readFileSync(0, 'utf8').trim().split(/\\s+/).map(Number);\nconsole.log(a + b);\n",
    "go": 'package main\nimport "fmt"\nfunc main() { var a, b int64; fmt.Scan(&a, &b); fmt.Println(a + b) }\n',
    "rust": (
        "use std::io::Read;\nfn main() { let mut s = String::new(); std::io::stdin().read_to_string(&mut s).unwrap();\n"
        '  let v: Vec<i64> = s.split_whitespace().map(|x| x.parse().unwrap()).collect(); println!("{}", v[0] + v[1]); }\n'
    ),
    "bash": "read a b\necho $((a + b))\n",
}
COMPILED = {"cpp", "java", "go", "rust"}
CASES = [
    {"input": "2 3\n", "output": "5\n"},
    {"input": "40 2\n", "output": "42\n"},
    {"input": "1 1\n", "output": "3\n"},
]


def runs(sandbox, body: dict) -> dict:
    r = httpx.post(f"{sandbox.url}/v1/runs", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def test_health_lists_the_languages(sandbox) -> None:
    languages = httpx.get(f"{sandbox.url}/health").json()["languages"]
    assert set(SUM) <= set(languages), languages  # `make toolchains` installs them (CI does)


@pytest.mark.parametrize("language", list(SUM))
def test_stdio_cases_in_every_language(sandbox, language: str) -> None:
    out = runs(
        sandbox, {"language": language, "code": SUM[language], "tests": {"kind": "stdio", "cases": CASES}}
    )
    assert [t["status"] for t in out["tests"]] == ["passed", "passed", "failed"], out
    assert out["status"] == "failed" and out["passed"] == 2
    assert out["tests"][2]["message"] == "line 1: expected '3', got '2'"
    if language in COMPILED:
        assert out["compile"]["status"] == "ok"
    # The same program through SandboxFusion's client: compiled once, then from the cache.
    fusion = run_code(
        RunCodeRequest(code=SUM[language], language=language, stdin="7 8\n"), endpoint=sandbox.url
    )
    assert fusion.status == RunStatus.Success, fusion
    assert fusion.run_result.stdout == "15\n" and fusion.run_result.return_code == 0
    if language in COMPILED:
        assert fusion.compile_result.status == CommandRunStatus.Finished
        assert fusion.compile_result.return_code == 0
    else:
        assert fusion.compile_result is None


def test_compile_error_is_a_syntax_error_with_the_diagnostics(sandbox) -> None:
    code = f"// {uuid.uuid4()}\nint main() {{ return undefined_name; }}\n"
    out = runs(sandbox, {"language": "cpp", "code": code, "tests": {"kind": "stdio", "cases": CASES[:1]}})
    assert out["status"] == "syntax_error" and out["exception_type"] == "CompileError"
    assert out["compile"]["status"] == "error" and out["compile"]["exit_code"] != 0
    assert "undefined_name" in out["compile"]["stderr"] and "undefined_name" in out["message"]
    assert out["tests"][0]["status"] == "not_run"
    fusion = run_code(RunCodeRequest(code=code, language="cpp"), endpoint=sandbox.url, max_attempts=1)
    assert fusion.status == RunStatus.Failed and fusion.run_result is None
    assert (
        fusion.compile_result.status == CommandRunStatus.Finished and fusion.compile_result.return_code != 0
    )
    assert summary_run_code_result(fusion, SummaryMapping(CompileFailed="ce")) == "ce"


def test_compile_step_has_its_own_time_limit(sandbox) -> None:
    # The preprocessor reads /dev/zero for ever (one endless line): only a limit of the step stops it.
    code = f'// {uuid.uuid4()}\n#include "/dev/zero"\nint main() {{}}\n'
    request = RunCodeRequest(code=code, language="cpp", compile_timeout=1)
    fusion = run_code(request, endpoint=sandbox.url, max_attempts=1)
    assert fusion.status == RunStatus.Failed and fusion.run_result is None
    compiled = fusion.compile_result
    # Time runs out first, or the compiler's memory (it holds the endless line): killed either way.
    assert compiled.status == CommandRunStatus.TimeLimitExceeded or compiled.return_code == -9, fusion
    assert fusion.compile_result.execution_time < 5


def test_a_cached_compile_keeps_the_requests_own_limits(sandbox) -> None:
    # Compiled once under the default limits; under a limit no compiler meets, the same program
    # must not come back compiled from the cache.
    code = f"// {uuid.uuid4()}\n{SUM['cpp']}"
    body = {
        "language": "cpp",
        "code": code,
        "tests": {"kind": "stdio", "cases": CASES[:1]},
        "use_cache": False,
    }
    assert runs(sandbox, body)["status"] == "passed"
    again = runs(sandbox, body)
    assert again["status"] == "passed" and again["compile"]["cached"], again["compile"]
    tight = runs(sandbox, {**body, "limits": {"compile_time_s": 0.001}})
    assert tight["status"] == "timeout" and not tight["compile"]["cached"], tight["compile"]


def test_exit_status_signal_and_runtime_limits(sandbox) -> None:
    def fusion(code: str, **extra) -> dict:
        r = httpx.post(
            f"{sandbox.url}/run_code", json={"language": "bash", "code": code, **extra}, timeout=60
        )
        assert r.status_code == 200, r.text
        return r.json()

    out = fusion("echo out; echo err >&2; exit 3")
    assert out["status"] == "Failed" and out["run_result"]["return_code"] == 3
    assert (out["run_result"]["stdout"], out["run_result"]["stderr"]) == ("out\n", "err\n")
    out = fusion("kill -SEGV $$")
    assert out["run_result"]["status"] == "Finished" and out["run_result"]["return_code"] == -11
    out = fusion("while :; do :; done", run_timeout=1)
    assert out["run_result"]["status"] == "TimeLimitExceeded" and out["run_result"]["return_code"] is None
    out = fusion("cat in.txt > out.txt; echo done", files={"in.txt": "aGVsbG8="}, fetch_files=["out.txt"])
    assert out["status"] == "Success" and out["files"] == {"out.txt": "aGVsbG8="}


def test_a_missing_or_disabled_toolchain_is_a_400_naming_it() -> None:
    env = {
        "CRUCIBLE_SANDBOX_WORKERS": "1",
        "CRUCIBLE_SANDBOX_LANGUAGES": "bash",
        "CRUCIBLE_SANDBOX_UID_BASE": str(UID_BASE + 56),  # apart from this process's other sandboxes
    }
    with spawn("crucible_sandbox", env, "CRUCIBLE_SANDBOX_PORT") as sandbox:
        assert httpx.get(f"{sandbox.url}/health").json()["languages"] == ["python", "bash"]
        r = httpx.post(
            f"{sandbox.url}/run_code", json={"language": "cpp", "code": "int main(){}"}, timeout=30
        )
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["field"] == "language" and error["code"] == "language_unavailable"
        assert "g++" in error["message"]
        r = httpx.post(f"{sandbox.url}/run_code", json={"language": "bash", "code": "echo hi"}, timeout=30)
        assert r.json()["run_result"]["stdout"] == "hi\n"
