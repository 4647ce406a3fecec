#!/usr/bin/env bash
# Launch vLLM as Crucible's generator. Every knob is an environment variable (see Dockerfile);
# extra arguments are passed through to `vllm serve`.
#
#   --enable-lora --max-loras N   N >= staleness window + 1: the trainer keeps the versions still used
#                                 by in-flight rollouts loaded while it loads the next one.
#   --max-lora-rank R             the largest LoRA rank the trainer may publish (vLLM preallocates for it).
#   --enable-prefix-caching       G samples of one prompt share its KV cache; safe with LoRA because
#                                 every adapter version has a new name (the cache is keyed by it).
set -euo pipefail
export VLLM_ALLOW_RUNTIME_LORA_UPDATING="${VLLM_ALLOW_RUNTIME_LORA_UPDATING:-True}"
exec vllm serve "${GENERATOR_MODEL:-HuggingFaceTB/SmolLM2-135M-Instruct}" \
    --served-model-name "${GENERATOR_SERVED_NAME:-smollm2-135m-instruct}" \
    --host 0.0.0.0 \
    --port "${GENERATOR_PORT:-8001}" \
    --enable-lora \
    --max-loras "${GENERATOR_MAX_LORAS:-4}" \
    --max-lora-rank "${GENERATOR_MAX_LORA_RANK:-64}" \
    --max-cpu-loras "${GENERATOR_MAX_CPU_LORAS:-${GENERATOR_MAX_LORAS:-4}}" \
    --enable-prefix-caching \
    --max-model-len "${GENERATOR_MAX_MODEL_LEN:-8192}" \
    --gpu-memory-utilization "${GENERATOR_GPU_MEMORY_UTILIZATION:-0.85}" \
    --max-logprobs 20 \
    --dtype "${GENERATOR_DTYPE:-auto}" \
    --generation-config vllm \
    "$@"
