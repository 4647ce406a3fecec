"""Self-play games (SPIRAL): the games, opponents, arena and the SPIRAL method config."""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import Field, model_validator

from crucible_shared.jobs.base import MAX_STEPS, _Spec, invalid, unused
from crucible_shared.jobs.methods import ClippedMethod


class CodeOutputGame(_Spec):
    """The code-output game: the writer writes a short program, the predictor says what it prints.

    The sandbox runs the program (`determinism_runs` times); the predictor's answer is compared
    with its output after whitespace normalisation. Right: predictor +1, writer -1; wrong: the
    reverse. A program that is missing, too long, fails, times out, prints nothing, prints more
    than `max_output_chars` or prints differently between runs scores the writer -1 and the
    predictor does not play.
    """

    name: Literal["code_output"] = "code_output"
    roles: ClassVar[tuple[str, ...]] = ("writer", "predictor")
    max_program_chars: int = Field(
        600, ge=20, le=20_000, description="A longer program is invalid (the writer loses)."
    )
    max_output_chars: int = Field(
        200, ge=1, le=10_000, description="A program that prints more is invalid (the writer loses)."
    )
    stdin: bool = Field(
        False,
        description="The writer may give its program an input (a ```stdin block); the predictor sees it.",
    )
    determinism_runs: int = Field(
        2,
        ge=1,
        le=4,
        description="Runs of each program; outputs that differ make it invalid (a random program is no puzzle).",
    )


class TicTacToeGame(_Spec):
    """Tic-tac-toe (SPIRAL's first game): X moves first; a missing or illegal move loses the game."""

    name: Literal["tictactoe"] = "tictactoe"
    roles: ClassVar[tuple[str, ...]] = ("x", "o")
    random_players: ClassVar[bool] = True


Game = Annotated[CodeOutputGame | TicTacToeGame, Field(discriminator="name")]


class Opponent(_Spec):
    """Who plays the roles the learning policy does not: itself (self-play), a fixed model, or a
    random legal mover."""

    kind: Literal["self", "model", "random"] = Field(
        "self",
        description="self: the learning policy (self-play); model: a fixed model; random: random legal moves.",
    )
    model: str = Field(
        "base",
        min_length=1,
        max_length=200,
        description="kind model: `base` (the frozen base model of the job) or any model or adapter name the "
        "generator serves.",
    )

    @model_validator(mode="after")
    def _check(self) -> Opponent:
        if self._changed("model") and self.kind != "model":
            raise unused("model", f"only a model opponent names a model (kind is {self.kind})")
        return self

    @property
    def label(self) -> str:
        """Its name in metrics: `self`, `random`, `base` or the model name."""
        return self.model if self.kind == "model" else self.kind


def _random_players(game: Any, opponent: Opponent, field: str) -> None:
    if opponent.kind == "random" and not getattr(game, "random_players", False):
        raise invalid(field, f"{game.name} has no random player (its moves are free text)")


class ArenaSpec(_Spec):
    """Games against fixed opponents that measure the policy while it trains (never trained on).

    They run with the step's training games (same batches), at steps 1, 1 + every, ...: each
    measures the policy that plays that step, before its update.
    """

    every: int = Field(0, ge=0, le=MAX_STEPS, description="Play them every N steps (0: never).")
    games: int = Field(
        16, ge=1, le=4096, description="Games per opponent, the learner's roles taken in turn."
    )
    opponents: list[Opponent] = Field(
        default_factory=lambda: [Opponent(kind="model")],
        min_length=1,
        max_length=8,
        description="Fixed opponents (model or random; not self).",
    )

    @model_validator(mode="after")
    def _check(self) -> ArenaSpec:
        if self.every == 0:
            for name in ("games", "opponents"):
                if self._changed(name):
                    raise unused(name, "arena.every is 0 (no arena games); set every > 0")
        for i, opponent in enumerate(self.opponents):
            if opponent.kind == "self":
                raise invalid(f"opponents.{i}.kind", "the arena measures against fixed opponents, not self")
        labels = [o.label for o in self.opponents]
        if len(set(labels)) != len(labels):
            raise invalid("opponents", f"each opponent once (got {labels})")
        return self


class SpiralConfig(ClippedMethod):
    """SPIRAL: multi-turn, multi-role games played by the policy against itself (its role given in
    the prompt) or against a fixed opponent, trained on its own turns with role-conditioned
    advantages: return minus an EMA baseline per (game, role)."""

    name: Literal["spiral"] = "spiral"
    game: Game = Field(default_factory=CodeOutputGame, description="The game and its options.")
    games_per_step: int = Field(16, ge=1, le=4096, description="Games played (and trained on) per step.")
    opponent: Opponent = Field(default_factory=Opponent, description="Who plays the other roles.")
    learner_roles: list[Annotated[str, Field(min_length=1, max_length=32)]] | None = Field(
        None,
        max_length=8,
        description="Fixed opponent: the roles the learner plays, taken in turn over the games "
        "(default: every role of the game).",
    )
    baseline: Literal["role", "shared", "none"] = Field(
        "role",
        description="role: RAE, an EMA baseline per (game, role); shared: one EMA baseline for every role "
        "(the ablation); none: raw returns.",
    )
    baseline_decay: float = Field(
        0.95, ge=0, lt=1, description="EMA decay of a baseline, per return folded in."
    )
    scale: Literal["none", "role"] = Field(
        "none",
        description="role: divide advantages by the std of the role's returns in the step (GRPO-style).",
    )
    arena: ArenaSpec = Field(
        default_factory=ArenaSpec, description="Measuring games against fixed opponents."
    )

    @model_validator(mode="after")
    def _check(self) -> SpiralConfig:
        roles = type(self.game).roles
        if self._changed("baseline_decay") and self.baseline == "none":
            raise unused("baseline_decay", "baseline is none (no baseline to decay)")
        if self.learner_roles is not None:
            if self.opponent.kind == "self":
                raise unused("learner_roles", "in self-play the learner plays every role")
            for i, role in enumerate(self.learner_roles):
                if role not in roles:
                    raise invalid(
                        f"learner_roles.{i}", f"{self.game.name} has roles {', '.join(roles)}, not {role!r}"
                    )
            if len(set(self.learner_roles)) != len(self.learner_roles):
                raise invalid("learner_roles", "each role once")
        _random_players(self.game, self.opponent, "opponent.kind")
        for i, opponent in enumerate(self.arena.opponents):
            _random_players(self.game, opponent, f"arena.opponents.{i}.kind")
        return self

    def samples_per_step(self, problems_per_step: int) -> int:
        """A game job's budget is its games (it samples no problems)."""
        return self.games_per_step

    @property
    def roles_learned(self) -> tuple[str, ...]:
        """The roles the learner plays."""
        roles = type(self.game).roles
        if self.opponent.kind == "self" or self.learner_roles is None:
            return roles
        return tuple(self.learner_roles)
