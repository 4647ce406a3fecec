"""The command lines' console (the CLI's, the sandbox demo's): a log or a pipe gets whole lines,
a terminal gets lines wrapped to it."""

from __future__ import annotations

import io
import sys
from typing import Any

import httpx
import pytest
from crucible_sandbox import demo
from crucible_shared.console import WIDE, new_console

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


def test_the_sandbox_demo_piped_prints_whole_lines(monkeypatch, capsys) -> None:
    """`make sandbox-demo` in a log: every row's message, the title and the tally on one line each
    (at rich's default 80 columns the message column folds mid-phrase)."""
    monkeypatch.delenv("COLUMNS", raising=False)
    message = (
        "AssertionError: assert remove_Occ('hello','l') == 'heo' failed: got 'oeh' (the value is reversed)"
    )
    health = {"status": "ok", "isolation": {"mode": "process"}}

    def get(url: str, **_: Any) -> httpx.Response:
        return httpx.Response(200, json=health)

    def post(url: str, json: dict, **_: Any) -> httpx.Response:
        results = [{"status": "failed", "passed": 2, "total": 3, "message": message} for _ in json["runs"]]
        return httpx.Response(200, json={"results": results})

    monkeypatch.setattr(httpx, "get", get)
    monkeypatch.setattr(httpx, "post", post)
    monkeypatch.setattr(sys, "argv", ["crucible_sandbox.demo", "--tasks", "2", "--url", "http://sandbox"])
    demo.main()  # stdout is pytest's capture: not a terminal, as in a pipe
    lines = capsys.readouterr().out.splitlines()
    assert sum(message in line for line in lines) == 4, "\n".join(lines)
    assert any("MBPP through the Crucible sandbox (process isolation)" in line for line in lines)
    assert lines[-1].startswith("4 runs in ") and lines[-1].endswith(" ms through POST /v1/runs/batch")
