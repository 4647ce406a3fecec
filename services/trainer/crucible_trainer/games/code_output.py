"""The code-output game (config: `crucible_shared.jobs.CodeOutputGame`).

The writer writes a short program (optionally with an input), the sandbox runs it without tests
(`"kind": "run"`), and the predictor, shown the program, says exactly what it prints. Outputs are
compared after whitespace normalisation. Zero-sum: predictor right -> predictor +1, writer -1;
wrong (or no answer) -> predictor -1, writer +1.

A writer program is valid only if the graded execution reward calls it "ran and printed" (+1):
a missing or too long program (illegal), one that fails to compile, raises, exits non-zero,
times out, exceeds a limit, prints nothing, prints more than `max_output_chars` or prints
something else on each of its `determinism_runs` runs scores the writer -1, and the predictor
does not play (its role does not count). What the program prints is read from the sandbox's
capture of its stdout, so nothing a program does can make the game see an output it did not
print. That it ran to its end is read from a secret marker appended as the run's final expression
(`value: last_expression`): a program that exits early (`exit()` included) or forges a "done"
status frame on the sandbox's report channel (which the run form otherwise believes) carries no
marker and is invalid. A sandbox fault makes the game void: no role counts.
"""

from __future__ import annotations

import random
import re
import secrets
from typing import Any

from crucible_shared.sandbox import Limits, RunOnly, RunRequest, RunResult, RunStatus

from crucible_trainer.games.base import Ask, Execute, Game, Move
from crucible_trainer.rl.rewards import graded
from crucible_trainer.tasks.extract import extract_code

# Each writer gets one theme (from the game's seeded RNG): varied prompts, varied programs.
THEMES = (
    "arithmetic with integers",
    "string methods",
    "lists and slicing",
    "a for loop",
    "a while loop",
    "dictionaries",
    "a recursive function",
    "sorting",
    "integer division and modulo",
    "string formatting",
    "list comprehensions",
    "sets",
    "nested loops",
    "a small class",
    "tuples and unpacking",
    "boolean logic",
)
_OUTPUT_TAG = re.compile(r"<output>(.*?)(?:</output>|\Z)", re.S)
_FENCED = re.compile(r"```[^\n`]*\n(.*?)(?:```|\Z)", re.S)
_STDIN_BLOCK = re.compile(r"```(?:stdin|input|text)\s*\n(.*?)(?:```|\Z)", re.S)
_LABEL = re.compile(r"^\s*(?:the\s+)?(?:exact\s+)?output(?:\s+is)?\s*:?\s*", re.I)


def normalise(text: str) -> str:
    """Whitespace-insensitive form of an output: runs of whitespace (newlines included) become one space.

    >>> normalise("  1\\n2   3 \\n\\n"), normalise("1 2 3") == normalise("1\\n2\\n3")
    ('1 2 3', True)
    """
    return " ".join(text.split())


def parse_prediction(text: str) -> str:
    """The predicted output in an answer: inside `<output>` tags, else the first fenced block, else
    the whole answer without an "Output:" label ("" when there is nothing).

    >>> parse_prediction("It prints <output>6\\n</output> because 1+2+3 = 6")
    '6\\n'
    >>> parse_prediction("Sure!\\n```\\nhello\\nworld\\n```"), parse_prediction("Output: 42")
    ('hello\\nworld\\n', '42')
    """
    tagged = _OUTPUT_TAG.search(text)
    if tagged:
        return tagged.group(1)
    fenced = _FENCED.search(text)
    if fenced:
        return fenced.group(1)
    return _LABEL.sub("", text.strip(), count=1)


def parse_stdin(text: str) -> str:
    """The input a writer gives its program: a ```stdin (or ```input) block; "" when none.

    >>> parse_stdin("```python\\nprint(input()[::-1])\\n```\\n```stdin\\nabc\\n```")
    'abc\\n'
    """
    found = _STDIN_BLOCK.search(text)
    return found.group(1) if found else ""


def writer_prompt(cfg: Any, theme: str) -> str:
    stdin = (
        " Optionally, give the program an input after it, in a ```stdin block; the other player sees it too."
        if cfg.stdin
        else " The program gets no input."
    )
    return (
        "You are the writer in a code-output game. Write a short Python program (at most "
        f"{cfg.max_program_chars} characters) that prints something. The other player reads your program and "
        "tries to predict exactly what it prints: you win if they get it wrong. The program must run quickly, "
        f"print at most {cfg.max_output_chars} characters and print the same thing every time it runs (no "
        f"randomness, no clock).{stdin}\n\nTheme: {theme}.\n\nReply with the program in a ```python block."
    )


def predictor_prompt(program: str, stdin: str) -> str:
    given = f"\n\nIts input (stdin):\n```\n{stdin}\n```" if stdin else ""
    return (
        "You are the predictor in a code-output game. Read this Python program and predict exactly what it "
        f"prints.\n\n```python\n{program}\n```{given}\n\n"
        "Reply with the exact output inside <output></output> tags."
    )


