"""Stage skipping (hashed records), the annotate stage's retries, the offline specs and their
refusals, user JSONL checks, and the pipeline's clear errors (no services needed)."""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path

import pytest
from crucible_shared.jobs import AnnotateSpec, JobSpec, PipelineJob, TrainJob, job_paths
from crucible_shared.sandbox import RunResult, RunStatus
from crucible_trainer.offline.annotate import SandboxUnavailable, annotate
from crucible_trainer.offline.artifacts import write_rows
from crucible_trainer.offline.rows import load_rows
from crucible_trainer.offline.stages import Input, MissingInput, StageBook, StagePlan
from crucible_trainer.tasks import DatasetError, Task
from pydantic import TypeAdapter, ValidationError

SPEC = TypeAdapter(JobSpec)


# -- stage records ------------------------------------------------------------------------------


def plan_for(run: Path, config: dict | None = None) -> StagePlan:
    return StagePlan(
        "round-1/build",
        "build",
        config or {"n_best": 4},
        [Input(run / "round-1" / "in.jsonl", "the `annotate` stage of round 1")],
        [run / "round-1" / "out.jsonl"],
    )


def run_stage(book: StageBook, plan: StagePlan) -> bool:
    """What the driver does: skip when fresh, else 'run' (write the output) and record."""
    book.check_inputs(plan)
    signature = book.signature(plan)
    if book.fresh(plan, signature):
        return False
    plan.outputs[0].write_text(plan.inputs[0].path.read_text().upper())
    book.record(plan, signature, 0.1, {})
    return True


def test_a_stage_runs_again_only_when_its_inputs_config_or_outputs_change(tmp_path: Path) -> None:
    run = tmp_path / "job"
    (run / "round-1").mkdir(parents=True)
    book = StageBook(run)
    with pytest.raises(MissingInput, match=r"round-1/in.jsonl, which the `annotate` stage of round 1 writes"):
        book.check_inputs(plan_for(run))
    (run / "round-1" / "in.jsonl").write_text("a\n")
    assert run_stage(book, plan_for(run))
    assert not run_stage(StageBook(run), plan_for(run))  # recorded on disk: skipped
    assert run_stage(book, plan_for(run, {"n_best": 2}))  # another config
    assert not run_stage(book, plan_for(run, {"n_best": 2}))
    (run / "round-1" / "in.jsonl").write_text("b\n")
    assert run_stage(book, plan_for(run, {"n_best": 2}))  # another input
    (run / "round-1" / "out.jsonl").write_text("edited")
    assert run_stage(book, plan_for(run, {"n_best": 2}))  # an output changed by hand
    (run / "round-1" / "out.jsonl").unlink()
    assert run_stage(book, plan_for(run, {"n_best": 2}))  # an output deleted
    # A copied run dir (`reuse`) keeps its records valid: paths are relative to the run dir.
    shutil.copytree(run, tmp_path / "copy")
    assert not run_stage(StageBook(tmp_path / "copy"), plan_for(tmp_path / "copy", {"n_best": 2}))


# -- annotate: sandbox faults are retried, never failures -----------------------------------------


class FlakySandbox:
    """Answers `sandbox_error` for the first `faults` batches, then real-looking verdicts."""

    def __init__(self, faults: int) -> None:
        self.faults, self.calls = faults, 0

    async def run_batch(self, requests):
        self.calls += 1
        if self.calls <= self.faults:
            return [
                RunResult(status=RunStatus.sandbox_error, passed=0, total=0, message="worker crashed")
            ] * len(requests)
        return [
            RunResult(status=RunStatus.passed if "+" in r.code else RunStatus.failed, passed=1, total=1)
            for r in requests
        ]


TASK = Task(
    task_id="t",
    dataset="jsonl",
    prompt="add",
    tests={"kind": "asserts", "asserts": ["assert add(1, 1) == 2"]},
)
ROWS = [
    {"task_id": "t", "index": 0, "code": "def add(a, b):\n    return a + b", "completion": "..."},
    {"task_id": "t", "index": 1, "code": "def add(a, b):\n    return a - b", "completion": "..."},
    {"task_id": "t", "index": 2, "code": "", "completion": "no idea"},
]


def test_annotate_retries_sandbox_errors_and_never_counts_them() -> None:
    sandbox = FlakySandbox(faults=2)
    rows = asyncio.run(annotate(ROWS, {"t": TASK}, sandbox, AnnotateSpec(retries=2), backoff_s=0))
    assert sandbox.calls == 3
    assert [r["status"] for r in rows] == ["passed", "failed", "no_code"]
    assert [r["passed"] for r in rows] == [True, False, False]
    assert rows[0]["fraction"] == 1.0 and rows[2]["message"] == "no code found in the answer"


