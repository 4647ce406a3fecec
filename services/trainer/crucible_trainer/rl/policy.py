"""The policy: the base model with a trainable LoRA adapter (PEFT), and what the trainer asks of it.

Log-probabilities are computed for exactly the token ids the generator sampled (never by
re-tokenising text), left-padded so every completion ends at the last position, and only the
last `max_completion + 1` positions' logits are materialised. Where those logits would not fit in
a GPU's free memory (and always on a CPU, where it is faster), only the completion tokens'
hidden states go through the output layer instead, a chunk at a time (rl/head.py, for the
families whose logits are that layer's output; not in compiled passes).

Mixed precision: the adapter's weights and their optimizer state stay float32 (PEFT upcasts them)
while a bf16/fp16 base model computes in its own dtype. Forwards run under autocast with PEFT's
input casting off, so each adapted layer multiplies the activations as they are (the small
adapter matrices are cast, not the activations: no float32 copy of every layer's input and
output, no float32 matmuls), and the gradients still reach the float32 weights.

Compiled passes (`optim.compile`): the log-probs of a batch (the model's forward under autocast
and the log-softmax of the kept logits) run through torch.compile, forward and backward, for
training and for the no-grad scoring of `log p_old` and of the reference (each a graph of its own:
the grad mode and the disabled adapter are part of what a graph assumes). Each batch is padded on
the left to a multiple of `COMPILE_MULTIPLE` tokens (`batch.padded`; masked, so no log-prob
changes) and its batch and length dimensions are marked dynamic, so the graphs are traced once. A
step run again because its gradient was not finite (`fallbacks`) runs eager: a compiled graph keeps
the kernels chosen when it was traced. Off (the default), the eager forward is the one it
always was. Only torch.compile's default mode is offered: under `reduce-overhead` (CUDA graphs) the
first update's backward read activations the graphs had already overwritten (docs/benchmarks.md).

Fused kernels (`rl/fused.py`): on CUDA, with the `liger-kernel` package installed, the norms,
gated MLPs and rotary embeddings of the families it knows run as one Triton kernel each way instead
of several elementwise kernels, and the kept logits' log-softmax runs as compiled kernels without a
float32 copy (`rl/head.py`, `kept_logprobs`); a step run again because its gradient was not finite
runs without them. On
any device, each LoRA layer adds its adapter's product into the base product in one `addmm_`
instead of PEFT's product, scaling and sum (where PEFT's forward would compute the same).

Attention: every pass runs transformers' SDPA without cuDNN's kernels (rl/attention.py): cuDNN
builds a plan for each new shape, and every step's micro-batches have new lengths. An eager pass of
a family with a plain output layer runs without a padding mask (`rl.head.unmasked_hidden`), so SDPA
takes its flash kernel (the 1.5B shape's update in a step: 4.0 s against 4.5 s, docs/benchmarks.md).

Jobs run the policy's work from their event loop on one thread of its own (`Policy.call`), not on
a pool's: the device's work of a job stays in one order on one thread, whichever pool thread the
loop would have picked.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import torch
from crucible_models import load_model
from crucible_shared.jobs import ModelSpec, OptimSpec

from crucible_trainer.rl import fused
from crucible_trainer.rl.attention import choose as choose_attention
from crucible_trainer.rl.batch import Batch, make_batch, padded
from crucible_trainer.rl.head import hidden_out, kept_logprobs, output_layer, tail_logprobs, unmasked_hidden
from crucible_trainer.runtime.atomic import output_dir
from crucible_trainer.runtime.hardware import checkpoint_needed

if TYPE_CHECKING:
    from peft import LoraConfig

log = logging.getLogger(__name__)
T = TypeVar("T")

# A compiled forward's batches are padded to a multiple of this many tokens (and completion tail).
COMPILE_MULTIPLE = 64


@dataclass
class PassCounts:
    """The policy's training forwards (micro-batches) so far; an update reports its own share
    (`since`): how many (a step run again after a non-finite gradient counts again), how many
    checkpointed, how many through the chunked head, and the share of their token slots that was
    padding (rows times width against the real tokens)."""

    micro_batches: int = 0
    checkpointed: int = 0
    chunked: int = 0
    slots: int = 0
    tokens: int = 0

    def count(self, batch: Batch, checkpointed: bool, chunked: bool = False) -> None:
        self.micro_batches += 1
        self.checkpointed += checkpointed
        self.chunked += chunked
        self.slots += batch.input_ids.numel()
        self.tokens += batch.tokens

    def since(self, before: PassCounts) -> dict[str, float]:
        """The update's figures: these counts less `before` (a copy taken when it began).

        >>> now = PassCounts(micro_batches=3, checkpointed=1, slots=71, tokens=58)
        >>> now.since(PassCounts())["update/padding_fraction"]
        0.1831
        """
        slots = self.slots - before.slots
        padding = 1 - (self.tokens - before.tokens) / slots if slots else 0.0
        return {
            "update/micro_batches": float(self.micro_batches - before.micro_batches),
            "update/checkpointed_micro_batches": float(self.checkpointed - before.checkpointed),
            "update/chunked_head_micro_batches": float(self.chunked - before.chunked),
            "update/padding_fraction": round(padding, 4),
        }


class Policy:
    """Base model + LoRA adapter + AdamW over the adapter's parameters."""

    def __init__(self, spec: ModelSpec, optim: OptimSpec, seed: int = 0) -> None:
        from peft import PeftModel, get_peft_model

        torch.manual_seed(seed)
        base, tokenizer = load_model(
            spec.base, device=spec.device, dtype=spec.dtype, attn_implementation=spec.attn_implementation
        )
        self.tokenizer = tokenizer
        self.device = str(base.device)
        if spec.init_adapter:
            self.model = PeftModel.from_pretrained(base, spec.init_adapter, is_trainable=True)
        else:
            self.model = get_peft_model(base, lora_config(spec))
        if spec.gradient_checkpointing is True and optim.compile:
            # The non-reentrant form, which torch.compile traces into its graph, without the hook
            # that makes the embeddings' output require grad (what the reentrant form needs; the
            # compiler breaks its graph at it).
            self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            self.model.disable_input_require_grads()
        elif spec.gradient_checkpointing is True:
            self.model.gradient_checkpointing_enable()
            self.model.enable_input_require_grads()
        # "auto" here (`hardware.resolve` keeps it for one process or DDP ranks on a GPU): each training
        # micro-batch is checkpointed only if its own shape would not fit in the memory free then
        # (`_checkpoint_for`); elsewhere it is off.
        self.checkpointing = spec.gradient_checkpointing
        self._checkpointing_on = spec.gradient_checkpointing is True
        self.passes = PassCounts()  # the training forwards so far (each update reports its share)
        self.free_memory: Callable[[], int | None] = self._free_memory
        # What a micro-batch's estimate is multiplied by before it is held against the free memory:
        # doubled each time a training pass runs out of memory all the same (`spare_memory`).
        self.memory_margin = 1
        self._planned: tuple[Any, int | None] = (None, None)  # the last training pass's batch, free memory
        self.model.train()
        self.mixed_precision(True)
        # Attention without cuDNN's kernels, chosen inside each attention call (rl/attention.py).
        self._cudnn = False
        self._registered = choose_attention(self.model.get_base_model(), cudnn=False)
        # Kernels to run a step again with when its gradient is not finite (below).
        self.fallbacks: list[Callable[[], AbstractContextManager]] = []
        # Fused kernels (rl/fused.py): the norms, MLPs and rotary embeddings on CUDA (Liger's
        # Triton kernels: a step run again runs without them, and without the LoRA layers'), the
        # LoRA layers on any device (torch's own ops). Not under optim.compile: the compiler fuses
        # those itself, and the two were never run together.
        self.lora_kernels = True  # the LoRA layers fused with the rest (a benchmark's arm turns it off)
        self.rope_kernel = True  # the rotary embedding fused with the rest (likewise)
        self.fused_lora = 0 if optim.compile else fused.fuse_lora(self.model)
        self.fused = 0 if optim.compile or not self.device.startswith("cuda") else fused.fuse(self.model)
        if self.fused or self.fused_lora:
            log.info(
                "fused kernels: %d norms, MLPs and attentions, %d LoRA layers", self.fused, self.fused_lora
            )
        # The kept logits' log-probs through fused kernels (rl/head.py `kept_logprobs`) on CUDA,
        # compiled on first use; under optim.compile the whole pass is compiled instead.
        self.logprob_kernel = self.device.startswith("cuda") and not optim.compile
        if self.fused or self.logprob_kernel:
            self.fallbacks = [self.unfused]
        # The output layer the chunked head stands in for (rl/head.py), None where it may not; when
        # it does is `head_mode`'s (`auto`: `_plan` decides per forward).
        self.head: torch.nn.Linear | None = output_layer(self.model.get_base_model())
        self.head_mode: str = "auto"  # or "chunked" / "full" (tests, a benchmark's arms)
        self._chunked_now = False  # this forward's choice (`_plan`)
        self.unmasked = True  # eager forwards of those families without a padding mask (off: an arm)
        self._unmasked_now = False  # this forward's choice (`_plan`)
        # What forward passes go through: the model, or a DDP wrapper on data-parallel ranks.
        self.runner: torch.nn.Module = self.model
        self.compile_mode: str | None = optim.compile or None
        self._compiled: Callable[..., torch.Tensor] | None = None
        self.run_eager = False  # True: eager forwards although compiled (a retry, a benchmark's arm)
        if self.compile_mode is not None:
            # The graphs of an earlier policy in this process (a worker's last job) are dropped:
            # each model adds graphs to the same function, which stops compiling after a few.
            torch._dynamo.reset()
            self._compiled = torch.compile(self._logprobs, mode=self.compile_mode)
            log.info("optim.compile %s: forward and backward passes compiled on first use", self.compile_mode)
            # A step run again runs eager: the compiled graph's kernels are those chosen when it
            # was traced.
            self.fallbacks = [self.eager]
        self.make_optimizer(optim)
        self.thread = ThreadPoolExecutor(1, thread_name_prefix="policy")  # see `call`
        self.max_grad_norm = optim.max_grad_norm
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id

        # The KL reference is the starting policy: the base model, or base + `init_adapter`
        # (an SFT adapter, say), whose LoRA weights are kept to swap in while scoring.
        self._start_state = (
            {n: p.detach().clone() for n, p in self.model.named_parameters() if p.requires_grad}
            if spec.init_adapter
            else None
        )

    async def call(self, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)` on the policy's own thread, awaited from the job's event loop: every update,
        score and save of a job runs on that one thread (see the module's docstring)."""
        return await asyncio.get_running_loop().run_in_executor(self.thread, fn, *args)

    def make_optimizer(self, optim: OptimSpec) -> None:
        """AdamW over the trainable parameters, with its warm-up schedule (made again when the
        parameters are replaced, as FSDP's sharding does)."""
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(params, lr=optim.lr, weight_decay=optim.weight_decay)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer,
            lambda step: min(1.0, (step + 1) / optim.warmup_steps) if optim.warmup_steps else 1.0,
        )

    # -- scoring ------------------------------------------------------------------------------
    def token_logprobs(self, batch: Batch, *, reference: bool = False) -> torch.Tensor:
        """[B, K] log-probabilities of the completion tokens (zeros elsewhere); keeps the graph.
        `reference=True` scores with the starting policy (no gradients)."""
        if reference:
            with torch.no_grad(), self.reference():
                return self._forward(batch)
        return self._forward(batch)

    @contextmanager
    def reference(self) -> Iterator[None]:
        """The starting policy, for a while: the adapter disabled, or its starting weights swapped in."""
        if self._start_state is None:
            with self.model.disable_adapter():
                yield
            return
        params = {n: p for n, p in self.model.named_parameters() if n in self._start_state}
        current = {n: p.detach().clone() for n, p in params.items()}
        with torch.no_grad():
            for n, p in params.items():
                p.copy_(self._start_state[n])
        try:
            yield
        finally:
            with torch.no_grad():
                for n, p in params.items():
                    p.copy_(current[n])

    def mixed_precision(self, on: bool) -> None:
        """Autocast with PEFT's input casting off (on; only a bf16/fp16 base model computes in its
        own dtype), or PEFT's own casting of every adapted layer's input (off)."""
        dtype = self.model.get_base_model().dtype
        self.compute_dtype = dtype if on and dtype in (torch.bfloat16, torch.float16) else None
        set_input_casting(self.model, enabled=self.compute_dtype is None)

    def precision(self) -> AbstractContextManager:
        """Autocast to the base model's dtype when it is bf16/fp16 (see the module docstring)."""
        if self.compute_dtype is None:
            return nullcontext()
        return torch.autocast(torch.device(self.device).type, dtype=self.compute_dtype)

    def fused_kernels(self, on: bool) -> int:
        """Swap the fused norms, MLPs, rotary embeddings and LoRA layers in (on) or out (off); how
        many modules changed."""
        if not on:
            return fused.unfuse(self.model)
        lora = fused.fuse_lora(self.model) if self.lora_kernels else 0
        cuda = self.device.startswith("cuda")
        return lora + (fused.fuse(self.model, rope=self.rope_kernel) if cuda else 0)

    @contextmanager
    def unfused(self) -> Iterator[None]:
        """Forwards with transformers' own norms, MLPs and rotary embeddings, PEFT's LoRA layers and
        autograd's log-softmax, for a while (a no-op when none is fused)."""
        swapped, kernel = fused.unfuse(self.model), self.logprob_kernel
        self.logprob_kernel = False
        try:
            yield
        finally:
            self.logprob_kernel = kernel
            if swapped:
                self.fused_kernels(True)

    @contextmanager
    def eager(self) -> Iterator[None]:
        """Forwards without the compiled graphs, for a while (a no-op when nothing is compiled)."""
        before, self.run_eager = self.run_eager, True
        try:
            yield
        finally:
            self.run_eager = before

    @property
    def cudnn_attention(self) -> bool:
        """Whether the passes may take cuDNN's attention (SDPA's own choice: a benchmark's arm, a
        test); False by default (rl/attention.py)."""
        return self._cudnn

    @cudnn_attention.setter
    def cudnn_attention(self, on: bool) -> None:
        self._cudnn = on
        if self._registered:
            choose_attention(self.model.get_base_model(), cudnn=on)

    def _forward(self, batch: Batch) -> torch.Tensor:
        self._plan(batch)
        if torch.is_grad_enabled():
            self.passes.count(batch, self._checkpointing_on, self._chunked_now)
        if self._compiled is None or self.run_eager:
            return self._logprobs(batch.input_ids, batch.attention_mask, batch.position_ids, batch.tail_mask)
        # Two rows at least: the compiler gives a dimension of size 1 a graph of its own.
        wide = padded(batch, COMPILE_MULTIPLE, self.pad_id, rows=2)
        inputs = (wide.input_ids, wide.attention_mask, wide.position_ids, wide.tail_mask)
        for t in inputs:  # one graph for every batch size and length
            torch._dynamo.maybe_mark_dynamic(t, 0)
            torch._dynamo.maybe_mark_dynamic(t, 1)
        rows = batch.input_ids.shape[0]
        return self._compiled(*inputs)[:rows, -batch.tail :]

    def _plan(self, batch: Batch) -> None:
        """How `batch`'s forward holds its memory: through the chunked head or the full logits
        (`head_mode`), and, on `gradient_checkpointing: auto`, checkpointed or not. A training
        micro-batch on a GPU takes the full logits where their estimate
        (`hardware.checkpoint_needed`) fits in the memory free now, else the chunked head, and is
        checkpointed only if it does not fit even so; checkpointing is switched only when that
        changes. Scoring (no gradient) keeps the full logits on a GPU. Where the free memory is
        unknown (a CPU) every forward takes the chunked head, and none is checkpointed."""
        grad, eager = torch.is_grad_enabled(), self._compiled is None or self.run_eager
        choose_head = self.head is not None and eager and self.head_mode == "auto"
        choose_checkpoint = grad and self.checkpointing == "auto"
        free = self.free_memory() if choose_head or choose_checkpoint else None
        if choose_head:
            self._chunked_now = free is None or (grad and not self._fits(batch, self._full_head(), free))
        else:
            self._chunked_now = self.head is not None and eager and self.head_mode == "chunked"
        self._unmasked_now = self.unmasked and self.head is not None and eager
        if choose_checkpoint:
            head = "chunked" if self._chunked_now else self._full_head()
            self._checkpoint(free is not None and not self._fits(batch, head, free))
        if grad:  # what `spare_memory` weighs if this pass runs out of memory
            self._planned = (batch, free)

    def spare_memory(self) -> bool:
        """After a training pass ran out of GPU memory although its estimate fitted: whether the
        next passes can hold less. The estimate's margin doubles until the micro-batch that failed
        would not fit as it ran, so it (and any near the line) takes the chunked head, then
        checkpointing, where `auto` lets the policy choose them; False where the failed pass had
        nothing left to choose (both set by the spec, or already taken). The margin stays for the
        job (`update/memory_margin`): the estimate proved low on this card."""
        eager = self._compiled is None or self.run_eager
        can_chunk = self.head is not None and self.head_mode == "auto" and eager and not self._chunked_now
        can_checkpoint = self.checkpointing == "auto" and not self._checkpointing_on
        if not (can_chunk or can_checkpoint):
            return False
        margin, (batch, free) = self.memory_margin * 2, self._planned
        if free is not None:  # doubled until the failed micro-batch no longer fits as it ran
            head = "chunked" if self._chunked_now else self._full_head()
            while self._fits(batch, head, free, margin):  # ends: the share tends to 0 bytes
                margin *= 2
        self.memory_margin = margin
        self._planned = (None, None)
        log.warning(
            "a training pass ran out of GPU memory: its step runs again with micro-batches estimated "
            "%dx larger (chunked head or checkpointing where they come near the free memory); "
            "a smaller optim.micro_batch avoids the lost pass",
            self.memory_margin,
        )
        return True

    def _full_head(self) -> str:
        """How the full logits are held (`hardware.bytes_per_sequence`'s `head`): through the kept
        logits' kernels or through autograd's float32 copies."""
        return "kept" if self.logprob_kernel else "full"

    def _fits(self, batch: Batch, head: str, free: int, margin: int | None = None) -> bool:
        """Whether `batch` fits in `free` bytes without checkpointing, its logits held as `head` says,
        its estimate multiplied by `margin` (default `memory_margin`)."""
        base = self.model.get_base_model()
        config = base.config.get_text_config()
        rows, width = batch.input_ids.shape
        attention = getattr(config, "_attn_implementation", None) or "sdpa"
        share = free // (margin or self.memory_margin)
        return not checkpoint_needed(
            config, rows, width, batch.tail, base.dtype.itemsize, share, attention, head
        )

    def _checkpoint(self, need: bool) -> None:
        """Gradient checkpointing on (`need`) or off for the next forwards."""
        if need == self._checkpointing_on:
            return
        if need:  # the non-reentrant form: it needs no hook making the embeddings' output require grad
            self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        else:
            self.model.gradient_checkpointing_disable()
        self._checkpointing_on = need

    def _free_memory(self) -> int | None:
        """Bytes a micro-batch may use on this policy's GPU: free on the card plus what this
        process's allocator holds unused; None on a CPU (no checkpointing decided there)."""
        if not self.device.startswith("cuda"):
            return None
        device = torch.device(self.device)
        free, _ = torch.cuda.mem_get_info(device)
        return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)

    def _logprobs(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        position_ids: torch.Tensor,
        tail_mask: torch.Tensor,
    ) -> torch.Tensor:
        """[B, K] log-probabilities of the last K tokens (K: `tail_mask`'s width) under `tail_mask`."""
        k = tail_mask.shape[1]
        targets = input_ids[:, -k:]
        if self._unmasked_now:
            assert self.head is not None
            with self.precision():
                kept = unmasked_hidden(self.runner, self.head, input_ids, attention_mask, k)
        else:
            # The completion tokens' hidden states through the chunked head (rl/head.py) where
            # `_plan` chose it; compiled passes keep the logits (`_plan` never chooses it for them).
            head = self.head if self._chunked_now else None
            with self.precision(), hidden_out(head) if head is not None else nullcontext():
                out = self.runner(
                    input_ids=input_ids,
                    attention_mask=attention_mask,
                    position_ids=position_ids,
                    logits_to_keep=k + 1,
                    use_cache=False,
                )
            kept = out.logits[:, -(k + 1) :, :]
        if self._chunked_now:
            assert self.head is not None
            return tail_logprobs(kept[:, :-1, :], self.head, targets, tail_mask)
        if self._unmasked_now:
            with self.precision():  # the output layer, as the model's forward would have run it
                kept = self.head(kept)
        if self.logprob_kernel:
            return kept_logprobs(kept, targets, tail_mask)
        logits = kept[:, :-1, :].float()
        picked = torch.gather(logits, -1, targets.unsqueeze(-1)).squeeze(-1)
        logp = picked - torch.logsumexp(logits, dim=-1)
        return logp * tail_mask

    @torch.no_grad()
    def score(
        self,
        prompts: list[list[int]],
        completions: list[list[int]],
        micro_batch: int = 16,
        reference: bool = False,
    ) -> list[list[float]]:
        """Per-token log-probs of each completion, without gradients, in the order given.

        Scored longest first, so each micro-batch pads to its own longest sequence, and every
        micro-batch is queued before the first is read back: the device never waits for the host
        between them."""
        order = sorted(
            range(len(prompts)),
            key=lambda i: (len(prompts[i]) + len(completions[i]), len(completions[i])),
            reverse=True,
        )
        pending = []
        with self.reference() if reference else nullcontext():
            for start in range(0, len(order), micro_batch):
                idx = order[start : start + micro_batch]
                b = make_batch(
                    [prompts[i] for i in idx], [completions[i] for i in idx], self.pad_id, self.device
                )
                pending.append((idx, b.tail, self._forward(b)))
        out: list[list[float]] = [[] for _ in prompts]
        for idx, tail, lp in pending:
            for row, i in zip(lp.cpu(), idx, strict=True):
                n = len(completions[i])
                out[i] = row[tail - n :].tolist() if n else []
        return out

    def warm_kernels(self, rows: int, prompt: int, completion: int) -> float:
        """A training forward and backward, and a scoring forward, of a made-up micro-batch of
        `rows` sequences (`prompt` tokens, then completions of `completion` down to a quarter of it,
        left-padded as a step's are), with everything they touch put back: the gradients, the pass
        counts and every random generator (LoRA dropout draws from them). Returns the seconds.

        On CUDA a process's first passes pay for first use: Triton compiles the fused kernels
        (rl/fused.py) and torch.compile the kept logits' (rl/head.py; their on-disk caches serve
        later processes of the machine), CUDA loads the
        kernels it picks lazily; about 10 s at the 1.5B
        shape on an H200 (docs/benchmarks.md). A job runs this while the generator is busy
        without the policy (its pre-filter, the first step's rollouts), so that step 1 does not
        wait for it. It changes no weight and takes no optimizer step."""
        started = time.perf_counter()
        vocab = self.model.get_base_model().config.get_text_config().vocab_size
        lengths = [completion - (completion * 3 // 4) * i // max(1, rows - 1) for i in range(rows)]
        prompts = [[(7 + j) % vocab for j in range(prompt)] for _ in range(rows)]
        completions = [[(11 + j) % vocab for j in range(max(1, n))] for n in lengths]
        batch = make_batch(prompts, completions, self.pad_id, self.device)
        params = [p for p in self.model.parameters() if p.requires_grad]
        grads, counts = [p.grad for p in params], replace(self.passes)
        for p in params:  # else the backward adds into the gradient held
            p.grad = None
        cuda = [torch.device(self.device)] if self.device.startswith("cuda") else []
        with torch.random.fork_rng(devices=cuda):
            self._forward(batch).sum().backward()
            with torch.no_grad():
                self._forward(batch)
        for p, grad in zip(params, grads, strict=True):
            p.grad = grad
        self.passes = counts
        if cuda:
            torch.cuda.synchronize(cuda[0])
        return time.perf_counter() - started

    # -- optimisation ---------------------------------------------------------------------------
    def step(self) -> float:
        """Clip, step the optimizer and the schedule; returns the pre-clip gradient norm.

        A non-finite norm (an overflow, or a faulty attention kernel: see `fallbacks`) skips the
        step (`update` runs it again under the fallbacks first, and logs it): one NaN in the adapter
        would be published to the generators and poison every later rollout."""
        params = [p for p in self.model.parameters() if p.requires_grad]
        if self.max_grad_norm:
            norm = float(torch.nn.utils.clip_grad_norm_(params, self.max_grad_norm))
        else:
            norm = float(torch.norm(torch.stack([p.grad.norm() for p in params if p.grad is not None])))
        if not math.isfinite(norm):
            self.optimizer.zero_grad(set_to_none=True)
            return norm
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return norm

    @property
    def lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    # -- persistence ----------------------------------------------------------------------------
    def save_adapter(self, path: Path, gate: Callable[[], None] | None = None) -> Path:
        """Write the adapter (PEFT format) to `path` atomically: a temp dir, then a rename, which
        `gate` (a run's lease check, `JobChannel.gate`) may refuse by raising."""
        with output_dir(path) as tmp:
            self.write_adapter(tmp)
            if gate is not None:
                gate()
        return path

    def write_adapter(self, folder: Path) -> None:
        """The adapter's files (PEFT format) into `folder`."""
        self.model.save_pretrained(folder)

    def optimizer_state(self) -> dict:
        return self.optimizer.state_dict()

    def restore(self, folder: Path, state: dict) -> None:
        """The adapter weights of checkpoint `folder` and its optimizer and schedule (`state`)."""
        from peft import set_peft_model_state_dict
        from safetensors.torch import load_file

        weights = folder / "adapter" / "adapter_model.safetensors"
        set_peft_model_state_dict(self.model, load_file(str(weights), device=self.device))
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])


def set_input_casting(model: torch.nn.Module, *, enabled: bool) -> None:
    """PEFT's cast of each adapted layer's input to the adapter's dtype, on or off."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    for module in model.modules():
        if isinstance(module, BaseTunerLayer):
            module.cast_input_dtype_enabled = enabled


def lora_config(spec: ModelSpec) -> LoraConfig:
    """The PEFT config of a fresh LoRA adapter as the job's model section describes it."""
    from peft import LoraConfig

    return LoraConfig(
        r=spec.lora_r,
        lora_alpha=spec.lora_alpha,
        lora_dropout=spec.lora_dropout,
        target_modules=spec.target_modules,
        task_type="CAUSAL_LM",
    )


def name_base(model: torch.nn.Module, base: str) -> None:
    """Record `base`, the path the job named, as the base model's name where the path it was
    loaded from (the run's private snapshot, removed when the run ends) would be: the config's
    `_name_or_path` and each adapter's `base_model_name_or_path`, which `save_pretrained` writes."""
    config = getattr(model, "config", None)
    if config is not None:
        config._name_or_path = base
    for adapter in (getattr(model, "peft_config", None) or {}).values():
        adapter.base_model_name_or_path = base
