"""Runs of programs in the languages beside Python: the compile step, then stdio cases or a plain run.

The worker calls `run_program` for a `PreparedRun` whose `language` is not Python. Every step is
a `command` spec for a run's program process (see `inrun.command`), in the same isolation as a
Python run:

1. **compile** (compiled languages): the compiler, under the compile limits (`compile_time_s`
   wall and CPU, `compile_memory_mb` for all its processes, a larger process count, the run's
   output cap). What it leaves in `out/` is the artifact, cached (`artifacts`) by a hash of the
   source, the language, the command, the compile limits and the request's `cache_scope` (its
   tenant: a tenant never gets, or times, a compile another tenant's run left). A compiler that fails, times out or
   runs out of memory ends the run: `syntax_error` (the graded reward's "did not compile"),
   `timeout` or `memory_exceeded`, with `compile` saying what the compiler said.
2. **run**: each stdio case a process of its own, judged like Python's (`output.judge_case`), or
   one run without tests (`output.judge_run`), with the request's files written first and
   `fetch_files` read back.
"""

from __future__ import annotations

import base64
from collections.abc import Callable

from crucible_sandbox.judging import languages, output
from crucible_sandbox.judging.artifacts import Artifacts
from crucible_sandbox.judging.verdict import ProcessOutcome, not_run, process_status
from crucible_sandbox.wire.messages import (
    CompileResultData,
    PreparedRun,
    ProgramSpec,
    RunLimits,
    RunResultData,
    StdioCase,
)

COMPILE_PROCESSES = 256  # go build, rustc and javac start threads and helpers
COMPILE_OPEN_FILES = 1024
# A run's process, started with these specs: (spec, wall seconds, (output cap, report cap)) -> outcome.
Execute = Callable[[ProgramSpec, float, tuple[int, int]], ProcessOutcome]


def _caps(limits: RunLimits) -> tuple[int, int]:
    return (limits["output_bytes"], limits["report_bytes"])


def files_of(proc: ProcessOutcome) -> dict[str, str]:
    """The last `files` frame a run's process wrote (its own files: untrusted, only passed on)."""
    frame = proc.last("files")
    files = frame.get("files") if frame else None
    if type(files) is not dict:
        return {}
    return {k: v for k, v in files.items() if type(k) is str and type(v) is str}


def compile_step(
    execute: Execute,
    cache: Artifacts,
    lang: languages.Language,
    source: str,
    limits: RunLimits,
    scope: str = "",
) -> tuple[dict[str, bytes] | None, CompileResultData]:
    """(the artifact or None, the compile step's result); from the cache when it has the artifact
    in `scope` (the tenant's part of the cache)."""
    wall = limits.get("compile_time_s", 10.0)
    memory = limits.get("compile_memory_mb", 1024)
    key = languages.artifact_key(lang, source, (wall, memory), scope)
    hit = cache.get(key)
    if hit is not None:
        return hit, {
            "status": "ok",
            "exit_code": 0,
            "stdout": "",
            "stderr": "",
            "duration_ms": 0.0,
            "cached": True,
        }
    cls = languages.java_class(source)
    name = lang["source"].format(cls=cls)
    step: RunLimits = {
        **limits,
        "wall_time_s": wall,
        "test_time_s": wall,
        "cpu_time_s": wall,
        "memory_mb": memory,
        "address_space_mb": memory + languages.RESERVE_MB,
        "processes": COMPILE_PROCESSES,
        "open_files": COMPILE_OPEN_FILES,
    }
    assert lang["compile"] is not None
    spec: ProgramSpec = {
        "kind": "command",
        "source": "",
        "limits": step,
        "argv": languages.expand(lang["compile"], name, cls, 0),
        "env": languages.environment(lang),
        "files": {name: source.encode("utf-8", "surrogatepass")},
        "mkdir": ["out"],
        "collect": "out",
    }
    proc = execute(spec, wall + 0.05, _caps(limits))
    status = process_status(proc)
    result: CompileResultData = {
        "status": "ok",
        "exit_code": proc.exit_code,
        "stdout": proc.stdout,
        "stderr": proc.stderr,
        "duration_ms": round(proc.duration_ms, 3),
        "cached": False,
    }
    if status in ("timeout", "memory_exceeded", "output_exceeded"):
        result["status"] = status
        return None, result
    files = {k: base64.b64decode(v) for k, v in files_of(proc).items()}
    if proc.exit_code != 0 or proc.signal is not None or not proc.started or not files:
        result["status"] = "error"
        return None, result
    artifact = {k.removeprefix("out/"): v for k, v in files.items()}
    cache.put(key, artifact)
    return artifact, result


