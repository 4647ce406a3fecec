"""A spec the gateway accepts never fails validation in the worker.

Every numeric field of every spec class reachable from a job is set, one at a time, to each of
its bounds (and to a value just inside an exclusive one) within a few base jobs that switch on
what the field needs (sampling for evaluation temperatures, several iterations for clip ranges,
...). Whatever the gateway's parser accepts goes through what the worker does with it: the queued
JSON parsed again, every evaluation section turned into the runner's `EvalConfig`, the method's
update config, the sandbox limits of the reward. The test also proves the bounds were reached:
each (class, field, bound) is accepted in at least one base job.
"""

from __future__ import annotations

import copy
import math
import types
import typing
from collections.abc import Iterator
from typing import Any

import annotated_types as at
import pytest
from crucible_shared.jobs import EvalJob, EvalSpec, JobSpec, PipelineJob, TrainJob
from crucible_shared.sandbox import Limits
from crucible_trainer.evaluation.config import EvalConfig
from crucible_trainer.methods import method_module
from pydantic import BaseModel, TypeAdapter, ValidationError
from pydantic.fields import FieldInfo

SPEC = TypeAdapter(JobSpec)
SAMPLED_EVAL = {"n": 1000, "ks": [1]}
ITERATED = {"num_iterations": 2}
BASES: dict[str, dict[str, Any]] = {
    "grpo": {
        "kind": "train",
        "method": {"name": "grpo", **ITERATED, "filter": {"mode": "dynamic"}},
        "data": {"split": "train", "shuffle": True},
        "eval": {**SAMPLED_EVAL, "every": 1},
        "overlap": {"max_staleness": 1},
    },
    "grpo-pre": {"kind": "train", "method": {"name": "grpo", "filter": {"mode": "pre"}}},
    "grpo-overlap": {"kind": "train", "method": {"name": "grpo"}, "overlap": {"max_staleness": 1}},
    "srrl": {"kind": "train", "method": {"name": "srrl", **ITERATED, "c1": 1}},
    "srrl-wide": {"kind": "train", "method": {"name": "srrl", "budget": 4096}},
    "reinforce": {"kind": "train", "method": {"name": "reinforce"}},
    "ppo": {"kind": "train", "method": {"name": "ppo"}},
    "spiral": {
        "kind": "train",
        "method": {
            "name": "spiral",
            **ITERATED,
            "opponent": {"kind": "model"},
            "arena": {"every": 1},
        },
    },
    "spiral-tictactoe": {"kind": "train", "method": {"name": "spiral", "game": {"name": "tictactoe"}}},
    "sft": {"kind": "train", "method": {"name": "sft", "path": "rows.jsonl"}},
    "dpo": {
        "kind": "train",
        "method": {
            "name": "dpo",
            "path": "pairs.jsonl",
            "loss_type": ["robust", "sigmoid"],
            "loss_weights": [1.0, 1.0],
        },
    },
    "eval": {"kind": "eval", **SAMPLED_EVAL},
    "eval-greedy": {"kind": "eval"},
    "eval-stdio": {"kind": "eval", "data": {"dataset": "stdio", "path": "cases.jsonl"}},
    "pipeline": {"kind": "pipeline", "eval": SAMPLED_EVAL},
    "pipeline-dpo": {"kind": "pipeline", "train": {"name": "dpo"}},
}
Path = tuple[str | int, ...]


def bounded(info: FieldInfo | Any) -> tuple[type, list[tuple[str, float]]]:
    """The numeric type of a field (int or float) and its bounds: (kind, value) pairs."""
    annotation = info.annotation if isinstance(info, FieldInfo) else info
    metadata = list(getattr(info, "metadata", []))
    if typing.get_origin(annotation) is typing.Annotated:
        annotation, *extra = typing.get_args(annotation)
        metadata += [m for e in extra for m in getattr(e, "metadata", [e])]
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        numeric = [a for a in typing.get_args(annotation) if a in (int, float)]
        annotation = numeric[0] if numeric else annotation
    bounds = []
    for m in metadata:
        for kind in ("ge", "gt", "le", "lt"):
            if isinstance(m, getattr(at, kind.capitalize())):
                bounds.append((kind, getattr(m, kind)))
    return annotation, bounds


