"""SPIRAL: self-play on execution games, with role-conditioned advantage estimation (config:
`crucible_shared.jobs.SpiralConfig`).

A step plays `games_per_step` games of the configured game (`crucible_trainer.games`) with the
learning policy in every role (self-play: its role is named in each prompt) or in some of them
against a fixed opponent (the frozen base, any adapter the generator serves, a random legal
mover). Each of the learner's turns becomes one `Sample` with that turn's prompt and completion
ids, so the policy trains on its own turns only, each credited with its role's return in the game.

Advantages (RAE): a turn's return minus the baseline of its (game, role), an exponential moving
average of that role's returns (`baseline_decay` per return) as it stood before the step; after
the step each game's return updates its role's baseline. `baseline: shared` keeps one baseline
for every role (the ablation RAE is measured against), `none` trains on raw returns, `scale: role`
divides by the std of the role's returns in the step. Both kinds of baseline are kept whichever
trains, so every step logs the mean squared advantage each would give (`rae/*`). The baselines
are the method's state (`StepContext.state`): saved with every checkpoint, restored on resume.

Arena games (`arena`) against fixed opponents run in the same rounds as the training games and
only measure: the learner's win / draw / loss rates per opponent and role.
"""

from __future__ import annotations

import random
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

from crucible_shared import jsonl
from crucible_shared.jobs import Opponent, SpiralConfig
from crucible_shared.sandbox import Limits

from crucible_trainer.games import new_game
from crucible_trainer.games.engine import Episode, ModelPlayer, Player, RandomPlayer, Sampling, play
from crucible_trainer.methods.clipped import update_config as update_config  # GRPO, SRRL, SPIRAL share it
from crucible_trainer.rl.advantages import baseline_advantages, ema_baselines, scale_within
from crucible_trainer.rl.context import StepContext
from crucible_trainer.rl.rollout import Sample


def judge(cfg: SpiralConfig) -> None:  # no pre-filter: every problem trains
    return None


async def collect(
    ctx: StepContext, cfg: SpiralConfig, indices: list[int]
) -> tuple[list[Sample], dict[str, float]]:
    job = ctx.job
    r = job.rollout
    sampling = Sampling(r.temperature, r.top_p, r.max_tokens, r.stop, job.seed * 1_000_003 + ctx.step * 7919)
    learner = ModelPlayer(ctx.roller.generator, ctx.model_name, "learner", sampling, learner=True)
    limits = job.reward.limits()
    seed = f"spiral:{job.seed}:{ctx.step}"
    opponent = _player(ctx, cfg.opponent, learner, sampling, random.Random(f"{seed}:random"))
    episodes = _episodes(cfg, cfg.games_per_step, learner, opponent, "train", limits, seed)
    arena: list[Episode] = []
    if cfg.arena.every and (ctx.step - 1) % cfg.arena.every == 0:
        for fixed in cfg.arena.opponents:
            player = _player(ctx, fixed, learner, sampling, random.Random(f"{seed}:arena:{fixed.label}"))
            arena += _episodes(cfg, cfg.arena.games, learner, player, f"arena/{fixed.label}", limits, seed)
    await play(episodes + arena, ctx.roller.sandbox, _renderer(ctx), ctx.timing)
    batch = _samples(cfg, episodes)
    metrics = _advantages(ctx, cfg, episodes, batch)
    metrics.update(game_metrics(episodes, batch))
    for fixed in cfg.arena.opponents if arena else []:
        label = f"arena/{fixed.label}"
        metrics.update(arena_metrics([e for e in arena if e.tag == label], label))
    return batch, metrics


# -- playing ------------------------------------------------------------------------------------


def _player(
    ctx: StepContext, opponent: Opponent, learner: ModelPlayer, sampling: Sampling, rng: random.Random
) -> Player:
    if opponent.kind == "self":
        return learner
    if opponent.kind == "random":
        return RandomPlayer(rng)
    model = ctx.base_name if opponent.model == "base" else opponent.model
    return ModelPlayer(ctx.roller.generator, model, opponent.label, sampling)


def _episodes(
    cfg: SpiralConfig, count: int, learner: Player, opponent: Player, tag: str, limits: Limits, seed: str
) -> list[Episode]:
    """`count` fresh games; against a fixed opponent the learner takes its roles in turn."""
    roles, mine = type(cfg.game).roles, cfg.roles_learned
    out = []
    for i in range(count):
        game = new_game(cfg.game, random.Random(f"{seed}:{tag}:{i}"), limits)
        if opponent is learner:
            seats: dict[str, Player] = dict.fromkeys(roles, learner)
        else:
            seats = {role: learner if role == mine[i % len(mine)] else opponent for role in roles}
        out.append(Episode(game, seats, tag))
    return out


def _renderer(ctx: StepContext) -> Callable[[list[dict[str, str]]], str]:
    """Messages -> the prompt text: the chat template for chat models, the plain contents otherwise."""
    if ctx.prompts.chat:
        return ctx.prompts.render
    return lambda messages: "\n\n".join(m["content"] for m in messages) + "\n\n"


