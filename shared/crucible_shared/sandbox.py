"""Sandbox protocol (v1): what to run, against which tests, within which limits, and the verdict.

A run is one candidate program plus one test suite in one of three forms, or none:

* `asserts`: assert statements with optional setup code (MBPP),
* `check`: a `check(candidate)` function and the entry point it is called with (HumanEval),
* `stdio`: stdin/stdout cases (TACO / APPS / CodeContests),
* `run`: no tests: the program runs with optional stdin, and the result says what it did.

The response carries an overall status, one verdict per test (with actual vs expected values
for failed comparisons, and whether the test was judged outside the program's process),
trimmed tracebacks, capped output and timings.
"""

from __future__ import annotations

import base64
import binascii
from enum import StrEnum
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

MAX_PATH_CHARS = 255


def check_relative_path(path: str) -> str:
    """A path inside a run's directory: relative, no `..`, no empty or NUL parts. Raises ValueError.

    >>> check_relative_path("data/in.txt")
    'data/in.txt'
    >>> check_relative_path("../etc/passwd")
    Traceback (most recent call last):
    ValueError: path '../etc/passwd' must stay inside the run's directory (no '..')
    """
    if not path or len(path) > MAX_PATH_CHARS or "\0" in path:
        raise ValueError(f"path {path[:80]!r} must be 1 to {MAX_PATH_CHARS} characters without NUL")
    if path.startswith("/"):
        raise ValueError(f"path {path[:80]!r} must be relative to the run's directory")
    parts = path.split("/")
    if ".." in parts:
        raise ValueError(f"path {path[:80]!r} must stay inside the run's directory (no '..')")
    if any(p in ("", ".") for p in parts):
        raise ValueError(f"path {path[:80]!r} has an empty or '.' part")
    return path


def check_no_file_holds_another(paths: list[str]) -> None:
    """No path is a directory another path needs (`a` and `a/b`: a file cannot be both). Raises
    ValueError.

    >>> check_no_file_holds_another(["a", "a/b"])
    Traceback (most recent call last):
    ValueError: 'a' is a file and the directory of 'a/b'
    """
    names = set(paths)
    for path in paths:
        parts = path.split("/")
        for i in range(1, len(parts)):
            parent = "/".join(parts[:i])
            if parent in names:
                raise ValueError(f"{parent[:80]!r} is a file and the directory of {path[:80]!r}")


def check_base64(content: str, path: str) -> bytes:
    """The bytes of a base64 file body. Raises ValueError naming the file."""
    try:
        return base64.b64decode(content, validate=True)
    except (ValueError, binascii.Error):
        raise ValueError(f"the content of {path[:80]!r} is not base64") from None


class RunStatus(StrEnum):
    """Overall outcome of a run, worst first when several apply.

    For a run without tests (`"kind": "run"`), `passed` means the program ran to its end (or
    called `exit()` / `sys.exit(0)` / `os._exit(0)`) and its process exited with status 0; `error`
    that it raised, exited with another status or was killed (whatever it wrote to the harness's
    channel before); `syntax_error` that it did not compile (`exception_type` says `SyntaxError`,
    `IndentationError` or `TabError`). Whether it printed is `stdout`.
    """

    sandbox_error = "sandbox_error"  # infrastructure fault: not the candidate's doing; trainers drop these
    syntax_error = "syntax_error"
    memory_exceeded = "memory_exceeded"
    output_exceeded = "output_exceeded"
    timeout = "timeout"
    error = "error"  # the candidate raised (at import or inside a test)
    failed = "failed"  # ran, but some test's answer was wrong
    passed = "passed"


class TestStatus(StrEnum):
    """Outcome of one test."""

    passed = "passed"
    failed = "failed"  # the check was false (wrong answer)
    error = "error"  # raised an exception
    timeout = "timeout"
    not_run = "not_run"  # never reached: the program died or the run's time budget ran out


