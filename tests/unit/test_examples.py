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


def test_the_best_recipe_example_is_the_benchmarks_best_recipe() -> None:
    """examples/grpo_mbpp_prefilter.yaml is the job `bench/seeds.py run pre-t07` measured."""
    import sys

    sys.path.insert(0, str(EXAMPLES[0].parents[1]))
    from bench.grpo_race import job_spec
    from bench.seeds import RECIPES

    flags = RECIPES["pre-t07"][0]
    assert flags[flags.index("--filter") + 1] == "pre" and flags[flags.index("--micro-batch") + 1] == "16"
    assert flags[flags.index("--temperature") + 1] == "0.7"
    measured = job_spec(
        "grpo", 100, 500, "smollm2-135m-instruct", group_filter="pre", micro_batch=16, temperature=0.7
    )
    example = yaml.safe_load((EXAMPLES[0].parent / "grpo_mbpp_prefilter.yaml").read_text())
    differ = {"name", "logging"}  # the example's name; the benchmark turns wandb off
    assert TrainJob.model_validate(example).model_dump(exclude=differ) == TrainJob.model_validate(
        measured
    ).model_dump(exclude=differ)
