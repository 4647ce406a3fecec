"""The generator's logic without HTTP: OpenAI/vLLM requests in, vLLM-shaped responses out.

Validates requests the way vLLM does (same status codes, error types and, where practical, the
same messages), turns prompts and chat messages into token ids, runs them through the `Engine` and
builds the responses with vLLM's field names. Raises `GeneratorError`s; `api.py` renders them.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import time
from collections.abc import AsyncIterator, Callable, Sequence
from functools import lru_cache
from pathlib import Path
from typing import Any, TypeVar

from crucible_shared.openai_protocol import (
    ChatCompletionLogProb,
    ChatCompletionLogProbs,
    ChatCompletionLogProbsContent,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatCompletionResponseStreamChoice,
    ChatCompletionStreamResponse,
    ChatMessage,
    CompletionLogProbs,
    CompletionRequest,
    CompletionResponse,
    CompletionResponseChoice,
    CompletionStreamResponse,
    DeltaMessage,
    LoadLoRAAdapterRequest,
    ModelCard,
    ModelList,
    ModelPermission,
    SamplingFields,
    UnloadLoRAAdapterRequest,
    UsageInfo,
)

from .adapter_files import MAX_NAME_CHARS, check_load_request, snapshot_adapter
from .engine import Completion, Engine, SamplingParams
from .errors import BadRequest, GeneratorError, NotFound
from .faults import for_json
from .metrics import process_age_s
from .settings import Settings
from .sizing import WORKING_LEN, CachePlan

log = logging.getLogger(__name__)
T = TypeVar("T", CompletionStreamResponse, ChatCompletionStreamResponse)

# vLLM request fields this server does not implement: refused rather than silently ignored.
UNSUPPORTED = ("prompt_logprobs", "use_beam_search", "logit_bias", "guided_json", "structured_outputs")


class GeneratorService:
    """Serves completions, chat completions, the model list and LoRA adapter loads/unloads."""

    def __init__(
        self,
        engine: Engine,
        *,
        model_name: str,
        model_root: str,
        max_logprobs: int = 20,
        adapter_roots: Sequence[Path] | None = None,
    ) -> None:
        self.engine = engine
        self.adapter_roots = list(adapter_roots or [Path.cwd()])
        self.tokenizer = engine.tokenizer
        self.model_name = model_name
        self.model_root = model_root
        self.max_logprobs = max_logprobs
        self._token_text = lru_cache(maxsize=None)(self._decode_token)
        # The newest fencing token seen per key (a job id): loads of older runs are refused.
        self.fences: dict[str, int] = {}

    # --- models and adapters -------------------------------------------------------------------

    def list_models(self) -> ModelList:
        cards = [
            ModelCard(
                id=self.model_name,
                root=self.model_root,
                max_model_len=self.engine.max_model_len,
                permission=[ModelPermission()],
            )
        ]
        cards += [
            ModelCard(
                id=a.name,
                root=a.path,
                parent=self.model_name,
                created=a.created,
                permission=[ModelPermission()],
            )
            for a in self.engine.adapters.served()
        ]
        return ModelList(data=cards)

    async def load_adapter(self, request: LoadLoRAAdapterRequest) -> str:
        if request.load_inplace:
            raise BadRequest(
                "load_inplace is not supported: load new weights under a new, versioned name.",
                param="load_inplace",
            )
        name, lora_path = request.lora_name, request.lora_path
        check_load_request(name, lora_path, self.model_name)
        self._check_fence(request)
        if not name or not lora_path:  # the registry answers vLLM's "both must be provided"
            await self.engine.load_adapter(name, lora_path)
            return ""
        # PEFT loads a private copy read through checked descriptors: a link swapped into the
        # adapter store after the check is never followed (see `adapter_files`).
        snapshot = await asyncio.to_thread(
            snapshot_adapter, name, lora_path, self.adapter_roots, "CRUCIBLE_GENERATOR_ADAPTER_ROOTS"
        )
        try:
            await self.engine.load_adapter(name, str(snapshot), source=lora_path)
        finally:
            await asyncio.to_thread(shutil.rmtree, snapshot, True)
        return f"Success: LoRA adapter '{name}' added successfully."

    def _check_fence(self, request: LoadLoRAAdapterRequest) -> None:
        """A load from a run older than the newest this server has seen for the same job is
        refused (400 naming `fence`): that run was superseded and must not take a slot or serve
        weights under the job's names. A newer token becomes the newest."""
        fence = request.fence
        if fence is None:
            return
        newest = self.fences.get(fence.key, fence.token)
        if fence.token < newest:
            raise BadRequest(
                f"Loading lora {request.lora_name} refused: its fencing token {fence.token} for "
                f"{fence.key!r} is older than {newest}, a newer run's",
                param="fence",
            )
        self.fences[fence.key] = fence.token

    async def unload_adapter(self, request: UnloadLoRAAdapterRequest) -> str:
        if len(request.lora_name) > MAX_NAME_CHARS:
            raise BadRequest(f"lora_name is longer than {MAX_NAME_CHARS} characters", param="lora_name")
        await self.engine.unload_adapter(request.lora_name)
        return f"Success: LoRA adapter '{request.lora_name}' removed successfully."

    def _adapter_for(self, model: str | None) -> str | None:
        """None for the base model, else the adapter name; `NotFound` for anything unknown."""
        if not model or model == self.model_name:
            return None
        if any(a.name == model for a in self.engine.adapters.served()):
            return model
        raise NotFound(f"The model `{model}` does not exist.", param="model")

    # --- completions ---------------------------------------------------------------------------

    async def complete(self, request: CompletionRequest) -> CompletionResponse:
        prompts, params, adapter = self._completion_job(request)
        outputs = await self.engine.generate(prompts, params, n=request.n, adapter=adapter)
        choices = [self._completion_choice(request, prompts, i, out) for i, out in enumerate(outputs)]
        return CompletionResponse(
            model=request.model or self.model_name, choices=choices, usage=self._usage(prompts, outputs)
        )

    def complete_stream(self, request: CompletionRequest) -> AsyncIterator[str]:
        """A streamed completion (`stream: true`) as vLLM's server-sent events: an event per choice
        when it finishes (its whole text, token ids and logprobs, and its `finish_reason`), the
        usage last with `stream_options.include_usage`, then `[DONE]`. The request is validated
        here, before the first event, so that a bad one is still a 4xx; an error while decoding is
        an `error` event, as vLLM sends it."""
        prompts, params, adapter = self._completion_job(request)
        head = _stream_head(CompletionStreamResponse, request.model or self.model_name)

        def event(index: int, out: Completion) -> CompletionStreamResponse:
            return head.model_copy(
                update={"choices": [self._completion_choice(request, prompts, index, out)]}
            )

        return self._events(request, prompts, params, adapter, head, [], event)

    def _events(
        self,
        request: SamplingFields,
        prompts: list[list[int]],
        params: SamplingParams,
        adapter: str | None,
        head: CompletionStreamResponse | ChatCompletionStreamResponse,
        first: list[Any],
        event: Callable[[int, Completion], Any],
    ) -> AsyncIterator[str]:
        """The server-sent events of a streamed request: `first` (sent before decoding), then
        `event(index, completion)` per choice as it finishes, the usage with
        `stream_options.include_usage`, then `[DONE]`; an error while decoding is an `error` event."""
        include_usage = bool(request.stream_options and request.stream_options.include_usage)

        async def events() -> AsyncIterator[str]:
            outputs = []
            try:
                for chunk in first:
                    yield f"data: {chunk.model_dump_json(exclude_unset=True)}\n\n"
                async for index, out in self.engine.stream(prompts, params, n=request.n, adapter=adapter):
                    outputs.append(out)
                    yield f"data: {event(index, out).model_dump_json(exclude_unset=True)}\n\n"
                if include_usage:
                    last = head.model_copy(update={"usage": self._usage(prompts, outputs)})
                    yield f"data: {last.model_dump_json(exclude_none=True)}\n\n"
            except GeneratorError as exc:
                yield f"data: {exc.to_response().model_dump_json()}\n\n"
            yield "data: [DONE]\n\n"

        return events()

    def _completion_job(
        self, request: CompletionRequest
    ) -> tuple[list[list[int]], SamplingParams, str | None]:
        """A completion request checked (as vLLM does) and turned into its prompts' token ids,
        sampling settings and adapter; raises a `GeneratorError` for a bad one."""
        if request.echo:
            raise BadRequest("echo is not supported by this server.", param="echo")
        if request.suffix is not None:
            raise BadRequest("suffix is not currently supported", param="suffix")
        adapter = self._adapter_for(request.model)
        prompts = self._completion_prompts(request)
        max_tokens = request.max_tokens if request.max_tokens is not None else 16
        for prompt in prompts:
            self._check_length(len(prompt), max_tokens)
        num_logprobs = self._check_logprobs(request.logprobs)
        return prompts, self._sampling_params(request, max_tokens, num_logprobs), adapter

    def _completion_choice(
        self, request: CompletionRequest, prompts: list[list[int]], index: int, out: Completion
    ) -> CompletionResponseChoice:
        ids = request.return_token_ids
        return CompletionResponseChoice(
            index=index,
            text=out.text,
            logprobs=self._completion_logprobs(out) if request.logprobs is not None else None,
            finish_reason=out.finish_reason,
            stop_reason=out.stop_reason,
            token_ids=out.token_ids if ids else None,
            prompt_token_ids=prompts[index // request.n] if ids else None,
        )

    def _completion_prompts(self, request: CompletionRequest) -> list[list[int]]:
        prompt = request.prompt
        if prompt is None or prompt == "" or prompt == []:
            raise BadRequest("Either prompt or prompt_embeds must be provided and non-empty.", param="prompt")
        if isinstance(prompt, str):
            items: list[Any] = [prompt]
        elif all(isinstance(p, int) for p in prompt):
            items = [prompt]
        else:
            items = list(prompt)
        prompts = []
        for item in items:
            if isinstance(item, str):
                ids = self.tokenizer(item, add_special_tokens=request.add_special_tokens).input_ids
            else:
                ids = list(item)
                bad = [t for t in ids if not 0 <= t < self.engine.vocab_size]
                if bad:
                    raise BadRequest(f"Token id {bad[0]} is out of vocabulary", param="prompt")
            if not ids:
                raise BadRequest("Prompt cannot be empty", param="prompt")
            prompts.append(ids)
        return prompts

    def _completion_logprobs(self, out: Completion) -> CompletionLogProbs:
        tokens, offsets, top = [], [], []
        offset = 0
        for i, token_id in enumerate(out.token_ids):
            text = self._token_text(token_id)
            tokens.append(text)
            offsets.append(offset)
            offset += len(text)
            entry = {text: for_json(out.logprobs[i])}  # the sampled token first, as vLLM
            for top_id, top_lp in out.top_logprobs[i] if out.top_logprobs else []:
                entry.setdefault(self._token_text(top_id), for_json(top_lp))
            top.append(entry)
        return CompletionLogProbs(
            text_offset=offsets,
            token_logprobs=[for_json(lp) for lp in out.logprobs or []],
            tokens=tokens,
            top_logprobs=top,
        )

    # --- chat completions ----------------------------------------------------------------------

    async def chat(self, request: ChatCompletionRequest) -> ChatCompletionResponse:
        prompt, params, adapter = self._chat_job(request)
        outputs = await self.engine.generate([prompt], params, n=request.n, adapter=adapter)
        choices = [
            ChatCompletionResponseChoice(
                index=index,
                message=ChatMessage(role="assistant", content=out.text),
                logprobs=self._chat_logprobs(out) if params.logprobs is not None else None,
                finish_reason=out.finish_reason,
                stop_reason=out.stop_reason,
                token_ids=out.token_ids if request.return_token_ids else None,
            )
            for index, out in enumerate(outputs)
        ]
        return ChatCompletionResponse(
            model=request.model or self.model_name,
            choices=choices,
            usage=self._usage([prompt], outputs),
            prompt_token_ids=prompt if request.return_token_ids else None,
        )

    def chat_stream(self, request: ChatCompletionRequest) -> AsyncIterator[str]:
        """A streamed chat completion, as vLLM streams one: first an event per choice with its role
        (and the prompt's token ids under `return_token_ids`), then each choice's whole content,
        logprobs and `finish_reason` when it finishes, the usage, `[DONE]` (see `complete_stream`)."""
        prompt, params, adapter = self._chat_job(request)
        head = _stream_head(ChatCompletionStreamResponse, request.model or self.model_name)
        ids = request.return_token_ids
        first = [
            head.model_copy(
                update={
                    "choices": [
                        ChatCompletionResponseStreamChoice(
                            index=i,
                            delta=DeltaMessage(role="assistant", content=""),
                            logprobs=None,
                            finish_reason=None,
                        )
                    ],
                    **({"prompt_token_ids": prompt} if ids else {}),
                }
            )
            for i in range(request.n)
        ]

        def event(index: int, out: Completion) -> ChatCompletionStreamResponse:
            choice = ChatCompletionResponseStreamChoice(
                index=index,
                delta=DeltaMessage(content=out.text),
                logprobs=self._chat_logprobs(out) if params.logprobs is not None else None,
                finish_reason=out.finish_reason,
                stop_reason=out.stop_reason,
                token_ids=out.token_ids if ids else None,
            )
            return head.model_copy(update={"choices": [choice]})

        return self._events(request, [prompt], params, adapter, head, first, event)

    def _chat_job(self, request: ChatCompletionRequest) -> tuple[list[int], SamplingParams, str | None]:
        """A chat request checked and turned into its prompt's token ids, sampling settings and adapter."""
        adapter = self._adapter_for(request.model)
        prompt = self._chat_prompt(request)
        max_tokens = request.max_completion_tokens or request.max_tokens
        if max_tokens is None:
            max_tokens = max(1, self.engine.max_model_len - len(prompt))
        self._check_length(len(prompt), max_tokens)
        if request.top_logprobs and not request.logprobs:
            raise BadRequest(
                "when using `top_logprobs`, `logprobs` must be set to true.", param="top_logprobs"
            )
        num_logprobs = self._check_logprobs(request.top_logprobs or 0) if request.logprobs else None
        return prompt, self._sampling_params(request, max_tokens, num_logprobs), adapter

    def _chat_prompt(self, request: ChatCompletionRequest) -> list[int]:
        if not request.messages:
            raise BadRequest("messages must not be empty.", param="messages")
        conversation = []
        for i, message in enumerate(request.messages):
            if "role" not in message:
                raise BadRequest(f"messages[{i}] has no role.", param="messages")
            conversation.append({**message, "content": _text_content(message.get("content"), i)})
        if request.add_generation_prompt and request.continue_final_message:
            raise BadRequest(
                "Cannot set both `continue_final_message` and `add_generation_prompt` to True.",
                param="continue_final_message",
            )
        try:
            text = self.tokenizer.apply_chat_template(
                conversation,
                tokenize=False,
                add_generation_prompt=request.add_generation_prompt,
                continue_final_message=request.continue_final_message,
                **(request.chat_template_kwargs or {}),
            )
        except Exception as exc:  # jinja2 errors of the model's own template
            raise BadRequest(f"Chat template failed: {exc}", param="messages") from exc
        return self.tokenizer(text, add_special_tokens=request.add_special_tokens).input_ids

    def _chat_logprobs(self, out: Completion) -> ChatCompletionLogProbs:
        content = []
        for i, token_id in enumerate(out.token_ids):
            text = self._token_text(token_id)
            tops = [
                ChatCompletionLogProb(
                    token=self._token_text(t),
                    logprob=for_json(lp),
                    bytes=_utf8(self._token_text(t)),
                )
                for t, lp in (out.top_logprobs[i] if out.top_logprobs else [])
            ]
            content.append(
                ChatCompletionLogProbsContent(
                    token=text,
                    logprob=for_json(out.logprobs[i]),
                    bytes=_utf8(text),
                    top_logprobs=tops,
                )
            )
        return ChatCompletionLogProbs(content=content)

    # --- shared validation and helpers ---------------------------------------------------------

    def _sampling_params(
        self, request: SamplingFields, max_tokens: int, logprobs: int | None
    ) -> SamplingParams:
        if request.stream_options and not request.stream:
            raise BadRequest("Stream options can only be defined when `stream=True`.", param="stream_options")
        for name in UNSUPPORTED:
            if (request.model_extra or {}).get(name):
                raise BadRequest(f"{name} is not supported by this server.", param=name)
        if request.n < 1:
            raise BadRequest(f"n must be at least 1, got {request.n}.", param="n")
        if max_tokens < 1:
            raise BadRequest(f"max_tokens must be at least 1, got {max_tokens}.", param="max_tokens")
        temperature = 1.0 if request.temperature is None else request.temperature
        if temperature < 0:
            raise BadRequest(f"temperature must be non-negative, got {temperature}.", param="temperature")
        top_p = 1.0 if request.top_p is None else request.top_p
        if not 0.0 < top_p <= 1.0:
            raise BadRequest(f"top_p must be in (0, 1], got {top_p}.", param="top_p")
        top_k = request.top_k or 0
        if top_k < -1:
            raise BadRequest(f"top_k must be 0 or -1 (disable), or at least 1, got {top_k}.", param="top_k")
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=temperature,
            top_p=top_p,
            top_k=max(top_k, 0),
            seed=request.seed,
            stop=tuple(request.stop_list()),
            stop_token_ids=tuple(request.stop_token_ids or ()),
            ignore_eos=request.ignore_eos,
            include_stop_str_in_output=request.include_stop_str_in_output,
            skip_special_tokens=request.skip_special_tokens,
            logprobs=logprobs,
        )

    def _check_logprobs(self, logprobs: int | None) -> int | None:
        if logprobs is None:
            return None
        if logprobs < 0:
            raise BadRequest("`logprobs` must be a positive value.", param="logprobs")
        if logprobs > self.max_logprobs:
            raise BadRequest(
                f"Requested sample logprobs of {logprobs}, which is greater than max allowed: "
                f"{self.max_logprobs}",
                param="logprobs",
            )
        return logprobs

    def _check_length(self, prompt_len: int, max_tokens: int) -> None:
        limit = self.engine.max_model_len
        if prompt_len >= limit:
            raise BadRequest(
                f"This model's maximum context length is {limit} tokens. However, your request has "
                f"{prompt_len} input tokens. Please reduce the length of the input messages.",
                param="messages",
            )
        if prompt_len + max_tokens > limit:
            raise BadRequest(
                f"'max_tokens' or 'max_completion_tokens' is too large: {max_tokens}. This model's maximum "
                f"context length is {limit} tokens and your request has {prompt_len} input tokens "
                f"({max_tokens} > {limit} - {prompt_len}).",
                param="max_tokens",
            )

    @staticmethod
    def _usage(prompts: list[list[int]], outputs: list[Completion]) -> UsageInfo:
        prompt_tokens = sum(len(p) for p in prompts)
        completion_tokens = sum(len(o.token_ids) for o in outputs)
        return UsageInfo(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
        )

    def _decode_token(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])


