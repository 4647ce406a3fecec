"""Dockerfile instructions and .dockerignore matching, enough to check what an image build needs."""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class Instruction:
    keyword: str  # upper case: FROM, COPY, ENV, ...
    args: str  # the rest of the instruction, continuation lines joined
    stage: int  # index of the build stage (FROM) it belongs to
    heredocs: list[str] = field(default_factory=list)  # bodies of `<<NAME` here-documents


_HEREDOC = re.compile(r"<<-?(['\"]?)([A-Za-z_][A-Za-z0-9_]*)\1")


def parse(text: str) -> list[Instruction]:
    """Instructions of a Dockerfile: comments dropped, `\\` continuations joined, heredocs collected."""
    lines = text.splitlines()
    instructions: list[Instruction] = []
    stage = -1
    i = 0
    while i < len(lines):
        line = lines[i].strip()
        i += 1
        if not line or line.startswith("#"):
            continue
        while line.endswith("\\") and i < len(lines):
            nxt = lines[i].strip()
            i += 1
            if nxt.startswith("#"):
                continue
            line = line[:-1].rstrip() + " " + nxt
        keyword, _, args = line.partition(" ")
        keyword = keyword.upper()
        heredocs = []
        for match in _HEREDOC.finditer(args):
            body = []
            while i < len(lines) and lines[i] != match[2]:
                body.append(lines[i])
                i += 1
            i += 1  # the terminator
            heredocs.append("\n".join(body) + "\n")
        if keyword == "FROM":
            stage += 1
        instructions.append(Instruction(keyword, args.strip(), stage, heredocs))
    return instructions


def final_stage(instructions: list[Instruction]) -> list[Instruction]:
    last = max(i.stage for i in instructions)
    return [i for i in instructions if i.stage == last]


def words(args: str) -> list[str]:
    """Arguments of an instruction in exec (JSON) or shell form."""
    if args.startswith("["):
        return json.loads(args)
    return shlex.split(args)


def copy_sources(instruction: Instruction) -> list[str]:
    """Build-context paths a COPY/ADD reads (none for `--from=` copies and here-documents)."""
    parts = [w for w in words(instruction.args) if not w.startswith("--")]
    if any(w.startswith("--from") for w in words(instruction.args)) or instruction.heredocs:
        return []
    return parts[:-1]


def env(instructions: list[Instruction]) -> dict[str, str]:
    """ENV values set by `instructions` (later ones win); `$VAR` references are kept as written."""
    values: dict[str, str] = {}
    for instruction in instructions:
        if instruction.keyword != "ENV":
            continue
        parts = shlex.split(instruction.args)
        if parts and "=" not in parts[0]:  # legacy `ENV KEY value`
            values[parts[0]] = " ".join(parts[1:])
            continue
        for part in parts:
            key, _, value = part.partition("=")
            values[key] = value
    return values


class DockerIgnore:
    """`.dockerignore` rules: the last matching pattern wins; `!` re-includes; a match on a directory
    covers everything below it; `*` and `?` stay within one path segment, `**` spans any number."""

    def __init__(self, text: str) -> None:
        self.rules: list[tuple[bool, re.Pattern[str]]] = []
        for raw in text.splitlines():
            line = raw.strip()
            if not line or line.startswith("#"):
                continue
            negated = line.startswith("!")
            pattern = line[1:].strip() if negated else line
            pattern = pattern.strip("/")
            self.rules.append((negated, re.compile(_translate(pattern))))

    @classmethod
    def read(cls, path: Path) -> DockerIgnore:
        return cls(path.read_text())

    def excluded(self, path: str) -> bool:
        parts = path.strip("/").split("/")
        candidates = ["/".join(parts[: n + 1]) for n in range(len(parts))]
        result = False
        for negated, regex in self.rules:
            if any(regex.fullmatch(c) for c in candidates):
                result = not negated
        return result


def _translate(pattern: str) -> str:
    out = []
    i = 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out.append("(?:.*/)?")
            i += 3
        elif pattern.startswith("**", i):
            out.append(".*")
            i += 2
        elif pattern[i] == "*":
            out.append("[^/]*")
            i += 1
        elif pattern[i] == "?":
            out.append("[^/]")
            i += 1
        elif pattern[i] == "[":
            end = pattern.index("]", i)
            out.append(pattern[i : end + 1])
            i = end + 1
        else:
            out.append(re.escape(pattern[i]))
            i += 1
    return "".join(out)