# -- samples and advantages ---------------------------------------------------------------------


def turn_returns(episode: Episode) -> list[float | None]:
    """Each turn's return: its role's terminal return plus the role's per-turn rewards from this turn
    on (None when the role does not count)."""
    returns = episode.game.returns()
    out: list[float | None] = [None] * len(episode.turns)
    later: dict[str, float] = defaultdict(float)
    for i in range(len(episode.turns) - 1, -1, -1):
        turn = episode.turns[i]
        later[turn.role] += turn.move.reward
        if turn.role in returns:
            out[i] = returns[turn.role] + later[turn.role]
    return out


def role_totals(episode: Episode) -> dict[str, float]:
    """What each learner role that counts scored in the game (terminal + per-turn rewards)."""
    returns = episode.game.returns()
    totals = {role: returns[role] for role in episode.learner_roles if role in returns}
    for turn in episode.turns:
        if turn.role in totals:
            totals[turn.role] += turn.move.reward
    return totals


def _samples(cfg: SpiralConfig, episodes: list[Episode]) -> list[Sample]:
    """One sample per learner turn (a turn whose role does not count has no reward: not trained on)."""
    out = []
    for g, episode in enumerate(episodes):
        record = episode.game.record()
        outcome = episode.game.returns()
        opponent = next((p.label for p in episode.seats.values() if not p.learner), "self")
        for t, (turn, value) in enumerate(zip(episode.turns, turn_returns(episode), strict=True)):
            if not turn.learner:
                continue
            c = turn.completion
            out.append(
                Sample(
                    task_index=0,
                    group=g,
                    prompt_ids=c.prompt_ids,
                    completion_ids=c.completion_ids,
                    text=c.text,
                    code="",
                    gen_logprobs=c.logprobs,
                    finish_reason=c.finish_reason,
                    phase=turn.role,
                    reward=value,
                    problem_id=f"{cfg.game.name}#{g}",
                    info={
                        "game": g,
                        "turn": t,
                        "role": turn.role,
                        "opponent": opponent,
                        "legal": turn.move.legal,
                        "note": turn.move.note,
                        # What logs and `crucible watch --samples` show of a turn (no test verdict here).
                        "status": "legal" if turn.move.legal else "illegal",
                        "message": turn.move.note,
                        "outcome": outcome,
                        "record": record,
                    },
                )
            )
    return out


def _key(cfg: SpiralConfig, role: str, kind: str) -> str:
    return f"{cfg.game.name}/{role if kind == 'role' else '*'}"


def _advantages(
    ctx: StepContext, cfg: SpiralConfig, episodes: list[Episode], batch: list[Sample]
) -> dict[str, float]:
    """Set every scored sample's advantage from the baselines in `ctx.state`, then fold this step's
    returns into them. Returns the RAE metrics."""
    state = ctx.state.setdefault("baselines", {"role": {}, "shared": {}})
    scored = [s for s in batch if s.reward is not None]
    returns = [float(s.reward) for s in scored if s.reward is not None]
    roles = [s.phase for s in scored]
    metrics: dict[str, float] = {}
    shadow = {}
    for kind in ("role", "shared"):
        keys = [_key(cfg, role, kind) for role in roles]
        shadow[kind] = baseline_advantages(returns, keys, state[kind])
        if shadow[kind]:
            metrics[f"rae/advantage_sq_{kind}"] = sum(a * a for a in shadow[kind]) / len(shadow[kind])
    advantages = shadow[cfg.baseline] if cfg.baseline != "none" else list(returns)
    if cfg.scale == "role":
        advantages = scale_within(advantages, returns, roles)
    for s, a in zip(scored, advantages, strict=True):
        s.advantage = a
        if cfg.baseline != "none":
            s.info["baseline"] = state[cfg.baseline].get(_key(cfg, s.phase, cfg.baseline), 0.0)
    for role in cfg.roles_learned:
        mine = [a for a, r in zip(advantages, roles, strict=True) if r == role]
        if mine:
            mean = sum(mine) / len(mine)
            metrics[f"role/{role}/advantage_mean"] = mean
            metrics[f"role/{role}/advantage_std"] = (sum((a - mean) ** 2 for a in mine) / len(mine)) ** 0.5
        if cfg.baseline != "none":
            metrics[f"role/{role}/baseline"] = state[cfg.baseline].get(_key(cfg, role, cfg.baseline), 0.0)
    totals = [(role, value) for e in episodes for role, value in role_totals(e).items()]
    for kind in ("role", "shared"):
        folded = [(_key(cfg, role, kind), value) for role, value in totals]
        state[kind] = ema_baselines(folded, state[kind], cfg.baseline_decay)
    return metrics


# -- metrics ------------------------------------------------------------------------------------


