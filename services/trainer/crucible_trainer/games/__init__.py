"""Games for self-play training (SPIRAL): the interface (`base`), the rollout engine that plays many
episodes at once (`engine`), and the games, each one module registered below by its config class.

Adding a game: a module implementing `base.Game`, a config class in `crucible_shared.jobs` (in
its `Game` union, with the game's `roles`), one line in `GAMES`. See docs/games.md.
"""

from __future__ import annotations

import random
from typing import Any

from crucible_shared.jobs import CodeOutputGame, TicTacToeGame
from crucible_shared.sandbox import Limits

from crucible_trainer.games.base import Ask, Execute, Game, Move
from crucible_trainer.games.code_output import CodeOutput
from crucible_trainer.games.tictactoe import TicTacToe

GAMES: dict[type, type[Game]] = {
    CodeOutputGame: CodeOutput,
    TicTacToeGame: TicTacToe,
}


def new_game(cfg: Any, rng: random.Random, limits: Limits) -> Game:
    """A fresh episode of the game `cfg` configures."""
    try:
        cls = GAMES[type(cfg)]
    except KeyError:
        raise ValueError(f"no game is registered for {type(cfg).__name__}") from None
    return cls(cfg, rng, limits)


__all__ = ["GAMES", "Ask", "Execute", "Game", "Move", "new_game"]
