"""A job's events as a person reads them: one aligned line per event, rounded figures with units,
a progress bar with the latest reward and pass rate, and the report paths at the end.

`describe` turns one event into a line (or None for events the bar shows); `follow` drives the
bar from a gateway's event stream. `--json` callers print the raw events instead.
"""

from __future__ import annotations

import functools
import json
import textwrap
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from crucible_shared import events as ev

LABEL_WIDTH = 10


def _pct(value: Any) -> str:
    return "-" if value is None else f"{value * 100:.1f}%"


def _num(value: Any, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _line(label: str, text: str) -> str:
    return f"{label:<{LABEL_WIDTH}} {text}"


def _dataset(data: dict[str, Any]) -> str:
    name = str(data.get("dataset") or "").replace("mbpp", "MBPP").replace("humaneval", "HumanEval")
    return f"{name} tasks" if name else "tasks"


def describe(event: str, data: dict[str, Any], *, samples: bool = False) -> str | None:
    """One human line for an event (None: shown by the progress bar, or not at all).

    The event is read as its type in `crucible_shared.events` and rendered by that type; one that
    does not parse (a newer server's) is shown as it came.

    >>> describe("adapter_published", {"step": 1, "name": "job-v1", "load_s": 0.6683764339995832})
    'v1         hot-swapped into the generator in 0.67 s (job-v1)'
    >>> describe("eval_finished", {"label": "before", "report": "r", "greedy_pass@1": 0.0, "problems": 4,
    ...          "dataset": "mbpp", "mean_generated_tokens": 118.4})
    'before     pass@1 0.0% on 4 MBPP tasks, 118 tokens avg'
    >>> describe("eval_finished", {"label": "after", "report": "r", "dataset": "", "greedy_pass@1": None,
    ...          "pass@1": 0.625, "problems": 2})
    'after      pass@1 62.5% (sampled) on 2 tasks'
    >>> describe("requeued", {"reason": "the worker stopped after step 3"})
    'requeued   the worker stopped after step 3 (no attempt used)'
    """
    from crucible_shared import events as ev
    from pydantic import ValidationError

    try:
        parsed = ev.parse(event, data)
    except ValidationError:
        if event not in ev.EVENT_TYPES:
            return None  # an event this CLI does not know
        return _line(event, json.dumps(data, default=str)[:300])
    render = _renderers().get(type(parsed))
    if isinstance(parsed, ev.SampleEvent) and not samples:
        return None
    return None if render is None else render(parsed)


def _status(e: ev.StatusEvent) -> str:
    return _line("status", f"{e.status}: {e.error}" if e.error else e.status)


def _settings(e: ev.SettingsEvent) -> str:
    parts = [e.device, e.dtype, f"micro-batch {e.micro_batch}"]
    checkpointing = {True: "on", False: "off"}.get(e.gradient_checkpointing, "per micro-batch")
    parts.append("gradient checkpointing " + checkpointing)
    parts.append(f"attention {e.attn_implementation}")
    if e.gpu_free_gb is not None:
        parts.append(f"{e.gpu_free_gb} of {e.gpu_total_gb} GiB free")
    return _line("settings", ", ".join(parts))


def _eval_started(e: ev.EvalStartedEvent) -> str:
    where = f" ({e.data})" if e.data else ""
    return _line(e.label, f"evaluating {e.model} on {e.tasks} tasks{where}")


def _eval_finished(e: ev.EvalFinishedEvent) -> str:
    parts = [] if e.greedy_pass_at_1 is None else [f"pass@1 {_pct(e.greedy_pass_at_1)}"]  # samples only
    parts += [f"{k} {_pct(v)} (sampled)" for k, v in e.pass_at_k.items()]
    text = " · ".join(parts) + f" on {e.problems} {_dataset({'dataset': e.dataset})}"
    if e.mean_generated_tokens is not None:
        text += f", {e.mean_generated_tokens:.0f} tokens avg"
    if e.hard_coded_answers:  # worth reading before trusting the pass rate
        text += f", {e.hard_coded_answers} ignore their input"
    return _line(e.label, text)


def _requeued(e: ev.RequeuedEvent) -> str:
    return _line(
        "requeued", f"{e.reason}; attempt {e.attempt}" if e.attempt else f"{e.reason} (no attempt used)"
    )


def _stale(e: ev.StalePolicyEvent) -> str:
    return _line(
        "stale",
        f"the generator's log-probs differ by {_num(e.diff, 3)} per token for version {e.version} "
        f"(tolerance {e.tolerance})",
    )


def _sample(e: ev.SampleEvent) -> str:
    head = f"step {e.step} {e.problem_id} ({e.phase}): reward {_num(e.reward)}, {e.status}"
    if e.message:
        head += f" - {e.message}"
    completion = "\n".join(e.completion.splitlines()[:12])
    return _line("sample", head) + "\n" + textwrap.indent(completion, " " * (LABEL_WIDTH + 1) + "| ")


@functools.cache
def _renderers() -> dict[type, Callable[[Any], str | None]]:
    """Each event type's line (imported on first use: `crucible --help` loads no pydantic)."""
    from crucible_shared import events as ev

    return {
        ev.StatusEvent: _status,
        ev.NoticeEvent: lambda e: _line("note", e.message),
        ev.SettingsEvent: _settings,
        ev.EvalStartedEvent: _eval_started,
        ev.EvalFinishedEvent: _eval_finished,
        ev.AdapterPublishedEvent: lambda e: _line(
            f"v{e.step}", f"hot-swapped into the generator in {_num(e.load_s)} s ({e.name})"
        ),
        ev.DifficultyFilterEvent: lambda e: _line(
            "filter", f"kept {e.kept} of {e.of} problems (0 < pass rate < 1)"
        ),
        ev.ResumedEvent: lambda e: _line("resumed", f"from the checkpoint of step {e.step}"),
        ev.CheckpointEvent: lambda e: _line("checkpoint", f"step {e.step} saved ({e.path})"),
        ev.StageEvent: lambda e: _stage_line(e.model_dump(by_alias=True)),
        ev.RequeuedEvent: _requeued,
        ev.StalePolicyEvent: _stale,
        ev.SampleEvent: _sample,
        ev.RawEvent: lambda e: _line("raw", e.data[:300]),
        ev.MetricsEvent: lambda e: None,  # the progress bar's
        ev.StageProgressEvent: lambda e: None,  # a pipeline's stage bar (not drawn yet)
    }


def _stage_line(data: dict[str, Any]) -> str:
    """A pipeline stage's start, end (with its headline counts) or skip.

    >>> _stage_line({"stage": "round-1/build", "status": "finished", "seconds": 0.2, "nbest": 12, "pairs": 30})
    'stage      round-1/build finished in 0.2 s: nbest 12, pairs 30'
    """
    stage, status = data.get("stage", "?"), data.get("status", "?")
    if status == "skipped":
        return _line("stage", f"{stage} skipped ({data.get('reason', 'up to date')})")
    if status != "finished":
        return _line("stage", f"{stage} {status}")
    shown = ("problems", "candidates", "passing", "nbest", "pairs", "steps", "greedy_pass@1", "path")
    facts = [
        f"{k} {_pct(data[k]) if k.startswith('greedy') else data[k]}"
        for k in shown
        if data.get(k) is not None
    ]
    return _line(
        "stage",
        f"{stage} finished in {_num(data.get('seconds'), 1)} s" + (": " + ", ".join(facts) if facts else ""),
    )


def bar_text(step: Any, metrics: dict[str, Any]) -> str:
    """The progress bar's label: reward and pass rate; for a game job each role's win rate; for
    SFT / DPO the training loss.

    >>> bar_text(3, {"reward_mean": 0.25, "pass_rate": 0.5})
    'step 3: reward 0.250 · pass 50.0%'
    >>> bar_text(3, {"games": 8, "role/x/win_rate": 0.5, "role/o/win_rate": 0.25, "game/illegal_rate": 0.125})
    'step 3: x wins 50.0% · o wins 25.0% · illegal 12.5%'
    >>> bar_text(3, {"loss": 0.6931})
    'step 3: loss 0.6931'
    """
    if "games" in metrics:
        roles = [k.split("/")[1] for k in metrics if k.startswith("role/") and k.endswith("/win_rate")]
        parts = [f"{role} wins {_pct(metrics[f'role/{role}/win_rate'])}" for role in roles]
        parts.append(f"illegal {_pct(metrics.get('game/illegal_rate'))}")
        return f"step {step}: " + " · ".join(parts)
    if "reward_mean" not in metrics and "loss" in metrics:  # SFT / DPO: the training loss
        return f"step {step}: loss {_num(metrics.get('loss'), 4)}"
    return (
        f"step {step}: reward {_num(metrics.get('reward_mean'), 3)} · pass {_pct(metrics.get('pass_rate'))}"
    )


def game_lines(step: Any, metrics: dict[str, Any]) -> list[str]:
    """A game job's step as lines a person reads: how each role did, the game's own figures, and
    the arena's results against each fixed opponent.

    >>> for line in game_lines(2, {"games": 4, "role/writer/return_mean": -0.5, "role/writer/win_rate": 0.25,
    ...         "role/writer/illegal_rate": 0.0, "role/writer/baseline": -0.1, "game/writer_invalid_rate": 0.75,
    ...         "game/predictor_accuracy": 0.0, "arena/base/games": 4, "arena/base/win_rate": 0.5,
    ...         "arena/base/draw_rate": 0.0, "arena/base/loss_rate": 0.5}):
    ...     print(line)
    games      step 2: writer return -0.50, wins 25.0%, illegal 0.0%, baseline -0.10
    games      step 2: predictor accuracy 0.0% · writer invalid 75.0%
    arena      step 2 vs base: win 50.0% · draw 0.0% · loss 50.0% (4 games)
    """
    if "games" not in metrics:
        return []
    lines = []
    roles = [k.split("/")[1] for k in metrics if k.startswith("role/") and k.endswith("/return_mean")]
    for role in roles:
        text = (
            f"step {step}: {role} return {_num(metrics[f'role/{role}/return_mean'])}, "
            f"wins {_pct(metrics.get(f'role/{role}/win_rate'))}, "
            f"illegal {_pct(metrics.get(f'role/{role}/illegal_rate'))}"
        )
        if f"role/{role}/baseline" in metrics:
            text += f", baseline {_num(metrics[f'role/{role}/baseline'])}"
        lines.append(_line("games", text))
    shown = {"game/predictor_accuracy": "predictor accuracy", "game/writer_invalid_rate": "writer invalid"}
    shown |= {"game/draw_rate": "draws", "game/forfeit_rate": "lost to an illegal move"}
    facts = [f"{label} {_pct(metrics[key])}" for key, label in shown.items() if key in metrics]
    if facts:
        lines.append(_line("games", f"step {step}: " + " · ".join(facts)))
    opponents = [k.split("/")[1] for k in metrics if k.startswith("arena/") and k.endswith("/games")]
    for name in opponents:
        rates = " · ".join(
            f"{r} {_pct(metrics.get(f'arena/{name}/{r}_rate'))}" for r in ("win", "draw", "loss")
        )
        lines.append(
            _line("arena", f"step {step} vs {name}: {rates} ({metrics[f'arena/{name}/games']:.0f} games)")
        )
    return lines


def follow(client: Any, job_id: str, console: Any, *, samples: bool = False, raw: bool = False) -> Any:
    """Print a job's events until it ends; returns its final record."""
    if raw:
        for event_id, event, data in client.events(job_id):
            print(json.dumps({"id": event_id, "event": event, "data": data}), flush=True)
        return client.job(job_id)
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total}"),
        TimeElapsedColumn(),
        console=console,
    ) as bar:
        task = bar.add_task(job_id, total=None)
        total = None
        for _id, event, data in client.events(job_id):
            if event == "metrics":
                if total is None:
                    total = client.job(job_id).total_steps
                bar.update(
                    task,
                    completed=data.get("step", 0),
                    total=total,
                    description=bar_text(data.get("step"), data.get("metrics", {})),
                )
                # A game job's steps with arena games (every arena.every steps) get a summary.
                if any(k.startswith("arena/") for k in data.get("metrics", {})):
                    for line in game_lines(data.get("step"), data.get("metrics", {})):
                        bar.console.print(line, markup=False, highlight=False)
                continue
            text = describe(event, data, samples=samples)
            if text is not None:
                bar.console.print(text, markup=False, highlight=False)
    return client.job(job_id)


def print_outcome(console: Any, record: Any) -> None:
    """The final status, and where the job's results are."""
    error = f" ({record.error})" if record.error else ""
    console.print(f"{record.id}: {record.status.value}{error}", markup=False, highlight=False)
    summary = record.summary.model_dump() if record.summary else {}
    for key, label in (
        ("adapter", "adapter"),
        ("before_after", "before/after"),
        ("games_report", "games"),
        ("report", "report"),
        ("learning_curve", "curves"),
        ("merged", "merged"),
        ("run_dir", "run dir"),
    ):
        if summary.get(key):
            console.print(_line(label, str(summary[key])), markup=False, highlight=False)
