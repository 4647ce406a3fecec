"""Which server `crucible up` and the demo start as the generator: vLLM where it is there, else
Crucible's own.

`auto` (the default; `--generator-backend` or `CRUCIBLE_GENERATOR_BACKEND`) picks vLLM on a host
with CUDA and the `vllm` package, and Crucible's server (`python -m crucible_generator`) elsewhere;
`vllm` and `crucible` force one. vLLM runs with the same launch profile as the compose and
Kubernetes GPU generator (`services/generator/vllm/serve.sh`; a unit test keeps the two in step):
runtime LoRA loading, prefix caching, the same LoRA limits and logprob cap, and the built-in
model's dense checkpoint served under its Crucible name.
"""

from __future__ import annotations

import importlib.util
import os
import sys

BACKENDS = ("auto", "vllm", "crucible")

# `vllm serve` flags of the launch profile, beside the model, name, host and port. The memory
# share is lower than the image's 0.85: here the trainer shares the card with the generator.
PROFILE = {
    "--max-loras": "4",
    "--max-lora-rank": "64",
    "--max-cpu-loras": "4",
    "--max-model-len": "8192",
    "--gpu-memory-utilization": "0.4",
    "--max-logprobs": "20",
    "--generation-config": "vllm",
    "--dtype": "auto",
}
PROFILE_SWITCHES = ("--enable-lora", "--enable-prefix-caching")
VLLM_ENV = {
    "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True",  # /v1/load_lora_adapter and /v1/unload_lora_adapter
    "VLLM_NO_USAGE_STATS": "1",
}


def has_vllm() -> bool:
    return importlib.util.find_spec("vllm") is not None


def has_cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def pick(choice: str | None = None) -> str:
    """`vllm` or `crucible` for `choice` (None: `CRUCIBLE_GENERATOR_BACKEND`, else `auto`)."""
    choice = (choice or os.environ.get("CRUCIBLE_GENERATOR_BACKEND") or "auto").lower()
    if choice not in BACKENDS:
        raise ValueError(f"generator backend {choice!r}: use one of {', '.join(BACKENDS)}")
    if choice == "crucible":
        return "crucible"
    if choice == "vllm":
        if not has_vllm():
            raise ValueError(
                "generator backend vllm: the vllm package is not installed here "
                "(pip install vllm on a CUDA host, or use --generator-backend crucible)"
            )
        return "vllm"
    return "vllm" if has_vllm() and has_cuda() else "crucible"


def vllm_command(model: str, served_name: str, port: int) -> list[str]:
    """The `vllm serve` command line of the launch profile for `model` (a built-in name or any
    Hugging Face id or path)."""
    import crucible_models

    path = crucible_models.resolve_model_path(model)
    dtype = {"--dtype": "bfloat16"} if crucible_models.is_builtin(model) else {}  # its copy is fp32
    flags = [arg for key, value in {**PROFILE, **dtype}.items() for arg in (key, value)]
    return [
        sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", path,
        "--served-model-name", served_name, "--host", "127.0.0.1", "--port", str(port),
        *PROFILE_SWITCHES, *flags,
    ]  # fmt: skip