def test_annotate_fails_when_the_sandbox_stays_down() -> None:
    with pytest.raises(
        SandboxUnavailable, match=r"could not run 2 of 2 candidates in 2 attempts \(worker crashed\)"
    ):
        asyncio.run(
            annotate(ROWS, {"t": TASK}, FlakySandbox(faults=99), AnnotateSpec(retries=1), backoff_s=0)
        )


# -- specs ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("spec", "where"),
    [
        ({"kind": "train", "method": {"name": "sft"}}, "method.path"),
        (
            {"kind": "train", "method": {"name": "sft", "path": "a.jsonl"}, "rollout": {"max_tokens": 3}},
            "rollout",
        ),
        (
            {"kind": "train", "method": {"name": "dpo", "path": "a.jsonl"}, "reward": {"kind": "graded"}},
            "reward",
        ),
        (
            {"kind": "train", "method": {"name": "sft", "path": "a.jsonl"}, "optim": {"steps": 5}},
            "optim.steps",
        ),
        ({"kind": "train", "method": {"name": "sft", "path": "a.jsonl"}, "data": {"limit": 3}}, "data"),
        ({"kind": "train", "method": {"name": "sft", "path": "a", "epochs": 2, "max_steps": 3}}, "epochs"),
        (
            {"kind": "train", "method": {"name": "dpo", "path": "a", "label_smoothing": 0.1}},
            "label_smoothing",
        ),
        (
            {"kind": "train", "method": {"name": "dpo", "path": "a", "loss_type": ["exo_pair"]}},
            "label_smoothing",
        ),
        ({"kind": "train", "method": {"name": "dpo", "path": "a", "loss_type": ["nope"]}}, "loss_type"),
        ({"kind": "train", "method": {"name": "dpo", "path": "a", "loss_weights": [1.0]}}, "loss_weights"),
        ({"kind": "pipeline", "stages": ["generate", "generate"]}, "stages"),
        ({"kind": "pipeline", "stages": ["publish"]}, "stages"),
        ({"kind": "pipeline", "train": {"name": "sft", "path": "x.jsonl"}}, "train.path"),
        ({"kind": "pipeline", "optim": {"problems_per_step": 3}}, "optim.problems_per_step"),
        ({"kind": "pipeline", "optim": {"length_buckets": False}}, "optim.length_buckets"),
        ({"kind": "pipeline", "generate": {"k": 0}}, "generate.k"),
        ({"kind": "pipeline", "build": {"min_margin": 2}}, "build.min_margin"),
        ({"kind": "pipeline", "reuse": "../etc"}, "reuse"),
        ({"kind": "pipeline", "logging": {"samples_every": 3}}, "samples_every"),
    ],
)
def test_offline_fields_a_method_does_not_read_are_refused(spec: dict, where: str) -> None:
    with pytest.raises(ValidationError) as info:
        SPEC.validate_python(spec)
    assert where in str(info.value)


def test_pipeline_spec_defaults_order_and_paths() -> None:
    spec = SPEC.validate_python(
        {
            "kind": "pipeline",
            "stages": ["evaluate", "train", "build"],
            "data": {"dataset": "stdio", "path": "data/stdio/crucible_stdio.jsonl"},
            "model": {"init_adapter": "runs/jobs/x/adapter"},
            "train": {"name": "dpo", "beta": 0.2, "loss_type": ["sigmoid", "sft"], "loss_weights": [1, 0.5]},
        }
    )
    assert isinstance(spec, PipelineJob)
    assert spec.stages == ["build", "train", "evaluate"]  # pipeline order
    assert SPEC.validate_json(spec.model_dump_json()) == spec  # RQ payloads are JSON
    assert {(f, k) for f, _, k in job_paths(spec)} == {
        ("data.path", "data"),
        ("model.init_adapter", "adapter"),
    }
    sft = SPEC.validate_python({"kind": "train", "method": {"name": "sft", "path": "my/rows.jsonl"}})
    assert isinstance(sft, TrainJob) and ("method.path", "my/rows.jsonl", "data") in job_paths(sft)


# -- user JSONL -------------------------------------------------------------------------------------


def test_user_jsonl_is_checked_naming_line_and_field(tmp_path: Path) -> None:
    good = write_rows(tmp_path / "sft.jsonl", [{"prompt": "p", "completion": "c", "extra": 1}] * 2)
    assert load_rows(good, "sft") == [{"prompt": "p", "completion": "c"}] * 2
    chat = [{"prompt": [{"role": "user", "content": "p"}], "chosen": [{"role": "assistant", "content": "a"}]}]
    bad = write_rows(
        tmp_path / "dpo.jsonl", [{**chat[0], "rejected": [{"role": "assistant", "content": "b"}]}, chat[0]]
    )
    with pytest.raises(DatasetError, match=r"dpo.jsonl:2: field 'rejected'"):
        load_rows(bad, "dpo")
    mixed = write_rows(
        tmp_path / "mixed.jsonl", [{"prompt": "p", "completion": "c"}, {**chat[0], "completion": "c"}]
    )
    with pytest.raises(DatasetError, match=r"mixed.jsonl:2: field 'prompt': is a message list"):
        load_rows(mixed, "sft")