def _rates(values: list[float], prefix: str) -> dict[str, float]:
    if not values:
        return {}
    n = len(values)
    return {
        f"{prefix}win_rate": sum(v > 0 for v in values) / n,
        f"{prefix}draw_rate": sum(v == 0 for v in values) / n,
        f"{prefix}loss_rate": sum(v < 0 for v in values) / n,
    }


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def game_metrics(episodes: list[Episode], batch: list[Sample]) -> dict[str, float]:
    """Per role: return, win / draw / loss and illegal-move rates, tokens; per game: the game's own
    stats (`game/<key>`), void games, how far from zero-sum the outcomes are; and the reward
    figures every method logs."""
    out: dict[str, float] = {"games": float(len(episodes)), "samples": float(len(batch))}
    scored = [s for s in batch if s.reward is not None]
    out["dropped_turns"] = float(len(batch) - len(scored))
    if scored:
        rewards = [float(s.reward) for s in scored if s.reward is not None]
        out["reward_mean"] = _mean(rewards)
        out["reward_std"] = _mean([(x - out["reward_mean"]) ** 2 for x in rewards]) ** 0.5
        out["completion_tokens_mean"] = _mean([float(len(s.completion_ids)) for s in scored])
        out["truncated_fraction"] = _mean([float(s.finish_reason == "length") for s in scored])
    by_role: dict[str, list[Sample]] = {role: [] for e in episodes for role in e.learner_roles}
    for s in batch:
        by_role[s.phase].append(s)
    for role, turns in by_role.items():
        out[f"role/{role}/turns"] = float(len(turns))
        if turns:  # a role can go without a turn (its opponent's first move was illegal)
            out[f"role/{role}/illegal_rate"] = _mean([float(not s.info["legal"]) for s in turns])
            out[f"role/{role}/tokens_mean"] = _mean([float(len(s.completion_ids)) for s in turns])
    if batch:
        out["game/illegal_rate"] = _mean([float(not s.info["legal"]) for s in batch])
    totals: dict[str, list[float]] = defaultdict(list)
    for e in episodes:
        for role, value in role_totals(e).items():
            totals[role].append(value)
    for role, values in totals.items():
        out[f"role/{role}/return_mean"] = _mean(values)
        out.update(_rates(values, f"role/{role}/"))
    counted = [e.game.returns() for e in episodes]
    out["game/void_rate"] = _mean([float(not r) for r in counted]) if counted else 0.0
    sums = [sum(r.values()) for r in counted if r]
    if sums:
        out["game/return_sum_mean"] = _mean(sums)
    out["game/turns_per_game"] = _mean([float(len(e.turns)) for e in episodes]) if episodes else 0.0
    stats: dict[str, list[float]] = defaultdict(list)
    for e in episodes:
        for key, value in e.game.stats().items():
            stats[key].append(value)
    out.update({f"game/{key}": _mean(values) for key, values in stats.items()})
    return out


def arena_metrics(episodes: list[Episode], prefix: str) -> dict[str, float]:
    """The learner's outcomes against one fixed opponent: overall and per role it played."""
    per_role: dict[str, list[float]] = defaultdict(list)
    illegal = []
    for e in episodes:
        returns = e.game.returns()
        for role in e.learner_roles:
            if role in returns:
                per_role[role].append(returns[role])
        illegal += [float(not t.move.legal) for t in e.turns if t.learner]
    out: dict[str, float] = {f"{prefix}/games": float(len(episodes))}
    out.update(_rates([v for values in per_role.values() for v in values], f"{prefix}/"))
    for role, values in per_role.items():
        out.update(_rates(values, f"{prefix}/{role}/"))
    if illegal:
        out[f"{prefix}/illegal_rate"] = _mean(illegal)
    return out


# -- report -------------------------------------------------------------------------------------


def report(cfg: SpiralConfig, run_dir: Path) -> dict[str, Any]:
    """`games.md`: per role, the mean return and win rate over the first and last steps; the arena's
    first and last measurements against each opponent."""
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return {}
    steps = [r for r in jsonl.rows(path.read_text()) if "games" in r]
    if not steps:
        return {}
    lines = [f"# {cfg.game.name}: {len(steps)} steps, opponent {cfg.opponent.label}", ""]
    lines += [
        "| role | first: return | first: win rate | last: return | last: win rate |",
        "|---|---:|---:|---:|---:|",
    ]
    summary: dict[str, Any] = {}
    for role in cfg.roles_learned:
        first, last = steps[0], steps[-1]
        cells = [
            f"{row.get(f'role/{role}/{k}', float('nan')):.3f}"
            for row in (first, last)
            for k in ("return_mean", "win_rate")
        ]
        lines.append(f"| {role} | " + " | ".join(cells) + " |")
    for fixed in cfg.arena.opponents if cfg.arena.every else []:
        key = f"arena/{fixed.label}/win_rate"
        points = [(r["step"], r[key]) for r in steps if key in r]
        if points:
            lines.append("")
            lines.append(
                f"Against {fixed.label}: win rate {points[0][1]:.1%} at step {points[0][0]}, {points[-1][1]:.1%} at step {points[-1][0]}."
            )
            summary[f"arena_{fixed.label}_win_rate"] = points[-1][1]
    (run_dir / "games.md").write_text("\n".join(lines) + "\n")
    return {"games_report": str(run_dir / "games.md"), **summary}