def _stream_head(kind: type[T], model: str) -> T:
    """The fields every event of one stream repeats (id, object, created, model), set explicitly
    so that events dumped without their unset fields (as vLLM dumps them) still carry them."""
    fields = kind(model=model, choices=[]).model_dump(include={"id", "object", "created", "model"})
    return kind(**fields, choices=[])


def _text_content(content: Any, index: int) -> str:
    """A message's content as text: a string, or the concatenated text parts of a content list."""
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list):
        parts = []
        for part in content:
            if isinstance(part, dict) and part.get("type") == "text":
                parts.append(str(part.get("text", "")))
            else:
                raise BadRequest(
                    f"messages[{index}]: only text content parts are supported.", param="messages"
                )
        return "\n".join(parts)
    raise BadRequest(f"messages[{index}].content must be a string or a list of parts.", param="messages")


def _utf8(text: str) -> list[int]:
    return list(text.encode("utf-8"))


def cache_plan(model: Any, settings: Settings) -> CachePlan:
    """Rows of the decode batch and the fast path's cache blocks: from the memory budget
    (`gpu_memory_fraction`), else from the memory free after loading; `max_batch_size` and
    `kv_blocks` when set (sizing.py)."""
    from .fastpath import LENGTH_BUCKET
    from .features import model_gap
    from .sizing import budget_plan, footprint_of, free_memory_plan, rows_for_blocks

    context = settings.max_model_len or int(getattr(model.config, "max_position_embeddings", 2048))
    requested = None if settings.max_batch_size == "auto" else settings.max_batch_size
    cuda = model.device.type == "cuda"
    fast = settings.fast_decode == "on" or (settings.fast_decode == "auto" and cuda)
    fast = fast and model_gap(model, LENGTH_BUCKET) is None
    block_size = settings.block_size
    if settings.kv_blocks is not None and fast:
        rows = requested or rows_for_blocks(settings.kv_blocks, block_size)
        plan = CachePlan(rows=rows, blocks=settings.kv_blocks, block_size=block_size)
    elif settings.gpu_memory_fraction is not None and cuda:
        footprint = footprint_of(
            model,
            row_length=-(-min(context, WORKING_LEN) // LENGTH_BUCKET) * LENGTH_BUCKET,
            fast=fast,
            prefill_graphs=settings.cuda_graphs and settings.prefill_graphs,
            max_loras=settings.max_loras,
            max_lora_rank=settings.max_lora_rank,
            graphs=settings.cuda_graphs,
        )
        return budget_plan(model, settings.gpu_memory_fraction, footprint, requested, block_size)
    else:
        if settings.gpu_memory_fraction is not None:
            log.info("gpu_memory_fraction applies on CUDA only; ignored on %s", model.device)
        plan = free_memory_plan(model, context, requested, block_size, paged=fast)
    how = "from memory" if requested is None else "set"
    log.info("max_batch_size %d (%s): %s", plan.rows, how, plan.describe(min(context, WORKING_LEN)))
    return plan


def build_service(settings: Settings) -> GeneratorService:
    """Load the model named by `settings`, start an engine on it and wrap it in a service."""
    import torch
    from crucible_models import load_model, resolve_model_path

    if settings.threads:
        torch.set_num_threads(settings.threads)

    imports, began = process_age_s(), time.perf_counter()
    model, tokenizer = load_model(settings.model, device=settings.device, dtype=settings.dtype)
    log.info("loaded %s on %s (%s)", settings.model, model.device, model.dtype)
    loaded = time.perf_counter()
    plan = cache_plan(model, settings)
    engine = Engine(
        model,
        tokenizer,
        max_batch_size=plan.rows,
        batch_wait_s=settings.batch_wait_ms / 1000,
        join_wait_s=settings.join_wait_ms / 1000,
        max_model_len=settings.max_model_len,
        max_loras=settings.max_loras,
        max_lora_rank=settings.max_lora_rank,
        seed=settings.seed,
        fast_decode=settings.fast_decode,
        cuda_graphs=settings.cuda_graphs,
        prefill_graphs=settings.prefill_graphs,
        fast_context=WORKING_LEN,  # the row length the cache plan budgets for
        attention_kernels=settings.attention_kernels,
        block_size=settings.block_size,
        kv_blocks=plan.blocks,
        eager_batch_size=plan.eager_rows,
        graph_capture=settings.graph_capture,
    )
    engine.start()
    engine.metrics.started(imports=imports, load=loaded - began, engine=time.perf_counter() - loaded)
    return GeneratorService(
        engine,
        model_name=settings.base_model_name,
        model_root=resolve_model_path(settings.model),
        max_logprobs=settings.max_logprobs,
        adapter_roots=settings.adapter_roots,
    )