# -- the pipeline's errors ------------------------------------------------------------------------


def run_pipeline(spec: dict, job_id: str, tmp_path: Path) -> dict:
    from crucible_trainer.offline.pipeline import run_pipeline_job
    from crucible_trainer.runtime.channel import LocalChannel
    from crucible_trainer.settings import Settings

    settings = Settings(
        generator_urls=["http://127.0.0.1:9"], sandbox_url="http://127.0.0.1:9", runs_dir=tmp_path / "jobs"
    )
    job = PipelineJob.model_validate({"kind": "pipeline", "logging": {"wandb_mode": "disabled"}, **spec})
    return asyncio.run(run_pipeline_job(job, job_id, settings, LocalChannel(job_id)))


def test_a_stage_without_its_inputs_names_the_stage_to_run_first(tmp_path: Path) -> None:
    with pytest.raises(
        MissingInput, match=r"round-1/train needs round-1/nbest.jsonl, which the `build` stage"
    ):
        run_pipeline({"stages": ["train"]}, "p-missing", tmp_path)
    with pytest.raises(
        MissingInput, match=r"evaluate needs round-1/adapter, which the `train` stage of round 1"
    ):
        run_pipeline({"stages": ["evaluate"]}, "p-missing", tmp_path)


def test_build_without_passing_candidates_fails_with_the_counts(tmp_path: Path) -> None:
    rows = [
        {**r, "round": 1, "prompt": "p", "tokens": 3, "status": s, "passed": False, "fraction": 0.0}
        for r, s in zip(ROWS, ["failed", "failed", "no_code"], strict=True)
    ]
    write_rows(tmp_path / "jobs" / "p-empty" / "round-1" / "candidates_annotated.jsonl", rows)
    with pytest.raises(
        ValueError, match=r"no passing candidate among 3 candidates of 1 problems \(failed 2, no_code 1\)"
    ):
        run_pipeline({"stages": ["build"]}, "p-empty", tmp_path)
    assert not (tmp_path / "jobs" / "p-empty" / "round-1" / "nbest.jsonl").exists()
    summary = json.loads((tmp_path / "jobs" / "p-empty" / "summary.json").read_text())
    assert summary["stages"] == {}


@pytest.mark.parametrize("method", ["sft", "dpo"])
def test_auto_micro_batch_and_checkpointing_reach_trl_as_numbers(method: str, tmp_path: Path) -> None:
    """A spec left at `optim.micro_batch: auto` (the default) is one the gateway accepts: TRL must
    get a batch size, not the word (its data loader refuses it)."""
    from crucible_trainer.offline.trl_train import OfflineRun, trainer_config

    spec = TrainJob.model_validate({"method": {"name": method, "path": "rows.jsonl"}})
    assert spec.optim.micro_batch == "auto" and spec.model.gradient_checkpointing == "auto"
    run = OfflineRun(spec.method, spec.model, spec.optim, [], tmp_path / "w", tmp_path / "a")  # type: ignore[arg-type]
    args = trainer_config(run, device="cpu", dtype="float32")
    assert args.per_device_train_batch_size == 16 and args.gradient_checkpointing is False
    explicit = spec.optim.model_copy(update={"micro_batch": 3})
    args = trainer_config(
        OfflineRun(spec.method, spec.model, explicit, [], tmp_path / "w", tmp_path / "a"),  # type: ignore[arg-type]
        device="cpu",
        dtype="float32",
    )
    assert args.per_device_train_batch_size == 3


@pytest.mark.parametrize("method", ["sft", "dpo"])
def test_trl_gets_a_model_attending_without_cudnn(method: str, tmp_path: Path, monkeypatch) -> None:
    """The offline trainers' SDPA never takes cuDNN's kernels, as the online update's
    (rl/attention.py): TRL's trainer is handed the model switched to that attention."""
    import trl
    from crucible_trainer.offline.trl_train import Hooks, OfflineRun, train
    from crucible_trainer.rl.attention import NAME

    from tests.families import build_family

    seen = []

    class Handed(Exception):
        pass

    def trainer(*, model, **kwargs):
        seen.append(model.config._attn_implementation)
        raise Handed

    monkeypatch.setattr(trl, "SFTTrainer" if method == "sft" else "DPOTrainer", trainer)
    base = str(build_family("qwen2", tmp_path))
    spec = TrainJob.model_validate(
        {"method": {"name": method, "path": "rows.jsonl"}, "model": {"base": base, "device": "cpu"}}
    )
    run = OfflineRun(spec.method, spec.model, spec.optim, [], tmp_path / "w", tmp_path / "a")  # type: ignore[arg-type]
    with pytest.raises(Handed):
        train(run, Hooks())
    assert seen == [NAME]
