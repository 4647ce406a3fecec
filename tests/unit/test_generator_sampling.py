"""Sampling: greedy, nucleus and top-k filters, per-row generators and raw logprobs."""

from __future__ import annotations

import torch
from crucible_generator.sampling import RowParams, filter_logits, make_generator, sample


def test_greedy_takes_argmax_and_reports_raw_logprob():
    logits = torch.tensor([[0.0, 3.0, 1.0], [2.0, 0.0, -1.0]])
    out = sample(logits, [RowParams(temperature=0.0), RowParams(temperature=0.0)])
    assert out.tokens.tolist() == [1, 0]
    expected = torch.log_softmax(logits, -1)[[0, 1], [1, 0]]
    assert torch.allclose(out.logprobs, expected)


def test_logprobs_are_raw_whatever_the_temperature():
    logits = torch.randn(1, 50, generator=torch.Generator().manual_seed(0))
    row = RowParams(temperature=0.3, top_p=0.5, generator=make_generator(1))
    out = sample(logits, [row], num_top=3)
    raw = torch.log_softmax(logits, -1)[0]
    assert torch.isclose(out.logprobs[0], raw[out.tokens[0]])
    assert torch.allclose(out.top_logprobs[0], torch.topk(raw, 3).values)


def test_top_p_keeps_the_smallest_nucleus():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    kept = torch.isfinite(filter_logits(logits, top_p=0.7, top_k=0))
    assert kept.tolist() == [True, True, False, False]
    # The most likely token always survives, even when it alone exceeds top_p.
    assert torch.isfinite(filter_logits(logits, top_p=0.1, top_k=0)).tolist() == [True, False, False, False]


def test_top_k_keeps_k_tokens():
    logits = torch.tensor([1.0, 4.0, 3.0, 2.0])
    assert torch.isfinite(filter_logits(logits, top_p=1.0, top_k=2)).tolist() == [False, True, True, False]


def test_seeded_rows_do_not_depend_on_their_batch():
    vocab = 1000
    logits = torch.randn(4, vocab, generator=torch.Generator().manual_seed(3))
    alone = sample(logits[2:3], [RowParams(temperature=1.0, generator=make_generator(42))])
    rows = [RowParams(temperature=1.0, generator=make_generator(s)) for s in (1, 2)]
    rows += [RowParams(temperature=1.0, generator=make_generator(42)), RowParams(temperature=0.0)]
    batched = sample(logits, rows)
    assert batched.tokens[2] == alone.tokens[0]


def test_same_seed_same_draws():
    logits = torch.zeros(1, 5000)
    draws = [
        sample(logits, [RowParams(temperature=1.0, generator=make_generator(7))]).tokens.item()
        for _ in range(2)
    ]
    assert draws[0] == draws[1]


def test_batched_filters_match_row_by_row():
    logits = torch.randn(5, 300, generator=torch.Generator().manual_seed(4))
    top_p = [1.0, 0.9, 0.5, 1.0, 0.3]
    top_k = [0, 0, 10, 7, 3]
    batched = filter_logits(logits, torch.tensor(top_p), torch.tensor(top_k))
    for i in range(5):
        alone = filter_logits(logits[i], top_p[i], top_k[i])
        assert torch.isfinite(alone).tolist() == torch.isfinite(batched[i]).tolist()
    assert torch.isfinite(batched[0]).all() and torch.isfinite(batched[3]).sum() == 7


def test_draws_follow_the_tempered_distribution():
    # 20,000 rows drawn in one call: the empirical frequencies match softmax(logits / T).
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = torch.log(probs).repeat(20_000, 1)
    rows = [RowParams(temperature=0.5)] * 20_000
    torch.manual_seed(0)
    counts = torch.bincount(sample(logits, rows).tokens, minlength=4).float() / 20_000
    expected = torch.softmax(torch.log(probs) / 0.5, -1)
    assert torch.allclose(counts, expected, atol=0.015), (counts, expected)


def test_top_p_draws_never_leave_the_nucleus():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05])).repeat(2_000, 1)
    rows = [RowParams(temperature=1.0, top_p=0.7, generator=make_generator(5))] * 2_000
    assert set(sample(logits, rows).tokens.tolist()) == {0, 1}
