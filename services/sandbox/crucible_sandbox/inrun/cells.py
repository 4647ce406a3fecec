"""A notebook session in the program's process: cells run in order in one namespace.

The worker compiled each cell (its body, and its final expression when it ends in one) or says why
it does not compile; this process runs them one after the other, each under its own timer
(`test_time_s`; a cell that runs out is interrupted and the next one runs; the session's wall time
ends the run), with `sys.stdout` and `sys.stderr` captured per cell. It writes a `cells` frame
before the first cell and reports each as a `cell` frame: output, the repr of the final
expression's value (None is not shown, as in Jupyter), the exception. State (variables, imports)
carries from cell to cell, as in a kernel; the whole session has the run's wall time, and its
process ends with the run. Nothing here decides a verdict: the cells' code shares this process, and
can write the frames of the cells after it, or turn off its own timer. That timer is only the
clean way out for cooperative code: the worker keeps each cell's time from outside as well
(`judging.cell_clock`), from these frames as they arrive, and ends the whole run when the cell in
progress has not reported in its time (plus a grace); that cell is then timed out and the cells
after it are not run.
"""

from __future__ import annotations

import io
import sys
import time
from types import CodeType
from typing import Any

from crucible_sandbox.inrun import runtime
from crucible_sandbox.inrun.runtime import TestTimeout, exception_info
from crucible_sandbox.wire.channel import write_frame
from crucible_sandbox.wire.values import short_repr

VALUE_CHARS = 10_000

Cell = tuple[
    CodeType | None, CodeType | None, str | None, str
]  # body, final expression, syntax error, source


def cell_name(index: int) -> str:
    return f"<cell {index}>"


def run_cells(
    cells: list[Cell], namespace: dict[str, Any], report_fd: int, cell_time: float, deadline: float, cap: int
) -> None:
    """Run the cells; `deadline` (monotonic): the session's end, where the zygote ends the process."""
    for i, (_, _, _, source) in enumerate(cells):
        runtime.SOURCES[cell_name(i)] = source
    write_frame(report_fd, {"t": "cells"})  # the worker's clock for the first cell starts here
    for i, (body, last, syntax, _) in enumerate(cells):
        frame: dict[str, Any] = {"t": "cell", "i": i}
        out, err = io.StringIO(), io.StringIO()
        saved = sys.stdout, sys.stderr
        started = time.perf_counter()
        try:
            sys.stdout, sys.stderr = out, err
            try:
                if syntax is not None:
                    frame["error"] = {
                        "exc": "SyntaxError",
                        "msg": syntax.strip().splitlines()[-1],
                        "tb": syntax,
                    }
                else:
                    # A cell's own limit only where it ends before the session's: past that, the
                    # zygote's backstop ends the whole run (a timeout, the cells after it not run).
                    if cell_time < deadline - runtime.now():
                        runtime.arm(cell_time)
                    if body is not None:
                        exec(body, namespace)
                    if last is not None:
                        value = eval(last, namespace)
                        if value is not None:
                            frame["value"] = short_repr(value, VALUE_CHARS)
            finally:
                runtime.disarm()
        except TestTimeout:  # also one that fired late, while the cell was being wrapped up
            frame["timeout"] = True
        except BaseException as exc:  # SystemExit too: a notebook shows it as the cell's error
            frame["error"] = exception_info(exc)
        finally:
            sys.stdout, sys.stderr = saved
        frame["out"] = out.getvalue()[:cap]
        frame["err"] = err.getvalue()[:cap]
        frame["ms"] = (time.perf_counter() - started) * 1000
        write_frame(report_fd, frame)
