"""Self-play games without services: the rules and zero-sum accounting of each game, illegal moves
and invalid programs, the rollout engine's batching, and the game specs' refusals."""

from __future__ import annotations

import asyncio
import random

import pytest
from crucible_shared.jobs import CodeOutputGame, SpiralConfig, TicTacToeGame, TrainJob
from crucible_shared.openai_protocol import CompletionResponse, CompletionResponseChoice, UsageInfo
from crucible_shared.sandbox import Limits, RunResult
from crucible_trainer.games import Execute, new_game
from crucible_trainer.games.code_output import CodeOutput
from crucible_trainer.games.engine import Completion, Episode, ModelPlayer, RandomPlayer, Sampling, play
from crucible_trainer.games.tictactoe import TicTacToe
from pydantic import ValidationError

LIMITS = Limits(wall_time_s=2)


def ttt() -> TicTacToe:
    game = new_game(TicTacToeGame(), random.Random(0), LIMITS)
    assert isinstance(game, TicTacToe)
    return game


def code(**cfg) -> CodeOutput:
    game = new_game(CodeOutputGame(**cfg), random.Random(0), LIMITS)
    assert isinstance(game, CodeOutput)
    return game


def ran(stdout: str = "", status: str = "passed", **kw) -> RunResult:
    return RunResult(status=status, passed=0, total=0, stdout=stdout, **kw)


def ended(game: CodeOutput, *outputs: str, status: str = "passed") -> list[RunResult]:
    """Results of runs that reached their end: each reports its run's end marker as its value."""
    return [ran(out, status, value=repr(m)) for out, m in zip(outputs, game.markers, strict=True)]


# -- tic-tac-toe --------------------------------------------------------------------------------


def play_moves(game: TicTacToe, answers: list[str]) -> list[bool]:
    legal = []
    for text in answers:
        ask = game.next()
        assert ask is not None
        legal.append(game.answer(ask.role, text).legal)
    return legal


def test_tictactoe_win_loss_and_draw_sum_to_zero() -> None:
    win = ttt()
    play_moves(win, ["[1]", "[4]", "[2]", "[5]", "I play [3]"])  # X takes the top row
    assert win.next() is None and win.returns() == {"x": 1.0, "o": -1.0}
    draw = ttt()
    play_moves(draw, [f"[{c}]" for c in (1, 2, 3, 5, 4, 6, 8, 7, 9)])
    assert draw.next() is None and draw.returns() == {"x": 0.0, "o": 0.0}
    assert draw.stats()["draw_rate"] == 1.0


def test_tictactoe_illegal_move_loses() -> None:
    taken = ttt()
    assert play_moves(taken, ["[5]", "[5]"]) == [True, False]
    assert taken.next() is None and taken.returns() == {"x": 1.0, "o": -1.0}
    nothing = ttt()
    assert play_moves(nothing, ["I am not sure."]) == [False]
    assert nothing.returns() == {"x": -1.0, "o": 1.0} and sum(nothing.returns().values()) == 0


def test_tictactoe_prompt_names_the_role_and_shows_the_board() -> None:
    game = ttt()
    play_moves(game, ["[5]"])
    ask = game.next()
    assert ask is not None and ask.role == "o"
    text = ask.messages[0]["content"]
    assert "as O" in text and " 4 | X | 6" in text and "Moves so far: X 5." in text


class NoSandbox:
    async def run_batch(self, runs):  # pragma: no cover - tic-tac-toe runs nothing
        raise AssertionError("tic-tac-toe asked for a run")


def test_random_players_play_legal_games_to_the_end() -> None:
    rng = random.Random(1)
    episodes = [
        Episode(
            new_game(TicTacToeGame(), random.Random(i), LIMITS),
            {"x": RandomPlayer(rng), "o": RandomPlayer(rng)},
        )
        for i in range(40)
    ]
    asyncio.run(play(episodes, NoSandbox(), lambda m: m[0]["content"]))
    outcomes = set()
    for e in episodes:
        assert e.game.next() is None and all(t.move.legal for t in e.turns) and 5 <= len(e.turns) <= 9
        returns = e.game.returns()
        assert sum(returns.values()) == 0
        outcomes.add(tuple(sorted(returns.items())))
    assert len(outcomes) == 3  # wins for each side and draws


# -- code-output game ---------------------------------------------------------------------------


def write(game: CodeOutput, text: str) -> Execute | None:
    ask = game.next()
    assert ask is not None and ask.role == "writer"
    game.answer("writer", text)
    waiting = game.next()
    return waiting if isinstance(waiting, Execute) else None