class CodeOutput(Game):
    roles = ("writer", "predictor")

    def __init__(self, cfg: Any, rng: random.Random, limits: Limits) -> None:
        super().__init__(cfg, rng, limits)
        self.theme = rng.choice(THEMES)
        self.state = "write"  # write -> run -> predict -> over
        self.program = self.stdin = self.output = self.prediction = ""
        self.invalid: str | None = None  # why the writer's program does not count
        self.void = False  # the sandbox failed: nothing counts
        self.correct: bool | None = None
        self.result: RunResult | None = None
        # A secret end marker per run: the run's final expression, so the sandbox reports it only
        # when the program really ran to its end (a status frame the program forges carries none).
        self.markers = [f"end-{secrets.token_hex(8)}" for _ in range(cfg.determinism_runs)]

    def next(self) -> Ask | Execute | None:
        if self.state == "write":
            return Ask("writer", [{"role": "user", "content": writer_prompt(self.cfg, self.theme)}])
        if self.state == "run":
            # Output bytes well above the game's cap: a longer output is the writer's loss by the
            # game's rule, a flood is the sandbox's `output_exceeded`.
            limits = self.limits.model_copy(update={"output_bytes": max(4096, 8 * self.cfg.max_output_chars)})
            tests = RunOnly(stdin=self.stdin, value="last_expression")
            return Execute(
                [
                    RunRequest(
                        code=f"{self.program}\n{marker!r}\n", tests=tests, limits=limits, use_cache=False
                    )
                    for marker in self.markers
                ]
            )
        if self.state == "predict":
            return Ask("predictor", [{"role": "user", "content": predictor_prompt(self.program, self.stdin)}])
        return None

    def answer(self, role: str, text: str) -> Move:
        if role == "writer" and self.state == "write":
            return self._write(text)
        assert role == "predictor" and self.state == "predict", (role, self.state)
        self.state = "over"
        self.prediction = parse_prediction(text)
        if not self.prediction.strip():
            self.correct = False
            return Move(False, "no prediction")
        self.correct = normalise(self.prediction) == normalise(self.output)
        return Move(True, "right" if self.correct else "wrong")

    def _write(self, text: str) -> Move:
        self.program = extract_code(text)
        self.stdin = parse_stdin(text) if self.cfg.stdin else ""
        if not self.program.strip():
            return self._lose("no program", legal=False)
        if len(self.program) > self.cfg.max_program_chars:
            return self._lose(
                f"program of {len(self.program)} chars (max {self.cfg.max_program_chars})", legal=False
            )
        self.state = "run"
        return Move(True, f"program of {len(self.program)} chars")

    def _lose(self, why: str, *, legal: bool = True) -> Move:
        self.invalid, self.state = why, "over"
        return Move(legal, why)

    def executed(self, results: list[RunResult]) -> None:
        assert self.state == "run" and len(results) == self.cfg.determinism_runs
        self.result = results[0]
        if any(r.status == RunStatus.sandbox_error for r in results):
            self.void, self.state = True, "over"
            return
        self.output = self.result.stdout
        if graded(self.result) != 1.0:
            what = (
                "ran without output" if self.result.status == RunStatus.passed else self.result.status.value
            )
            self._lose(f"invalid program: {what}")
        elif any(r.value != repr(m) for r, m in zip(results, self.markers, strict=True)):
            self._lose("invalid program: it did not run to its end (it exited early or forged its status)")
        elif self.result.output_truncated or len(self.output) > self.cfg.max_output_chars:
            self._lose(f"invalid program: printed {len(self.output)} chars (max {self.cfg.max_output_chars})")
        elif any((r.status, r.stdout) != (self.result.status, self.output) for r in results[1:]):
            self._lose("invalid program: its output differs between runs")
        else:
            self.state = "predict"

    def returns(self) -> dict[str, float]:
        if self.void:
            return {}
        if self.invalid is not None:
            return {"writer": -1.0}
        return {"predictor": 1.0, "writer": -1.0} if self.correct else {"predictor": -1.0, "writer": 1.0}

    def stats(self) -> dict[str, float]:
        out = {"program_chars": float(len(self.program))}
        if self.void:
            return out
        out["writer_invalid_rate"] = float(self.invalid is not None)
        if self.correct is not None:
            out["predictor_accuracy"] = float(self.correct)
            out["answer_chars"] = float(len(self.prediction))
            out["output_chars"] = float(len(self.output))
        return out

    def record(self) -> dict[str, Any]:
        return {
            "theme": self.theme,
            "program": self.program,
            "stdin": self.stdin,
            "output": self.output,
            "prediction": self.prediction,
            "invalid": self.invalid,
            "void": self.void,
        }
