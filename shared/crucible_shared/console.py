"""The one way Crucible's command lines (the CLI, `python -m crucible_sandbox.demo`) make a rich
`Console`: wrapped to the terminal on a terminal, never wrapped mid-phrase elsewhere.

Piped to a file, a CI log or another program, rich assumes 80 columns and breaks long lines
between words ("attention" / "sdpa" on two lines). There, lines are printed whole (soft wrap) and
tables laid out on `WIDE` columns, unless `COLUMNS` says otherwise.

rich is imported when a console is made: the packages that print install it, and `shared`
itself stays installable without it.
"""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rich.console import Console

WIDE = 160


def new_console(**kwargs: Any) -> Console:
    """A `Console` for stdout (or `file=`) that does not wrap lines when it is not a terminal."""
    from rich.console import Console

    stream = kwargs.get("file") or (sys.stderr if kwargs.get("stderr") else sys.stdout)
    if _is_terminal(stream) or "COLUMNS" in os.environ or "width" in kwargs:
        return Console(**kwargs)
    return Console(width=WIDE, soft_wrap=True, **kwargs)


def _is_terminal(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # closed, or not a real file
        return False