def test_code_output_zero_sum_when_the_program_counts() -> None:
    for prediction, returns in (
        ("<output>6</output>", {"predictor": 1.0, "writer": -1.0}),
        ("<output>7</output>", {"predictor": -1.0, "writer": 1.0}),
    ):
        game = code()
        runs = write(game, "```python\nprint(sum([1, 2, 3]))\n```")
        assert runs is not None and len(runs.runs) == 2  # determinism_runs
        assert runs.runs[0].tests.kind == "run" and not runs.runs[0].use_cache
        assert (
            runs.runs[0].code.startswith("print(sum([1, 2, 3]))\n")
            and runs.runs[0].tests.value == "last_expression"
        )
        game.executed(ended(game, "6\n", "6\n"))
        ask = game.next()
        assert (
            ask is not None
            and ask.role == "predictor"
            and "print(sum([1, 2, 3]))" in ask.messages[0]["content"]
        )
        game.answer("predictor", prediction)
        assert game.next() is None and game.returns() == returns and sum(returns.values()) == 0


def test_whitespace_does_not_matter_but_content_does() -> None:
    game = code()
    write(game, "```python\nfor i in range(3):\n    print(i, end='  ')\n```")
    game.executed(ended(game, "0  1  2  ", "0  1  2  "))
    game.answer("predictor", "```\n0 1\n2\n```")
    assert game.correct is True


@pytest.mark.parametrize(
    ("writer", "results", "why"),
    [
        ("I cannot write code today.", None, "no program"),
        ("```python\n" + "x = 1\n" * 200 + "print(x)\n```", None, "chars (max"),
        ("```python\nprint(1/0)\n```", [("", "error")] * 2, "invalid program: error"),
        ("```python\nx = 1\n```", [("", "passed")] * 2, "ran without output"),
        ("```python\nwhile True: pass\n```", [("", "timeout")] * 2, "timeout"),
        ("```python\ndef f(:\n```", [("", "syntax_error")] * 2, "syntax_error"),
        ("```python\nprint('a' * 500)\n```", [("a" * 500 + "\n", "passed")] * 2, "printed 501 chars"),
        (
            "```python\nimport random\nprint(random.random())\n```",
            [("0.1\n", "passed"), ("0.7\n", "passed")],
            "differs",
        ),
        ("```python\nprint('x')\n```", [("x\n", "output_exceeded")] * 2, "output_exceeded"),
        # "passed" without the end marker: it exited early, or forged a "done" frame and then crashed.
        ("```python\nprint('x')\nexit()\n```", [("x\n", "passed", False)] * 2, "did not run to its end"),
    ],
)
def test_invalid_writer_programs_score_the_writer_alone(writer, results, why) -> None:
    game = code()
    runs = write(game, writer)
    assert (runs is None) == (results is None)
    if runs is not None:
        game.executed(
            [
                ran(out, status, value=None if no_marker else repr(m))
                for (out, status, *no_marker), m in zip(results, game.markers, strict=True)
            ]
        )
    assert game.next() is None, "the predictor must not play an invalid program"
    assert game.returns() == {"writer": -1.0}
    assert why in (game.invalid or ""), game.invalid
    assert game.stats()["writer_invalid_rate"] == 1.0 and "predictor_accuracy" not in game.stats()


def test_a_sandbox_fault_voids_the_game() -> None:
    game = code()
    write(game, "```python\nprint(2)\n```")
    game.executed([ended(game, "2\n", "2\n")[0], RunResult(status="sandbox_error", passed=0, total=0)])
    assert game.next() is None and game.returns() == {} and game.void


def test_writer_input_reaches_the_run_and_the_predictor() -> None:
    game = code(stdin=True)
    runs = write(game, "```python\nprint(input()[::-1])\n```\n```stdin\nabc\n```")
    assert runs is not None and runs.runs[0].tests.stdin == "abc\n"
    game.executed(ended(game, "cba\n", "cba\n"))
    ask = game.next()
    assert ask is not None and "abc" in ask.messages[0]["content"]
    assert "stdin" in code(stdin=True).next().messages[0]["content"]
    assert "gets no input" in code().next().messages[0]["content"]


def test_no_prediction_is_an_illegal_answer_and_a_loss() -> None:
    game = code()
    write(game, "```python\nprint(5)\n```")
    game.executed(ended(game, "5\n", "5\n"))
    move = game.answer("predictor", "   ")
    assert not move.legal and game.returns() == {"predictor": -1.0, "writer": 1.0}


# -- the engine ---------------------------------------------------------------------------------


