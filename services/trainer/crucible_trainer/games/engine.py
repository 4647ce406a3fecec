"""The rollout engine of games: many episodes played at once, every pending turn batched.

`play` advances all episodes in rounds. In a round every unfinished episode waits either for a
move or for the sandbox; the moves asked of each player go to it together (a `ModelPlayer`
sends them to the generator as one batch), every program of every episode goes to the sandbox
in one batch call, and generation and execution run concurrently. A step of 64 tic-tac-toe
games is at most 9 rounds of batched generation; the code-output game is 3 rounds (write, run,
predict).

Players: `ModelPlayer` samples from a model the generator serves (the learning policy's current
adapter, the frozen base or any other adapter); `RandomPlayer` makes random legal moves. One
player object can sit in several seats (self-play: the policy plays every role), and its turns
are batched together.
"""

from __future__ import annotations

import asyncio
import random
import time
import zlib
from collections import defaultdict
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol, TypeVar

from crucible_shared.generator_client import GeneratorPool, samples
from crucible_shared.sandbox import RunResult
from crucible_shared.sandbox_client import SandboxClient

from crucible_trainer.games.base import Ask, Execute, Game, Move
from crucible_trainer.rl.rollout import Timing

T = TypeVar("T")
MAX_ROUNDS = 1000  # a game that never ends is a bug of the game, not a reason to hang a job


@dataclass
class Completion:
    """A player's answer, with the token data the policy update needs (empty for random moves)."""

    text: str
    prompt_ids: list[int] = field(default_factory=list)
    completion_ids: list[int] = field(default_factory=list)
    logprobs: list[float] | None = None
    finish_reason: str | None = None


@dataclass
class Turn:
    """One answer of one episode: who gave it, to what, and what the game made of it."""

    role: str
    player: str
    learner: bool
    prompt: str
    completion: Completion
    move: Move


@dataclass
class Pending:
    """A turn the engine asks a player for."""

    game: Game
    role: str
    prompt: str  # the game's messages, rendered as the generator gets them


class Player(Protocol):
    label: str  # its name in metrics and logs: `learner`, `base`, `random`, a model name
    learner: bool  # its turns are trained on

    async def act(self, turns: Sequence[Pending], round: int) -> list[Completion]: ...


@dataclass
class Sampling:
    temperature: float
    top_p: float
    max_tokens: int
    stop: list[str] | None
    seed: int


class ModelPlayer:
    """Answers with a model the generator serves.

    Identical prompts (every game's first turn, often) are sampled together as one prompt with
    `n` = their count: seeded requests draw sample j of every prompt from seed + j, so sending
    them as separate prompts of one request would give them identical answers. Prompts that occur
    the same number of times share a request; a round's requests go out concurrently.
    """

    def __init__(
        self, generator: GeneratorPool, model: str, label: str, sampling: Sampling, *, learner: bool = False
    ) -> None:
        self.generator, self.model, self.label, self.sampling, self.learner = (
            generator,
            model,
            label,
            sampling,
            learner,
        )
        # Two players on one model (the learner and the frozen base before the first update) must
        # not draw the same samples for the same prompt: each gets seeds of its own.
        self.salt = zlib.crc32(label.encode()) % 1_000_003

    async def act(self, turns: Sequence[Pending], round: int) -> list[Completion]:
        where: dict[str, list[int]] = defaultdict(list)
        for i, turn in enumerate(turns):
            where[turn.prompt].append(i)
        by_count: dict[int, list[str]] = defaultdict(list)
        for text, positions in where.items():
            by_count[len(positions)].append(text)
        counts = sorted(by_count)
        s = self.sampling
        responses = await asyncio.gather(
            *(
                self.generator.complete(
                    by_count[n],
                    model=self.model,
                    n=n,
                    temperature=s.temperature,
                    top_p=s.top_p,
                    max_tokens=s.max_tokens,
                    stop=s.stop,
                    seed=s.seed + round * 104_729 + k * 7_919 + self.salt,
                    logprobs=0,
                    return_token_ids=True,
                )
                for k, n in enumerate(counts)
            )
        )
        out: list[Completion | None] = [None] * len(turns)
        for n, response in zip(counts, responses, strict=True):
            texts = by_count[n]
            for choice in samples(response, n):
                i = where[texts[choice.prompt_index]][choice.index % n]
                out[i] = Completion(
                    text=choice.text,
                    prompt_ids=list(choice.prompt_token_ids or []),
                    completion_ids=list(choice.token_ids or []),
                    logprobs=choice.logprobs,
                    finish_reason=choice.finish_reason,
                )
        assert all(c is not None for c in out), "the generator answered fewer choices than asked"
        return [c for c in out if c is not None]


