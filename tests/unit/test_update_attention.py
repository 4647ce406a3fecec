"""The update's attention without cuDNN's kernels (rl/attention.py), on every family's tiny checkpoint.

SDPA's backend flags are process-wide and a CPU has them too, so what CUDA would choose is read
here from inside each attention call: every call of the passes, the forward's and a checkpointed
layer's recompute in the backward alike, runs with cuDNN's attention off, and the log-probs and
gradients are SDPA's own (transformers' function, on a CPU the same kernels).
"""

from __future__ import annotations

from contextlib import contextmanager

import pytest
import torch

from tests.families import FAMILIES, build_family
from tests.unit.test_update_buckets import batch


def make_policy(model, checkpointing: bool):
    from crucible_shared.jobs import TrainJob
    from crucible_trainer.rl.policy import Policy

    spec = TrainJob.model_validate(
        {
            "model": {
                "base": str(model),
                "device": "cpu",
                "dtype": "float32",
                "gradient_checkpointing": checkpointing,
            },
            "optim": {"lr": 1e-2, "micro_batch": 4},
            "seed": 3,
        }
    )
    return Policy(spec.model, spec.optim, spec.seed)


@contextmanager
def recorded_flags(monkeypatch):
    """cuDNN's SDPA flag as each call of transformers' SDPA function saw it."""
    from transformers import AttentionInterface
    from transformers.integrations import sdpa_attention

    seen, plain = [], sdpa_attention.sdpa_attention_forward

    def recording(*args, **kwargs):
        seen.append(torch.backends.cuda.cudnn_sdp_enabled())
        return plain(*args, **kwargs)

    # Where rl/attention.py's function finds it, and where the layers look "sdpa" up.
    with monkeypatch.context() as patch:
        patch.setattr(sdpa_attention, "sdpa_attention_forward", recording)
        patch.setitem(AttentionInterface._global_mapping, "sdpa", recording)
        yield seen


def logprobs_and_grads(policy):
    from crucible_trainer.rl.batch import make_batch

    samples = batch()
    b = make_batch([s.prompt_ids for s in samples], [s.completion_ids for s in samples], policy.pad_id, "cpu")
    policy.model.zero_grad(set_to_none=True)
    logp = policy.token_logprobs(b)
    logp.sum().backward()
    grads = {n: p.grad.clone() for n, p in policy.model.named_parameters() if p.grad is not None}
    return logp.detach(), grads


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_attention_call_runs_without_cudnn_and_computes_sdpas_values(
    family, tmp_path, monkeypatch
) -> None:
    model = build_family(family, tmp_path)
    policy = make_policy(model, checkpointing=True)
    layers = policy.model.get_base_model().config.get_text_config().num_hidden_layers
    assert torch.backends.cuda.cudnn_sdp_enabled()
    with recorded_flags(monkeypatch) as seen:
        got, got_grads = logprobs_and_grads(policy)
    assert torch.backends.cuda.cudnn_sdp_enabled()  # and back on after
    if not policy._registered:  # a family that does not attend through SDPA (eager by default)
        assert policy.model.get_base_model().config._attn_implementation != "sdpa" and seen == []
        return
    # Every layer's forward, then its recompute in the backward (checkpointed), without cuDNN.
    assert seen == [False] * (2 * layers), seen
    policy.cudnn_attention = True  # transformers' own SDPA function: the same values
    with recorded_flags(monkeypatch) as seen:
        want, want_grads = logprobs_and_grads(policy)
    assert seen == [True] * (2 * layers)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert got_grads.keys() == want_grads.keys() and got_grads
    for name in got_grads:
        torch.testing.assert_close(got_grads[name], want_grads[name], rtol=0, atol=0)
    policy.cudnn_attention = False
    with recorded_flags(monkeypatch) as seen:
        logprobs_and_grads(policy)
    assert seen == [False] * (2 * layers)


def test_scoring_and_the_reference_run_without_cudnn_too(tmp_path, monkeypatch) -> None:
    from crucible_trainer.rl.batch import make_batch

    policy = make_policy(build_family("qwen2", tmp_path), checkpointing=False)
    samples = batch()
    prompts, completions = [s.prompt_ids for s in samples], [s.completion_ids for s in samples]
    with recorded_flags(monkeypatch) as seen:
        policy.score(prompts, completions, micro_batch=4)  # 3 micro-batches of 2 layers
        policy.token_logprobs(make_batch(prompts, completions, policy.pad_id, "cpu"), reference=True)
    assert seen == [False] * 8
