"""The subset of vLLM's OpenAI-compatible protocol Crucible uses, as pydantic models.

Field names, defaults and shapes follow vLLM's `entrypoints/openai` protocol (completions, chat
completions, models, LoRA load/unload, `ErrorResponse`), including vLLM's extensions
(`return_token_ids`, `token_ids`, `prompt_token_ids`, `stop_reason`, `ignore_eos`, ...). Crucible's
generator server answers with these models and `crucible_shared.generator_client` parses vLLM's and
Crucible's answers with them, so both must stay a faithful mirror of vLLM. Like vLLM, request and
response models accept unknown fields: a newer server may add some.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


def random_id(prefix: str) -> str:
    """`<prefix>-<32 hex chars>`, the shape of vLLM's response ids."""
    return f"{prefix}-{uuid.uuid4().hex}"


class OpenAIBaseModel(BaseModel):
    """Base of every protocol model: unknown fields are kept, never rejected (as in vLLM)."""

    model_config = ConfigDict(extra="allow")


# --- errors -------------------------------------------------------------------------------------


class ErrorInfo(OpenAIBaseModel):
    """What went wrong; `code` repeats the HTTP status, `type` names the error class."""

    message: str
    type: str
    param: str | None = None
    code: int


class ErrorResponse(OpenAIBaseModel):
    """Body of every non-2xx answer of vLLM's OpenAI server (and of Crucible's generator)."""

    error: ErrorInfo


# --- models -------------------------------------------------------------------------------------


class ModelPermission(OpenAIBaseModel):
    id: str = Field(default_factory=lambda: random_id("modelperm"))
    object: str = "model_permission"
    created: int = Field(default_factory=lambda: int(time.time()))
    allow_create_engine: bool = False
    allow_sampling: bool = True
    allow_logprobs: bool = True
    allow_search_indices: bool = False
    allow_view: bool = True
    allow_fine_tuning: bool = False
    organization: str = "*"
    group: str | None = None
    is_blocking: bool = False


class ModelCard(OpenAIBaseModel):
    """One servable model: the base model (`parent` is None) or a LoRA adapter (`parent` = base)."""

    id: str
    object: str = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "vllm"
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None
    permission: list[ModelPermission] = Field(default_factory=list)


class ModelList(OpenAIBaseModel):
    object: str = "list"
    data: list[ModelCard] = Field(default_factory=list)


# --- LoRA adapters ------------------------------------------------------------------------------


class LoadFence(OpenAIBaseModel):
    """Who loads an adapter: a key (a job id) and that run's fencing token."""

    key: str = Field(min_length=1, max_length=200)
    token: int = Field(ge=0, le=2**62)


class LoadLoRAAdapterRequest(OpenAIBaseModel):
    """`POST /v1/load_lora_adapter`: serve the PEFT adapter at `lora_path` as model `lora_name`."""

    lora_name: str
    lora_path: str
    load_inplace: bool = False
    # Crucible's extension (vLLM keeps unknown fields and ignores them): the fencing token of the
    # job run loading this adapter. A load whose token is older than the newest the generator has
    # seen for the same key is refused, so a superseded run cannot load into a live job's slots.
    fence: LoadFence | None = None


class UnloadLoRAAdapterRequest(OpenAIBaseModel):
    """`POST /v1/unload_lora_adapter`: stop serving `lora_name` and free its memory."""

    lora_name: str
    lora_int_id: int | None = None


# --- usage --------------------------------------------------------------------------------------


class PromptTokenUsageInfo(OpenAIBaseModel):
    cached_tokens: int | None = None


class UsageInfo(OpenAIBaseModel):
    prompt_tokens: int = 0
    total_tokens: int = 0
    completion_tokens: int | None = 0
    prompt_tokens_details: PromptTokenUsageInfo | None = None


# --- completions --------------------------------------------------------------------------------

StopParam = str | list[str] | None


class StreamOptions(OpenAIBaseModel):
    """`stream_options` of a streamed request: `include_usage` adds a last chunk with the usage."""

    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


