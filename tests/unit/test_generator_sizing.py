"""The generator's memory (`gpu_memory_fraction`, sizing.py): what it counts, the rows and cache
blocks it leaves, and the refusals, on a tiny model and on the real Qwen2.5-Coder-7B shape (built
on the meta device: shapes without memory)."""

from __future__ import annotations

import logging

import pytest
import torch
from crucible_generator import sizing as budget
from crucible_generator.sizing import GIB, BudgetError, footprint_of, plan_paged, plan_rows

from tests.unit.test_generator_engine import tiny_model

H100 = 85_029_158_912  # what `torch.cuda.mem_get_info` reports as an H100 80GB's total (79.2 GiB)


def test_the_footprint_counts_weights_their_copy_caches_activations_and_adapters() -> None:
    model = tiny_model()  # hidden 32, MLP 64, 2 layers, 2 KV heads of 8, 64-token vocabulary, fp32
    weights = sum(p.numel() * 4 for p in model.parameters()) + sum(b.numel() * 4 for b in model.buffers())
    f = footprint_of(model, row_length=256, fast=True, prefill_graphs=True, max_loras=4, max_lora_rank=8)
    per_token = 2 * 2 * 2 * 8 * 4  # keys and values, layers, KV heads, head size, bytes
    assert (f.weights, f.merged_copy) == (weights, weights)
    assert f.per_row == per_token * 256 + 64 * budget.SAMPLING_BYTES
    # Prefill graphs at rows of 256 tokens: 1-16 prompts (31 in all) x widths 64..256 (640 tokens).
    assert f.prefill_scratch == 31 * 640 * per_token
    # q, k, v, o, gate, up, down: in + out features per layer (the output layer takes no adapter).
    assert f.adapters == 4 * 8 * 2 * (64 + 48 + 48 + 64 + 96 + 96 + 96) * 4
    assert f.fixed == weights * 2 + f.prefill_scratch + f.activations + f.adapters + budget.CONTEXT_BYTES
    eager = footprint_of(model, row_length=256, fast=False, prefill_graphs=True, max_loras=4, max_lora_rank=8)
    assert eager.merged_copy == eager.prefill_scratch == 0  # no merged copy, no captured prefills


@pytest.fixture(scope="module")
def qwen_7b():
    import importlib.util
    from pathlib import Path

    from transformers import AutoConfig, AutoModelForCausalLM

    path = Path(__file__).parents[2] / "bench" / "model_shapes.py"
    spec = importlib.util.spec_from_file_location("model_shapes", path)
    shapes = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(shapes)
    values = {k: v for k, v in shapes.SHAPES["qwen2.5-coder-7b"].items() if v is not None}
    config = AutoConfig.for_model(**values)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)


def footprint_7b(model, fast: bool = True):
    return footprint_of(model, row_length=2048, fast=fast, prefill_graphs=True, max_loras=4, max_lora_rank=64)


def test_the_7b_shape_fits_beside_a_trainer_or_vllm_and_says_why_when_it_does_not(qwen_7b) -> None:
    f = footprint_7b(qwen_7b)
    assert 0 < f.weights - 7_615_616_512 * 2 <= 1024  # bf16 parameters and the rotary buffers
    assert f.per_row == 2 * 28 * 4 * 128 * 2 * 2048 + 152_064 * budget.SAMPLING_BYTES  # 114 MiB a row
    rows = plan_rows(H100, 0.55, f)
    budget_bytes = int(H100 * 0.55)
    assert rows == 32 and f.fixed + rows * f.per_row <= budget_bytes < f.fixed + 2 * rows * f.per_row
    # 0.35 holds the weights (14.2 GiB) but not their merged copy as well: refused, and told why.
    with pytest.raises(BudgetError) as refused:
        plan_rows(H100, 0.35, f)
    message = str(refused.value)
    assert "no room for one cache row of 2048 tokens" in message
    assert "weights 14.2 GiB, merged copy 14.2 GiB" in message
    assert "raise it to at least 0.4" in message and "fast_decode=off" in message
    assert plan_rows(H100, 0.35, footprint_7b(qwen_7b, fast=False)) >= 32  # without the copy it fits
    with pytest.raises(BudgetError, match=r"the model's weights \(14.2 GiB\) exceed"):
        plan_rows(H100, 0.15, f)


