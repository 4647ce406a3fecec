"""The generation engine: continuous batching over one transformers model with many LoRA adapters.

One engine thread owns the model. Requests from the event loop become *sequences* (one per prompt
and sample, so `n` expands inside the batch) in a FIFO queue. The thread serves them on two decode
paths, behind one interface (`decoding.py`: the engine picks a path per batch and is the paths'
`Host`):

* **The continuous path** (the fast path, on by default with CUDA; `batching.py` over
  `continuous.py`): sequences of one adapter (or none) decode in rows of a paged KV cache
  (`paged.py`: blocks taken as a row grows, given back when it ends) with that adapter merged into
  a copy of the weights. Between two decode steps finished rows leave and waiting sequences of the
  same adapter join while free blocks hold them, each prefilled into a free row; when the blocks
  run out mid-decode the newest sequences are preempted (queued again with their tokens so far).
  Steps replay CUDA graphs captured once per window. The queue stays FIFO: a waiting sequence of
  another adapter stops further joins, the batch drains, and the next batch merges that adapter.
* **The eager path** (mixed adapters, adapters that cannot be merged, models with a feature the
  fast path does not implement (`features.py`) or whose decode step cannot be captured as a CUDA
  graph, requests longer than its rows, or `fast_decode=off`; `eager.py`): up to
  `eager_batch_size` sequences (the rows full-length caches fit in; at most `max_batch_size`), a
  left-padded prefill, then one token per step with a dynamic KV cache, dropping finished rows as
  it goes. Rows of different adapters share such a batch through PEFT's `adapter_names`
  (mixed-adapter LoRA), with `"__base__"` for the base model.

A lone request waits at most `batch_wait_s` after it arrived for others to share its first batch.
While a continuous batch runs, joiners are admitted together (one prefill serves them all) once
enough have gathered (`len(waiting) >= running // JOIN_FRACTION`) or the oldest waited `join_wait_s`.

Adapter loads and unloads run on the same thread *between two decode steps*, so they never race
with a forward pass and never wait for a long batch to end. Loading adds new modules under a new name
and leaves the others untouched, so requests in flight on an older version keep decoding with it.
An unloaded adapter is deleted (its memory freed) when its last sequence finishes.

**CUDA graphs** (`graph_capture`, continuous.py): all captured before the first batch (`start`), or
(`idle`) one at a time whenever nothing waits and nothing decodes, the queue looked at between two.

The event loop never blocks: results come back through `loop.call_soon_threadsafe`.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from typing import Any, Literal

import torch

from . import faults
from .adapters import AdapterRegistry
from .batching import ContinuousPath
from .continuous import ContinuousDecoder
from .decoding import DecodePath
from .eager import EagerPath
from .errors import BadRequest, GeneratorError, ServerError
from .fastpath import LENGTH_BUCKET
from .features import fast_length
from .metrics import Metrics
from .sampling import RowParams, SampleOutput, make_generator, sample
from .sequences import (
    Completion,
    Readback,
    Request,
    SamplingParams,
    Sequence,
    eos_ids,
    hit_stop_string,
    resolve,
)
from .slots import SpareSlot, config_signature

log = logging.getLogger(__name__)


class Engine:
    """Owns the model, the batch queue, the decode loop and the LoRA adapters; decodes each batch on
    one of its decode paths (`decoding.py`), to which it is their `Host`."""

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        *,
        max_batch_size: int = 64,
        batch_wait_s: float = 0.005,
        max_model_len: int | None = None,
        max_loras: int = 4,
        max_lora_rank: int = 64,
        seed: int | None = None,
        metrics: Metrics | None = None,
        fast_decode: str = "auto",
        cuda_graphs: bool = True,
        prefill_graphs: bool = True,
        fast_context: int = 2048,
        join_wait_s: float = 0.02,
        attention_kernels: str = "auto",
        block_size: int = 16,
        kv_blocks: int | None = None,
        eager_batch_size: int | None = None,
        graph_capture: Literal["idle", "start"] = "idle",
    ) -> None:
        self.base = model
        self.peft: Any = None  # a PeftModel wrapping `base` while at least one adapter is loaded
        self.tokenizer = tokenizer
        self.device = next(model.parameters()).device
        self.max_batch_size = max_batch_size
        self.batch_wait_s = batch_wait_s
        self.max_model_len = max_model_len or int(getattr(model.config, "max_position_embeddings", 2048))
        self.adapters = AdapterRegistry(max_loras=max_loras, max_lora_rank=max_lora_rank)
        self.metrics = metrics or Metrics()
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.eos_ids = eos_ids(model, tokenizer)
        self.vocab_size = int(model.get_input_embeddings().weight.shape[0])
        self._default_generator = make_generator(
            seed if seed is not None else int.from_bytes(os.urandom(8), "little"), self.device
        )
        self._spare: SpareSlot | None = None  # an unloaded adapter's modules, kept for reuse
        # Eager batches hold dynamic caches outside the fast path's blocks: at most this many.
        rows = min(eager_batch_size or max_batch_size, max_batch_size)
        self.eager = EagerPath(self, rows=rows, pad_id=self.pad_id, device=self.device)
        self.continuous: ContinuousPath | None = None  # None: every batch decodes eagerly
        if fast_decode == "on" or (fast_decode == "auto" and self.device.type == "cuda"):
            length = fast_length(model, min(self.max_model_len, fast_context), LENGTH_BUCKET)
            if length is not None:  # None: a feature it does not implement (logged)
                decoder = ContinuousDecoder(
                    model,
                    rows=max_batch_size,
                    length=length,
                    block_size=block_size,
                    blocks=kv_blocks,
                    use_graphs=cuda_graphs,
                    prefill_graphs=prefill_graphs,
                    on_capture=self.metrics.graph_captures.inc,
                    attention_kernels="no_cudnn" if attention_kernels == "no_cudnn" else "auto",
                    graph_capture=graph_capture,
                )
                self.continuous = ContinuousPath(
                    self, decoder, max_model_len=self.max_model_len, join_wait_s=join_wait_s
                )
        self._cond = threading.Condition()
        self._waiting: deque[Sequence] = deque()
        self._control: deque[tuple[Callable[[], Any], asyncio.AbstractEventLoop, asyncio.Future]] = deque()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="generator-engine", daemon=True)

    @property
    def fast(self) -> ContinuousDecoder | None:
        """The fast path's merged model and paged cache; None while every batch decodes eagerly."""
        return self.continuous.decoder if self.continuous is not None else None

    # --- lifecycle ---------------------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._thread.is_alive():
            self._thread.join(timeout=30)

    # --- event-loop side ---------------------------------------------------------------------

    def submit(
        self,
        prompts: list[list[int]],
        params: SamplingParams,
        n: int,
        adapter: str | None,
        on_done: Callable[[int, Completion], None] | None = None,
    ) -> tuple[asyncio.Future, Request]:
        """Queue `n` samples of each prompt; the future yields `len(prompts) * n` completions, and
        `on_done(index, completion)` (on the event loop) hears of each as it finishes.

        Completions are ordered prompt-major (`index = prompt_index * n + sample_index`), like
        vLLM's choices. Sample `j` of a seeded request draws from a generator seeded `seed + j`.
        """
        loop = asyncio.get_running_loop()
        total = len(prompts) * n
        slot = self.adapters.acquire(adapter, total).slot if adapter is not None else None
        request = Request(loop=loop, future=loop.create_future(), results=[None] * total, remaining=total)
        request.on_done = on_done
        seqs = []
        for p, prompt in enumerate(prompts):
            for j in range(n):
                generator = (
                    make_generator(params.seed + j, self.device)
                    if params.seed is not None
                    else self._default_generator
                )
                row = RowParams(
                    temperature=params.temperature,
                    top_p=params.top_p,
                    top_k=params.top_k,
                    generator=generator,
                )
                seqs.append(Sequence(request, p * n + j, list(prompt), params, adapter, slot, row))
        with self._cond:
            self._waiting.extend(seqs)
            self.metrics.waiting.set(len(self._waiting))
            self._cond.notify_all()
        return request.future, request

    async def generate(
        self, prompts: list[list[int]], params: SamplingParams, n: int = 1, adapter: str | None = None
    ) -> list[Completion]:
        """Generate and wait; cancelling the awaiting task drops the request's sequences."""
        future, request = self.submit(prompts, params, n, adapter)
        try:
            return await future
        except asyncio.CancelledError:
            request.cancelled = True
            raise

    async def stream(
        self, prompts: list[list[int]], params: SamplingParams, n: int = 1, adapter: str | None = None
    ) -> AsyncIterator[tuple[int, Completion]]:
        """Generate, yielding `(index, completion)` as each sample finishes (in the order they
        finish); raises the request's error if it fails. Leaving early (the client hung up) drops
        the request's sequences that are still decoding."""
        finished: asyncio.Queue[tuple[int, Completion]] = asyncio.Queue()
        future, request = self.submit(
            prompts, params, n, adapter, on_done=lambda *done: finished.put_nowait(done)
        )
        remaining, waiter = len(prompts) * n, None
        try:
            while remaining:
                if finished.empty() and future.done():
                    future.result()  # a failed request raises its error here
                    break  # (every completion is queued before the future resolves)
                if finished.empty():
                    waiter = asyncio.ensure_future(finished.get())
                    await asyncio.wait({waiter, future}, return_when=asyncio.FIRST_COMPLETED)
                    if not waiter.done():
                        waiter.cancel()  # an item it was woken for stays queued
                        continue
                    done = waiter.result()
                else:
                    done = finished.get_nowait()
                remaining -= 1
                yield done
        finally:
            if waiter is not None:
                waiter.cancel()
            if not future.done():
                request.cancelled = True

    async def load_adapter(self, name: str, path: str, source: str | None = None) -> None:
        """Load the PEFT adapter at `path` as `name`; raises a `GeneratorError` as vLLM would.
        `source`: the path the client named, shown in the model list (`path` may be a snapshot).

        At `max_loras` the least recently used idle adapter goes first (see `adapters.py`)."""
        self.adapters.validate(name, path)  # a load that will fail must not evict anything
        victim = self.adapters.evict_for_room()
        if victim is not None:
            await asyncio.shield(self._call_in_engine(lambda: self._detach(victim)))
            log.warning("max_loras reached: evicted %s, the least recently used idle adapter", victim)
            self.metrics.adapter_evictions.inc()
        slot = self.adapters.reserve(name, path, source).slot
        started = time.perf_counter()

        def attach() -> None:
            try:
                self._attach(name, slot, path)
            except Exception:
                self._drop_slot(slot)  # a half-injected adapter must not linger
                self.adapters.forget(name)
                raise
            self.adapters.mark_ready(name)

        try:
            await asyncio.shield(self._call_in_engine(attach))
        except GeneratorError:
            raise
        except MemoryError as exc:
            log.exception("loading LoRA adapter %s from %s failed", name, path)
            raise ServerError(f"Loading lora {name} failed: out of memory") from exc
        except Exception as exc:
            # The adapter's files are the client's: a bad config or a corrupt weights file is a 400.
            # PEFT's and safetensors' words can quote those files (a config key, a header), so the
            # log keeps them for the operator and the answer names only the kind of failure.
            log.warning("loading LoRA adapter %s from %s failed: %r", name, path, exc)
            raise BadRequest(
                f"Loading lora {name} failed: PEFT could not load the adapter ({type(exc).__name__}); "
                "check that it was saved by PEFT for this base model",
                param="lora_path",
            ) from exc
        finally:
            self._update_adapter_gauge()
        self.metrics.adapter_load_seconds.observe(time.perf_counter() - started)

    async def unload_adapter(self, name: str) -> None:
        """Stop serving `name`; its weights go when its last in-flight sequence finishes."""
        if self.adapters.begin_unload(name):
            await asyncio.shield(self._call_in_engine(lambda: self._detach(name)))
        self._update_adapter_gauge()

    async def _call_in_engine(self, fn: Callable[[], Any]) -> Any:
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        with self._cond:
            self._control.append((fn, loop, future))
            self._cond.notify_all()
        return await future

    def _update_adapter_gauge(self) -> None:
        for state, count in self.adapters.counts().items():
            self.metrics.adapters.labels(state=state).set(count)

    # --- engine thread: adapters -------------------------------------------------------------

    def _attach(self, name: str, slot: str, path: str) -> None:
        from peft import PeftModel

        spare, self._spare = self._spare, None
        if spare is not None and self.peft is not None:
            if spare.fill(self.peft, path):
                self.adapters.rebind(name, spare.slot)
                log.info("loaded LoRA adapter %s from %s into %s (reused)", name, path, spare.slot)
                return
            self._delete_slot(spare.slot)
        if self.peft is None:
            self.peft = PeftModel.from_pretrained(self.base, path, adapter_name=slot, is_trainable=False)
            self.peft.eval()
        else:
            self.peft.load_adapter(path, adapter_name=slot, is_trainable=False)
        log.info("loaded LoRA adapter %s from %s as %s", name, path, slot)

    def _detach(self, name: str) -> None:
        slot, signature = self.adapters.slot(name), config_signature(self.adapters.path(name))
        self.adapters.forget(name)
        if self.continuous is not None:
            self.continuous.forget(slot)
        if self._spare is None and signature is not None and self.peft is not None:
            self._spare = SpareSlot(slot, signature)  # the next same-shaped load fills it
        else:
            self._delete_slot(slot)
        log.info("unloaded LoRA adapter %s", name)

    def _drop_slot(self, slot: str) -> None:
        """Delete a half-loaded adapter."""
        if self.continuous is not None:
            self.continuous.forget(slot)
        self._delete_slot(slot)

    def _delete_slot(self, slot: str) -> None:
        if self.peft is None:
            return
        if slot in self.peft.peft_config:
            self.peft.delete_adapter(slot)
        if not self.peft.peft_config:
            # PEFT cannot run with zero adapters: go back to the plain model.
            self.base = self.peft.unload()
            self.peft = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def control_pending(self) -> bool:
        return bool(self._control)

    def run_control_ops(self) -> None:
        with self._cond:
            ops = list(self._control)
            self._control.clear()
        for fn, loop, future in ops:
            try:
                # Out of the decode loop's inference mode: an adapter loaded between two steps of a
                # batch (overlapped rollouts publish while the generator decodes) would otherwise
                # hold inference tensors, and every later load outside a batch would fail on them.
                with torch.inference_mode(False), torch.no_grad():
                    result = fn()
            except Exception as exc:
                log.exception("adapter operation failed")
                loop.call_soon_threadsafe(resolve, future, None, exc)
            else:
                loop.call_soon_threadsafe(resolve, future, result)

    # --- engine thread: batching -------------------------------------------------------------

    def _run(self) -> None:
        if self.continuous is not None:
            self.continuous.capture(idle=False)
            self._leave_fast_path_if_capture_failed()
        while True:
            batch = self._next_batch()
            if batch is None:
                return
            try:
                with torch.inference_mode():
                    path = self._path(batch[0])
                    if not self._ready(path, batch[0].slot):  # an adapter the fast path cannot merge
                        path = self.eager
                        if len(batch) > path.rows:
                            self.requeue(batch[path.rows :])
                            batch = batch[: path.rows]
                    path.decode(batch)
                    if path is not self.eager:
                        self._leave_fast_path_if_capture_failed()
            except Exception as exc:
                log.exception("batch failed")
                for seq in batch:
                    if seq.finish_reason is None:
                        self.fail(seq, exc)

    def _path(self, seq: Sequence) -> DecodePath:
        """The path `seq` decodes on: the continuous one when it fits there, else the eager one."""
        if self.continuous is not None and self.continuous.fits(seq):
            return self.continuous
        return self.eager

    def _ready(self, path: DecodePath, slot: str | None) -> bool:
        """Get `path` ready for adapter `slot`; False when the batch must decode eagerly instead."""
        try:
            return path.ready(slot)
        except Exception:
            log.exception("merging an adapter failed; using the eager path from now on")
            self.continuous = None
            return False

    def _leave_fast_path_if_capture_failed(self) -> None:
        """A CUDA graph the fast path needed could not be captured (a model that syncs with the
        host inside its forward, such as gpt-oss's expert routing, ...): serve this model on the
        eager path from now on, with one log line, rather than on a path its tests never saw run
        (`ContinuousDecoder.failure`). Called after start-up's or an idle-time capture and between
        batches: the batch that hit a failure mid-way completes without graphs first (the same
        steps, uncaptured)."""
        if self.continuous is None or self.continuous.decoder.failure is None:
            return
        reason, self.continuous = self.continuous.decoder.failure, None  # its copy, caches, graphs go
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        log.warning("CUDA graph capture failed (%s); this model decodes on the eager path", reason)

    def _next_batch(self) -> list[Sequence] | None:
        """The next batch, FIFO: a run of sequences that all take the continuous path with one
        adapter, or a run of sequences that all take the eager path. While nothing waits, captures
        the fast path's missing CUDA graphs one at a time (`graph_capture: idle`), then sleeps."""
        while True:
            self.run_control_ops()
            with self._cond:
                if self._stopping:
                    return None
                if self._control:
                    continue
                while self._waiting and self._waiting[0].request.cancelled:
                    self._drop(self._waiting.popleft())
                if not self._waiting:
                    if self.continuous is None or not self.continuous.decoder.idle_captures_left:
                        self._cond.wait()
                        continue
                else:
                    wait_left = self._waiting[0].enqueued + self.batch_wait_s - time.monotonic()
                    if len(self._waiting) < self.max_batch_size and wait_left > 0:
                        self._cond.wait(wait_left)
                        continue
                    head = self._waiting[0]
                    path = self._path(head)

                    def joins(seq: Sequence, head: Sequence = head, path: DecodePath = path) -> bool:
                        return self._path(seq) is path and path.joins(head, seq)

                    batch = self._take(joins, path.rows)
                    if batch:
                        return batch
                    continue
            # Idle: capture one graph outside the lock (`submit` must not wait for it), then look
            # for work again, so that a request arriving now waits for this one capture at most.
            assert self.continuous is not None
            self.continuous.capture(idle=True)
            self._leave_fast_path_if_capture_failed()

    def _take(self, joins: Callable[[Sequence], bool], limit: int) -> list[Sequence]:
        """Pop waiting sequences from the head while `joins` accepts them (caller holds the lock)."""
        batch: list[Sequence] = []
        while self._waiting and len(batch) < limit:
            seq = self._waiting[0]
            if seq.request.cancelled:
                self._drop(self._waiting.popleft())
            elif joins(seq):
                batch.append(self._waiting.popleft())
            else:
                break
        self.metrics.waiting.set(len(self._waiting))
        return batch

    def take_joiners(
        self, joins: Callable[[Sequence], bool], limit: int, due: Callable[[int, float], bool]
    ) -> list[Sequence]:
        with self._cond:
            if self._control or not self._waiting or not due(len(self._waiting), self._waiting[0].enqueued):
                return []
            return self._take(joins, limit)

    def requeue(self, seqs: list[Sequence]) -> None:
        with self._cond:
            for seq in sorted(seqs, key=lambda s: s.enqueued, reverse=True):
                self._waiting.appendleft(seq)
            self.metrics.waiting.set(len(self._waiting))

    def sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> SampleOutput:
        num_top = max((s.params.logprobs or 0) for s in seqs)
        return sample(logits, [s.row for s in seqs], num_top=num_top)

    def record(self, seqs: list[Sequence], readback: Readback, index: list[int]) -> list[bool]:
        tokens, lps, *top = readback.lists()
        top_ids, top_lps = top if top else (None, None)
        ended = []
        for j, seq in zip(index, seqs, strict=True):
            if faults.is_fault(lps[j]):
                self._fault(seq, lps[j])
                ended.append(True)
                continue
            if seq.request.cancelled:
                self._drop(seq)
                ended.append(True)
                continue
            seq.output_ids.append(tokens[j])
            seq.logprobs.append(lps[j])
            if seq.params.logprobs and top_ids is not None and top_lps is not None:
                k = seq.params.logprobs
                seq.top.append(list(zip(top_ids[j][:k], top_lps[j][:k], strict=True)))
            if self._finished(seq):
                self._complete(seq)
                ended.append(True)
            else:
                ended.append(False)
        self.metrics.generation_tokens.inc(len(seqs))
        return ended

    # --- engine thread: stopping rules and results ---------------------------------------------

    def _finished(self, seq: Sequence) -> bool:
        """Apply vLLM's stopping rules to the token just appended; fill in the finish reason."""
        token, params = seq.output_ids[-1], seq.params
        if not params.ignore_eos and token in self.eos_ids:
            seq.finish_reason = "stop"
        elif token in params.stop_token_ids:
            seq.finish_reason, seq.stop_reason = "stop", token
        elif params.stop and hit_stop_string(seq, self.tokenizer):
            return True
        elif (
            len(seq.output_ids) >= params.max_tokens
            or len(seq.prompt_ids) + len(seq.output_ids) >= self.max_model_len
        ):
            seq.finish_reason = "length"
        return seq.finish_reason is not None

    def _complete(self, seq: Sequence) -> None:
        if seq.text is None:
            seq.text = self.tokenizer.decode(
                seq.output_ids, skip_special_tokens=seq.params.skip_special_tokens
            )
        request = seq.request
        request.results[seq.index] = Completion(
            token_ids=seq.output_ids,
            text=seq.text,
            finish_reason=seq.finish_reason or "stop",
            stop_reason=seq.stop_reason,
            logprobs=seq.logprobs if seq.params.logprobs is not None else None,
            top_logprobs=seq.top if seq.params.logprobs else None,
        )
        self._release(seq)
        if request.on_done is not None:
            request.loop.call_soon_threadsafe(request.on_done, seq.index, request.results[seq.index])
        request.remaining -= 1
        if request.remaining == 0:
            request.loop.call_soon_threadsafe(resolve, request.future, request.results)

    def _fault(self, seq: Sequence, value: float) -> None:
        """`seq`'s logits were not finite: fail its request (once, logged) and mark its row to clear."""
        seq.faulted = True
        if seq.request.cancelled:
            self._drop(seq)
            return
        seq.request.cancelled = True  # its other sequences stop too: the request has failed
        p = seq.params
        details = {"sample": seq.index, "token": len(seq.output_ids), "prompt_tokens": len(seq.prompt_ids)}
        details |= {"adapter": seq.adapter, "cache_row": seq.cache_row, "temperature": p.temperature}
        details |= {"top_p": p.top_p, "top_k": p.top_k, "seed": p.seed, "max_tokens": p.max_tokens}
        self.fail(seq, faults.non_finite(seq.request.id, details, value))

    def _drop(self, seq: Sequence) -> None:
        seq.finish_reason = "abort"
        self._release(seq)

    def fail(self, seq: Sequence, exc: Exception) -> None:
        self._drop(seq)
        error = exc if isinstance(exc, GeneratorError) else ServerError(f"Generation failed: {exc}")
        seq.request.loop.call_soon_threadsafe(resolve, seq.request.future, None, error)

    def _release(self, seq: Sequence) -> None:
        if seq.adapter is not None and self.adapters.release(seq.adapter):
            self._detach(seq.adapter)
            self._update_adapter_gauge()