class Limits(BaseModel):
    """Per-run limits. Unset fields take the server's defaults; every value is capped by the server's maxima."""

    model_config = ConfigDict(extra="forbid")

    wall_time_s: float | None = Field(
        default=None, gt=0, le=600, description="Wall-clock budget for the whole run."
    )
    test_time_s: float | None = Field(
        default=None, gt=0, le=600, description="Wall-clock budget for each test."
    )
    cpu_time_s: float | None = Field(default=None, gt=0, le=600, description="CPU seconds for the whole run.")
    memory_mb: int | None = Field(
        default=None,
        ge=16,
        le=65536,
        description="Memory in MiB for the whole run (all its processes together); also each process's "
        "address-space limit.",
    )
    output_bytes: int | None = Field(
        default=None, ge=0, le=64 << 20, description="Cap on stdout+stderr kept per run."
    )
    compile_time_s: float | None = Field(
        default=None, gt=0, le=600, description="Wall-clock budget of the compile step (compiled languages)."
    )
    compile_memory_mb: int | None = Field(
        default=None, ge=16, le=65536, description="Memory in MiB of the compile step (all its processes)."
    )


class AssertTests(BaseModel):
    """Assert statements run one by one after the candidate (MBPP)."""

    model_config = ConfigDict(extra="forbid")

    kind: Literal["asserts"] = "asserts"
    asserts: list[str] = Field(
        min_length=1, description="Each entry is one test: usually `assert f(x) == y`."
    )
    setup: str = Field(default="", description="Code run after the candidate and before the tests.")


class CheckTests(BaseModel):
    """A `check(candidate)` function; each top-level assert in it is one test (HumanEval)."""

    model_config = ConfigDict(extra="forbid")

    kind: Literal["check"] = "check"
    check: str = Field(
        min_length=1, description="Source defining `check(candidate)` (and anything it needs)."
    )
    entry_point: str = Field(
        min_length=1, pattern=r"^[A-Za-z_][A-Za-z0-9_]*$", description="Name passed as `candidate`."
    )


class StdioCase(BaseModel):
    """One stdin/stdout case."""

    model_config = ConfigDict(extra="forbid")

    input: str = ""
    output: str


class StdioTests(BaseModel):
    """The program reads stdin and writes stdout; each case is a fresh execution.

    Comparator: both outputs are split into lines, trailing whitespace is stripped from every
    line and trailing empty lines are dropped; the line lists must then be equal. Runs of
    whitespace inside a line are collapsed to one space. A prefix of the expected output fails.
    """

    model_config = ConfigDict(extra="forbid")

    kind: Literal["stdio"] = "stdio"
    cases: list[StdioCase] = Field(min_length=1)


class Call(BaseModel):
    """A call of a function the program defines, with JSON arguments."""

    model_config = ConfigDict(extra="forbid")

    function: str = Field(pattern=r"^[A-Za-z_][A-Za-z0-9_]*$", description="The function's name.")
    args: list[Any] = Field(default_factory=list, description="Positional arguments (JSON values).")
    kwargs: dict[str, Any] = Field(default_factory=dict, description="Keyword arguments (JSON values).")