class Scripted:
    """A player answering from a function of the prompt; records each `act` call."""

    def __init__(self, label: str, answer, learner: bool = False) -> None:
        self.label, self.answer, self.learner, self.calls = label, answer, learner, []

    async def act(self, turns, round):
        self.calls.append((round, len(turns)))
        return [Completion(text=self.answer(t.prompt), prompt_ids=[1], completion_ids=[2, 3]) for t in turns]


class CountingSandbox:
    def __init__(self) -> None:
        self.batches: list[int] = []

    async def run_batch(self, runs):
        self.batches.append(len(runs))
        return [ran("6\n", value=run.code.splitlines()[-1]) for run in runs]  # the end marker


def test_engine_batches_every_turn_of_a_round_and_every_run() -> None:
    writer = Scripted("w", lambda p: "```python\nprint(6)\n```", learner=True)
    predictor = Scripted("p", lambda p: "<output>6</output>")
    sandbox = CountingSandbox()
    episodes = [Episode(code(), {"writer": writer, "predictor": predictor}) for _ in range(8)]
    asyncio.run(play(episodes, sandbox, lambda m: m[0]["content"]))
    assert writer.calls == [(0, 8)] and predictor.calls == [(2, 8)]  # one call per round for all games
    assert sandbox.batches == [16]  # 8 programs x 2 determinism runs, one batch
    assert all(e.game.returns() == {"predictor": 1.0, "writer": -1.0} for e in episodes)
    assert all(e.learner_roles == ["writer"] for e in episodes)


class FakeGenerator:
    def __init__(self) -> None:
        self.requests: list[dict] = []

    async def complete(self, prompts, *, n, seed, **kw):
        self.requests.append({"prompts": list(prompts), "n": n, "seed": seed})
        choices = [
            CompletionResponseChoice(
                index=p * n + j, text=f"{text}|{j}", token_ids=[p, j], prompt_token_ids=[len(text)]
            )
            for p, text in enumerate(prompts)
            for j in range(n)
        ]
        return CompletionResponse(
            model="m", choices=choices, usage=UsageInfo(prompt_tokens=0, total_tokens=0)
        )


def test_model_player_samples_identical_prompts_together() -> None:
    """A seeded request draws sample j of every prompt from seed + j: identical prompts must be one
    prompt with n > 1 or they would get identical answers."""
    generator = FakeGenerator()
    player = ModelPlayer(generator, "m", "learner", Sampling(1.0, 1.0, 8, None, 7), learner=True)
    from crucible_trainer.games.engine import Pending

    prompts = ["a", "b", "a", "c", "a", "b"]
    out = asyncio.run(player.act([Pending(None, "x", p) for p in prompts], round=0))
    assert sorted((tuple(r["prompts"]), r["n"]) for r in generator.requests) == [
        (("a",), 3),
        (("b",), 2),
        (("c",), 1),
    ]
    assert len({r["seed"] for r in generator.requests}) == 3
    assert [c.text.split("|")[0] for c in out] == prompts
    assert len({c.text for c in out}) == len(prompts)  # every copy of "a" got its own sample


class AnsweringGenerator:
    """Writes a program for a writer's prompt and predicts its output for a predictor's."""

    async def complete(self, prompts, *, n, seed, **kw):
        def text(prompt: str) -> str:
            return "<output>6</output>" if "<output>" in prompt else "```python\nprint(6)\n```"

        choices = [
            CompletionResponseChoice(index=p * n + j, text=text(t), token_ids=[j], prompt_token_ids=[p])
            for p, t in enumerate(prompts)
            for j in range(n)
        ]
        return CompletionResponse(
            model="m", choices=choices, usage=UsageInfo(prompt_tokens=0, total_tokens=0)
        )


class RecordingSandbox:
    def __init__(self) -> None:
        self.runs: list = []

    async def run_batch(self, runs):
        self.runs += runs
        return [ran("6\n", value=run.code.splitlines()[-1]) for run in runs]


def test_spiral_runs_programs_under_the_reward_specs_limits() -> None:
    """Each run of a game's program gets the spec's time limit for the whole run and for each test
    (not the sandbox server's default per-test limit)."""
    from types import SimpleNamespace

    from crucible_trainer.methods import spiral as method

    job = spiral(game={"name": "code_output"}, games_per_step=2)
    job = job.model_copy(update={"reward": job.reward.model_copy(update={"time_limit_s": 3.5})})
    sandbox = RecordingSandbox()
    roller = SimpleNamespace(generator=AnsweringGenerator(), sandbox=sandbox)
    ctx = SimpleNamespace(
        job=job,
        roller=roller,
        model_name="m",
        base_name="b",
        step=1,
        state={},
        timing=None,
        prompts=SimpleNamespace(chat=False),
    )
    batch, _ = asyncio.run(method.collect(ctx, job.method, []))
    assert batch and sandbox.runs
    assert {(r.limits.wall_time_s, r.limits.test_time_s) for r in sandbox.runs} == {(3.5, 3.5)}


