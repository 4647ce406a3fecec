"""The one task model every dataset adapter produces, and the error a malformed source raises."""

from __future__ import annotations

from typing import Any

from crucible_shared.sandbox import Limits, RunRequest, Tests
from pydantic import BaseModel, ConfigDict, Field


class DatasetError(ValueError):
    """A dataset file, line or field is wrong; the message names it (`tasks.jsonl:3: tests.asserts: ...`)."""

    def __init__(
        self, message: str, *, path: str | None = None, line: int | None = None, field: str | None = None
    ) -> None:
        where = f"{path}:{line}" if path and line else path or ""
        parts = [p for p in (where, f"field {field!r}" if field else "", message) if p]
        super().__init__(": ".join(parts))
        self.path, self.line, self.field = path, line, field


class Task(BaseModel):
    """One programming problem: what the model is shown and how its answer is tested."""

    model_config = ConfigDict(extra="forbid")

    task_id: str = Field(description="Unique within its dataset, e.g. `MBPP/11`, `HumanEval/0`.")
    dataset: str = Field(description="Adapter that produced it: `mbpp`, `humaneval`, `stdio`, `jsonl`.")
    prompt: str = Field(description="The problem as shown to the model (text, or code to continue).")
    tests: Tests = Field(description="The sandbox test suite, in any of its three forms.")
    entry_point: str | None = Field(default=None, description="Function the tests call, when there is one.")
    reference: str | None = Field(
        default=None, description="A known-good solution, when the dataset has one."
    )
    shown_test: str | None = Field(
        default=None, description="The one test shown in the prompt so the function name is known (MBPP)."
    )
    prompt_is_code: bool = Field(
        default=False,
        description="The prompt is the start of the program (HumanEval): base models continue it.",
    )
    preamble: str = Field(
        default="",
        description="Code run before the candidate (HumanEval: the prompt's imports and helper functions).",
    )
    metadata: dict[str, Any] = Field(default_factory=dict, description="Anything else the source carries.")
    language: str = Field(
        default="python",
        description="The language answers are written in and the sandbox runs (`cpp`, `java`, `nodejs`, `go`, "
        "`rust`, `bash` take stdio tests).",
    )

    def program(self, code: str) -> str:
        """The program the sandbox runs for `code`: the preamble first, unless `code` already starts with it."""
        if not self.preamble.strip() or code.lstrip().startswith(self.preamble.strip()):
            return code
        return f"{self.preamble.rstrip()}\n\n\n{code}"

    def run_request(self, code: str, limits: Limits | None = None) -> RunRequest:
        """The sandbox request that tests `code` (a candidate solution) against this task."""
        return RunRequest(
            language=self.language, code=self.program(code), tests=self.tests, limits=limits or Limits()
        )

    def reference_request(self, limits: Limits | None = None) -> RunRequest:
        """The request that tests this task's reference solution; `ValueError` when it has none."""
        if self.reference is None:
            raise ValueError(f"{self.task_id} has no reference solution")
        return self.run_request(self.reference, limits)
