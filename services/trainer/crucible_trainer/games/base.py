"""The game interface: one episode of a game with roles and turns, as a small state machine.

The rollout engine (`games.engine`) drives many episodes at once. At any moment an episode
waits for one of:

* `Ask(role, messages)`: the player of `role` to answer `messages`, a chat the game builds from
  its history (what that role may see, its role named in it);
* `Execute(runs)`: the sandbox to run programs (the engine batches every episode's runs);
* nothing (`None`): it is over, and `returns()` says what each role scored.

`answer(role, text)` applies a player's answer: the game parses it (a move, a program, a
prediction) and says whether it was legal, with an optional per-turn reward. An illegal answer
ends the game with the penalty the game defines (in both games here: the offender loses).
`executed(results)` hands back the sandbox's verdicts, in the order of the runs asked for.

`returns()` holds the terminal reward of every role that counts; a role missing from it does not
count (it never got to play, or the game was void because the sandbox failed), so its turns are
neither trained on nor folded into baselines. A zero-sum game's returns sum to zero.

Adding a game: one module implementing `Game`, its config class in `crucible_shared.jobs`
(in the `Game` union), one line in `games.GAMES` (docs/games.md).
"""

from __future__ import annotations

import random
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar

from crucible_shared.sandbox import Limits, RunRequest, RunResult


@dataclass(frozen=True)
class Ask:
    """The game waits for `role` to answer `messages` (chat messages: role + content)."""

    role: str
    messages: list[dict[str, str]]


@dataclass(frozen=True)
class Execute:
    """The game waits for the sandbox to run `runs`."""

    runs: list[RunRequest]


@dataclass(frozen=True)
class Move:
    """What the game made of an answer."""

    legal: bool
    note: str = ""  # what the answer was, or why it was illegal (rollout logs)
    reward: float = 0.0  # a per-turn reward, added to the role's return for this turn and the ones before


class Game(ABC):
    """One episode. Subclasses set `roles` (in the order they first move) and implement the
    abstract methods; `executed` only if they ask for runs, `random_answer` only if a random
    player can play them."""

    roles: ClassVar[tuple[str, ...]]

    def __init__(self, cfg: Any, rng: random.Random, limits: Limits) -> None:
        self.cfg, self.rng, self.limits = cfg, rng, limits

    @abstractmethod
    def next(self) -> Ask | Execute | None:
        """What the episode waits for now; None once it is over."""

    @abstractmethod
    def answer(self, role: str, text: str) -> Move:
        """Apply `role`'s answer to the last `Ask`."""

    def executed(self, results: list[RunResult]) -> None:
        """The sandbox's verdicts of the last `Execute`, in order."""
        raise NotImplementedError(f"{type(self).__name__} runs no programs")

    @abstractmethod
    def returns(self) -> dict[str, float]:
        """Once over: the terminal reward of each role that counts."""

    def random_answer(self, role: str, rng: random.Random) -> str:
        """An answer of a random legal mover (games whose moves can be enumerated)."""
        raise NotImplementedError(f"{type(self).__name__} has no random player")

    def stats(self) -> dict[str, float]:
        """Facts of this episode for the step's metrics (`game/<key>`, averaged over the episodes
        that report the key): a 0/1 per episode averages to a rate."""
        return {}

    def record(self) -> dict[str, Any]:
        """What the rollout log keeps of the episode (final board, program and output)."""
        return {}
