"""Options researchers rely on: PPO's ratio per token or per sequence, SRRL's full test log, HumanEval's
named splits, the attention kernel, settings chosen from the hardware, and the method registry."""

from __future__ import annotations

import math

import pytest
import torch
from crucible_shared.jobs import GRPOConfig, PPOConfig, TrainJob
from crucible_shared.sandbox import RunResult, TestVerdict
from crucible_trainer.methods import REGISTRY, method_module
from crucible_trainer.rl import losses
from crucible_trainer.runtime import hardware
from pydantic import ValidationError


def test_token_ratio_clips_each_token() -> None:
    logp = torch.tensor([[math.log(2.0), 0.0]])  # token ratios 2 and 1 against old log p 0
    old = torch.zeros(1, 2)
    mask = torch.ones(1, 2)
    out = losses.clipped_surrogate(logp, old, torch.tensor([1.0]), mask, clip_eps=0.2, ratio_mode="token")
    # min(2, 1.2) = 1.2 and min(1, 1) = 1, averaged over tokens, negated.
    assert out.loss.item() == pytest.approx(-(1.2 + 1.0) / 2)
    assert out.clip_fraction == pytest.approx(0.5)


def test_sequence_ratio_is_the_ratio_of_summed_log_probs() -> None:
    logp = torch.tensor([[math.log(1.1), math.log(1.1)], [math.log(0.5), 0.0]])
    old = torch.zeros(2, 2)
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    adv = torch.tensor([1.0, -1.0])
    out = losses.clipped_surrogate(logp, old, adv, mask, clip_eps=0.2, ratio_mode="sequence")
    # Sequence 1: ratio 1.21 -> clipped to 1.2 (A > 0). Sequence 2: ratio 0.5, A < 0 ->
    # min(-0.5, -0.8) = -0.8. Loss = -mean(1.2, -0.8).
    assert out.loss.item() == pytest.approx(-(1.2 - 0.8) / 2)
    assert out.ratio_mean == pytest.approx((1.21 + 0.5) / 2)
    assert out.clip_fraction == pytest.approx(1.0)
    # The same numbers per token give a different loss: the two modes are really different.
    per_token = losses.clipped_surrogate(logp, old, adv, mask, clip_eps=0.2, ratio_mode="token")
    assert per_token.loss.item() != pytest.approx(out.loss.item())


def test_ppo_ratio_option_reaches_the_update() -> None:
    job = TrainJob.model_validate(
        {"method": {"name": "ppo", "ratio": "sequence"}, "optim": {"micro_batch": 4}}
    )
    cfg = method_module(job.method).update_config(job.method, job)
    assert cfg.ratio == "sequence" and cfg.aggregation == "sequence" and cfg.iterations == 4
    with pytest.raises(ValidationError):
        PPOConfig(ratio="episode")


@pytest.mark.parametrize("name", ["grpo", "srrl", "spiral"])
def test_clipped_methods_share_their_fields_and_update(name: str) -> None:
    """GRPO, SRRL and SPIRAL declare loss / clip_eps / kl_beta / num_iterations once (ClippedMethod),
    with one description and bounds each, and every one of them reaches the update."""
    from crucible_shared.jobs import ClippedMethod

    method = {"name": name, "loss": "dr_grpo", "clip_eps": 0.3, "kl_beta": 0.5, "num_iterations": 2}
    if name == "grpo":
        method["clip_eps_high"] = 0.4
    job = TrainJob.model_validate({"method": method, "optim": {"micro_batch": 4, "grad_accum": 2}})
    assert isinstance(job.method, ClippedMethod)
    for field in ("loss", "clip_eps", "kl_beta", "num_iterations"):
        assert field not in vars(type(job.method)).get("__annotations__", {})  # declared once
        assert repr(type(job.method).model_fields[field]) == repr(ClippedMethod.model_fields[field])
    cfg = method_module(job.method).update_config(job.method, job)
    assert (cfg.objective, cfg.aggregation, cfg.clip_eps, cfg.kl_beta, cfg.iterations) == (
        "clip",
        "dr_grpo",
        0.3,
        0.5,
        2,
    )
    assert cfg.clip_eps_high == (0.4 if name == "grpo" else None)
    assert (cfg.micro_batch, cfg.grad_accum, cfg.max_tokens) == (4, 2, job.rollout.max_tokens)
    with pytest.raises(ValidationError, match="clip_eps"):  # the shared check: nothing to clip
        TrainJob.model_validate({"method": {"name": name, "clip_eps": 0.3}})


