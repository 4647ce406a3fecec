"""Compiled update passes (`optim.compile`, rl/policy.py) give the eager passes' log-probs and
gradients.

On tiny random-weight checkpoints with a random LoRA adapter, a policy whose passes run through
torch.compile (inductor) and one that runs them eager must agree, token by token and gradient by
gradient, within float32 rounding: the whole update (training, the KL reference scored with the
adapter disabled, a second pass whose `log p_old` comes from the first), the reference scored with
the starting adapter's weights swapped in, and
the padding of each batch to a multiple of 64 tokens (masked: no log-prob or gradient moves). A
step whose compiled gradient is not finite runs again eager. The spec field is checked as the
others are.

Inductor's C++ kernels are built quickly here (`quick_compiler`: no vector instructions, -O0):
the tests check what compiling changes (tracing, padding, dynamic shapes, autograd), not gcc's
code generation, and a cold compile of one forward and backward takes ~20 s on a 2-core machine
instead of ~40 s (inductor caches them on disk afterwards). The default run compiles one family
(Llama, its reference the base model); `CRUCIBLE_TEST_COMPILE=1` also runs the other families
(their reference the starting adapter swapped in), a reference graph beside the adapter's,
gradient checkpointing, a bf16 base under autocast and a no-grad `log p_old` pass (several
minutes cold).
"""

from __future__ import annotations

import math
import os
import time
from pathlib import Path

import pytest
import torch

from tests.families import family_config, save_checkpoint, save_lora
from tests.unit.test_update_buckets import MAX_TOKENS, assert_close, batch, grads, recorded

every_family = pytest.mark.skipif(
    os.environ.get("CRUCIBLE_TEST_COMPILE") != "1",
    reason="compiles another model (minutes on a 2-core CPU); CRUCIBLE_TEST_COMPILE=1 runs it",
)


@pytest.fixture(scope="module")
def adapter_model(tmp_path_factory) -> tuple[Path, str]:
    """The tiny Llama with a vocabulary of 1,024 (the tests' token ids are below 200): the
    compiled kernels here are built unoptimised, and a 49,152-token head would dominate."""
    from crucible_models import load_tokenizer

    root = tmp_path_factory.mktemp("compile")
    tokenizer = load_tokenizer()
    config = family_config("llama", tokenizer)
    config.vocab_size = 1024
    model = save_checkpoint(config, root / "llama", tokenizer, seed=0)
    return model, save_lora(model, root / "adapter", seed=5, rank=4, scale=0.05)


@pytest.fixture
def quick_compiler(monkeypatch):
    """Inductor's CPU kernels built without vector instructions or optimisation (see above)."""
    import torch._inductor.config as config

    monkeypatch.setenv("TORCHINDUCTOR_DEBUG_COMPILE", "1")
    with config.patch({"cpp.vec_isa_ok": False}):
        yield


def make_policy(model: Path, adapter: str | None, compile: bool | str = False, **model_fields):
    from crucible_shared.jobs import TrainJob
    from crucible_trainer.rl.policy import Policy

    spec = TrainJob.model_validate(
        {
            "model": {"base": str(model), "device": "cpu", "dtype": "float32", "init_adapter": adapter}
            | model_fields,
            "optim": {"lr": 1e-2, "micro_batch": 3, "max_grad_norm": 1.0, "compile": compile},
            "seed": 3,
        }
    )
    return Policy(spec.model, spec.optim, spec.seed)


def randomised(policy):
    """`policy` with a seeded random LoRA B (PEFT starts it at zero), the same in every policy."""
    torch.manual_seed(11)
    with torch.no_grad():
        for name, p in policy.model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    return policy


class Compiled:
    """Counts a policy's calls into its compiled function and the graphs traced meanwhile."""

    def __init__(self, policy) -> None:
        from torch._dynamo.utils import counters

        self.counters = counters
        self.graphs_before = counters["stats"]["unique_graphs"]
        self.breaks_before = sum(counters["graph_break"].values())
        self.calls = 0
        inner = policy._compiled
        assert inner is not None

        def counted(*inputs):
            self.calls += 1
            return inner(*inputs)

        policy._compiled = counted

    @property
    def graphs(self) -> int:
        return self.counters["stats"]["unique_graphs"] - self.graphs_before

    @property
    def breaks(self) -> int:
        return sum(self.counters["graph_break"].values()) - self.breaks_before


def longer_batch() -> list:
    """The gradient tests' batch plus a group of longer prompts, so micro-batches pad to two widths."""
    from crucible_trainer.rl.rollout import Sample

    prompt = list(range(100, 180))
    return [
        *batch(),
        *(
            Sample(4, 4, prompt, c, "", "", None, None, reward=1.0, advantage=a)
            for c, a in (([7, 8], 0.7), ([9], -0.7))
        ),
    ]


