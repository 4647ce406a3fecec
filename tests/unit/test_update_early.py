"""The update that starts on the groups already scored (`rl/early.py`) computes the whole batch's
gradient, takes one optimizer step, and leaves nothing behind when the step fails.

The gradient is compared with the sample-by-sample reference of test_update_buckets.py (one
sequence per forward, each loss divided by the whole batch's published count), on that test's
batch: groups are scored from the test's thread while the update runs on another, as the event
loop and the policy's thread do in a job.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
from crucible_shared.jobs import TrainJob

from tests.unit.test_update_buckets import (
    MAX_TOKENS,
    adapter_model,  # noqa: F401  (the fixture)
    assert_close,
    batch,
    grads,
    make_policy,
    reference_gradient,
)


def started(policy, groups, cfg) -> tuple[threading.Thread, dict]:
    """`update_early` on its own thread, recording the gradient of its optimizer step."""
    from crucible_trainer.rl.early import update_early

    out: dict = {"steps": []}
    inner = policy.step

    def step() -> float:
        out["steps"].append(grads(policy))
        return inner()

    policy.step = step

    def run() -> None:
        try:
            out["metrics"] = update_early(policy, groups, cfg)
        except BaseException as exc:  # the test reads it
            out["error"] = exc

    thread = threading.Thread(target=run)
    thread.start()
    return thread, out


def two_groups_scored() -> tuple[list, Any]:
    """The test batch generated, its groups 0 and 3 scored (their five trainable samples fill one
    micro-batch of three), the rest not yet."""
    from crucible_trainer.rl.early import EarlyGroups

    samples = batch()
    groups = EarlyGroups()
    groups.open(lambda members: None)
    groups.scored([s for s in samples if s.group in (0, 3)])
    groups.generated(samples)
    return samples, groups


def rest_scored(samples: list, groups: Any, thread: threading.Thread, out: dict) -> dict:
    """Groups 1 and 2 scored and the stream closed: the gradient of the update's one step."""
    groups.scored([s for s in samples if s.group in (1, 2)])
    groups.close(samples)
    thread.join(timeout=60)
    assert "error" not in out, out.get("error")
    (got,) = out["steps"]
    return got


