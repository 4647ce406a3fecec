"""SandboxFusion's protocol (`POST /run_code`, `POST /run_jupyter`), as the sandbox serves it.

The shapes of the `sandbox-fusion` package's `models.py` (0.3.7), which verl's `sandbox_fusion`
reward and other trainers send: a program in one language, optional stdin, files in (base64) and
files out (`fetch_files`), a compile and a run timeout; the answer's `status` is `Success`,
`Failed` or `SandboxError` and `compile_result` / `run_result` say how each step ended
(`Finished`, `Error`, `TimeLimitExceeded`, with the return code, output and duration). How
Crucible's verdicts map onto them: docs/sandbox.md, "SandboxFusion's API".

Requests are checked as strictly as `/v1/runs`: an unknown field, an empty program, a file that
is not base64, a path that is absolute or has `..`, a timeout of 0 or below are 422s that name
the field (timeouts above the server's maximum too, checked by the server).
"""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from crucible_shared.sandbox import check_base64, check_no_file_holds_another, check_relative_path


class FusionRunStatus(StrEnum):
    Success = "Success"  # every step finished with return code 0
    Failed = "Failed"  # a step failed: did not compile, non-zero return code, a limit
    SandboxError = "SandboxError"  # the sandbox's own fault (the client retries, then raises)


class CommandRunStatus(StrEnum):
    Finished = "Finished"  # ran to its end (whatever its return code)
    Error = "Error"  # ended by a limit other than time (memory, output), or could not start
    TimeLimitExceeded = "TimeLimitExceeded"


class CommandRunResult(BaseModel):
    status: CommandRunStatus
    execution_time: float | None = Field(default=None, description="Seconds.")
    return_code: int | None = Field(default=None, description="None when the sandbox ended the step.")
    stdout: str | None = None
    stderr: str | None = None


def _check_files(files: dict[str, str | None]) -> dict[str, str | None]:
    for path, content in files.items():
        check_relative_path(path)
        if content is not None:
            check_base64(content, path)
    check_no_file_holds_another(list(files))
    return files


def _check_fetch(paths: list[str]) -> list[str]:
    for path in paths:
        check_relative_path(path)
    return paths


# The two file fields of both requests, checked the same way.
Files = Annotated[dict[str, str | None], AfterValidator(_check_files)]
FetchFiles = Annotated[list[str], AfterValidator(_check_fetch)]


class RunCodeRequest(BaseModel):
    """`POST /run_code`: one program, run once (compiled first where its language is compiled)."""

    model_config = ConfigDict(extra="forbid")

    code: str = Field(min_length=1, description="The program.")
    language: str = Field(
        description="`python`, `cpp`, `java`, `nodejs`, `go`, `rust`, `bash` (see /health)."
    )
    stdin: str | None = Field(default=None, description="What the program reads from stdin.")
    compile_timeout: float = Field(default=10, gt=0, description="Seconds for the compile step.")
    run_timeout: float = Field(default=10, gt=0, description="Seconds for the run.")
    memory_limit_MB: int = Field(default=-1, description="MiB for the run; -1: the server's default.")
    files: Files = Field(
        default_factory=dict, description="Relative path -> base64 content, written before the run."
    )
    fetch_files: FetchFiles = Field(
        default_factory=list, description="Relative paths read back after the run."
    )


class RunCodeResponse(BaseModel):
    status: FusionRunStatus
    message: str = ""
    compile_result: CommandRunResult | None = None
    run_result: CommandRunResult | None = None
    executor_pod_name: str | None = None
    files: dict[str, str] = Field(default_factory=dict, description="`fetch_files` that existed, base64.")


class RunJupyterRequest(BaseModel):
    """`POST /run_jupyter`: Python cells run in order in one process, its state kept between them."""

    model_config = ConfigDict(extra="forbid")

    cells: list[str] = Field(min_length=1, description="Code blocks, run in order.")
    cell_timeout: float = Field(default=0, ge=0, description="Seconds per cell; 0: only the total applies.")
    total_timeout: float = Field(default=45, gt=0, description="Seconds for all the cells.")
    kernel: Literal["python3"] = "python3"
    files: Files = Field(default_factory=dict)
    fetch_files: FetchFiles = Field(default_factory=list)


class CellRunResult(BaseModel):
    stdout: str = ""
    stderr: str = ""
    display: list[dict[str, Any]] = Field(
        default_factory=list, description='The value of a cell ending in an expression: {"text/plain": repr}.'
    )
    error: list[dict[str, Any]] = Field(
        default_factory=list, description="An exception: ename, evalue, traceback (a list of lines)."
    )


class RunJupyterResponse(BaseModel):
    status: FusionRunStatus
    message: str = ""
    driver: CommandRunResult | None = None
    cells: list[CellRunResult] = Field(default_factory=list)
    executor_pod_name: str | None = None
    files: dict[str, str] = Field(default_factory=dict)