@pytest.mark.slow
def test_a_compiled_update_gives_the_eager_gradients(adapter_model, quick_compiler) -> None:
    """Two passes of one optimizer step each, a KL term (the reference scored with the adapter
    disabled, as a job without `init_adapter` does), micro-batches of 5, 5 and 1 rows padded to
    two widths."""
    from crucible_trainer.rl.update import UpdateConfig

    cfg = UpdateConfig(
        micro_batch=5, max_tokens=MAX_TOKENS, iterations=2, kl_beta=0.05, clip_eps=0.001, aggregation="token"
    )
    samples = longer_batch()
    model, _ = adapter_model
    want, eager_metrics = recorded(randomised(make_policy(model, None)), cfg, samples)
    policy = randomised(make_policy(model, None, compile="default"))
    compiled = Compiled(policy)
    got, metrics = recorded(policy, cfg, samples)
    # Every pass went through the compiled function, in whole graphs: one for training, one for
    # the no-grad reference, each for every batch size and length (a batch of one padded to two).
    assert compiled.calls == 2 * 3 + 3 and compiled.graphs == 2 and compiled.breaks == 0
    assert len(got) == len(want) == 2
    for g, w in zip(got, want, strict=True):
        assert_close(g, w)
    for key in ("loss", "kl", "clip_fraction", "update/ratio_mean_iter1"):
        assert metrics[key] == pytest.approx(eager_metrics[key], rel=1e-4, abs=1e-6), key
    assert metrics["kl"] > 0 and metrics["clip_fraction"] > 0  # the second pass's ratios moved


@every_family
@pytest.mark.slow
def test_the_reference_with_the_adapter_disabled_compiles_to_the_eager_scores(
    adapter_model, quick_compiler
) -> None:
    """A job without `init_adapter` scores the reference with PEFT's adapter disabled: a graph of
    its own beside the adapter's (the switch is a module attribute the graphs must not ignore)."""
    model, _ = adapter_model
    eager = randomised(make_policy(model, None))
    compiled = randomised(make_policy(model, None, compile="default"))
    counted = Compiled(compiled)
    prompts = [s.prompt_ids for s in batch()]
    comps = [s.completion_ids for s in batch()]
    adapted = eager.score(prompts, comps, micro_batch=5)
    want = eager.score(prompts, comps, micro_batch=5, reference=True)
    got_adapted = compiled.score(prompts, comps, micro_batch=5)  # this graph first, then the reference
    got = compiled.score(prompts, comps, micro_batch=5, reference=True)
    assert counted.calls == 4 and counted.graphs == 2 and counted.breaks == 0
    for g, w in [*zip(got, want, strict=True), *zip(got_adapted, adapted, strict=True)]:
        assert len(g) == len(w) and g == pytest.approx(w, abs=1e-5)
    assert (
        max(abs(x - y) for w, a in zip(want, adapted, strict=True) for x, y in zip(w, a, strict=True)) > 1e-3
    )


@pytest.mark.parametrize("family", ["llama", "gemma2", "phi3"])
def test_padding_to_a_multiple_changes_no_log_prob_or_gradient(family, family_checkpoints) -> None:
    """Eager, so every family is cheap: the same batch as it is and padded as a compiled forward
    pads it (64 tokens, two rows at least), log-probs and adapter gradients."""
    from crucible_trainer.rl.batch import make_batch, padded
    from crucible_trainer.rl.policy import COMPILE_MULTIPLE

    policy = make_policy(family_checkpoints.get(family), family_checkpoints.adapter(family))
    samples = batch()
    for rows in (samples[:3], samples[3:4]):  # three rows, and one (padded with a masked copy)
        b = make_batch([s.prompt_ids for s in rows], [s.completion_ids for s in rows], policy.pad_id, "cpu")
        wide = padded(b, COMPILE_MULTIPLE, policy.pad_id, rows=2)
        assert (wide.tail, wide.input_ids.shape) == (64, (max(2, len(rows)), 128))  # tail + 1 <= width
        weights = torch.linspace(-1.0, 1.0, b.tail)
        results = []
        for batch_in, cut in ((b, False), (wide, True)):
            policy.model.zero_grad(set_to_none=True)
            logp = policy.token_logprobs(batch_in)
            if cut:
                logp = logp[: len(rows), -b.tail :]
            (logp * weights).sum().backward()
            results.append((logp.detach(), grads(policy)))
        (plain, plain_grads), (wide_logp, wide_grads) = results
        assert plain.abs().sum() > 0
        torch.testing.assert_close(wide_logp, plain, rtol=1e-5, atol=1e-5)
        assert_close(wide_grads, plain_grads)


