"""Every shipped job spec parses, and bad specs fail naming the field."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from crucible_shared.jobs import EvalJob, JobSpec, PipelineJob, TrainJob
from pydantic import TypeAdapter, ValidationError

EXAMPLES = sorted((Path(__file__).resolve().parents[2] / "examples").glob("*.yaml"))
SPEC = TypeAdapter(JobSpec)


def test_there_are_examples() -> None:
    assert len(EXAMPLES) >= 5


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_parses(path: Path) -> None:
    spec = SPEC.validate_python(yaml.safe_load(path.read_text()))
    assert isinstance(spec, TrainJob | EvalJob | PipelineJob)
    assert SPEC.validate_json(spec.model_dump_json()) == spec  # JSON round trip (RQ payloads are JSON)


@pytest.mark.parametrize(
    ("spec", "where"),
    [
        ({"kind": "train", "method": {"name": "grpo"}, "rollout": {"group_size": 1}}, "group_size"),
        ({"kind": "train", "method": {"name": "srrl", "c1": 10, "budget": 10}}, "c1"),
        ({"kind": "train", "method": {"name": "nope"}}, "method"),
        ({"kind": "train", "optim": {"lr": -1}}, "optim.lr"),
        ({"kind": "train", "data": {"dataset": "stdio"}}, "path"),
        ({"kind": "eval", "n": 2, "ks": [5]}, "ks"),
        ({"kind": "train", "surprise": True}, "surprise"),
        ({"kind": "train", "distributed": {"train_gpus": 1, "strategy": "fsdp"}}, "strategy"),
        ({"kind": "train", "distributed": {"train_gpus": 65}}, "distributed.train_gpus"),
        (
            {
                "kind": "train",
                "method": {"name": "sft", "path": "/x.jsonl"},
                "distributed": {"train_gpus": 2},
            },
            "distributed",
        ),
    ],
)
def test_bad_specs_name_the_field(spec: dict, where: str) -> None:
    with pytest.raises(ValidationError) as info:
        SPEC.validate_python(spec)
    assert where in str(info.value)


def test_demo_job_is_the_tiny_example() -> None:
    from crucible_cli.stack_cmd import DEMO_JOB

    example = yaml.safe_load((EXAMPLES[0].parent / "grpo_tiny.yaml").read_text())
    assert TrainJob.model_validate(DEMO_JOB) == TrainJob.model_validate(example)


def test_the_attention_kernel_defaults_to_the_familys_and_old_specs_still_parse() -> None:
    assert TrainJob.model_validate({"kind": "train"}).model.attn_implementation == "auto"
    # `sdpa` was the default before `auto`: an eval job queued with it dumped stays valid...
    old = EvalJob.model_validate({"kind": "eval"}).model_dump(mode="json")
    old["model"]["attn_implementation"] = "sdpa"
    assert EvalJob.model_validate(old).model.attn_implementation == "sdpa"
    # ...while choosing a kernel for the generator's model is still refused, naming the field.
    old["model"]["attn_implementation"] = "eager"
    with pytest.raises(ValidationError, match=r"model\.attn_implementation"):
        EvalJob.model_validate(old)


def test_the_best_recipe_example_is_the_pre_filter_recipe_at_temperature_0_7() -> None:
    """examples/grpo_mbpp_prefilter.yaml is the spec of the learning recipe `pre-t07`
    (recipes/learning.yaml), and the learning table compares it with `pre` seed by seed: the two
    jobs differ in the rollout temperature only."""
    import sys

    sys.path.insert(0, str(EXAMPLES[0].parents[1]))
    from bench.common import load_job, recipes

    found = recipes()
    assert found["pre-t07"]["spec"] == "examples/grpo_mbpp_prefilter.yaml"
    root = EXAMPLES[0].parents[1]
    best, pre = (load_job(root / found[n]["spec"], found[n]["set"]) for n in ("pre-t07", "pre"))
    assert (best.rollout.temperature, pre.rollout.temperature) == (0.7, 1.0)
    assert best.model_dump(exclude={"name", "rollout"}) == pre.model_dump(exclude={"name", "rollout"})
    assert best.rollout.model_dump(exclude={"temperature"}) == pre.rollout.model_dump(exclude={"temperature"})


def test_the_real_model_example_is_the_b16_v_recipe_with_24_problems_a_step() -> None:
    """examples/grpo_qwen1p5b_mbpp.yaml is the spec of the learning recipe `qwen-tta-all-b24-v`,
    which docs/benchmarks.md compares with `qwen-tta-all-b16-v` seed by seed: the two jobs differ in
    the problems a step only."""
    import sys

    sys.path.insert(0, str(EXAMPLES[0].parents[1]))
    from bench.common import job_source, load_job

    b24, b16 = (load_job(*job_source(name, [])[:2]) for name in ("qwen-tta-all-b24-v", "qwen-tta-all-b16-v"))
    assert job_source("qwen-tta-all-b24-v", [])[0].name == "grpo_qwen1p5b_mbpp.yaml"
    assert (b24.optim.problems_per_step, b16.optim.problems_per_step) == (24, 16)
    assert b24.model_dump(exclude={"name", "optim"}) == b16.model_dump(exclude={"name", "optim"})
    assert b24.optim.model_dump(exclude={"problems_per_step"}) == b16.optim.model_dump(
        exclude={"problems_per_step"}
    )
    assert (b24.data.id_range, b24.model.base) == ((511, 974), "qwen2.5-coder-1.5b-instruct")
