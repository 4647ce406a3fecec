"""The fast path's decode attention: grouped query heads attend to their key/value head without
copies, and give what transformers' expanded SDPA attention gives."""

from __future__ import annotations

import types

import pytest
import torch
import torch.nn.functional as F
from crucible_generator.attention import NAME, packed_gqa_sdpa, use_packed_attention


def _expanded(query, key, value, mask, scale):
    """The reference: every key/value head copied once per query head of its group (repeat_kv)."""
    groups = query.shape[1] // key.shape[1]
    key = key.repeat_interleave(groups, dim=1)
    value = value.repeat_interleave(groups, dim=1)
    return F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scale).transpose(1, 2)


@pytest.mark.parametrize("kv_heads,groups", [(3, 3), (2, 4)])
def test_one_query_token_matches_expanded_attention(kv_heads: int, groups: int) -> None:
    gen = torch.Generator().manual_seed(0)
    batch, slots, dim = 5, 37, 16
    query = torch.randn(batch, kv_heads * groups, 1, dim, generator=gen)
    key = torch.randn(batch, kv_heads, slots, dim, generator=gen)
    value = torch.randn(batch, kv_heads, slots, dim, generator=gen)
    # Rows see different prefixes (an additive mask, as the row cache builds it).
    lengths = torch.tensor([1, 7, 20, 37, 12])
    mask = torch.where(torch.arange(slots)[None, :] < lengths[:, None], 0.0, torch.finfo(torch.float32).min)
    mask = mask[:, None, None, :]
    module = types.SimpleNamespace(num_key_value_groups=groups)
    out, weights = packed_gqa_sdpa(module, query, key, value, mask, scaling=0.25)
    assert weights is None
    assert out.shape == (batch, 1, kv_heads * groups, dim)
    torch.testing.assert_close(out, _expanded(query, key, value, mask, 0.25), rtol=1e-5, atol=1e-5)


def test_a_wrong_head_grouping_would_be_caught() -> None:
    """Guards the test above: pairing query heads with the wrong key/value head changes the output."""
    gen = torch.Generator().manual_seed(1)
    query = torch.randn(2, 6, 1, 8, generator=gen)
    key, value = torch.randn(2, 2, 9, 8, generator=gen), torch.randn(2, 2, 9, 8, generator=gen)
    interleaved = F.scaled_dot_product_attention(
        query, key.repeat(1, 3, 1, 1), value.repeat(1, 3, 1, 1)
    ).transpose(1, 2)  # head h -> kv head h % 2: not transformers' order
    out, _ = packed_gqa_sdpa(types.SimpleNamespace(num_key_value_groups=3), query, key, value, None)
    assert not torch.allclose(out, interleaved, atol=1e-3)


def test_prefill_goes_to_transformers_sdpa() -> None:
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    gen = torch.Generator().manual_seed(2)
    query = torch.randn(2, 6, 4, 8, generator=gen)  # four query tokens
    key, value = torch.randn(2, 2, 4, 8, generator=gen), torch.randn(2, 2, 4, 8, generator=gen)
    module = types.SimpleNamespace(num_key_value_groups=3, is_causal=True)
    ours, _ = packed_gqa_sdpa(module, query, key, value, None, scaling=0.3)
    theirs, _ = sdpa_attention_forward(module, query, key, value, None, scaling=0.3)
    torch.testing.assert_close(ours, theirs)


def test_arguments_that_change_attention_go_to_transformers() -> None:
    """Soft-capping is not something the packed path does: transformers' SDPA refuses it loudly."""
    query = torch.randn(1, 6, 1, 8)
    key, value = torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8)
    with pytest.raises(ValueError, match="softcap"):
        packed_gqa_sdpa(types.SimpleNamespace(num_key_value_groups=3), query, key, value, None, softcap=30.0)


def test_only_sdpa_models_switch(tiny_llama_config) -> None:
    from transformers import AutoModelForCausalLM

    sdpa = AutoModelForCausalLM.from_config(tiny_llama_config, attn_implementation="sdpa")
    assert use_packed_attention(sdpa)
    assert sdpa.config._attn_implementation == NAME
    eager = AutoModelForCausalLM.from_config(tiny_llama_config, attn_implementation="eager")
    assert not use_packed_attention(eager)
    assert eager.config._attn_implementation == "eager"


@pytest.fixture
def tiny_llama_config():
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=64, hidden_size=48, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=64,
    )  # fmt: skip


def test_packed_model_decodes_like_sdpa(tiny_llama_config) -> None:
    """A whole model: one decode step after a prefill gives the same logits either way."""
    import inspect

    from transformers import AttentionInterface, AutoModelForCausalLM, DynamicCache

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_llama_config, attn_implementation="sdpa").eval()
    cache_kw = "cache" if "cache" in inspect.signature(type(model).forward).parameters else "past_key_values"
    ids = torch.randint(0, 64, (3, 9))

    def last_logits() -> torch.Tensor:
        cache = DynamicCache()
        with torch.no_grad():
            model(input_ids=ids[:, :-1], use_cache=True, **{cache_kw: cache})
            return model(input_ids=ids[:, -1:], use_cache=True, **{cache_kw: cache}).logits[:, -1]

    before = last_logits()
    assert use_packed_attention(model)
    decode_calls = []

    def spy(module, query, *args, **kwargs):
        decode_calls.append(query.shape[2] == 1)
        return packed_gqa_sdpa(module, query, *args, **kwargs)

    AttentionInterface.register(NAME, spy)
    try:
        after = last_logits()
    finally:
        AttentionInterface.register(NAME, packed_gqa_sdpa)
    assert decode_calls.count(True) == tiny_llama_config.num_hidden_layers  # the decode step ran ours
    torch.testing.assert_close(after, before, rtol=1e-5, atol=1e-5)