def test_the_paged_cache_holds_many_more_rows_than_full_length_rows_in_the_same_budget(qwen_7b) -> None:
    """At 7B, 0.55 of an H100 holds 32 rows reserved at 2,048 tokens (65k tokens); paged, the same
    room holds 256 rows and more tokens than that (no memory goes to rows' unused slots)."""
    f = footprint_7b(qwen_7b)
    assert plan_rows(H100, 0.55, f) == 32
    plan = plan_paged(H100, 0.55, f, block_size=16)
    assert plan.rows == 256 and plan.tokens > 65_536
    room = int(H100 * 0.55) - f.fixed
    assert plan.rows * f.row_share <= room // 2  # the rows' own share leaves half for the blocks
    assert plan.rows * f.row_share + plan.blocks * 16 * f.kv_per_token <= room
    # A set max_batch_size is kept, with the blocks that fit beside it.
    assert plan_paged(H100, 0.55, f, block_size=16, requested=40).rows == 40
    assert plan_paged(H100, 0.55, f, block_size=16, requested=40).blocks > plan.blocks
    # On an H200 (139 GiB) the room holds 256 rows at full length: each row owns its blocks (no
    # gather), as many rows as rows reserved at the context gave.
    big = plan_paged(int(139.8 * GIB), 0.55, f, block_size=16)
    assert big.rows == plan_rows(int(139.8 * GIB), 0.55, f) == budget.CONTIGUOUS_ROWS
    assert big.blocks == big.rows * 2048 // 16


def test_a_set_batch_size_is_checked_against_the_budget(qwen_7b) -> None:
    f = footprint_7b(qwen_7b)
    assert plan_rows(H100, 0.55, f, requested=40) == 40  # not a power of two, but it fits
    with pytest.raises(
        BudgetError,
        match=r"max_batch_size 128 needs 14.3 GiB of cache rows; .* leaves 7.0 GiB for rows \(32 rows\)",
    ):
        plan_rows(H100, 0.55, f, requested=128)


def test_the_setting_is_read_from_the_environment_and_bounded(monkeypatch) -> None:
    from crucible_generator.settings import Settings

    assert Settings().gpu_memory_fraction is None  # unset: rows from the free memory, as before
    monkeypatch.setenv("CRUCIBLE_GENERATOR_GPU_MEMORY_FRACTION", "0.35")
    assert Settings().gpu_memory_fraction == 0.35
    for bad in ("0", "1.5", "-0.2", "most"):
        monkeypatch.setenv("CRUCIBLE_GENERATOR_GPU_MEMORY_FRACTION", bad)
        with pytest.raises(ValueError, match="gpu_memory_fraction"):
            Settings()


def test_on_a_cpu_the_fraction_is_ignored_with_a_line(caplog) -> None:
    from crucible_generator.service import cache_plan
    from crucible_generator.settings import Settings

    with caplog.at_level(logging.INFO):
        assert cache_plan(tiny_model(), Settings(gpu_memory_fraction=0.3)).rows == budget.CPU_BATCH
    assert "gpu_memory_fraction applies on CUDA only" in caplog.text


def test_a_set_block_count_sizes_the_cache_and_the_rows(monkeypatch) -> None:
    from crucible_generator.service import cache_plan
    from crucible_generator.settings import Settings

    monkeypatch.setenv("CRUCIBLE_GENERATOR_KV_BLOCKS", "4096")
    monkeypatch.setenv("CRUCIBLE_GENERATOR_FAST_DECODE", "on")
    plan = cache_plan(tiny_model(), Settings())
    assert (plan.blocks, plan.block_size, plan.rows) == (4096, 16, 256)  # 256 rows of 256 tokens
    monkeypatch.setenv("CRUCIBLE_GENERATOR_BLOCK_SIZE", "32")
    monkeypatch.setenv("CRUCIBLE_GENERATOR_MAX_BATCH_SIZE", "12")
    assert cache_plan(tiny_model(), Settings()) == budget.CachePlan(rows=12, blocks=4096, block_size=32)
    for bad in ("24", "0", "512"):
        monkeypatch.setenv("CRUCIBLE_GENERATOR_BLOCK_SIZE", bad)
        with pytest.raises(ValueError, match="block_size"):
            Settings()


def test_gib_rounds_to_a_tenth() -> None:
    assert budget.gib(1.25 * GIB) == "1.2 GiB" and budget.gib(0) == "0.0 GiB"
