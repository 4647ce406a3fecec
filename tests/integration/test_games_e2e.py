"""Self-play games end to end with the real SmolLM2 model, a spawned generator and sandbox: a step
of tic-tac-toe in self-play (with arena games against the random player and the frozen base, then
a resumed step that starts from the RAE baselines it saved), the code-output game against the
frozen base, and hostile writer programs that must score the writer -1 and nothing else."""

from __future__ import annotations

import asyncio
import json
import random
from pathlib import Path

import pytest
import torch
from crucible_shared.jobs import CodeOutputGame, TrainJob
from crucible_shared.sandbox import Limits, RunStatus
from crucible_shared.sandbox_client import SandboxClient
from crucible_trainer.games import new_game
from crucible_trainer.games.engine import Completion, Episode, play

from tests.integration import sandbox_programs as hostile
from tests.integration.test_sandbox_isolation import HOSTILE
from tests.integration.test_trainer import lora_b_norm, settings_for, train

pytestmark = pytest.mark.slow


def game_job(method: dict, **sections) -> TrainJob:
    """A tiny game job; `sections` override whole sections' fields."""
    spec = {
        "kind": "train",
        "method": {"name": "spiral", **method},
        "rollout": {"max_tokens": 8, "temperature": 1.0},
        # Micro-batches of 2: the update's peak memory is about 2.5 MB per token of a micro-batch,
        # and a turn's prompt holds the rules and the board: micro-batches of 4 peaked at 4.9 GB
        # (a step's 6-10 turns in one micro-batch of 16 would hold them all at once).
        "optim": {"lr": 5e-4, "steps": 2, "micro_batch": 2},
        # The stale-policy probe (4-5 s a step here) is test_trainer's; these tests are the games'.
        "publish": {"every": 1, "staleness_window": 1, "stale_check": False},
        "eval": None,
        "checkpoint": {"every": 1},
        "logging": {"wandb_mode": "disabled"},
        "seed": 1,
    }
    for key, value in sections.items():
        spec[key] = {**spec.get(key, {}), **value}
    return TrainJob.model_validate(spec)