def _compile_failed(compiled: CompileResultData, tests: list[str]) -> RunResultData:
    status = compiled["status"]
    run_status = {"timeout": "timeout", "memory_exceeded": "memory_exceeded"}.get(status, "syntax_error")
    what = {
        "timeout": "compilation ran out of time",
        "memory_exceeded": "compilation ran out of memory",
        "output_exceeded": "the compiler wrote more than the output limit",
    }.get(status, f"compilation failed (exit status {compiled['exit_code']})")
    diagnostics = compiled["stderr"] or compiled["stdout"]
    first = next((line for line in diagnostics.splitlines() if "error" in line), "")
    out: RunResultData = {
        "status": run_status,  # type: ignore[typeddict-item]
        "passed": 0,
        "total": len(tests),
        "message": f"{what}: {first[:300]}" if first else what,
        "tests": [not_run(i, s) for i, s in enumerate(tests)],
        "exception_type": "CompileError" if run_status == "syntax_error" else None,
        "traceback": diagnostics[-4000:] or None,
        "stdout": "",
        "stderr": "",
        "compile": compiled,
    }
    return out


def run_program(execute: Execute, cache: Artifacts, request: PreparedRun) -> RunResultData:
    lang = languages.LANGUAGES[request.get("language", "")]
    source, tests, limits = request["code"], request["tests"], request["limits"]
    cls = languages.java_class(source)
    name = lang["source"].format(cls=cls)
    cases = tests["cases"] if tests["kind"] == "stdio" else []
    compiled: CompileResultData | None = None
    files: dict[str, bytes] = {}
    exe: bytes | None = None
    if lang["compile"] is not None:
        artifact, compiled = compile_step(
            execute, cache, lang, source, limits, request.get("cache_scope", "")
        )
        if artifact is None:
            return _compile_failed(compiled, [c["input"][:200] for c in cases])
        if "{exe}" in lang["run"]:
            exe = artifact.get("main")
        else:
            files = artifact
    else:
        files = {name: source.encode("utf-8", "surrogatepass")}
    argv = languages.expand(lang["run"], name, cls, languages.heap_mb(limits["memory_mb"]))
    if exe is not None:
        argv = ["main" if a == "{exe}" else a for a in argv]
    run_limits: RunLimits = {**limits}
    if lang["reserve_mb"]:
        run_limits["address_space_mb"] = limits["memory_mb"] + lang["reserve_mb"]
    base: ProgramSpec = {
        "kind": "command",
        "source": "",
        "limits": run_limits,
        "argv": argv,
        "env": languages.environment(lang),
        "exe": exe,
    }
    if tests["kind"] == "stdio":
        result = _stdio(execute, base, files, tests["cases"], run_limits)
    elif tests["kind"] == "run":
        own = {p: base64.b64decode(c) for p, c in tests.get("files", {}).items()}
        spec: ProgramSpec = {
            **base,
            "files": {**own, **files},  # the program's own files win over the request's
            "stdin": tests.get("stdin", ""),
            "fetch": tests.get("fetch_files", []),
        }
        proc = execute(spec, limits["wall_time_s"] + 0.05, _caps(limits))
        result = output.judge_run(proc)
        result["value"] = result["value_type"] = None
        result["files"] = files_of(proc)
        result["exit_code"] = exit_code(proc)
    else:  # the server lets only stdio and run tests through
        raise ValueError(f"tests of kind {tests['kind']!r} are for Python programs")
    result["compile"] = compiled
    return result


def exit_code(proc: ProcessOutcome) -> int | None:
    """The program's exit status; minus the signal that killed it; None when the sandbox ended it."""
    if proc.killed or not proc.started:
        return None
    return -proc.signal if proc.signal is not None else proc.exit_code


def _stdio(
    execute: Execute,
    base: ProgramSpec,
    files: dict[str, bytes],
    cases: list[StdioCase],
    limits: RunLimits,
) -> RunResultData:
    def run_case(stdin: str, wall_s: float) -> ProcessOutcome:
        spec: ProgramSpec = {**base, "files": files, "stdin": stdin}
        return execute(spec, wall_s, _caps(limits))

    return output.run_cases(cases, limits, run_case)
