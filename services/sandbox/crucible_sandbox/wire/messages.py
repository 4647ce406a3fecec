"""The shapes of the messages between the sandbox's own processes, as TypedDicts.

They stay plain dicts at run time: JSON (server <-> worker) and marshal (worker -> a run's
processes) carry them as they are, and nothing is converted or validated twice on the hot path;
mypy checks the code that builds and reads them, and tests/unit/test_sandbox_layout.py that they
name the fields of the protocol models they mirror.

* server -> worker: `SlotConfig` when it starts it, then a `PreparedRun` per run: a request the
  server validated, its limits resolved;
* worker -> server: `SlotInfo` once, then a `RunResultData` per run (the server validates it as
  `crucible_shared.sandbox.RunResult`);
* worker -> a run's processes: a `ProgramSpec`, and for a judged plan a `JudgeSpec` with the
  `JudgedTests`.

What a run's processes write back (their report frames, the judge's requests and the program's
answers) has no type here on purpose: it is untrusted, and read as `dict[str, Any]` with
`dict.get` and exact type checks.
"""

from __future__ import annotations

from types import CodeType
from typing import Any, Literal, NotRequired, TypedDict

# -- server -> worker -------------------------------------------------------------------------------


class IsolationSettings(TypedDict):
    """How slots isolate their runs, from the server's settings (`isolation.confine.IsolationConfig`)."""

    uid_base: int
    tmpfs_mb: int
    work_root: str
    want_namespaces: bool
    want_cgroup: bool
    want_mount_namespace: bool
    want_memory_cgroup: bool


class SlotConfig(IsolationSettings):
    """A worker's first argument, passed on to its zygote."""

    slot: int
    owner: int  # the server's pid: the slot's cgroups and scratch directories are named after it


class RunLimits(TypedDict):
    """A run's limits: the request's, or the defaults, capped by the server's maxima."""

    wall_time_s: float
    test_time_s: float
    cpu_time_s: float
    memory_mb: int
    output_bytes: int
    report_bytes: int
    file_bytes: int
    open_files: int
    # Dropped where runs have no uid of their own (see `isolation.confine.Isolation.confine_program`).
    processes: NotRequired[int]
    # Compiled languages: the compile step's own limits (see `judging.languages`).
    compile_time_s: NotRequired[float]
    compile_memory_mb: NotRequired[int]
    # Runtimes that reserve address space (the JVM, V8, Go): the address-space limit, above `memory_mb`.
    address_space_mb: NotRequired[int]


class AssertTests(TypedDict):
    kind: Literal["asserts"]
    asserts: list[str]
    setup: str


class CheckTests(TypedDict):
    kind: Literal["check"]
    check: str
    entry_point: str


class StdioCase(TypedDict):
    input: str
    output: str


class StdioTests(TypedDict):
    kind: Literal["stdio"]
    cases: list[StdioCase]


class CallAfterRun(TypedDict):
    function: str
    args: list[Any]
    kwargs: dict[str, Any]


class RunOnly(TypedDict):
    kind: Literal["run"]
    stdin: str
    value: Literal["none", "last_expression"]
    call: CallAfterRun | None
    files: dict[str, str]  # relative path -> base64
    fetch_files: list[str]
    cells: list[str]


# The request's tests as `RunRequest.tests.model_dump(mode="json")` gives them.
Tests = AssertTests | CheckTests | StdioTests | RunOnly


class PreparedRun(TypedDict):
    code: str
    tests: Tests
    limits: RunLimits
    language: NotRequired[str]  # absent: Python; else a name of `judging.languages.LANGUAGES`
    # Whose compile cache entries the run may use (the tenant's, or the sharing tenants'): the
    # server's result cache scope. A compile served from another tenant's entry would tell that
    # tenant's program (`compile.cached`, the time it saved).
    cache_scope: NotRequired[str]


# -- worker -> server -------------------------------------------------------------------------------

TestStatusName = Literal["passed", "failed", "error", "timeout", "not_run"]
RunStatusName = Literal[
    "passed",
    "failed",
    "error",
    "syntax_error",
    "timeout",
    "memory_exceeded",
    "output_exceeded",
    "sandbox_error",
]


class TestVerdictData(TypedDict):
    """A test's verdict (`crucible_shared.sandbox.TestVerdict`)."""

    index: int
    test: str
    # "sandbox_error" only inside the worker, for a stdio case whose process did not start; the
    # run's status says so and the case reads as an error (see `judging.output.summarise_cases`).
    status: TestStatusName | Literal["sandbox_error"]
    message: str
    judged_outside: bool | None
    actual: NotRequired[str | None]
    expected: NotRequired[str | None]
    exception_type: NotRequired[str | None]
    traceback: NotRequired[str | None]
    program_helpers: NotRequired[list[str]]
    duration_ms: NotRequired[float]
    # Only inside the worker: the test ran out of memory (the run's status says so once judged).
    memory: NotRequired[bool]


