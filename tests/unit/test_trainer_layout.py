"""The trainer's rooms import one way (read from the sources, imports inside functions included):
the job plumbing (`runtime/`) stands beneath every job and imports no other room; the building
blocks (rl, methods, games, tasks, evaluation) never import the jobs that hold them (online,
offline, distributed); and only the multi-rank job builds on the online loop."""

from __future__ import annotations

from tests.unit.test_import_cycles import graph

PACKAGE = "crucible_trainer"
JOBS = {"online", "offline", "distributed"}
BLOCKS = {"rl", "methods", "games", "tasks", "evaluation"}


def _room(module: str) -> str:
    """`crucible_trainer.rl.policy` -> `rl`; a module at the package's root is a room of its own."""
    return module.split(".")[1] if "." in module else ""


def room_edges() -> dict[str, set[str]]:
    """room -> the other rooms its modules import."""
    out: dict[str, set[str]] = {}
    for module, imports in graph().items():
        if module.startswith(f"{PACKAGE}."):
            rooms = {_room(m) for m in imports if m.startswith(f"{PACKAGE}.")}
            out.setdefault(_room(module), set()).update(rooms - {_room(module)})
    return out


def test_the_rooms_are_read_from_the_sources() -> None:
    edges = room_edges()
    assert {"runtime", "online", "rl", "methods", "evaluation", "settings", "worker"} <= set(edges)
    assert "runtime" in edges["online"] and "rl" in edges["methods"]  # the parser sees imports


def test_the_job_plumbing_imports_no_other_room() -> None:
    assert room_edges()["runtime"] <= {"settings"}


def test_building_blocks_never_import_the_jobs_that_hold_them() -> None:
    edges = room_edges()
    wrong = {room: sorted(edges[room] & JOBS) for room in BLOCKS if edges.get(room, set()) & JOBS}
    assert not wrong, f"import the other way (the job holds the block): {wrong}"


def test_only_the_multi_rank_job_builds_on_the_online_loop() -> None:
    assert {room for room, rooms in room_edges().items() if "online" in rooms} <= {"distributed"}
