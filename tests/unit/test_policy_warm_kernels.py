"""The policy's first passes, taken ahead (`Policy.warm_kernels`, started by the job on CUDA while
the generator works without the policy): they run a training forward and backward and a scoring
forward, and leave nothing behind. After them the random generators, gradients, pass counts,
weights and optimizer are as they were, and the first update's gradients and metrics equal those
of a policy that never warmed up; LoRA dropout is on, so a draw taken from a generator, or a
gradient left in place, would show. The job's side (`TrainRun._warm_kernels`) is checked with the
policy's calls recorded: what it asks for, when it asks nothing, and that a failure only logs.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tests.families import build_family
from tests.unit.test_update_buckets import recorded


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return build_family("llama", tmp_path_factory.mktemp("warm"))


def make_policy(model: Path):
    from crucible_shared.jobs import TrainJob
    from crucible_trainer.rl.policy import Policy

    spec = TrainJob.model_validate(
        {
            "model": {
                "base": str(model),
                "device": "cpu",
                "dtype": "float32",
                "lora_r": 4,
                "lora_dropout": 0.2,
            },
            "optim": {"lr": 1e-2, "micro_batch": 3, "max_grad_norm": 1.0},
            "seed": 3,
        }
    )
    return Policy(spec.model, spec.optim, spec.seed)


def test_the_warm_up_runs_both_passes_and_leaves_the_first_update_as_it_was(model) -> None:
    from crucible_trainer.rl.policy import PassCounts
    from crucible_trainer.rl.update import UpdateConfig

    cold, warm = make_policy(model), make_policy(model)
    weights = {n: p.detach().clone() for n, p in warm.model.named_parameters()}
    calls = {"forward": 0, "backward": 0}
    layer = next(m for n, m in warm.model.named_modules() if n.endswith("lora_B.default"))
    hooks = [
        warm.model.register_forward_hook(lambda *a: calls.__setitem__("forward", calls["forward"] + 1)),
        layer.register_full_backward_hook(lambda *a: calls.__setitem__("backward", calls["backward"] + 1)),
    ]
    torch.manual_seed(11)
    rng = torch.get_rng_state()
    seconds = warm.warm_kernels(4, 6, 8)
    for hook in hooks:
        hook.remove()

    assert seconds > 0 and calls == {"forward": 2, "backward": 1}  # training and scoring; one backward
    assert torch.equal(torch.get_rng_state(), rng)  # dropout drew from a forked generator
    assert warm.passes == PassCounts() and not warm.optimizer.state
    trainable = [p for p in warm.model.parameters() if p.requires_grad]
    assert trainable and all(p.grad is None for p in trainable)
    assert all(torch.equal(p, weights[n]) for n, p in warm.model.named_parameters())

    cfg = UpdateConfig(micro_batch=3, aggregation="token")
    torch.manual_seed(5)
    cold_steps, cold_metrics = recorded(cold, cfg)
    torch.manual_seed(5)
    warm_steps, warm_metrics = recorded(warm, cfg)
    assert len(warm_steps) == len(cold_steps) == 1
    assert warm_steps[0].keys() == cold_steps[0].keys() and warm_steps[0]
    for name, grad in cold_steps[0].items():
        assert torch.equal(warm_steps[0][name], grad), name
    timing = ("time/", "perf/")
    assert {k: v for k, v in warm_metrics.items() if not k.startswith(timing)} == {
        k: v for k, v in cold_metrics.items() if not k.startswith(timing)
    }


def test_the_warm_up_keeps_a_gradient_already_there(model) -> None:
    policy = make_policy(model)
    trainable = [p for p in policy.model.parameters() if p.requires_grad]
    held = [torch.full_like(p, 0.5) for p in trainable]
    for p, g in zip(trainable, held, strict=True):
        p.grad = g
    policy.warm_kernels(2, 3, 4)
    assert all(p.grad is g for p, g in zip(trainable, held, strict=True))
    assert all(torch.equal(g, torch.full_like(g, 0.5)) for g in held)


class Recorder:
    """A loaded policy as the job sees it: its device and passes' wrapper, and its calls recorded."""

    def __init__(self, device: str, wrapped: bool = False, fails: bool = False) -> None:
        self.device, self.model, self.fails = device, object(), fails
        self.runner = object() if wrapped else self.model
        self.asked: list[tuple] = []

    async def call(self, fn, *args):
        return fn(*args)

    def warm_kernels(self, rows: int, prompt: int, completion: int) -> float:
        self.asked.append((rows, prompt, completion))
        if self.fails:
            raise RuntimeError("CUDA out of memory")
        return 1.234


def warm_in_job(policy: Recorder, train_gpus: int = 1) -> tuple[Recorder, dict]:
    from crucible_shared.jobs import TrainJob
    from crucible_trainer.online.train import TrainRun

    spec = TrainJob.model_validate(
        {
            "model": {"base": "tiny"},
            "optim": {"micro_batch": 12},
            "rollout": {"max_tokens": 40},
            "distributed": {"train_gpus": train_gpus},
        }
    )
    job = TrainRun.__new__(TrainRun)  # only what `_warm_kernels` reads
    job.spec, job.summary = spec, {}
    job.tokenizer = lambda text: SimpleNamespace(input_ids=text.split())
    prompts = SimpleNamespace(first=lambda i: "one two three four five")

    async def run() -> None:
        job._loading = asyncio.get_running_loop().create_future()
        job._loading.set_result(policy)
        job._warm_kernels(prompts)
        warming = getattr(job, "_warming", None)
        if warming is not None:
            await warming

    asyncio.run(run())
    return policy, job.summary


def test_a_one_gpu_job_warms_its_policy_at_its_micro_batch_first_prompt_and_max_tokens() -> None:
    policy, summary = warm_in_job(Recorder("cuda:0"))
    assert policy.asked == [(12, 5, 40)] and summary == {"kernel_warm_up_s": 1.23}


@pytest.mark.parametrize(
    "policy, ranks",
    [(Recorder("cpu"), 1), (Recorder("cuda:0", wrapped=True), 1), (Recorder("cuda:0"), 2)],
    ids=["cpu", "wrapped-passes", "data-parallel"],
)
def test_no_warm_up_on_a_cpu_or_for_passes_other_ranks_join(policy, ranks) -> None:
    asked, summary = warm_in_job(policy, ranks)
    assert asked.asked == [] and summary == {}


def test_a_failed_warm_up_only_logs(caplog) -> None:
    with caplog.at_level(logging.WARNING):
        policy, summary = warm_in_job(Recorder("cuda:0", fails=True))
    assert policy.asked == [(12, 5, 40)] and summary == {}
    assert "kernel warm-up stopped" in caplog.text and "out of memory" in caplog.text
