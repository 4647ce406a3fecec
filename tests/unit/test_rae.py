"""Role-conditioned advantage estimation (SPIRAL's RAE): the EMA baselines, the variance they remove
against one shared baseline, and the baselines as method state that a checkpoint carries."""

from __future__ import annotations

import pickle
import random
from types import SimpleNamespace

import pytest
from crucible_shared.jobs import SpiralConfig, TicTacToeGame
from crucible_shared.sandbox import Limits
from crucible_trainer.games import new_game
from crucible_trainer.games.engine import Completion, Episode, Turn
from crucible_trainer.methods import spiral
from crucible_trainer.rl.advantages import baseline_advantages, ema_baselines, scale_within


def test_ema_folds_returns_in_order_from_zero() -> None:
    b = ema_baselines([("g/w", 1.0)], {}, 0.9)
    assert b == {"g/w": pytest.approx(0.1)}
    b = ema_baselines([("g/w", 1.0), ("g/p", -1.0)], b, 0.9)
    assert b == {"g/w": pytest.approx(0.19), "g/p": pytest.approx(-0.1)}
    assert ema_baselines([("g/w", 5.0)], {"g/w": 1.0}, 0.0) == {"g/w": 5.0}  # decay 0: the last return


def test_advantage_uses_the_baseline_from_before_the_batch() -> None:
    assert baseline_advantages([1.0, 1.0], ["w", "w"], {"w": 0.25}) == [0.75, 0.75]
    assert baseline_advantages([1.0], ["new"], {}) == [1.0]


def _mean_square(values: list[float]) -> float:
    return sum(v * v for v in values) / len(values)


def test_role_baselines_reduce_variance_against_a_shared_baseline() -> None:
    """A game the writer wins 80% of the time (zero-sum: the predictor's return is the negative).
    One shared baseline sits near 0 and leaves each role's mean in its advantages; a baseline per
    role removes it: E[A^2] drops from about 1 to about 1 - 0.6^2 = 0.64."""
    rng = random.Random(0)
    state = {"role": {}, "shared": {}}
    seen: dict[str, list[float]] = {"role": [], "shared": []}
    per_role_mean: dict[str, dict[str, list[float]]] = {
        "role": {"w": [], "p": []},
        "shared": {"w": [], "p": []},
    }
    for step in range(300):
        writer = [1.0 if rng.random() < 0.8 else -1.0 for _ in range(16)]
        returns = [r for w in writer for r in (w, -w)]  # game by game, as the method folds them
        roles = ["w", "p"] * 16
        for kind in ("role", "shared"):
            keys = roles if kind == "role" else ["*"] * 32
            adv = baseline_advantages(returns, keys, state[kind])
            if step >= 30:  # past the baselines' warm-up
                seen[kind] += adv
                for role in ("w", "p"):
                    per_role_mean[kind][role] += [a for a, r in zip(adv, roles, strict=True) if r == role]
            state[kind] = ema_baselines(list(zip(keys, returns, strict=True)), state[kind], 0.95)
    role, shared = _mean_square(seen["role"]), _mean_square(seen["shared"])
    assert role == pytest.approx(0.64, abs=0.08) and shared == pytest.approx(1.0, abs=0.05)
    assert role < 0.75 * shared
    # With a role baseline each role's advantages are centred; with a shared one they are not.
    for r in ("w", "p"):
        assert abs(sum(per_role_mean["role"][r]) / len(per_role_mean["role"][r])) < 0.1
        assert abs(sum(per_role_mean["shared"][r]) / len(per_role_mean["shared"][r])) > 0.5
    assert state["role"]["w"] > 0.3 and state["role"]["p"] < -0.3  # each tracks its role's mean (+-0.6)


def test_role_scaling_divides_by_the_role_std() -> None:
    assert scale_within([1.0, -1.0, 0.5], [2.0, 0.0, 1.0], ["w", "w", "p"]) == [1.0, -1.0, 0.5]


# -- the method's use of them -------------------------------------------------------------------


class _Learner:
    label, learner = "learner", True


