"""The update's model FLOPs formula (rl/throughput.py), its counts on a real model, and the
figures the update reports."""

from __future__ import annotations

import doctest

import pytest
from crucible_trainer.rl import throughput
from crucible_trainer.rl.throughput import ModelCounts, peak_flops


def test_doctests() -> None:
    assert doctest.testmod(throughput).failed == 0


def test_formula_by_hand() -> None:
    # 2 layers, attention width 8: A(L) = 2 * 2 * 8 * L * (L + 1)
    m = ModelCounts(body=1000, head=50, adapter=10, layers=2, attention=8)
    assert m.attention_flops(3) == 2 * 2 * 8 * 3 * 4
    p, c = 4, 3
    a = m.attention_flops(7)
    assert m.forward_flops(p, c) == 2 * 1010 * 7 + 2 * 50 * 3 + a
    assert m.forward_flops(p, c, adapter=False) == 2 * 1000 * 7 + 2 * 50 * 3 + a
    # forward (2N + 2R per token) + activation gradients (the same) + the adapter's weight gradients (2R)
    assert m.train_flops(p, c) == 4 * 1000 * 7 + 6 * 10 * 7 + 4 * 50 * 3 + 3 * a
    assert m.pass_flops([(p, c), (1, 1)], "train") == m.train_flops(p, c) + m.train_flops(1, 1)
    assert m.pass_flops([(p, c)], "reference") == m.forward_flops(p, c, adapter=False)


def test_peaks_by_card_name() -> None:
    assert peak_flops("NVIDIA H200") == peak_flops("NVIDIA H100 80GB HBM3") == 989.5e12
    assert peak_flops("NVIDIA H200 NVL") == 835.5e12
    assert peak_flops("Tesla T4") is None and peak_flops("cpu") is None


def test_counts_of_a_lora_model(tmp_path) -> None:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        "llama",
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=100,
        tie_word_embeddings=False,
    )
    base = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(r=2, target_modules=["q_proj", "v_proj"]))
    m = ModelCounts.of(model)
    # per layer: q 32x32, k and v 32x16 each, o 32x32, MLP 3 x 32x64, two norms of 32; a final norm
    assert m.body == 2 * (32 * 32 * 2 + 32 * 16 * 2 + 3 * 32 * 64 + 2 * 32) + 32
    assert m.head == 100 * 32
    assert m.adapter == 2 * ((2 * 32 + 32 * 2) + (2 * 32 + 16 * 2))  # q: A 2x32, B 32x2; v: B 16x2
    assert (m.layers, m.attention) == (2, 32)
    tied_config = AutoConfig.for_model(
        "llama",
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        vocab_size=100,
        tie_word_embeddings=True,
    )
    tied = ModelCounts.of(AutoModelForCausalLM.from_config(tied_config).requires_grad_(False))
    assert tied.head == 100 * 32 and tied.adapter == 0


def test_the_update_reports_its_parts(tmp_path) -> None:
    from crucible_trainer.rl.update import UpdateConfig, update

    from tests.unit.test_update_buckets import batch, build_family, make_policy, save_lora

    model = build_family("llama", tmp_path)
    policy = make_policy(model, save_lora(model, tmp_path / "adapter", seed=1, rank=4))
    m = update(policy, batch(), UpdateConfig(micro_batch=3, kl_beta=0.05, iterations=2))
    for part in ("ref", "forward_backward", "optimizer"):
        assert m[f"time/update_{part}_s"] > 0
    assert (
        m["time/update_allreduce_s"] < m["time/update_forward_backward_s"]
    )  # one process: nothing to reduce
    assert m["time/update_old_s"] == 0.0  # p_old from the first pass's forwards (one optimizer step)
    assert "perf/update_old_tflop" not in m
    counts = ModelCounts.of(policy.model)
    lengths = [(len(s.prompt_ids), len(s.completion_ids)) for s in batch()]  # every sample trains (KL)
    assert m["perf/update_train_tflop"] == pytest.approx(2 * counts.pass_flops(lengths, "train") / 1e12)
    assert m["perf/update_ref_tflop"] == pytest.approx(counts.pass_flops(lengths, "reference") / 1e12)
    tokens = sum(p + c for p, c in lengths)
    assert m["perf/update_train_tokens_per_s_per_gpu"] == pytest.approx(
        2 * tokens / m["time/update_forward_backward_s"]
    )
    assert m["perf/update_tokens_per_s_per_gpu"] > 0
    assert not any(k.endswith("peak_fraction") for k in m)  # a CPU has no listed peak
