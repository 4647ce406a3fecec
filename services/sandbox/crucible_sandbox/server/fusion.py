"""SandboxFusion's routes (`POST /run_code`, `POST /run_jupyter`) over the sandbox's own runs.

Thin, like `routes` (`router`, included by `api.create_app`): a request becomes a `RunRequest` without tests (`"kind": "run"`) and goes the
way every run goes (`SandboxService.run_one`: the same tenant, validation, admission, per-key
concurrency and worker slots); the `RunResult` is then worded as SandboxFusion words it
(`crucible_shared.fusion`; the mapping is in docs/sandbox.md). Runs here skip the result cache:
a caller of `run_code` asks for an execution, and a program may read the clock or a random source.
"""

from __future__ import annotations

from crucible_shared.fusion import (
    CellRunResult,
    CommandRunResult,
    CommandRunStatus,
    FusionRunStatus,
    RunCodeRequest,
    RunCodeResponse,
    RunJupyterRequest,
    RunJupyterResponse,
)
from crucible_shared.http import ERROR_RESPONSES, ApiError
from crucible_shared.sandbox import (
    CellResult,
    CompileResult,
    Limits,
    RunOnly,
    RunRequest,
    RunResult,
    RunStatus,
)
from fastapi import APIRouter

from crucible_sandbox.server.routes import Caller, Service
from crucible_sandbox.server.service import SandboxService


def _check_most(checks: tuple[tuple[str, float, float], ...]) -> None:
    for field, value, most in checks:
        if value > most:
            raise ApiError(422, f"{field} is {value:g} s; this server allows at most {most:g} s", field=field)


def _check_timeouts(service: SandboxService, body: RunCodeRequest) -> None:
    s = service.settings
    _check_most(
        (
            ("compile_timeout", body.compile_timeout, s.max_compile_time_s),
            ("run_timeout", body.run_timeout, s.max_wall_time_s),
        )
    )
    memory = body.memory_limit_MB
    if memory != -1 and not 16 <= memory <= s.max_memory_mb:
        raise ApiError(
            422,
            f"memory_limit_MB must be -1 (the default) or 16 to {s.max_memory_mb}",
            field="memory_limit_MB",
        )


def as_run_request(body: RunCodeRequest) -> RunRequest:
    return RunRequest(
        language=body.language,
        code=body.code,
        tests=RunOnly(
            stdin=body.stdin or "",
            files={path: content or "" for path, content in body.files.items()},
            fetch_files=body.fetch_files,
        ),
        limits=Limits(
            wall_time_s=body.run_timeout,
            test_time_s=body.run_timeout,
            cpu_time_s=body.run_timeout,
            memory_mb=body.memory_limit_MB if body.memory_limit_MB > 0 else None,
            compile_time_s=body.compile_timeout,
        ),
        use_cache=False,
    )


# A step the sandbox ended for its memory or output: killed, as SandboxFusion's own runs see an
# OOM kill (the client's `summary_run_code_result` needs a return code for every finished step).
_KILLED = -9


def _compile_result(step: CompileResult) -> CommandRunResult:
    if step.status == "timeout":
        return CommandRunResult(
            status=CommandRunStatus.TimeLimitExceeded,
            execution_time=step.duration_ms / 1000,
            stdout=step.stdout,
            stderr=step.stderr,
        )
    killed = step.status in ("memory_exceeded", "output_exceeded")
    return CommandRunResult(
        status=CommandRunStatus.Finished,
        execution_time=step.duration_ms / 1000,
        return_code=_KILLED if killed else step.exit_code,
        stdout=step.stdout,
        stderr=step.stderr + (f"{step.status.replace('_', ' ')}\n" if killed else ""),
    )


def _run_result(result: RunResult) -> CommandRunResult:
    stderr = result.stderr
    if result.traceback and result.compile is None:  # a Python exception: where the interpreter prints it
        stderr = f"{stderr}{'' if not stderr or stderr.endswith(chr(10)) else chr(10)}{result.traceback}"
    if result.status == RunStatus.timeout:
        status, code = CommandRunStatus.TimeLimitExceeded, None
    elif result.status in (RunStatus.memory_exceeded, RunStatus.output_exceeded):
        status, code = CommandRunStatus.Finished, _KILLED
        if result.message not in stderr:
            stderr = f"{stderr}{result.message}\n"
    else:
        status = CommandRunStatus.Finished
        code = (
            result.exit_code
            if result.exit_code is not None
            else (0 if result.status == RunStatus.passed else 1)
        )
    return CommandRunResult(
        status=status,
        execution_time=result.duration_ms / 1000,
        return_code=code,
        stdout=result.stdout,
        stderr=stderr,
    )