def wait_until(condition, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


@pytest.mark.parametrize("aggregation", ["token", "sequence"])
def test_the_early_update_takes_the_whole_batch_gradient_in_one_step(aggregation, adapter_model) -> None:  # noqa: F811
    from crucible_trainer.rl.early import EarlyGroups
    from crucible_trainer.rl.update import UpdateConfig

    cfg = UpdateConfig(micro_batch=3, max_tokens=MAX_TOKENS, aggregation=aggregation)
    samples = batch()
    groups = EarlyGroups()
    opened: list[list[int]] = []
    groups.open(lambda members: opened.append([s.group for s in members]))
    # Groups 0 and 3 are scored while generation still runs (the roller reports them before the batch).
    groups.scored([s for s in samples if s.group in (0, 3)])
    groups.generated(samples)
    policy = make_policy(*adapter_model)
    thread, out = started(policy, groups, cfg)
    # Their five trainable samples fill one micro-batch of three, handed out before the rest is scored.
    wait_until(lambda: groups.handed_early == 1)
    assert not out["steps"], "the optimizer stepped before the last group was scored"
    got = rest_scored(samples, groups, thread, out)
    assert_close(got, reference_gradient(make_policy(*adapter_model), cfg))
    metrics = out["metrics"]
    # Seven samples carry an advantage (group 2's two do not), all nine count in the normaliser.
    assert metrics["update/sequences"] == 7 and metrics["update/normaliser_sequences"] == 9
    assert metrics["update/optimizer_steps"] == 1 and metrics["update/early_micro_batches"] == 1
    assert metrics["time/update_waited_s"] > 0
    # Each group's advantages were set once, when its last sample was scored, in batch order.
    assert sorted(opened) == [[0, 0, 0], [1, 1], [2, 2], [3, 3]]


def test_a_sample_left_without_a_reward_runs_the_passes_again_by_the_smaller_count(adapter_model) -> None:  # noqa: F811
    # A sandbox fault leaves a sample unscored (reward None): the published count drops it, as
    # `update`'s does, so the passes run before it was known are run again with that count.
    from crucible_trainer.rl.early import EarlyGroups
    from crucible_trainer.rl.update import UpdateConfig

    from tests.unit.test_update_buckets import recorded

    cfg = UpdateConfig(micro_batch=3, max_tokens=MAX_TOKENS, aggregation="token")
    samples = batch()
    samples[6].reward = None  # group 2's second sample: its six tokens leave the count
    groups = EarlyGroups()
    groups.open(lambda members: None)
    groups.scored(samples)
    groups.generated(samples)
    groups.close(samples)
    thread, out = started(make_policy(*adapter_model), groups, cfg)
    thread.join(timeout=60)
    (got,) = out["steps"]
    plain = batch()
    plain[6].reward = None
    (want,), metrics = recorded(make_policy(*adapter_model), cfg, plain)
    assert metrics["update/normaliser_tokens"] == out["metrics"]["update/normaliser_tokens"] == 28
    assert_close(got, want)


def test_a_failed_collection_stops_the_update_without_a_step_or_gradients(adapter_model) -> None:  # noqa: F811
    from crucible_trainer.rl.early import StepFailed
    from crucible_trainer.rl.update import UpdateConfig

    _, groups = two_groups_scored()
    policy = make_policy(*adapter_model)
    thread, out = started(policy, groups, UpdateConfig(micro_batch=3, max_tokens=MAX_TOKENS))
    wait_until(lambda: groups.handed_early == 1)
    groups.close(error=ConnectionError("the sandbox went away"))
    thread.join(timeout=60)
    assert isinstance(out.get("error"), StepFailed) and "the sandbox went away" in str(out["error"])
    assert not out["steps"]
    assert not grads(policy), "the first micro-batch's gradients were left for the next step"


def test_a_batch_other_than_the_generated_one_fails_the_update(adapter_model) -> None:  # noqa: F811
    from crucible_trainer.rl.early import EarlyGroups, StepFailed
    from crucible_trainer.rl.update import UpdateConfig

    samples = batch()
    groups = EarlyGroups()
    groups.generated(samples)
    policy = make_policy(*adapter_model)
    thread, out = started(policy, groups, UpdateConfig(micro_batch=3, max_tokens=MAX_TOKENS))
    groups.close(list(reversed(samples)))
    thread.join(timeout=60)
    assert isinstance(out.get("error"), StepFailed) and "not the one its rollouts generated" in str(
        out["error"]
    )
    assert not out["steps"]


def test_a_method_that_never_opens_the_stream_trains_on_its_final_advantages(adapter_model) -> None:  # noqa: F811
    # Nothing is handed out early; once closed, every trainable sample trains, as in `update`.
    from crucible_trainer.rl.early import EarlyGroups
    from crucible_trainer.rl.update import UpdateConfig

    cfg = UpdateConfig(micro_batch=3, max_tokens=MAX_TOKENS, aggregation="token")
    samples = batch()
    groups = EarlyGroups()
    groups.scored(samples)
    groups.generated(samples)
    groups.close(samples)
    policy = make_policy(*adapter_model)
    thread, out = started(policy, groups, cfg)
    thread.join(timeout=60)
    (got,) = out["steps"]
    assert_close(got, reference_gradient(make_policy(*adapter_model), cfg))
    assert out["metrics"]["update/early_micro_batches"] == 0


def job(**fields) -> dict:
    return {"kind": "train", "optim": {"early_update": True}, **fields}


@pytest.mark.parametrize(
    ("fields", "reason"),
    [
        ({"method": {"name": "grpo", "filter": {"mode": "dynamic"}}}, "dynamic"),
        ({"method": {"name": "grpo", "scale": "batch"}}, "method.scale is batch"),
        ({"method": {"name": "grpo", "num_iterations": 2}}, "num_iterations is 2"),
        ({"method": {"name": "grpo", "kl_beta": 0.1}}, "kl_beta"),
        ({"method": {"name": "srrl"}}, "method srrl is not GRPO"),
        ({"distributed": {"train_gpus": 2}}, "train_gpus is 2"),
        ({"overlap": {"max_staleness": 1}}, "max_staleness"),
    ],
)
def test_early_update_true_is_refused_where_the_job_needs_the_whole_batch(fields, reason) -> None:
    from pydantic import ValidationError

    spec = job(**fields)
    with pytest.raises(ValidationError, match=r"optim\.early_update") as caught:
        TrainJob.model_validate(spec)
    assert reason in str(caught.value)
    # auto (the default) and false accept the same job: they start the update when it can.
    for mode in ("auto", False):
        TrainJob.model_validate({**spec, "optim": {"early_update": mode}})


def test_grad_accum_is_refused_with_early_update_true() -> None:
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="grad_accum is set"):
        TrainJob.model_validate(job(optim={"early_update": True, "grad_accum": 2}))
    assert TrainJob.model_validate(job()).optim.early_update is True


@pytest.mark.parametrize("backward", [False, True], ids=["forward", "backward"])
def test_a_pass_out_of_memory_runs_again_with_the_micro_batches_before_it(adapter_model, backward) -> None:  # noqa: F811
    # The second micro-batch's forward runs out of GPU memory after the first's backward added its
    # gradient: the gradients are dropped and both run again (then the third), one step, the
    # whole batch's gradient.
    from crucible_trainer.rl.update import UpdateConfig

    from tests.unit.test_checkpoint_per_batch import out_of_memory_at

    cfg = UpdateConfig(micro_batch=3, max_tokens=MAX_TOKENS, aggregation="token")
    samples, groups = two_groups_scored()
    policy = make_policy(*adapter_model)
    assert policy.checkpointing == "auto"
    calls = out_of_memory_at(policy, 2, backward)
    thread, out = started(policy, groups, cfg)
    wait_until(lambda: groups.handed_early == 1)
    got = rest_scored(samples, groups, thread, out)
    assert_close(got, reference_gradient(make_policy(*adapter_model), cfg))
    assert out["metrics"]["update/out_of_memory_retries"] == 1 and policy.memory_margin == 2
    # Two forwards, then all three again; nothing of the failed pass alive when the retry runs.
    assert calls == [False] * 5 and out["metrics"]["update/sequences"] == 7