class RandomPlayer:
    """Uniformly random legal moves (games that can enumerate them: `Game.random_answer`)."""

    learner = False

    def __init__(self, rng: random.Random, label: str = "random") -> None:
        self.rng, self.label = rng, label

    async def act(self, turns: Sequence[Pending], round: int) -> list[Completion]:
        return [Completion(text=t.game.random_answer(t.role, self.rng)) for t in turns]


@dataclass
class Episode:
    """One game being played, its seats (role -> player) and what happened."""

    game: Game
    seats: dict[str, Player]
    tag: str = "train"  # which set it belongs to: `train`, or `arena/<opponent>`
    turns: list[Turn] = field(default_factory=list)

    @property
    def learner_roles(self) -> list[str]:
        return [role for role, player in self.seats.items() if player.learner]


async def play(
    episodes: Sequence[Episode],
    sandbox: SandboxClient,
    render: Callable[[list[dict[str, str]]], str],
    timing: Timing | None = None,
) -> None:
    """Play every episode to its end (see the module docstring for how turns are batched)."""
    timing = timing or Timing()
    for round in range(MAX_ROUNDS + 1):
        asks: list[tuple[Episode, Ask]] = []
        runs: list[tuple[Episode, Execute]] = []
        for episode in episodes:
            waiting = episode.game.next()
            if isinstance(waiting, Ask):
                asks.append((episode, waiting))
            elif isinstance(waiting, Execute):
                runs.append((episode, waiting))
        if not asks and not runs:
            return
        if round == MAX_ROUNDS:
            raise RuntimeError(f"games still running after {MAX_ROUNDS} rounds")
        (answers, generate_s), (results, execute_s) = await asyncio.gather(
            _timed(_answers(asks, render, round)), _timed(_execute(runs, sandbox))
        )
        for (episode, ask), (player, prompt, completion) in zip(asks, answers, strict=True):
            move = episode.game.answer(ask.role, completion.text)
            episode.turns.append(Turn(ask.role, player.label, player.learner, prompt, completion, move))
        for (episode, _), verdicts in zip(runs, results, strict=True):
            episode.game.executed(verdicts)
        # Generation and execution of a round overlap: only execution outlasting generation adds wall time.
        timing.generate_s += generate_s
        timing.execute_busy_s += execute_s
        timing.execute_tail_s += max(0.0, execute_s - generate_s)


async def _timed(work: Awaitable[T]) -> tuple[T, float]:
    started = time.perf_counter()
    out = await work
    return out, time.perf_counter() - started


async def _answers(
    asks: list[tuple[Episode, Ask]], render: Callable[[list[dict[str, str]]], str], round: int
) -> list[tuple[Player, str, Completion]]:
    """Every asked turn's answer; each player gets all of its turns at once, players concurrently."""
    groups: dict[int, tuple[Player, list[int]]] = {}
    pending: list[Pending] = []
    for i, (episode, ask) in enumerate(asks):
        player = episode.seats[ask.role]
        groups.setdefault(id(player), (player, []))[1].append(i)
        pending.append(Pending(episode.game, ask.role, render(ask.messages)))
    replies = await asyncio.gather(
        *(player.act([pending[i] for i in members], round) for player, members in groups.values())
    )
    out: list[tuple[Player, str, Completion] | None] = [None] * len(asks)
    for (player, members), completions in zip(groups.values(), replies, strict=True):
        for i, completion in zip(members, completions, strict=True):
            out[i] = (player, pending[i].prompt, completion)
    return [x for x in out if x is not None]


async def _execute(runs: list[tuple[Episode, Execute]], sandbox: SandboxClient) -> list[list[RunResult]]:
    """Every episode's programs in one batch call, the results split back per episode."""
    if not runs:
        return []
    results = await sandbox.run_batch([r for _, execute in runs for r in execute.runs])
    out, at = [], 0
    for _, execute in runs:
        out.append(results[at : at + len(execute.runs)])
        at += len(execute.runs)
    return out