def rows_of(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def turns_of(run_dir: Path) -> list[dict]:
    return [
        json.loads(line)
        for path in sorted((run_dir / "rollouts").glob("step-*.jsonl"))
        for line in path.read_text().splitlines()
    ]


def test_tictactoe_self_play_trains_measures_and_resumes(stack_generator, sandbox, stack_dirs) -> None:
    method = {
        "game": {"name": "tictactoe"},
        "games_per_step": 4,
        "baseline_decay": 0.5,
        "arena": {
            "every": 1,
            "games": 2,
            "opponents": [{"kind": "random"}, {"kind": "model", "model": "base"}],
        },
    }
    # One step, then a resumed second: the step trains and plays the arena, and the resumed one
    # starts from the baselines the first folded its returns into (a step of 4-10 turns whose
    # prompts hold the rules and the board: 11-18 s alone on a 2-core CPU).
    spec = game_job(method, rollout={"max_tokens": 8, "temperature": 1.0}, optim={"steps": 1})
    settings = settings_for(stack_generator, sandbox, stack_dirs)
    summary = train(spec, "ttt-it", settings)
    assert summary["status"] == "finished"
    run_dir = Path(summary["run_dir"])
    rows = rows_of(run_dir)
    assert [r["step"] for r in rows] == [1]
    for row in rows:
        for key in ("x", "o"):
            assert {f"role/{key}/{m}" for m in ("return_mean", "win_rate", "turns", "baseline")} <= set(row)
        for opponent in ("random", "base"):
            assert row[f"arena/{opponent}/games"] == 2 and 0 <= row[f"arena/{opponent}/win_rate"] <= 1
        assert row["game/return_sum_mean"] == 0  # zero-sum, illegal moves included
        assert "game/illegal_rate" in row and "rae/advantage_sq_role" in row
    # Every learner turn (both roles are the learner) is credited with its role's return.
    turns = turns_of(run_dir)
    assert {t["role"] for t in turns} <= {"x", "o"} and {t["opponent"] for t in turns} == {"self"}
    for t in turns:
        assert sum(t["outcome"].values()) == 0 and t["reward"] == t["outcome"][t["role"]]
        if not t["legal"]:
            assert t["reward"] == -1  # an illegal move loses
    # Arena turns are measured, never trained on.
    assert sum(r["samples"] for r in rows) == len(turns)
    assert (run_dir / "learning_curve.png").exists() and (run_dir / "games.md").exists()
    if sum(r["update/sequences"] for r in rows):
        assert lora_b_norm(run_dir / "adapter") > 0

    # The baselines are in the checkpoint, and a resumed job starts from them.
    state = torch.load(run_dir / "checkpoints" / "step-000001" / "state.pt", weights_only=False)
    saved = state["extra"]["method"]["baselines"]["role"]
    assert set(saved) == {"tictactoe/x", "tictactoe/o"}
    longer = game_job(method, rollout={"max_tokens": 8, "temperature": 1.0}, optim={"steps": 2})
    assert train(longer, "ttt-it", settings)["status"] == "finished"
    second = rows_of(run_dir)[-1]
    assert second["step"] == 2
    assert (second["role/x/baseline"], second["role/o/baseline"]) == (
        saved["tictactoe/x"],
        saved["tictactoe/o"],
    )


def test_code_output_against_the_frozen_base(stack_generator, sandbox, stack_dirs) -> None:
    spec = game_job(
        {
            "game": {"name": "code_output", "max_program_chars": 400},
            "games_per_step": 4,
            "opponent": {"kind": "model"},
        },
        rollout={"max_tokens": 64, "temperature": 0.7},
        optim={"steps": 1},
        reward={"time_limit_s": 2},
    )
    summary = train(spec, "code-it", settings_for(stack_generator, sandbox, stack_dirs))
    run_dir = Path(summary["run_dir"])
    (row,) = rows_of(run_dir)
    assert row["games"] == 4 and 0 <= row["game/writer_invalid_rate"] <= 1
    turns = turns_of(run_dir)
    assert turns and {t["opponent"] for t in turns} == {"base"}
    assert {t["game"] for t in turns if t["role"] == "writer"} <= {0, 2}  # the learner's roles alternate
    for t in turns:
        outcome, record = t["outcome"], t["record"]
        if record["invalid"] is not None:
            assert outcome == {"writer": -1.0}  # an invalid program: the writer alone loses
        else:
            assert set(outcome) == {"writer", "predictor"} and sum(outcome.values()) == 0
            assert record["output"].strip()  # a valid program printed something
        assert t["reward"] == outcome.get(t["role"])


# -- hostile writers ----------------------------------------------------------------------------

PRINTS = "print('a', flush=True)\n"


def _hostile_writers() -> dict[str, str]:
    """Programs that print, then try to escape the sandbox or to forge their result."""
    out = {}
    for name, (code, _, _) in HOSTILE.items():
        if name in ("setsid_daemon", "network"):  # a daemon that outlives a finished program is not a failure
            continue
        out[name] = PRINTS + code + ("f(0)\n" if "def f(n)" in code else "f()\n")
    out["forged-done-then-crash"] = PRINTS + hostile._FORGE + "_forge({'t': 'done'})\n1 / 0\n"
    out["forged-done-then-exit-3"] = (
        PRINTS + hostile._FORGE + "_forge({'t': 'done', 'value': \"'end'\"})\nraise SystemExit(3)\n"
    )
    out["forged-passed-frames"] = PRINTS + hostile.TRUSTS_INTERPRETER["forged-passed-frames"]
    out["os-exit-before-the-end"] = PRINTS + "import os\nos._exit(0)\n"
    out["reads-the-dataset"] = PRINTS + "print(open(" + repr(str(hostile.MBPP)) + ").read()[:50])\n"
    out["prints-its-address"] = "print(id(object()))\n"  # different on each run: no puzzle
    return out


class Writer:
    label, learner = "writer", True

    def __init__(self, programs: list[str]) -> None:
        self.programs = programs

    async def act(self, turns, round):
        return [Completion(f"```python\n{self.programs[i]}\n```") for i in range(len(turns))]


class Predictor:
    label, learner = "predictor", False

    def __init__(self) -> None:
        self.asked = 0

    async def act(self, turns, round):
        self.asked += len(turns)
        return [Completion("<output>a</output>") for _ in turns]


def test_hostile_writer_programs_score_the_writer_alone(sandbox) -> None:
    programs = _hostile_writers()
    writer, predictor = Writer(list(programs.values())), Predictor()
    cfg = CodeOutputGame(max_program_chars=4000)
    limits = Limits(wall_time_s=3, memory_mb=256)
    episodes = [
        Episode(new_game(cfg, random.Random(i), limits), {"writer": writer, "predictor": predictor})
        for i in range(len(programs))
    ]

    async def go():
        async with SandboxClient(sandbox.url) as client:
            await play(episodes, client, lambda messages: messages[0]["content"])

    asyncio.run(go())
    for name, episode in zip(programs, episodes, strict=True):
        game = episode.game
        assert game.returns() == {"writer": -1.0}, (name, game.invalid, game.result)
        assert game.invalid, name
        # A forged 'done' frame followed by a crash: the sandbox's run form waits for the real exit
        # status and reports the crash; were it ever fooled into "passed", the end marker catches it.
        if name.startswith("forged-done"):
            caught_by_sandbox = game.result is not None and game.result.status != RunStatus.passed
            assert caught_by_sandbox or "did not run to its end" in game.invalid, (name, game.result)
        if name == "prints-its-address":
            assert "differs between runs" in game.invalid
    assert predictor.asked == 0  # no invalid program reached the predictor

    # The same prints without the attacks are a valid puzzle (so the attacks, not the print, lost).
    control = Episode(
        new_game(cfg, random.Random(0), limits), {"writer": Writer([PRINTS]), "predictor": predictor}
    )

    async def control_game():
        async with SandboxClient(sandbox.url) as client:
            await play([control], client, lambda messages: messages[0]["content"])

    asyncio.run(control_game())
    assert control.game.returns() == {"predictor": 1.0, "writer": -1.0} and predictor.asked == 1
