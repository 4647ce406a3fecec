"""stdin/stdout problems in TACO-verified / APPS form, from a user's JSONL file.

Each line holds `question` and `input_output` (an object, or the JSON string TACO and APPS store)
with parallel `inputs` / `outputs` lists. Without `fn_name` every pair is a stdin/stdout case (a
list of lines is joined with newlines). With `fn_name` the problem is call-based (APPS): each input
is the argument list and each output the expected return value (wrapped in a one-element list, as
APPS stores it), so the cases become `assert fn(*args) == expected` tests; a LeetCode-style
`class Solution` answer is called through `Solution().fn`. Optional fields: `task_id` (or
`problem_id`, `id`, `name`), `solutions` (list or JSON string; the first is the reference),
`starter_code`, `language` (`python` by default; `cpp`, `java`, `nodejs`, `go`, `rust`, `bash`: the
answers are written in it and the sandbox compiles and runs them), and anything else (kept as metadata: `difficulty`, `source`, `tags`, ...).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from crucible_shared.sandbox import AssertTests, StdioCase, StdioTests

from .files import read_jsonl
from .task import DatasetError, Task

DATASET = "stdio"
_ID_FIELDS = ("task_id", "problem_id", "id", "name")
_USED = {"question", "input_output", "solutions", "starter_code", "language", *_ID_FIELDS}


def load(path: str | Path, *, max_cases: int | None = None) -> list[Task]:
    """Every problem of the file, in file order, keeping at most `max_cases` test cases each."""
    file = Path(path).expanduser()
    return [parse_row(row, file, number, max_cases) for number, row in read_jsonl(file)]


def parse_row(row: dict[str, Any], file: Path, number: int, max_cases: int | None = None) -> Task:
    def fail(message: str, field: str) -> DatasetError:
        return DatasetError(message, path=str(file), line=number, field=field)

    question = row.get("question")
    if not isinstance(question, str) or not question.strip():
        raise fail("missing or not a non-empty string", "question")
    io = _json_field(row, "input_output", fail)
    if not isinstance(io, dict):
        raise fail("expected an object with `inputs` and `outputs`", "input_output")
    inputs, outputs = io.get("inputs"), io.get("outputs")
    if not isinstance(inputs, list) or not isinstance(outputs, list):
        raise fail("`inputs` and `outputs` must be lists", "input_output")
    if len(inputs) != len(outputs):
        raise fail(f"{len(inputs)} inputs but {len(outputs)} outputs", "input_output")
    if not inputs:
        raise fail("no test cases", "input_output.inputs")
    if max_cases is not None:
        inputs, outputs = inputs[:max_cases], outputs[:max_cases]

    fn_name = io.get("fn_name")
    starter = row.get("starter_code") or ""
    if fn_name:
        if not isinstance(fn_name, str) or not fn_name.isidentifier():
            raise fail(f"not a function name: {fn_name!r}", "input_output.fn_name")
        tests: AssertTests | StdioTests = _call_tests(fn_name, inputs, outputs, starter, fail)
    else:
        cases = [
            StdioCase(
                input=_text(i, fail, f"input_output.inputs.{n}"),
                output=_text(o, fail, f"input_output.outputs.{n}"),
            )
            for n, (i, o) in enumerate(zip(inputs, outputs, strict=True))
        ]
        tests = StdioTests(cases=cases)

    solutions = _json_field(row, "solutions", fail) if "solutions" in row else []
    if isinstance(solutions, str):
        solutions = [solutions]
    if not isinstance(solutions, list):
        raise fail("expected a list of programs", "solutions")
    task_id = next((row[f] for f in _ID_FIELDS if row.get(f) not in (None, "")), f"{file.stem}/{number}")
    metadata = {k: v for k, v in row.items() if k not in _USED}
    metadata["line"] = number
    if fn_name:
        metadata["fn_name"] = fn_name
    if starter:
        metadata["starter_code"] = starter
    language = row.get("language", "python")
    if not isinstance(language, str) or not language.strip():
        raise fail("not a language name", "language")
    if fn_name and language.lower() != "python":
        raise fail(
            "call-based problems (fn_name) are Python's; other languages take stdin/stdout cases", "language"
        )
    return Task(
        task_id=str(task_id),
        dataset=DATASET,
        prompt=question.strip(),
        tests=tests,
        entry_point=fn_name or None,
        reference=solutions[0] if solutions and isinstance(solutions[0], str) else None,
        metadata=metadata,
        language=language.lower(),
    )


def _json_field(row: dict[str, Any], field: str, fail: Any) -> Any:
    """A field that may hold JSON text (TACO and APPS store `input_output` and `solutions` so)."""
    if field not in row:
        raise fail("missing", field)
    value = row[field]
    if isinstance(value, str) and value.strip()[:1] in ("{", "["):
        try:
            return json.loads(value)
        except ValueError as exc:
            raise fail(f"not valid JSON: {exc}", field) from exc
    return value


def _text(value: Any, fail: Any, field: str) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return "\n".join(value) + "\n"
    raise fail(f"expected a string or a list of lines, got {type(value).__name__}", field)


def _call_tests(fn: str, inputs: list, outputs: list, starter: str, fail: Any) -> AssertTests:
    asserts = []
    for n, (args, expected) in enumerate(zip(inputs, outputs, strict=True)):
        if not isinstance(args, list):
            raise fail("a call-based input must be the list of arguments", f"input_output.inputs.{n}")
        # APPS wraps each return value in a one-element list.
        value = expected[0] if isinstance(expected, list) and len(expected) == 1 else expected
        call = ", ".join(repr(a) for a in args)
        asserts.append(f"assert {fn}({call}) == {value!r}")
    setup = ""
    if "class Solution" in starter:
        setup = f"if {fn!r} not in globals() and 'Solution' in globals():\n    {fn} = Solution().{fn}\n"
    return AssertTests(asserts=asserts, setup=setup)
