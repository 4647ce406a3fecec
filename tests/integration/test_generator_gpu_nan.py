"""On CUDA: issue 24's NaN. Two checks the CPU cannot make.

1. The fast path's attention shapes through each SDPA kernel PyTorch may pick (cuDNN attention,
   which PyTorch >= 2.11 puts first on an H100; memory-efficient; math), eagerly and replayed as a
   CUDA graph. Keys, values and queries are views of larger buffers whose memory just past each
   view holds NaN (the rest of a cache row, the next row): a kernel that reads past its view
   answers NaN. Hidden slots hold finite stale values, as a cache row does. Each kernel's answer
   is compared with fp32 math.
2. The workload of the H100 runs that crashed (a pre-filter's sampled wave, the 500-task greedy
   evaluation at 256 concurrent requests, then seeded GRPO waves beside a greedy probe, seeds
   0-4) through the real engine on SmolLM2, once per `attention_kernels` setting: every sampled
   token's log-probability must be finite (the engine fails a request whose logits were not, and
   logs its row: `faults.py`).

Run on the GPU machine: `bash bench/gpu.sh gpu-tests tests/integration/test_generator_gpu_nan.py` (~4 minutes).
"""

from __future__ import annotations

import asyncio
import math

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

KERNELS = {"cudnn": "CUDNN_ATTENTION", "efficient": "EFFICIENT_ATTENTION", "math": "MATH"}