def as_fusion(result: RunResult) -> RunCodeResponse:
    """A run's result in SandboxFusion's words (docs/sandbox.md has the table)."""
    if result.status == RunStatus.sandbox_error:
        return RunCodeResponse(status=FusionRunStatus.SandboxError, message=result.message)
    compiled = _compile_result(result.compile) if result.compile is not None else None
    if result.compile is not None and result.compile.status != "ok":
        return RunCodeResponse(status=FusionRunStatus.Failed, message=result.message, compile_result=compiled)
    run = _run_result(result)
    ok = run.status == CommandRunStatus.Finished and run.return_code == 0
    return RunCodeResponse(
        status=FusionRunStatus.Success if ok else FusionRunStatus.Failed,
        message="" if ok else result.message,
        compile_result=compiled,
        run_result=run,
        files=result.files,
    )


def as_jupyter_request(body: RunJupyterRequest) -> RunRequest:
    return RunRequest(
        language="python",
        code="",
        tests=RunOnly(
            cells=body.cells,
            files={path: content or "" for path, content in body.files.items()},
            fetch_files=body.fetch_files,
        ),
        limits=Limits(
            wall_time_s=body.total_timeout,
            test_time_s=body.cell_timeout or body.total_timeout,
            cpu_time_s=body.total_timeout,
        ),
        use_cache=False,
    )


def _cell(cell: CellResult) -> CellRunResult:
    out = CellRunResult(stdout=cell.stdout, stderr=cell.stderr)
    if cell.value is not None:
        out.display = [{"text/plain": cell.value}]
    if cell.status == "timeout":
        out.error = [{"ename": "TimeoutError", "evalue": "the cell ran out of time", "traceback": []}]
    elif cell.status == "error":
        name = cell.exception_type or "Error"
        value = cell.message.removeprefix(name).removeprefix(": ")
        out.error = [{"ename": name, "evalue": value, "traceback": (cell.traceback or "").splitlines()}]
    return out


def as_jupyter(result: RunResult) -> RunJupyterResponse:
    """A session's result in SandboxFusion's words: `Success` when the session ran to its end (a cell
    that raised says so in its `error`), `Failed` when a limit of the whole session ended it."""
    if result.status == RunStatus.sandbox_error:
        return RunJupyterResponse(status=FusionRunStatus.SandboxError, message=result.message)
    driver = _run_result(result)
    ended = result.status in (
        RunStatus.timeout,
        RunStatus.memory_exceeded,
        RunStatus.output_exceeded,
        RunStatus.error,  # the session's process itself died (a cell called os._exit, killed it)
    )
    return RunJupyterResponse(
        status=FusionRunStatus.Failed if ended else FusionRunStatus.Success,
        message=result.message if ended else "",
        driver=driver,
        cells=[_cell(c) for c in result.cells if c.status != "not_run"],
        files=result.files,
    )


router = APIRouter()


@router.post(
    "/run_code",
    response_model=RunCodeResponse,
    responses=ERROR_RESPONSES,
    summary="SandboxFusion's run_code: run one program (compiled first where needed)",
    tags=["SandboxFusion"],
)
async def run_code(body: RunCodeRequest, tenant: Caller, service: Service) -> RunCodeResponse:
    _check_timeouts(service, body)
    return as_fusion(await service.run_one(as_run_request(body), tenant))


@router.post(
    "/run_jupyter",
    response_model=RunJupyterResponse,
    responses=ERROR_RESPONSES,
    summary="SandboxFusion's run_jupyter: Python cells in order in one isolated process, state kept",
    tags=["SandboxFusion"],
)
async def run_jupyter(body: RunJupyterRequest, tenant: Caller, service: Service) -> RunJupyterResponse:
    s = service.settings
    _check_most(
        (
            ("total_timeout", body.total_timeout, s.max_wall_time_s),
            ("cell_timeout", body.cell_timeout, s.max_wall_time_s),
        )
    )
    return as_jupyter(await service.run_one(as_jupyter_request(body), tenant))
