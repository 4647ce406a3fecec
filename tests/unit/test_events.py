"""Job events are one typed union (`crucible_shared.events`): every emitter's event validates, a
wrong one is refused where it is written, every type renders by its type in the CLI, and every
event the trainer's code emits is a type of the union."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from crucible_cli.render import describe
from crucible_shared import events
from crucible_trainer.runtime.channel import LocalChannel
from crucible_trainer.runtime.sink import EventSink
from pydantic import ValidationError

from tests.event_examples import EMITTED_TYPES, EXAMPLES

ROOT = Path(__file__).resolve().parents[2]


def test_the_examples_cover_every_event_type() -> None:
    assert EMITTED_TYPES | {"raw"} == set(events.EVENT_TYPES)


@pytest.mark.parametrize(("kind", "fields", "phrase"), EXAMPLES, ids=[e[0] for e in EXAMPLES])
def test_every_event_type_goes_from_the_trainer_to_a_cli_line(kind, fields, phrase, tmp_path) -> None:
    received: list[tuple[str, dict]] = []
    sink = EventSink(LocalChannel("job", lambda k, data: received.append((k, data))), tmp_path)
    sink.emit(kind, **fields)
    [(got, data)] = received
    assert got == kind and data["type"] == kind and isinstance(data["time"], float)
    assert events.parse(got, data) == events.parse(kind, {**fields, "time": data["time"]})
    line = describe(got, data, samples=True)
    assert (line is None) if phrase is None else (phrase in (line or "")), line


@pytest.mark.parametrize(
    ("kind", "fields", "field"),
    [
        ("stale_policy", {"version": 1, "name": "v1", "step": 1}, "diff"),  # the field the CLI once read
        ("status", {"status": "no comparison"}, "status"),
        ("metrics", {"step": 1}, "metrics"),
        ("nonsense", {}, "type"),
    ],
)
def test_a_wrong_event_is_refused_where_it_is_written(kind, fields, field) -> None:
    with pytest.raises(ValidationError, match=field):
        LocalChannel("job", lambda k, data: None).emit(kind, **fields)


def test_every_event_the_trainer_emits_is_a_declared_type() -> None:
    emitted: set[str] = set()
    for root in ("services/trainer/crucible_trainer", "services/gateway/crucible_gateway"):
        for path in (ROOT / root).rglob("*.py"):
            text = path.read_text()
            emitted |= set(
                re.findall(r"""(?:emit|event)\(\s*(?:(?:record\.id|job_id),\s*)?["']([a-z_]+)["']""", text)
            )
    assert emitted, "the pattern no longer finds the emitters"
    assert emitted <= set(events.EVENT_TYPES), emitted - set(events.EVENT_TYPES)
    assert emitted == EMITTED_TYPES, EMITTED_TYPES - emitted  # and no type is declared that nothing emits


def test_an_unknown_or_malformed_event_from_a_newer_server_is_not_lost() -> None:
    assert describe("something_new", {"x": 1}) is None
    assert describe("status", {"type": "status"}) == 'status     {"type": "status"}'


def test_a_row_cut_short_by_a_kill_does_not_take_the_next_runs_first_row(tmp_path) -> None:
    """A run killed while writing a row leaves half a line; an offline job's next run appends
    without a resume's clean-up first: its rows (and its journal's) still read back whole, and
    the readers (the learning curve here) skip the half line."""
    from crucible_trainer.runtime.sink import append_lines, metrics_rows

    sink = EventSink(LocalChannel("job", lambda k, data: None), tmp_path)
    sink.metrics_path.write_text('{"step": 1, "reward_mean": 0.5}\n{"step": 2, "rew')  # killed mid-write
    sink.metrics(2, {"reward_mean": 0.25}, emit=False)
    sink.metrics(3, {"reward_mean": 0.125}, emit=False)
    assert metrics_rows(sink.metrics_path) == [
        {"step": 1, "reward_mean": 0.5},
        {"step": 2, "reward_mean": 0.25},
        {"step": 3, "reward_mean": 0.125},
    ]
    from crucible_trainer.online.curves import learning_curve

    assert learning_curve(sink.metrics_path, tmp_path / "curve.png")  # the half line left in place
    journal = tmp_path / "journal.jsonl"
    append_lines(journal, ["{}"])  # a new file, and one ending in a line end, gain no empty line
    append_lines(journal, ['{"a": 1}'])
    assert journal.read_text() == '{}\n{"a": 1}\n'