def _poisoned(
    shape: tuple[int, ...], view: tuple[slice, ...], seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(buffer, view): random bf16 values inside `view`, NaN everywhere else in the buffer."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    buf = torch.full(shape, float("nan"), device="cuda", dtype=torch.bfloat16)
    inner = buf[view]
    inner.copy_(torch.randn(inner.shape, device="cuda", generator=gen).to(torch.bfloat16))
    return buf, inner


def _attend(kernel: str, q, k, v, mask, graph: bool) -> torch.Tensor:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def run() -> torch.Tensor:
        with sdpa_kernel([getattr(SDPBackend, KERNELS[kernel])]):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    if not graph:
        return run()
    from crucible_generator.continuous import capture_graph

    cuda_graph, out = capture_graph(run, run, torch.cuda.graph_pool_handle())
    cuda_graph.replay()
    return out


def _check(kernel: str, q, k, v, mask, want, label: str, failures: list[str], graph: bool = False) -> None:
    where = f"{kernel}{' (graph)' if graph else ''}"
    try:
        got = _attend(kernel, q, k, v, mask, graph)
        torch.cuda.synchronize()
    except RuntimeError as exc:
        if "No available kernel" in str(exc):  # not this kernel's shape: PyTorch would pick another
            return
        failures.append(f"{where}: {type(exc).__name__} at {label}: {str(exc)[:200]}")
        return
    if not bool(torch.isfinite(got).all()):
        failures.append(f"{where}: non-finite output at {label}")
    elif not torch.allclose(got.float(), want, atol=3e-2, rtol=3e-2):
        err = float((got.float() - want).abs().max())
        failures.append(f"{where}: max error {err:.3g} at {label}")


@pytest.mark.parametrize("kernel", ["cudnn", "efficient", "math"])
def test_attention_kernels_at_the_fast_paths_shapes(kernel) -> None:
    from crucible_generator.fastpath import prefill_mask

    failures: list[str] = []
    min_bf16 = torch.finfo(torch.bfloat16).min
    # Decode (packed GQA: 3 key/value heads x 3 query heads, one token): windows of a 128-row cache.
    for rows, slots in ((1, 256), (16, 512), (64, 768), (128, 1280), (128, 2048)):
        length = 2304  # the buffer runs past the largest window: NaN there
        _, k = _poisoned((128, 3, length, 64), (slice(0, rows), slice(None), slice(0, slots)), 1)
        _, v = _poisoned((128, 3, length, 64), (slice(0, rows), slice(None), slice(0, slots)), 2)
        _, q = _poisoned((129, 3, 4, 64), (slice(0, rows), slice(None), slice(0, 3)), 3)
        open_len = torch.randint(1, slots + 1, (rows,), device="cuda")
        visible = torch.arange(slots, device="cuda")[None, :] < open_len[:, None]
        full = torch.full((128, length), min_bf16, device="cuda", dtype=torch.bfloat16)
        full[:rows, :slots].masked_fill_(visible, 0.0)  # hidden slots hold finite stale values
        mask = full[:rows, :slots][:, None, None, :]
        want = torch.nn.functional.scaled_dot_product_attention(
            q.float(), k.float(), v.float(), attn_mask=mask.float()
        )
        for graph in (False, True):
            _check(kernel, q, k, v, mask, want, f"decode {rows} rows x {slots} slots", failures, graph)
    # Prefill: left-padded prompts, 9 query heads on repeated key/value heads, odd and round widths.
    for count, width in ((1, 64), (16, 192), (16, 320), (17, 289), (56, 292), (128, 300), (4, 448)):
        _, q = _poisoned((count, 9, width + 64, 64), (slice(None), slice(None), slice(0, width)), 4)
        _, k = _poisoned((count, 9, width + 64, 64), (slice(None), slice(None), slice(0, width)), 5)
        _, v = _poisoned((count, 9, width + 64, 64), (slice(None), slice(None), slice(0, width)), 6)
        lengths = torch.randint(1, width + 1, (count,), device="cuda")
        mask2d = torch.arange(width, device="cuda")[None, :] >= (width - lengths)[:, None]
        mask = prefill_mask(mask2d, width, torch.bfloat16)
        want = torch.nn.functional.scaled_dot_product_attention(
            q.float(), k.float(), v.float(), attn_mask=mask.float()
        )
        _check(kernel, q, k, v, mask, want, f"prefill {count} prompts x {width}", failures)
    assert not failures, "\n".join(failures)


def _mbpp_prompts(tokenizer, split: str, limit: int | None = None) -> list[list[int]]:
    from crucible_shared.jobs import DataSpec
    from crucible_trainer import tasks

    problems = tasks.load_tasks(DataSpec(dataset="mbpp", split=split, limit=limit))
    texts = [
        tokenizer.apply_chat_template(tasks.build_messages(p), add_generation_prompt=True, tokenize=False)
        for p in problems
    ]
    return [tokenizer(t).input_ids for t in texts]


@pytest.mark.parametrize("attention_kernels", ["auto", "no_cudnn"])
def test_the_crashing_runs_workload_keeps_every_logit_finite(attention_kernels) -> None:
    import crucible_models as models
    from crucible_generator.engine import Engine, SamplingParams
    from crucible_generator.errors import ServerError

    model, tokenizer = models.load_model(device="cuda")
    train, test = _mbpp_prompts(tokenizer, "train"), _mbpp_prompts(tokenizer, "test")
    engine = Engine(  # graphs from the first step on, as in the crashing run
        model,
        tokenizer,
        max_batch_size=128,
        fast_decode="on",
        attention_kernels=attention_kernels,
        graph_capture="start",
    )
    engine.start()
    faults: list[str] = []

    def sampled(seed: int) -> SamplingParams:
        return SamplingParams(max_tokens=256, temperature=1.0, seed=seed, logprobs=0)

    greedy = SamplingParams(max_tokens=256, temperature=0.0, logprobs=0)

    async def checked(prompts, params, n=1):
        try:
            out = await engine.generate(prompts, params, n=n)
        except ServerError as exc:  # a non-finite row: failed and logged by the engine
            faults.append(exc.message)
            return
        bad = [lp for c in out for lp in c.logprobs if not math.isfinite(lp)]
        if bad:
            faults.append(f"non-finite logprobs returned: {bad[:3]}")

    async def workload() -> None:
        await checked(train[:100], sampled(1_000_003), n=4)  # the pre-filter's wave (seed 1)
        limit = asyncio.Semaphore(256)  # the evaluation: 500 greedy requests, 256 at a time

        async def one(prompt):
            async with limit:
                await checked([prompt], greedy)

        await asyncio.gather(*(one(p) for p in test))
        for seed in range(5):  # GRPO steps: 8 problems x 8 samples beside the stale-policy probe
            for step in (1, 2, 3):
                start = (seed * 24 + step * 8) % (len(train) - 8)
                await asyncio.gather(
                    checked(train[start : start + 8], sampled(seed * 1_000_003 + step * 7919), n=8),
                    checked([train[0]], SamplingParams(max_tokens=24, temperature=0.0, logprobs=0)),
                )

    try:
        asyncio.run(workload())
    finally:
        engine.stop()
    assert not faults, f"{len(faults)} requests met non-finite logits:\n" + "\n".join(faults[:10])