class RunResultData(TypedDict):
    """A run's verdict (`crucible_shared.sandbox.RunResult`)."""

    status: RunStatusName
    passed: int
    total: int
    message: str
    tests: NotRequired[list[TestVerdictData]]
    exception_type: NotRequired[str | None]
    traceback: NotRequired[str | None]
    stdout: NotRequired[str]
    stderr: NotRequired[str]
    output_truncated: NotRequired[bool]
    value: NotRequired[str | None]
    value_type: NotRequired[str | None]
    same_answer: NotRequired[bool | None]
    duration_ms: NotRequired[float]
    cached: NotRequired[bool]
    exit_code: NotRequired[int | None]
    compile: NotRequired[CompileResultData | None]
    files: NotRequired[dict[str, str]]
    cells: NotRequired[list[CellResultData]]


class CellResultData(TypedDict):
    """A cell of a run with cells (`crucible_shared.sandbox.CellResult`)."""

    index: int
    status: Literal["ok", "error", "timeout", "not_run"]
    stdout: str
    stderr: str
    value: str | None
    exception_type: str | None
    message: str
    traceback: str | None
    duration_ms: float


class CompileResultData(TypedDict):
    """The compile step of a run (`crucible_shared.sandbox.CompileResult`)."""

    status: Literal["ok", "error", "timeout", "memory_exceeded", "output_exceeded"]
    exit_code: int | None
    stdout: str
    stderr: str
    duration_ms: float
    cached: bool


class CapabilitiesData(TypedDict):
    """What a slot's zygote could set up (`isolation.confine.Capabilities`)."""

    network_namespace: bool
    mount_namespace: bool
    filesystem: Literal["minimal root", "landlock", "host"]
    uid_switch: bool
    ipc_namespace: bool
    cgroup: str | None
    memory: Literal["cgroup v2", "cgroup v1", "sampled"]
    subreaper: bool
    masked: list[str]
    notes: list[str]


class ZygoteInfo(TypedDict):
    """What a zygote tells its worker once it has set up its isolation."""

    caps: CapabilitiesData
    mode: Literal["full", "reduced"]
    pid: int  # the zygote's
    cgroups: list[str]  # the slot's cgroups, removed by the worker when it exits
    oom_file: str | None  # the cgroup's memory.events (v2) or oom_control (v1), when it holds the limit
    slot_dir: str | None  # the slot's scratch directories (without a root of its own), removed likewise


class SlotInfo(ZygoteInfo):
    """A worker's first frame to the server: ready, and its zygote's isolation."""

    ready: bool


class ExceptionInfo(TypedDict):
    """What a frame of a run's process says about an exception (`inrun.runtime.exception_info`)."""

    exc: str  # its type's name
    msg: str
    tb: str  # trimmed to the candidate's and the tests' frames
    memory: bool  # a MemoryError


# -- worker -> a run's processes ------------------------------------------------------------------


class ProgramSpec(TypedDict):
    """What the program's process of a run receives (see `inrun.harness`, `inrun.command`)."""

    kind: Literal["calls", "judged", "stdio", "run", "command"]
    source: str  # for tracebacks
    program: NotRequired[CodeType]  # all but `command`
    limits: RunLimits
    calls: NotRequired[list[tuple[str, CodeType | None]]]  # `calls`: each test's function and arguments
    stdin: NotRequired[str]  # `stdio`, `run`
    last: NotRequired[CodeType | None]  # `run`: the final expression whose value to report
    call: NotRequired[tuple[str, tuple[Any, ...], dict[str, Any]]]  # `run`: the call whose value to report
    files: NotRequired[dict[str, bytes]]  # `run`, `command`: written to the run's directory first
    fetch: NotRequired[list[str]]  # `run`, `command`: read back afterwards
    argv: NotRequired[list[str]]  # `command`: what to start
    env: NotRequired[dict[str, str]]  # `command`: its environment
    exe: NotRequired[bytes | None]  # `command`: an executable, started from memory (argv[0] is its name)
    collect: NotRequired[str | None]  # `command`: a directory whose files are read back (a compile's `out`)
    mkdir: NotRequired[list[str]]  # `command`: directories made before it starts
    # `run` with cells: each cell compiled (its body and final expression) or why it does not compile,
    # and its source (for tracebacks)
    cells: NotRequired[list[tuple[CodeType | None, CodeType | None, str | None, str]]]


class JudgeSpec(TypedDict):
    """What the judge's process of a run receives beside the compiled tests (see `inrun.judge`)."""

    limits: RunLimits


class JudgedTests(TypedDict):
    """A judged plan's tests, compiled by the worker and marshalled to the judge."""

    setup: CodeType
    module: CodeType
    entry: str  # the function the judge calls
    entry_point: str | None  # a `check`'s function under test
    ops: list[str | None]  # the comparison of each assert site
    sources: dict[str, str]  # for tracebacks, by file name
    names: list[list[str]] | None  # the names each test reads (see `inrun.judge.ProgramNamespace`)
    setup_names: list[str] | None
