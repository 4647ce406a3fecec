"""Text one user gives that others see (job names, run names): printable characters only.

A name is printed by `crucible jobs`, shown in listings and W&B. A control character (NUL, ESC
starting a terminal escape sequence, a newline) or a format character (a right-to-left override
that makes `exe.txt` read as `txt.exe`, zero-width and bidi isolates) would let a name rewrite
what a reader sees, so specs refuse them (`Label`); `shown` escapes whatever older records hold.
"""

from __future__ import annotations

import unicodedata
from typing import Annotated

from pydantic import AfterValidator

# Control, format, surrogate, line and paragraph separator.
HIDDEN = frozenset({"Cc", "Cf", "Cs", "Zl", "Zp"})


def printable(value: str) -> str:
    """`value` if every character is printable; `ValueError` naming the first that is not.

    >>> printable("évaluation — 評価 ✓ (run 2)")
    'évaluation — 評価 ✓ (run 2)'
    >>> printable("evil\\u202etxt.exe")
    Traceback (most recent call last):
    ...
    ValueError: must be printable text: U+202E (RIGHT-TO-LEFT OVERRIDE) at position 4 is a control or format character
    """
    for i, char in enumerate(value):
        if unicodedata.category(char) in HIDDEN:
            name = unicodedata.name(char, "a control character")
            raise ValueError(
                f"must be printable text: U+{ord(char):04X} ({name}) at position {i} is a control or "
                "format character"
            )
    return value


def shown(value: str) -> str:
    """`value` with every hidden character written as an escape, for display.

    >>> shown("a\\x1b[31mb\\u202ec")
    'a\\\\x1b[31mb\\\\u202ec'
    """
    return "".join(char if unicodedata.category(char) not in HIDDEN else ascii(char)[1:-1] for char in value)


Label = Annotated[str, AfterValidator(printable)]