def test_every_online_method_of_the_spec_union_is_registered() -> None:
    from typing import get_args

    from crucible_shared.jobs import OFFLINE_METHODS, Method

    union = get_args(get_args(Method)[0])
    online = {c for c in union if not c.offline}
    assert online == set(REGISTRY)  # offline methods (TRL on a file) run outside the online loop
    assert OFFLINE_METHODS == ("sft", "dpo")  # read from the classes
    for module in REGISTRY.values():
        for name in ("judge", "collect", "update_config", "report"):
            assert callable(getattr(module, name)), (module.__name__, name)
    with pytest.raises(ValueError, match="no method module"):
        method_module(object())


def test_method_facts_are_read_from_the_config_classes() -> None:
    """Which methods may overlap the update and how many samples a step draws are class facts of
    each registered method's config, not tables keyed by method name."""
    from crucible_shared.jobs import GROUP_METHODS, METHOD_CONFIGS, SpiralConfig

    assert GROUP_METHODS == ("grpo", "srrl")
    assert {c for c in METHOD_CONFIGS if c.samples_groups} <= set(REGISTRY)
    for cls in REGISTRY:
        cfg = cls()
        if cls is SpiralConfig:
            assert cfg.samples_per_step(8) == cfg.games_per_step
        else:
            assert cls.per_problem in cls.model_fields, cls
            assert cfg.samples_per_step(8) == 8 * getattr(cfg, cls.per_problem)
    for cls in set(METHOD_CONFIGS) - set(REGISTRY):  # offline: TRL on a file, no sampling
        assert cls.offline and not cls.samples_groups
        with pytest.raises(ValueError, match="samples no completions"):
            cls().samples_per_step(8)


def test_the_gateways_work_bound_reads_samples_per_problem_from_the_config_class() -> None:
    from crucible_gateway.work import samples_per_problem
    from crucible_shared.jobs import METHOD_CONFIGS, GRPOConfig, SpiralConfig, SRRLConfig

    assert samples_per_problem(GRPOConfig(group_size=6)) == 6
    assert samples_per_problem(SRRLConfig(budget=10, c1=4)) == 10
    assert samples_per_problem(SpiralConfig()) == 1  # a game job samples no problems
    for cls in METHOD_CONFIGS:
        cfg = cls()
        want = getattr(cfg, cls.per_problem) if cls.per_problem else 1
        assert samples_per_problem(cfg) == want, cls


def test_srrl_full_test_log_in_the_refinement_prompt() -> None:
    from crucible_trainer import tasks

    task = tasks.load_tasks(tasks.DataSpec(dataset="mbpp", ids=[11]))[0]
    result = RunResult(
        status="failed",
        passed=1,
        total=3,
        tests=[
            TestVerdict(index=0, test="assert f(1) == 1", status="passed"),
            TestVerdict(
                index=1, test="assert f(2) == 4", status="failed", message="assert f(2) == 4 -> got 5"
            ),
            TestVerdict(
                index=2, test="assert f(3) == 9", status="failed", message="assert f(3) == 9 -> got 7"
            ),
        ],
    )
    first = "\n".join(m["content"] for m in tasks.build_refinement_messages(task, "def f(x): pass", result))
    full = "\n".join(
        m["content"] for m in tasks.build_refinement_messages(task, "def f(x): pass", result, all_tests=True)
    )
    assert "got 7" not in first and "PASS assert f(1) == 1" not in first
    assert "PASS assert f(1) == 1" in full and "FAIL assert f(2) == 4 -> got 5" in full and "got 7" in full


def test_humaneval_named_splits() -> None:
    from crucible_trainer import tasks

    train = {t.task_id for t in tasks.load_tasks(tasks.DataSpec(dataset="humaneval", split="train"))}
    test = {t.task_id for t in tasks.load_tasks(tasks.DataSpec(dataset="humaneval", split="test"))}
    assert len(train) == 131 and len(test) == 33 and not train & test
    assert "HumanEval/1" in test and "HumanEval/0" in train  # the documented seeded split, pinned


