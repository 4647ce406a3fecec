"""`--set a.b=c` on every command that takes a spec: the overrides land in the spec, are validated by
the same models, and an error names the full field and the override it came from."""

from __future__ import annotations

from pathlib import Path

import pytest
import typer
from crucible_cli import specs
from crucible_cli.app import COMMAND_MODULES, app
from typer.testing import CliRunner

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
UNREACHABLE = "http://127.0.0.1:9"


def cli(*args: str):
    import importlib

    for name in COMMAND_MODULES:
        importlib.import_module(f"crucible_cli.{name}")
    return CliRunner().invoke(app, list(args))


def test_overrides_land_in_the_validated_spec() -> None:
    spec = specs.load_spec(
        EXAMPLES / "grpo_tiny.yaml",
        "train",
        ["optim.lr=3e-5", "method.group_size=4", 'rollout.stop=["\\n\\n"]', "eval=null", "name=x y"],
    )
    assert spec.optim.lr == 3e-5 and spec.method.group_size == 4
    assert spec.rollout.stop == ["\n\n"] and spec.eval is None and spec.name == "x y"
    # A later override wins; a whole section can be given as a mapping.
    spec = specs.load_spec(EXAMPLES / "grpo_tiny.yaml", "train", ["optim.lr=1", "optim.lr=0.5"])
    assert spec.optim.lr == 0.5
    spec = specs.load_spec(EXAMPLES / "grpo_tiny.yaml", "train", ["method={name: srrl, c1: 2, budget: 6}"])
    assert spec.method.name == "srrl" and spec.method.budget == 6
    spec = specs.load_spec(EXAMPLES / "pipeline_sft_mbpp.yaml", "pipeline", ["annotate.time_limit_s=2"])
    assert spec.annotate.limits().test_time_s == 2
    from crucible_cli.stack_cmd import DEMO_JOB  # `crucible demo --set` without --config

    assert specs.parse_spec(DEMO_JOB, "train", ["optim.steps=2"], "the demo job").optim.steps == 2
    assert DEMO_JOB["optim"]["steps"] == 4  # the default job itself is untouched


@pytest.mark.parametrize(
    ("override", "why"),
    [
        ("optim.lr", "expected FIELD=VALUE"),
        ("optim..lr=1", "expected FIELD=VALUE"),
        ("optim.lr=", "give a value"),
        ("optim.lr=[1", "not YAML"),
        ("name.first=1", "name.first does not exist"),  # name is a string in the example
        ("eval.ks.5=1", "ks.5 does not exist"),  # the list is shorter
    ],
)
def test_malformed_overrides_say_what_to_fix(override: str, why: str) -> None:
    raw = {"name": "n", "eval": {"ks": [1, 10]}}
    with pytest.raises(typer.BadParameter, match=why):
        specs.apply_overrides(raw, [override])


@pytest.mark.parametrize(
    ("command", "config", "override", "field"),
    [
        ("train", "grpo_tiny.yaml", "optim.lr=-1", "train.optim.lr: "),
        ("train", "grpo_tiny.yaml", "optim.lrr=1", "train.optim.lrr: Extra inputs"),
        ("train", "grpo_tiny.yaml", "method.group_size=1", "train.method.grpo.group_size: "),
        ("pipeline", "pipeline_sft_mbpp.yaml", "annotate.retries=99", "pipeline.annotate.retries: "),
        ("eval", "eval_mbpp_test.yaml", "n=abc", "eval.n: "),
    ],
)
def test_a_bad_override_names_the_field_and_the_override(command, config, override, field) -> None:
    out = cli(command, "--config", str(EXAMPLES / config), "--set", override, "--gateway", UNREACHABLE)
    assert out.exit_code == 2, out.output
    assert field in out.output and f"(from --set {override})" in out.output, out.output


def test_a_good_override_reaches_the_submission(monkeypatch) -> None:
    """The overridden spec is the one submitted."""
    from crucible_cli import jobs_cmd

    sent = []
    monkeypatch.setattr(jobs_cmd, "submit_and_follow", lambda spec, *a, **k: sent.append(spec))
    out = cli("train", "-c", str(EXAMPLES / "grpo_tiny.yaml"), "--set", "optim.steps=7", "--set", "seed=3")
    assert out.exit_code == 0, out.output
    assert sent[0].optim.steps == 7 and sent[0].seed == 3


def test_compare_applies_overrides_to_every_spec_and_eval_needs_a_config() -> None:
    out = cli(
        "compare",
        "-c",
        str(EXAMPLES / "compare_grpo.yaml"),
        "-c",
        str(EXAMPLES / "compare_srrl.yaml"),
        "--set",
        "optim.steps=0",
        "--gateway",
        UNREACHABLE,
    )
    assert out.exit_code == 2 and out.output.count("train.optim.steps: ") == 1, (
        out.output
    )  # the first spec fails
    out = cli("eval", "--set", "eval.n=4")
    assert out.exit_code == 2 and "--config" in out.output, out.output
