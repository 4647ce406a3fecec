"""What the worker compiles before a run, so that a run's processes parse nothing themselves.

* the candidate (`compile_candidate`): a program that does not compile is answered without a
  process; one that ends in an expression whose value a run without tests reports is split
  before it (`split_last_expression`);
* the tests (`compile_tests`, cached by `PlanCache`: an RL batch runs many samples of one
  problem): the plan, which the worker keeps to judge the run by, and what the run's processes
  receive of the tests: for a call plan each test's function name and compiled literal arguments
  (for the program's process); otherwise the compiled tests, for the judge's process only.

Compiling runs no code of the request. Everything is compiled as plain Python would compile it
(`dont_inherit`: none of this module's `__future__` imports apply).
"""

from __future__ import annotations

import ast
import json
import marshal
import traceback
from collections import OrderedDict
from types import CodeType
from typing import Any, Literal, TypedDict, cast

from crucible_sandbox.inrun import runtime
from crucible_sandbox.inrun.runtime import CANDIDATE
from crucible_sandbox.judging.plan import (
    Plan,
    plan_asserts,
    plan_calls,
    plan_check,
    plan_check_calls,
    read_names,
)
from crucible_sandbox.wire.messages import AssertTests, CheckTests, JudgedTests

# What the program's process receives of a call plan: each test's function name and arguments.
Calls = list[tuple[str, CodeType | None]]


class SyntaxFrame(TypedDict):
    """Why the candidate does not compile (the worker's own frame, see `verdict.syntax_error`)."""

    t: Literal["syntax"]
    exc: str
    msg: str
    tb: str


def compile_candidate(source: str) -> tuple[CodeType | None, SyntaxFrame | None]:
    """(code, None), or (None, the `syntax` frame) when the program does not compile.

    The run's process then only loads the code object.
    """
    try:
        return compile(source, CANDIDATE, "exec", dont_inherit=True), None
    except (SyntaxError, ValueError) as exc:  # ValueError: source contains null bytes
        frame: SyntaxFrame = {
            "t": "syntax",
            "exc": type(exc).__name__ if isinstance(exc, SyntaxError) else "SyntaxError",
            "msg": runtime.exception_message(exc),
            "tb": "".join(traceback.format_exception_only(type(exc), exc)),
        }
        return None, frame


def split_last_expression(source: str, code: CodeType) -> tuple[CodeType, CodeType | None]:
    """(the program without its final expression statement, that expression) when it ends in one."""
    tree = ast.parse(source)
    tail = tree.body[-1] if tree.body else None
    if not isinstance(tail, ast.Expr):
        return code, None
    tree.body.pop()
    last = ast.Expression(tail.value)
    return (
        compile(tree, CANDIDATE, "exec", dont_inherit=True),
        compile(last, CANDIDATE, "eval", dont_inherit=True),
    )


def compile_cells(cells: list[str]) -> list[tuple[CodeType | None, CodeType | None, str | None, str]]:
    """Each notebook cell as (body, final expression, None, source), or (None, None, why it does
    not compile, source): a cell that does not compile is that cell's error, the others still run."""
    out: list[tuple[CodeType | None, CodeType | None, str | None, str]] = []
    for i, source in enumerate(cells):
        name = f"<cell {i}>"  # as `inrun.cells.cell_name` says
        try:
            tree = ast.parse(source, name)
        except (SyntaxError, ValueError) as exc:
            out.append((None, None, "".join(traceback.format_exception_only(type(exc), exc)), source))
            continue
        last = None
        tail = tree.body[-1] if tree.body else None
        if isinstance(tail, ast.Expr):
            tree.body.pop()
            last = compile(ast.Expression(tail.value), name, "eval", dont_inherit=True)
        out.append((compile(tree, name, "exec", dont_inherit=True), last, None, source))
    return out


def compile_tests(tests: AssertTests | CheckTests) -> tuple[Plan, Calls | bytes]:
    """The trusted plan (kept here, for judging) and what the run receives of the tests.

    For a call plan: each test's (name, compiled arguments), for the program's process. Otherwise
    the marshalled `JudgedTests`, for the judge; the program's process receives nothing of them.
    """
    if tests["kind"] == "asserts":
        setup = tests.get("setup", "")
        plan = plan_calls(tests["asserts"], setup) or plan_asserts(tests["asserts"])
        filename, sources, entry_point = "<tests>", {"<setup>": setup}, None
    else:
        setup = ""
        plan = plan_check_calls(tests["check"], tests["entry_point"]) or plan_check(tests["check"])
        filename, sources, entry_point = "<check>", {"<check>": tests["check"]}, tests["entry_point"]
    if plan.calls is not None:
        return plan, [(c.name, c.arguments) for c in plan.calls]
    assert plan.module is not None
    judged: JudgedTests = {
        "setup": compile(setup, "<setup>", "exec", dont_inherit=True),
        "module": compile(plan.module, filename, "exec", dont_inherit=True),
        "entry": plan.entry,
        "entry_point": entry_point,
        "ops": [site.op for site in plan.sites],
        "sources": sources,
        # Whose builtin-named functions a test means: see `inrun.judge.ProgramNamespace`.
        "names": plan.names,
        "setup_names": read_names(ast.parse(setup)) if plan.names is not None else None,
    }
    return plan, marshal.dumps(cast(dict[str, Any], judged))


class PlanCache:
    """LRU of compiled tests keyed by their JSON: RL batches run many samples of one problem."""

    def __init__(self, entries: int = 256) -> None:
        self.entries = entries
        self.data: OrderedDict[str, tuple[Plan, Calls | bytes]] = OrderedDict()

    def get(self, tests: AssertTests | CheckTests) -> tuple[Plan, Calls | bytes]:
        key = json.dumps(tests, sort_keys=True)
        hit = self.data.get(key)
        if hit is not None:
            self.data.move_to_end(key)
            return hit
        value = compile_tests(tests)
        self.data[key] = value
        if len(self.data) > self.entries:
            self.data.popitem(last=False)
        return value