def test_a_non_finite_compiled_step_runs_again_eager(adapter_model) -> None:
    """The compiled function stubbed to return NaN: the step's retry runs eager and gives the eager
    policy's gradient (nothing is compiled here)."""
    from crucible_trainer.rl.update import UpdateConfig

    cfg = UpdateConfig(micro_batch=3, max_tokens=MAX_TOKENS, aggregation="token")
    policy = make_policy(*adapter_model, compile="default")
    assert len(policy.fallbacks) == 1  # eager
    calls = []

    def poisoned(*inputs):
        calls.append(policy.run_eager)
        return policy._logprobs(*inputs) * math.nan

    policy._compiled = poisoned
    got, metrics = recorded(policy, cfg)
    want, _ = recorded(make_policy(*adapter_model), cfg)
    assert calls == [False] * 3  # the first attempt's micro-batches (7 of 9 samples train), not the retry's
    assert metrics["update/retried_nonfinite_steps"] == 1 and metrics["update/optimizer_steps"] == 1
    assert len(got) == 2 and not all(torch.isfinite(g).all() for g in got[0].values())
    assert_close(got[1], want[0])
    with policy.fallbacks[0]():
        assert policy.run_eager
    assert not policy.run_eager


def test_compile_is_off_by_default_and_off_means_eager(adapter_model) -> None:
    policy = make_policy(*adapter_model)
    assert policy.compile_mode is None and policy._compiled is None and policy.fallbacks == []


def test_a_jobs_policy_work_runs_on_one_thread_of_its_own(adapter_model) -> None:
    """CUDA graphs are recorded per thread: every call of a job (updates, scores, saves) must land on
    the policy's one thread, however many are in flight, never on the loop's or a pool's."""
    import asyncio
    import threading

    policy = make_policy(*adapter_model)

    async def go() -> set[int]:
        def where() -> int:
            time.sleep(0.01)  # overlapping calls: a pool would spread them over threads
            return threading.get_ident()

        return set(await asyncio.gather(*(policy.call(where) for _ in range(8))))

    threads = asyncio.run(go())
    assert len(threads) == 1 and threading.get_ident() not in threads
    assert asyncio.run(go()) == threads  # and the same thread for the job's next event loop


# -- the spec -----------------------------------------------------------------------------------


def errors(spec: dict) -> list[tuple[tuple, str]]:
    from crucible_shared.jobs import TrainJob
    from pydantic import ValidationError

    try:
        TrainJob.model_validate(spec)
    except ValidationError as exc:
        return [(e["loc"], e["msg"]) for e in exc.errors()]
    return []


@pytest.mark.parametrize("value", [False, "default"])
def test_spec_takes_the_compile_modes(value) -> None:
    from crucible_shared.jobs import OptimSpec, TrainJob

    assert OptimSpec().compile is False
    job = TrainJob.model_validate({"optim": {"compile": value}})
    assert job.optim.compile == value
    # A queued job is dumped and parsed again.
    assert TrainJob.model_validate(job.model_dump(mode="json")).optim.compile == value


@pytest.mark.parametrize("value", [True, "max-autotune", "", 1])
def test_spec_refuses_other_compile_values(value) -> None:
    ((loc, message),) = errors({"optim": {"compile": value}})
    assert loc == ("optim", "compile") and "False or 'default'" in message


def test_spec_refuses_cuda_graphs_by_name() -> None:
    ((loc, message),) = errors({"optim": {"compile": "reduce-overhead"}})
    assert loc == ("optim", "compile") and "reduce-overhead (CUDA graphs) is not offered" in message


def test_spec_refuses_compile_over_several_ranks() -> None:
    spec = {"optim": {"compile": "default"}, "distributed": {"train_gpus": 2}}
    assert errors(spec) == [
        (
            (),
            "optim.compile: compiled passes run in one process for now (distributed.train_gpus is 2); "
            "set optim.compile to false or train_gpus to 1",
        )
    ]
    assert errors({"optim": {"compile": False}, "distributed": {"train_gpus": 2}}) == []


@pytest.mark.parametrize("method", ["sft", "dpo"])
def test_spec_refuses_compile_for_offline_methods(method) -> None:
    assert errors({"method": {"name": method, "path": "rows.jsonl"}, "optim": {"compile": "default"}}) == [
        ((), f"optim.compile: {method} trains with TRL's trainer, which compiles nothing here")
    ]
    from crucible_shared.jobs import PipelineJob
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match=r"optim\.compile: sft trains with TRL"):
        PipelineJob.model_validate({"optim": {"compile": "default"}})