class RunOnly(BaseModel):
    """No tests: run the program under the same isolation and limits, and report what it did.

    The result carries `status` (see `RunStatus`), `stdout`, `stderr`, the exception if any, the
    duration and, when asked, `value`: the repr of the program's final expression statement
    (`value: "last_expression"`) or of what a call of one of its functions returned (`call`).
    """

    model_config = ConfigDict(extra="forbid")

    kind: Literal["run"] = "run"
    stdin: str = Field(default="", description="What the program reads from stdin.")
    value: Literal["none", "last_expression"] = Field(
        default="none", description="`last_expression`: report the value of the program's final expression."
    )
    call: Call | None = Field(default=None, description="After the program ran, call this function.")
    files: dict[str, str] = Field(
        default_factory=dict,
        description="Files written into the run's directory before it starts: relative path -> base64 content.",
    )
    fetch_files: list[str] = Field(
        default_factory=list,
        description="Files read back from the run's directory after it ends (relative paths); the result's "
        "`files` holds them, base64-encoded.",
    )
    cells: list[str] = Field(
        default_factory=list,
        description="Python: cells run after the program, in order, in its namespace (a notebook session in one "
        "process): each with its own output, the value of its final expression, its exception, and "
        "`test_time_s` of time; the result's `cells` says how each went.",
    )

    @field_validator("files")
    @classmethod
    def _files(cls, files: dict[str, str]) -> dict[str, str]:
        for path, content in files.items():
            check_relative_path(path)
            check_base64(content, path)
        check_no_file_holds_another(list(files))
        return files

    @field_validator("fetch_files")
    @classmethod
    def _fetch_files(cls, paths: list[str]) -> list[str]:
        for path in paths:
            check_relative_path(path)
        return paths

    @model_validator(mode="after")
    def _one_value(self) -> RunOnly:
        if self.call is not None and self.value == "last_expression":
            raise ValueError("ask for the final expression or for a call, not both")
        if self.cells and (self.call is not None or self.value == "last_expression"):
            raise ValueError("cells report their own values: ask for no final expression or call with them")
        return self


Tests = Annotated[AssertTests | CheckTests | StdioTests | RunOnly, Field(discriminator="kind")]


class RunRequest(BaseModel):
    """One candidate program and its tests."""

    model_config = ConfigDict(extra="forbid")

    language: str = Field(
        default="python",
        description="`python`, or one of the compiled and interpreted languages the server lists in `GET /health` "
        "(`cpp`, `java`, `nodejs`, `go`, `rust`, `bash`): those take `stdio` and `run` tests. Another is a 400.",
    )
    code: str = Field(description="The candidate program.")
    tests: Tests
    limits: Limits = Field(default_factory=Limits)
    use_cache: bool = Field(default=True, description="Serve an identical earlier run from the result cache.")


class BatchRequest(BaseModel):
    """Many runs at once; results come back in the same order."""

    model_config = ConfigDict(extra="forbid")

    runs: list[RunRequest] = Field(min_length=1)


class TestVerdict(BaseModel):
    """The verdict of one test, with what is needed to teach a model what went wrong."""

    index: int
    test: str = Field(description="The test's source (the assert statement, or the stdin for stdio cases).")
    status: TestStatus
    message: str = Field(default="", description="One line, e.g. `assert add(2, 2) == 4 -> got 5`.")
    actual: str | None = Field(default=None, description="repr of the value the candidate produced.")
    expected: str | None = Field(default=None, description="repr of the value the test expected.")
    exception_type: str | None = None
    traceback: str | None = Field(
        default=None, description="Trimmed to the candidate's and the test's frames."
    )
    judged_outside: bool | None = Field(
        default=None,
        description="True: decided outside the program's process, from plain values it produced (no object "
        "of the program was called to compare them). False: it could not be (the test needed to compare, or "
        "take the truth of, a value that is not plain data, or to pass the program one): it failed, and "
        "`message` says why. None: it did not run.",
    )
    program_helpers: list[str] = Field(
        default_factory=list,
        description="Names the test took from the program other than the function under test (e.g. "
        "HumanEval/32's `poly`): the verdict trusts the program's own version of them.",
    )
    duration_ms: float = 0.0


class CompileResult(BaseModel):
    """The compile step of a run in a compiled language (its own limits, same isolation)."""

    status: Literal["ok", "error", "timeout", "memory_exceeded", "output_exceeded"]
    exit_code: int | None = Field(
        default=None, description="The compiler's exit status; None when it was killed."
    )
    stdout: str = ""
    stderr: str = Field(default="", description="The compiler's diagnostics (capped).")
    duration_ms: float = 0.0
    cached: bool = Field(default=False, description="The artifact came from the compile cache.")


class CellResult(BaseModel):
    """One cell of a run with `cells`."""

    index: int
    status: Literal["ok", "error", "timeout", "not_run"]
    stdout: str = ""
    stderr: str = ""
    value: str | None = Field(default=None, description="repr of the cell's final expression, if it has one.")
    exception_type: str | None = None
    message: str = ""
    traceback: str | None = None
    duration_ms: float = 0.0


