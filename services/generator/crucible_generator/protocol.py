"""The generator's wire protocol: vLLM's OpenAI-compatible request and response models.

They live in `crucible_shared.openai_protocol` because the client in `shared` parses the same
bodies; this module is the service's single import point for them.
"""

from crucible_shared.openai_protocol import (
    ChatCompletionLogProb,
    ChatCompletionLogProbs,
    ChatCompletionLogProbsContent,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatMessage,
    CompletionLogProbs,
    CompletionRequest,
    CompletionResponse,
    CompletionResponseChoice,
    ErrorInfo,
    ErrorResponse,
    LoadLoRAAdapterRequest,
    ModelCard,
    ModelList,
    ModelPermission,
    SamplingFields,
    UnloadLoRAAdapterRequest,
    UsageInfo,
)

__all__ = [
    "ChatCompletionLogProb",
    "ChatCompletionLogProbs",
    "ChatCompletionLogProbsContent",
    "ChatCompletionRequest",
    "ChatCompletionResponse",
    "ChatCompletionResponseChoice",
    "ChatMessage",
    "CompletionLogProbs",
    "CompletionRequest",
    "CompletionResponse",
    "CompletionResponseChoice",
    "ErrorInfo",
    "ErrorResponse",
    "LoadLoRAAdapterRequest",
    "ModelCard",
    "ModelList",
    "ModelPermission",
    "SamplingFields",
    "UnloadLoRAAdapterRequest",
    "UsageInfo",
]