def x_wins(i: int) -> Episode:
    """A finished tic-tac-toe game the learner played on both sides: X takes the top row."""
    game = new_game(TicTacToeGame(), random.Random(i), Limits())
    episode = Episode(game, {"x": _Learner(), "o": _Learner()})
    for cell in (1, 4, 2, 5, 3):
        ask = game.next()
        move = game.answer(ask.role, f"[{cell}]")
        episode.turns.append(Turn(ask.role, "learner", True, "p", Completion(f"[{cell}]", [1], [2]), move))
    return episode


def step(cfg: SpiralConfig, state: dict) -> tuple[list, dict]:
    episodes = [x_wins(i) for i in range(4)]
    batch = spiral._samples(cfg, episodes)
    metrics = spiral._advantages(SimpleNamespace(state=state), cfg, episodes, batch)
    return batch, metrics


def test_every_turn_of_a_player_gets_its_return_and_role_advantage() -> None:
    cfg = SpiralConfig(game={"name": "tictactoe"}, baseline_decay=0.5)
    state: dict = {}
    batch, metrics = step(cfg, state)
    assert [s.phase for s in batch[:5]] == ["x", "o", "x", "o", "x"]
    assert all(s.reward == (1.0 if s.phase == "x" else -1.0) for s in batch)
    assert all(s.advantage == s.reward for s in batch)  # baselines start at 0
    assert metrics["role/x/baseline"] == 0.0
    # Four returns of +1 folded at decay 0.5: 1 - 0.5^4.
    assert state["baselines"]["role"] == {"tictactoe/x": 0.9375, "tictactoe/o": -0.9375}
    # The shared baseline swings between the roles' returns (+1, -1, ... at decay 0.5).
    assert state["baselines"]["shared"]["tictactoe/*"] == pytest.approx(-0.33203125)
    batch, metrics = step(cfg, state)
    assert metrics["role/x/baseline"] == 0.9375
    assert {s.advantage for s in batch if s.phase == "x"} == {0.0625}
    assert metrics["rae/advantage_sq_role"] < metrics["rae/advantage_sq_shared"]


def test_baselines_survive_a_checkpoint() -> None:
    """The state is pickled into the checkpoint (`extra["method"]`) and loaded back on resume: the
    resumed step's advantages equal those of a run that never stopped."""
    cfg = SpiralConfig(game={"name": "tictactoe"})
    state: dict = {}
    step(cfg, state)
    resumed = pickle.loads(pickle.dumps({"method": state}))["method"]
    uninterrupted, _ = step(cfg, state)
    again, _ = step(cfg, resumed)
    assert [s.advantage for s in again] == [s.advantage for s in uninterrupted]


def test_shared_and_none_baselines() -> None:
    shared = SpiralConfig(game={"name": "tictactoe"}, baseline="shared", baseline_decay=0.5)
    state: dict = {}
    step(shared, state)
    batch, metrics = step(shared, state)
    b = state["baselines"]["shared"]["tictactoe/*"]
    assert (
        "role/x/baseline" in metrics
        and batch[0].info["baseline"] != state["baselines"]["role"]["tictactoe/x"]
    )
    assert abs(b) < 0.5
    none = SpiralConfig(game={"name": "tictactoe"}, baseline="none")
    batch, metrics = step(none, {})
    assert all(s.advantage == s.reward for s in batch) and "role/x/baseline" not in metrics


def test_per_turn_rewards_add_to_the_return_from_their_turn_on() -> None:
    """A game may reward single turns (`Move.reward`): a turn's return is its role's terminal
    return plus the role's per-turn rewards from that turn on; the baseline folds the whole game's."""
    from crucible_trainer.games.base import Move

    episode = x_wins(0)
    episode.turns[0].move = Move(True, "[1]", reward=0.25)  # X's first move
    episode.turns[2].move = Move(True, "[2]", reward=0.5)  # X's second move
    returns = spiral.turn_returns(episode)
    assert returns[0] == 1.75 and returns[2] == 1.5 and returns[4] == 1.0  # X: +1 terminal
    assert returns[1] == returns[3] == -1.0  # O's turns: its terminal return alone
    assert spiral.role_totals(episode) == {"x": 1.75, "o": -1.0}
