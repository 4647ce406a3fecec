"""Any job spec (the union the gateway parses) and the file-system paths it names."""

from __future__ import annotations

import re
from typing import Annotated, Literal

from pydantic import Field

from crucible_shared.jobs.data import DataSpec
from crucible_shared.jobs.evaluation import EvalJob
from crucible_shared.jobs.offline import DPOConfig, SFTConfig
from crucible_shared.jobs.pipeline import PipelineJob
from crucible_shared.jobs.train import TrainJob

JobSpec = Annotated[TrainJob | EvalJob | PipelineJob, Field(discriminator="kind")]


RootKind = Literal["data", "model", "adapter"]


def job_paths(spec: TrainJob | EvalJob | PipelineJob) -> list[tuple[str, str, RootKind]]:
    """Every file-system path a spec names: (dotted field, value, root kind: data | model | adapter).

    Model ids that aren't paths (a built-in name, `org/model` on a hub) are not listed.
    """
    out: list[tuple[str, str, RootKind]] = []

    def data(prefix: str, d: DataSpec | None) -> None:
        if d is not None and d.path:
            out.append((f"{prefix}.path", d.path, "data"))

    if looks_like_path(spec.model.base):
        out.append(("model.base", spec.model.base, "model"))
    if isinstance(spec, EvalJob):
        data("data", spec.data)
        if spec.adapter:
            out.append(("adapter", spec.adapter, "adapter"))
        return out
    data("data", spec.data)
    data("eval.data", spec.eval.data if spec.eval else None)
    if spec.model.init_adapter:
        out.append(("model.init_adapter", spec.model.init_adapter, "adapter"))
    if isinstance(spec, TrainJob) and isinstance(spec.method, SFTConfig | DPOConfig) and spec.method.path:
        out.append(("method.path", spec.method.path, "data"))
    return out


def looks_like_path(name: str) -> bool:
    """A model name meant as a local path: anything but a built-in name or a hub id (`name` or
    `org/name` of letters, digits, `._-`, without `..`). So `org/../../etc` or `a/b/c` is a path,
    checked against the model roots, never handed to a loader that would take it as a directory.

    >>> looks_like_path("/models/x"), looks_like_path("./m"), looks_like_path("org/model")
    (True, True, False)
    >>> looks_like_path("org/../../etc"), looks_like_path("a/b/c"), looks_like_path("smollm2-135m")
    (True, True, False)
    >>> looks_like_path("org/model\\n")  # `$` would match before the newline; `fullmatch` does not
    True
    """
    return not is_hub_id(name)


def is_hub_id(name: str) -> bool:
    """`name` has the shape of a Hugging Face model id, exactly (`org/name` or `name`, no `..`).

    >>> is_hub_id("org/model"), is_hub_id("org/model\\n"), is_hub_id("org/.."), is_hub_id("a/b/c")
    (True, False, False, False)
    """
    return _HUB_ID.fullmatch(name) is not None and ".." not in name


_HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,95}(/[A-Za-z0-9][A-Za-z0-9._-]{0,95})?\Z")