class RunResult(BaseModel):
    """The verdict of a run."""

    status: RunStatus
    passed: int = Field(description="Number of tests that passed.")
    total: int = Field(description="Number of tests in the suite.")
    tests: list[TestVerdict] = Field(default_factory=list)
    message: str = Field(default="", description="The first thing to fix, in one line.")
    exception_type: str | None = Field(
        default=None, description="Set when the candidate failed before any test."
    )
    traceback: str | None = None
    stdout: str = ""
    stderr: str = ""
    output_truncated: bool = False
    value: str | None = Field(
        default=None, description="Runs without tests: repr of the final expression or the call's result."
    )
    value_type: str | None = Field(default=None, description="The type of `value`'s object.")
    same_answer: bool | None = Field(
        default=None,
        description="True: the program gave one answer to every test although the tests expect different "
        "ones (it ignores its input; the tests it passes, it passes by a constant). None: not known "
        "(fewer than two comparable answers, or a suite the sandbox does not compare itself).",
    )
    duration_ms: float = 0.0
    cached: bool = False
    exit_code: int | None = Field(
        default=None,
        description="Runs without tests: the program's exit status (negative: killed by that signal); None when "
        "the sandbox ended it (a limit) or it did not run.",
    )
    compile: CompileResult | None = Field(default=None, description="Compiled languages: the compile step.")
    files: dict[str, str] = Field(
        default_factory=dict, description="Runs without tests: `fetch_files` that existed, base64-encoded."
    )
    cells: list[CellResult] = Field(
        default_factory=list, description="Runs with `cells`: each cell, in order."
    )

    @property
    def fraction_passed(self) -> float:
        return self.passed / self.total if self.total else 0.0


class BatchResponse(BaseModel):
    results: list[RunResult]


class SandboxIsolation(BaseModel):
    """The isolation a sandbox's runs get, as its first slot's zygote could set it up."""

    mode: Literal["full", "reduced", "unsafe"] | None = Field(
        default=None,
        description="`full`: namespaces, a root of its own and a uid per slot; `reduced`: a fallback "
        "below; `unsafe`: no isolation at all, as root (see `warning`). None before any slot started.",
    )
    network_namespace: bool = Field(
        default=False, description="Runs have a network of their own, with no way out."
    )
    mount_namespace: bool = Field(default=False, description="Each slot has a private mount namespace.")
    filesystem: Literal["minimal root", "landlock", "host"] = Field(
        default="host",
        description="What runs see of the files: a root of their own, Landlock's rules, or the host's.",
    )
    uid_switch: bool = Field(default=False, description="Programs and judges run under uids of their own.")
    ipc_namespace: bool = Field(default=False, description="System V IPC objects cannot outlive a run.")
    cgroup: str | None = Field(default=None, description="The first slot's cgroup, killed whole after a run.")
    memory: Literal["cgroup v2", "cgroup v1", "sampled"] = Field(
        default="sampled", description="What holds a run's memory limit for all its processes together."
    )
    subreaper: bool = Field(
        default=False, description="Daemons a run leaves are re-parented to its zygote and killed."
    )
    masked: list[str] = Field(
        default_factory=list, description="Directories of installed packages hidden from runs."
    )
    notes: list[str] = Field(default_factory=list, description="Why a protection is missing, one line each.")
    warning: str | None = Field(
        default=None, description="Set when the service runs programs without isolation."
    )


class SandboxHealth(BaseModel):
    """`GET /health`: liveness, load and the isolation in force."""

    status: Literal["ok"] = "ok"
    workers: int = Field(description="Worker slots.")
    pending: int = Field(description="Runs admitted and not finished.")
    isolation: SandboxIsolation
    auth: bool = Field(description="Whether requests need an API key.")
    languages: list[str] = Field(
        default_factory=list, description="Languages whose toolchain this server found (`python` always)."
    )