def test_attention_kernel_choice() -> None:
    import crucible_models

    assert crucible_models.pick_attention(None) == "sdpa"
    with pytest.raises(ValueError, match="flash-attn"):
        crucible_models.pick_attention("flash_attention_2")  # not installed here
    with pytest.raises(ValueError, match="use one of"):
        crucible_models.pick_attention("paged")


def test_hardware_settings_on_a_cpu_and_explicit_values_kept() -> None:
    resolved, chosen = hardware.resolve(TrainJob.model_validate({"model": {"device": "cpu"}}))
    assert resolved.optim.micro_batch == 16 and resolved.model.gradient_checkpointing is False
    assert chosen["device"] == "cpu" and chosen["dtype"] == "float32"
    explicit = TrainJob.model_validate(
        {"model": {"device": "cpu", "gradient_checkpointing": True}, "optim": {"micro_batch": 3}}
    )
    resolved, chosen = hardware.resolve(explicit)
    assert resolved.optim.micro_batch == 3 and resolved.model.gradient_checkpointing is True
    assert chosen["micro_batch"] == 3


def test_group_filter_fields_are_refused_where_they_do_nothing() -> None:
    with pytest.raises(ValidationError, match="pre_samples"):
        GRPOConfig(filter={"mode": "dynamic", "pre_samples": 8})
    with pytest.raises(ValidationError, match="max_draw_factor"):
        GRPOConfig(filter={"mode": "pre", "max_draw_factor": 2})
    assert GRPOConfig(difficulty_filter=True, filter_samples=6).filter.pre_samples == 6
    with pytest.raises(ValidationError, match="pre_keep"):
        GRPOConfig(filter={"mode": "dynamic", "pre_keep": "reward_spread"})
    assert GRPOConfig(filter={"mode": "pre", "pre_keep": "reward_spread"}).filter.pre_keep == "reward_spread"
    with pytest.raises(ValidationError, match="pre_keep"):
        GRPOConfig(filter={"mode": "pre", "pre_keep": "sometimes"})


def test_the_pre_filter_keeps_by_pass_rate_or_reward_spread() -> None:
    pass


class _Prompts:
    def first(self, task_index: int) -> str:
        return f"problem {task_index}"


class _Context:
    """Just what first-attempt collection reads: the prompt book and sampling."""

    def __init__(self, rewards: list[float | None]) -> None:
        self.prompts = _Prompts()
        self.rewards = rewards

    async def sample(self, prompts, n: int):
        from crucible_trainer.rl.rollout import Sample

        assert [p.text for p in prompts] == ["problem 3"] and n == len(self.rewards)
        return [Sample(3, 0, [1], [2], "", "", None, "stop", reward=r, advantage=-9.0) for r in self.rewards]


@pytest.mark.parametrize(
    ("method", "options", "expected"),
    [
        ("reinforce", {"baseline": True}, [0.5, -0.5, -9.0]),
        ("reinforce", {"baseline": False}, [1.0, 0.0, -9.0]),
        ("ppo", {}, [1.0, -1.0, -9.0]),
    ],
)
def test_first_attempt_methods_weigh_scored_samples_only(method, options, expected) -> None:
    import asyncio

    from crucible_shared.jobs import ReinforceConfig

    config = {"reinforce": ReinforceConfig, "ppo": PPOConfig}[method](samples=3, **options)
    # The third sample was dropped (a sandbox fault): it keeps its advantage and is not scored.
    ctx = _Context([1.0, 0.0, None])
    batch, metrics = asyncio.run(method_module(config).collect(ctx, config, [3]))
    assert [s.advantage for s in batch] == pytest.approx(expected, abs=1e-3)
    assert metrics["dropped_sandbox_errors"] == 1.0 and metrics["reward_mean"] == 0.5


def test_a_fresh_adapter_follows_the_model_section() -> None:
    from crucible_shared.jobs import ModelSpec
    from crucible_trainer.rl.policy import lora_config

    config = lora_config(
        ModelSpec(lora_r=8, lora_alpha=4.0, lora_dropout=0.1, target_modules=["q_proj", "v_proj"])
    )
    assert (config.r, config.lora_alpha, config.lora_dropout) == (8, 4.0, 0.1)
    assert set(config.target_modules) == {"q_proj", "v_proj"} and config.task_type == "CAUSAL_LM"