def at_bound(kind: str, value: float, numeric: type) -> Any:
    if numeric is int:
        return int(value) + {"ge": 0, "le": 0, "gt": 1, "lt": -1}[kind]
    if kind == "gt":
        return math.nextafter(value, math.inf) if value else 1e-9
    if kind == "lt":
        return math.nextafter(value, -math.inf)
    return float(value)


def fields(model: BaseModel, path: Path = ()) -> Iterator[tuple[Path, str, str, Any]]:
    """(dotted path, class, field, the value to put there) for every bound of every spec class
    inside `model`, lists of models (arena opponents) and list items (ks, loss weights) included."""
    for name, info in type(model).model_fields.items():
        value = getattr(model, name)
        if isinstance(value, BaseModel):
            yield from fields(value, (*path, name))
            continue
        if isinstance(value, list) and value and isinstance(value[0], BaseModel):
            yield from fields(value[0], (*path, name, 0))
            continue
        numeric, bounds = bounded(info)
        for kind, bound in bounds:
            if numeric in (int, float):
                yield (*path, name), type(model).__name__, f"{name}:{kind}", at_bound(kind, bound, numeric)
        args = typing.get_args(info.annotation)
        item = next((typing.get_args(a)[0] for a in args if typing.get_origin(a) is list), None)
        if typing.get_origin(info.annotation) is list:
            item = args[0]
        if item is not None:
            numeric, bounds = bounded(item)
            for kind, bound in bounds:
                if numeric in (int, float):
                    item_value = at_bound(kind, bound, numeric)
                    length = len(value) if isinstance(value, list) else 1
                    yield (*path, name), type(model).__name__, f"{name}[]:{kind}", [item_value] * length


def put(spec: dict[str, Any], path: Path, value: Any) -> dict[str, Any]:
    out = copy.deepcopy(spec)
    node: Any = out
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    return out


def in_the_worker(job: TrainJob | EvalJob | PipelineJob) -> None:
    """What the worker does with a queued spec before and while it runs it, short of running it."""
    parsed = SPEC.validate_json(job.model_dump_json())  # the queued payload is JSON
    assert parsed == job
    evals: list[EvalSpec] = [job] if isinstance(job, EvalJob) else [job.eval] if job.eval else []
    for spec in evals:
        config = EvalConfig.from_spec(spec, model="policy", chat=True, seed=job.seed, concurrency=4)
        assert (config.n, config.temperature, config.max_tokens) == (
            spec.n,
            spec.temperature,
            spec.max_tokens,
        )
    if isinstance(job, TrainJob) and not job.method.offline:
        method_module(job.method).update_config(job.method, job)
        Limits(wall_time_s=job.reward.time_limit_s, test_time_s=job.reward.time_limit_s)
    if isinstance(job, PipelineJob):
        Limits(wall_time_s=job.annotate.time_limit_s, test_time_s=job.annotate.time_limit_s)


def test_every_spec_accepted_at_its_bounds_runs_in_the_worker() -> None:
    seen: set[tuple[str, str]] = set()
    accepted: set[tuple[str, str]] = set()
    failures: list[str] = []
    for base_name, base in BASES.items():
        job = SPEC.validate_python(base)
        dumped = job.model_dump(mode="json")
        in_the_worker(job)
        for path, cls, bound, value in fields(job):
            seen.add((cls, bound))
            try:
                candidate = SPEC.validate_python(put(dumped, path, value))  # what the gateway does
            except ValidationError:
                continue  # refused at submission: the worker never sees it
            accepted.add((cls, bound))
            try:
                in_the_worker(candidate)
            except (ValidationError, ValueError, AssertionError) as exc:
                where = ".".join(map(str, path))
                failures.append(f"{base_name}: {where}={value!r} accepted, fails in the worker: {exc}")
    assert not failures, "\n".join(failures)
    assert len(seen) > 100  # the walk reached the spec classes
    missed = sorted(seen - accepted)
    assert not missed, f"bounds no base job accepts (add a base that enables them): {missed}"


@pytest.mark.parametrize("field", ["n", "temperature", "top_p", "max_tokens", "ks", "greedy"])
def test_eval_spec_and_runner_config_share_defaults_and_bounds(field: str) -> None:
    spec, runner = EvalSpec.model_fields[field], EvalConfig.model_fields[field]
    assert repr(spec) == repr(runner)
    assert EvalSpec().model_dump()[field] == EvalConfig().model_dump()[field]
