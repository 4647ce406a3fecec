"""Tic-tac-toe, SPIRAL's first game (config: `crucible_shared.jobs.TicTacToeGame`).

The board is shown as text with the numbers of the empty cells; a player answers with a cell
number in square brackets (`[5]`; a lone number 1-9 in the answer is accepted too). A missing
move or a taken cell is illegal and loses the game: the offender -1, the other +1. Three in a
row wins (+1 / -1); a full board is a draw (0 / 0). Every outcome sums to zero.
"""

from __future__ import annotations

import random
import re
from typing import Any

from crucible_trainer.games.base import Ask, Game, Move

LINES = [(0, 1, 2), (3, 4, 5), (6, 7, 8), (0, 3, 6), (1, 4, 7), (2, 5, 8), (0, 4, 8), (2, 4, 6)]
_BRACKETED = re.compile(r"\[\s*([1-9])\s*\]")
_LONE = re.compile(r"(?<![\w.\[])([1-9])(?![\w\]])")

RULES = (
    "You are playing tic-tac-toe as {mark} against {other}. Players take turns marking one empty cell; "
    "the first to get three marks in a row (across, down or diagonally) wins. An invalid move loses the game."
)


def parse_move(text: str) -> int | None:
    """The cell (0-8) an answer names: its first `[N]`, else its first lone digit 1-9; None if none.

    >>> parse_move("I take the centre: [5]"), parse_move("5"), parse_move("[ 9 ] then [1]")
    (4, 4, 8)
    >>> parse_move("Cell 3 looks good."), parse_move("no idea"), parse_move("[0] or 12")
    (2, None, None)
    """
    found = _BRACKETED.search(text) or _LONE.search(text)
    return int(found.group(1)) - 1 if found else None


def winner(board: list[str]) -> str | None:
    """The mark with three in a row, if any.

    >>> winner(["x", "x", "x", "", "o", "o", "", "", ""]), winner([""] * 9)
    ('x', None)
    """
    for a, b, c in LINES:
        if board[a] and board[a] == board[b] == board[c]:
            return board[a]
    return None


def render(board: list[str]) -> str:
    """The board as text, empty cells by number.

    >>> print(render(["x", "", "", "", "o", "", "", "", ""]))
     X | 2 | 3
    ---+---+---
     4 | O | 6
    ---+---+---
     7 | 8 | 9
    """
    cells = [mark.upper() or str(i + 1) for i, mark in enumerate(board)]
    rows = [" " + " | ".join(cells[r * 3 : r * 3 + 3]) for r in range(3)]
    return "\n---+---+---\n".join(rows)


class TicTacToe(Game):
    roles = ("x", "o")

    def __init__(self, cfg: Any, rng: random.Random, limits: Any) -> None:
        super().__init__(cfg, rng, limits)
        self.board = [""] * 9
        self.moves: list[tuple[str, int]] = []
        self.forfeit: str | None = None  # the role that made an illegal move
        self.won: str | None = None

    @property
    def over(self) -> bool:
        return self.forfeit is not None or self.won is not None or all(self.board)

    @property
    def to_move(self) -> str:
        return self.roles[len(self.moves) % 2]

    def next(self) -> Ask | None:
        if self.over:
            return None
        role = self.to_move
        return Ask(role, [{"role": "user", "content": self.prompt(role)}])

    def prompt(self, role: str) -> str:
        mark, other = role.upper(), ("o" if role == "x" else "x").upper()
        history = ", ".join(f"{r.upper()} {cell + 1}" for r, cell in self.moves) or "none yet"
        return (
            f"{RULES.format(mark=mark, other=other)}\n\n"
            f"Current board (numbers are empty cells):\n{render(self.board)}\n\n"
            f"Moves so far: {history}.\n"
            f"Your move as {mark}: reply with the number of an empty cell in square brackets, for example "
            f"[{self.empty()[0] + 1}]."
        )

    def empty(self) -> list[int]:
        return [i for i, mark in enumerate(self.board) if not mark]

    def answer(self, role: str, text: str) -> Move:
        assert role == self.to_move and not self.over, (role, self.moves)
        cell = parse_move(text)
        if cell is None:
            self.forfeit = role
            return Move(False, "no move: no [N] with N from 1 to 9")
        if self.board[cell]:
            self.forfeit = role
            return Move(False, f"cell {cell + 1} is taken")
        self.board[cell] = role
        self.moves.append((role, cell))
        if winner(self.board) == role:
            self.won = role
        return Move(True, f"[{cell + 1}]")

    def returns(self) -> dict[str, float]:
        if self.forfeit is not None:
            return {r: (-1.0 if r == self.forfeit else 1.0) for r in self.roles}
        if self.won is not None:
            return {r: (1.0 if r == self.won else -1.0) for r in self.roles}
        return dict.fromkeys(self.roles, 0.0)

    def random_answer(self, role: str, rng: random.Random) -> str:
        return f"[{rng.choice(self.empty()) + 1}]"

    def stats(self) -> dict[str, float]:
        return {
            "moves": float(len(self.moves)),
            "draw_rate": float(self.forfeit is None and self.won is None),
            "forfeit_rate": float(self.forfeit is not None),
        }

    def record(self) -> dict[str, Any]:
        return {
            "board": render(self.board),
            "moves": " ".join(f"{r}{cell + 1}" for r, cell in self.moves),
            "forfeit": self.forfeit,
        }