def test_set_override_reaches_the_field() -> None:
    from crucible_cli.specs import apply_overrides

    raw = apply_overrides({}, ["optim.compile=default"])
    assert errors(raw) == [] and raw["optim"]["compile"] == "default"
    assert apply_overrides({}, ["optim.compile=false"])["optim"]["compile"] is False


# -- every family, and the rest (CRUCIBLE_TEST_COMPILE=1) ----------------------------------------


def compare(eager, compiled, samples, reference: bool = False) -> None:
    """Log-probs (and, unless `reference`, adapter gradients) of `samples` in one micro-batch."""
    from crucible_trainer.rl.batch import make_batch

    b = make_batch([s.prompt_ids for s in samples], [s.completion_ids for s in samples], eager.pad_id, "cpu")
    weights = torch.linspace(-1.0, 1.0, b.tail)
    out = []
    for policy in (eager, compiled):
        policy.model.zero_grad(set_to_none=True)
        if reference:
            with torch.no_grad():
                out.append((policy.token_logprobs(b, reference=True), {}))
            continue
        logp = policy.token_logprobs(b)
        (logp * weights).sum().backward()
        out.append((logp.detach(), grads(policy)))
    (want, want_grads), (got, got_grads) = out
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    if not reference:
        assert_close(got_grads, want_grads)


@every_family
@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen2-tied", "qwen3", "gemma2", "phi3", "mistral"])
def test_every_family_compiles_to_the_eager_log_probs(family, family_checkpoints, quick_compiler) -> None:
    model, adapter = family_checkpoints.get(family), family_checkpoints.adapter(family)
    eager, compiled = make_policy(model, adapter), make_policy(model, adapter, compile="default")
    counted = Compiled(compiled)
    samples = batch()
    compare(eager, compiled, samples[:3])
    compare(eager, compiled, samples[7:9])  # another batch size and length: the same graph
    compare(eager, compiled, samples[:3], reference=True)
    assert counted.graphs == 2 and counted.breaks == 0 and counted.calls == 3


@every_family
@pytest.mark.slow
def test_gradient_checkpointing_compiles_to_the_eager_gradients(adapter_model, quick_compiler) -> None:
    eager = make_policy(*adapter_model)
    compiled = make_policy(*adapter_model, compile="default", gradient_checkpointing=True)
    counted = Compiled(compiled)
    compare(eager, compiled, batch()[:3])
    assert counted.graphs == 1 and counted.breaks == 0  # non-reentrant checkpointing, in the graph


@every_family
@pytest.mark.slow
def test_a_bf16_base_under_autocast_compiles_close_to_eager(adapter_model, quick_compiler) -> None:
    """bf16 rounds differently once inductor fuses the casts: close, not equal."""
    from crucible_trainer.rl.batch import make_batch

    eager = make_policy(*adapter_model, dtype="bfloat16")
    compiled = make_policy(*adapter_model, compile="default", dtype="bfloat16")
    assert compiled.compute_dtype is torch.bfloat16
    counted = Compiled(compiled)
    samples = batch()[:3]
    b = make_batch([s.prompt_ids for s in samples], [s.completion_ids for s in samples], eager.pad_id, "cpu")
    out = []
    for policy in (eager, compiled):
        policy.model.zero_grad(set_to_none=True)
        logp = policy.token_logprobs(b)
        logp.sum().backward()
        g = grads(policy)
        out.append((logp.detach(), torch.cat([g[n].float().flatten() for n in sorted(g)])))
    (want, want_g), (got, got_g) = out
    assert counted.graphs == 1 and counted.breaks == 0
    assert all(p.dtype == torch.float32 for p in compiled.model.parameters() if p.requires_grad)
    torch.testing.assert_close(got, want, rtol=0.05, atol=0.05)
    assert float(torch.nn.functional.cosine_similarity(got_g, want_g, dim=0)) > 0.99


@every_family
@pytest.mark.slow
def test_a_no_grad_old_pass_compiles_to_the_eager_scores(adapter_model, quick_compiler) -> None:
    """PPO's separate `log p_old` pass (`Policy.score` without gradients, the adapter on), scored in
    micro-batches that are all queued before any is read."""
    eager, compiled = make_policy(*adapter_model), make_policy(*adapter_model, compile="default")
    counted = Compiled(compiled)
    prompts = [s.prompt_ids for s in batch()]
    comps = [s.completion_ids for s in batch()]
    got = compiled.score(prompts, comps, micro_batch=4)
    want = eager.score(prompts, comps, micro_batch=4)
    assert counted.calls == 3 and counted.graphs == 1 and counted.breaks == 0
    for g, w in zip(got, want, strict=True):
        assert len(g) == len(w) and g == pytest.approx(w, abs=1e-5)