class SamplingFields(OpenAIBaseModel):
    """Sampling fields shared by completions and chat completions (OpenAI's plus vLLM's extras)."""

    model: str | None = None
    n: int = 1
    seed: int | None = None
    stop: StopParam = Field(default_factory=list)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    user: str | None = None
    # vLLM extensions.
    top_k: int | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = Field(default_factory=list)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    return_token_ids: bool | None = None

    def stop_list(self) -> list[str]:
        """`stop` normalized to a list of non-empty strings."""
        if self.stop is None:
            return []
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop)
        return [s for s in stops if s]


class CompletionRequest(SamplingFields):
    """`POST /v1/completions`. `prompt` is a string, a list of strings, token ids or lists of ids."""

    prompt: list[int] | list[list[int]] | str | list[str] | None = None
    echo: bool | None = False
    logprobs: int | None = None
    max_tokens: int | None = 16
    suffix: str | None = None
    add_special_tokens: bool = True


class CompletionLogProbs(OpenAIBaseModel):
    """Per-token logprobs of a completion, in the legacy OpenAI layout."""

    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionResponseChoice(OpenAIBaseModel):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None
    prompt_logprobs: list[dict[int, Any] | None] | None = None
    prompt_token_ids: list[int] | None = None


class CompletionStreamResponse(OpenAIBaseModel):
    """One server-sent event of a streamed completion (`stream: true`): choices that grew, each
    with its new text (and token ids, logprobs) since the last event; a choice's last event carries
    its `finish_reason`. With `stream_options.include_usage`, a last event has no choices and the
    usage. vLLM sends an event per decoded token; Crucible's generator one per finished choice."""

    id: str = Field(default_factory=lambda: random_id("cmpl"))
    object: str = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionResponseChoice]
    usage: UsageInfo | None = None


class CompletionResponse(OpenAIBaseModel):
    id: str = Field(default_factory=lambda: random_id("cmpl"))
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionResponseChoice]
    system_fingerprint: str | None = None
    usage: UsageInfo


# --- chat completions ---------------------------------------------------------------------------


class ChatMessage(OpenAIBaseModel):
    role: str
    content: str | None = None
    refusal: str | None = None


class ChatCompletionRequest(SamplingFields):
    """`POST /v1/chat/completions`; the prompt is the model's chat template applied to `messages`."""

    messages: list[dict[str, Any]]
    logprobs: bool | None = False
    top_logprobs: int | None = 0
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    chat_template_kwargs: dict[str, Any] | None = None


class ChatCompletionLogProb(OpenAIBaseModel):
    token: str
    logprob: float = -9999.0
    bytes: list[int] | None = None


class ChatCompletionLogProbsContent(ChatCompletionLogProb):
    top_logprobs: list[ChatCompletionLogProb] = Field(default_factory=list)


class ChatCompletionLogProbs(OpenAIBaseModel):
    content: list[ChatCompletionLogProbsContent] | None = None


class ChatCompletionResponseChoice(OpenAIBaseModel):
    index: int
    message: ChatMessage
    logprobs: ChatCompletionLogProbs | None = None
    finish_reason: str | None = "stop"
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None


class DeltaMessage(OpenAIBaseModel):
    role: str | None = None
    content: str | None = None


class ChatCompletionResponseStreamChoice(OpenAIBaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatCompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None


class ChatCompletionStreamResponse(OpenAIBaseModel):
    """One server-sent event of a streamed chat completion: first the role of every choice (with the
    prompt's token ids under `return_token_ids`), then each choice's content; a choice's last event
    carries its `finish_reason`. vLLM sends the content token by token, Crucible's generator whole
    when the choice finishes."""

    id: str = Field(default_factory=lambda: random_id("chatcmpl"))
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionResponseStreamChoice]
    usage: UsageInfo | None = None
    prompt_token_ids: list[int] | None = None


class ChatCompletionResponse(OpenAIBaseModel):
    id: str = Field(default_factory=lambda: random_id("chatcmpl"))
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionResponseChoice]
    system_fingerprint: str | None = None
    usage: UsageInfo
    prompt_logprobs: list[dict[int, Any] | None] | None = None
    prompt_token_ids: list[int] | None = None
