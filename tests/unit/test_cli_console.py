"""The CLI's console: a log or a pipe gets whole lines, a terminal gets lines wrapped to it."""

from __future__ import annotations

import io

import pytest
from crucible_cli.console import WIDE, new_console

PHRASE = "the generator serves smollm2-135m-instruct on cpu with attention sdpa " * 3


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_not_a_terminal_lines_are_not_wrapped(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("COLUMNS", raising=False)
    out = io.StringIO()
    console = new_console(file=out)
    assert console.width == WIDE
    console.print(PHRASE.strip())
    assert out.getvalue() == PHRASE.strip() + "\n"


def test_a_terminal_and_columns_keep_rich_s_width(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "60")
    assert new_console(file=io.StringIO()).width == 60
    monkeypatch.delenv("COLUMNS")
    out = Terminal()
    console = new_console(file=out, force_terminal=True, width=50)
    console.print(PHRASE.strip())
    assert all(len(line) <= 50 for line in out.getvalue().splitlines())
    assert len(out.getvalue().splitlines()) > 1