# -- specs --------------------------------------------------------------------------------------


def spiral(**method) -> TrainJob:
    return TrainJob.model_validate({"method": {"name": "spiral", **method}})


def test_game_specs_parse_with_their_roles() -> None:
    job = spiral(game={"name": "tictactoe"}, opponent={"kind": "random"}, learner_roles=["o"])
    assert isinstance(job.method, SpiralConfig) and job.method.roles_learned == ("o",)
    job = spiral(arena={"every": 5, "opponents": [{"kind": "model"}, {"kind": "model", "model": "other-v3"}]})
    assert job.method.roles_learned == ("writer", "predictor")
    assert [o.label for o in job.method.arena.opponents] == ["base", "other-v3"]


@pytest.mark.parametrize(
    ("spec", "where"),
    [
        ({"method": {"name": "spiral"}, "data": {"dataset": "mbpp", "ids": [601]}}, "data"),
        ({"method": {"name": "spiral"}, "optim": {"problems_per_step": 4}}, "optim.problems_per_step"),
        ({"method": {"name": "spiral"}, "reward": {"kind": "graded"}}, "reward.kind"),
        ({"method": {"name": "spiral"}, "reward": {"length_penalty": 0.1}}, "reward.length_penalty"),
        (
            {"method": {"name": "spiral", "game": {"name": "tictactoe"}}, "reward": {"time_limit_s": 2}},
            "reward.time_limit_s",
        ),
        ({"method": {"name": "spiral", "learner_roles": ["writer"]}}, "learner_roles"),
        (
            {"method": {"name": "spiral", "opponent": {"kind": "model"}, "learner_roles": ["x"]}},
            "learner_roles.0",
        ),
        ({"method": {"name": "spiral", "opponent": {"kind": "random"}}}, "opponent.kind"),
        ({"method": {"name": "spiral", "opponent": {"model": "base-2"}}}, "model"),
        ({"method": {"name": "spiral", "arena": {"games": 4}}}, "games"),
        (
            {"method": {"name": "spiral", "arena": {"every": 1, "opponents": [{"kind": "self"}]}}},
            "opponents.0.kind",
        ),
        (
            {
                "method": {
                    "name": "spiral",
                    "game": {"name": "tictactoe"},
                    "arena": {"every": 1, "opponents": [{"kind": "random"}, {"kind": "random"}]},
                }
            },
            "each opponent once",
        ),
        ({"method": {"name": "spiral", "baseline": "none", "baseline_decay": 0.5}}, "baseline_decay"),
        ({"method": {"name": "spiral", "clip_eps": 0.3}}, "clip_eps"),
        ({"method": {"name": "spiral", "games_per_step": 0}}, "games_per_step"),
        ({"method": {"name": "spiral", "baseline_decay": float("nan")}}, "baseline_decay"),
        (
            {"method": {"name": "spiral", "game": {"name": "code_output", "max_program_chars": 10**6}}},
            "max_program_chars",
        ),
        ({"method": {"name": "spiral", "game": {"name": "chess"}}}, "game"),
    ],
)
def test_bad_game_specs_name_the_field(spec: dict, where: str) -> None:
    with pytest.raises(ValidationError) as info:
        TrainJob.model_validate(spec)
    assert where in str(info.value)


def test_a_queued_game_spec_round_trips() -> None:
    job = spiral(
        game={"name": "tictactoe"},
        opponent={"kind": "random"},
        arena={"every": 2, "opponents": [{"kind": "random"}]},
    )
    assert TrainJob.model_validate_json(job.model_dump_json()) == job


@pytest.mark.parametrize(
    ("method", "top", "field"),
    [
        ({"learner_roles": ["writer"]}, {}, "method.spiral.learner_roles"),
        ({"opponent": {"kind": "model"}, "learner_roles": ["x"]}, {}, "method.spiral.learner_roles.0"),
        ({"opponent": {"kind": "random"}}, {}, "method.spiral.opponent.kind"),
        ({}, {"data": {"dataset": "mbpp", "ids": [601]}}, "data"),
        ({}, {"optim": {"problems_per_step": 4}}, "optim.problems_per_step"),
    ],
)
def test_the_gateway_names_the_field_of_a_bad_game_spec(method, top, field) -> None:
    from crucible_shared.http import error_field

    with pytest.raises(ValidationError) as info:
        TrainJob.model_validate({"method": {"name": "spiral", **method}, **top})
    assert error_field(info.value.errors()[0]) == field
