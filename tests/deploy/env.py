"""Which environment variables each Crucible container reads, from the code itself.

A service reads: the variables of its pydantic-settings `Settings` (prefix + field name, or the
field's aliases such as `REDIS_URL`), the names its package and `crucible_shared` look up with
`os.environ` / `os.getenv`, and a short list of variables that third-party code in its image reads
(each with the reason it is set). The vLLM generator reads the `GENERATOR_*` variables of
`services/generator/vllm/serve.sh` plus vLLM's and Hugging Face's own.
"""

from __future__ import annotations

import importlib
import re
from dataclasses import dataclass, field
from pathlib import Path

from pydantic import AliasChoices
from pydantic_settings import BaseSettings

ROOT = Path(__file__).resolve().parents[2]

# Read by the Python interpreter or the shell in every image.
PYTHON = {
    "PATH": "executables: the image's virtualenv first",
    "PYTHONUNBUFFERED": "python: logs reach the container log at once",
    "PYTHONDONTWRITEBYTECODE": "python: no .pyc writes on a read-only root filesystem",
}
# Read by torch, transformers, huggingface_hub, Triton... in the images that run a model.
MODEL_RUNTIME = {
    "HOME": "the root filesystem is read-only: caches under ~ (Triton, torch, matplotlib) go to /tmp",
    "HF_HOME": "huggingface_hub: the model cache volume",
    "HF_TOKEN": "huggingface_hub: gated or private models",
    "HF_HUB_OFFLINE": "huggingface_hub: no hub calls on an air-gapped host (models from /models/local)",
}
VLLM_RUNTIME = {
    **MODEL_RUNTIME,
    "USER": "getpass.getuser() (torch.compile cache dirs) when the uid has no passwd entry",
    "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "vLLM: /v1/load_lora_adapter and /v1/unload_lora_adapter",
    "VLLM_NO_USAGE_STATS": "vLLM: no usage reporting",
}


@dataclass
class Reader:
    """What one kind of container reads and what a deployment must set for it."""

    name: str
    settings: tuple[str, ...] = ()  # "module:Class" of each pydantic-settings model it reads
    packages: tuple[str, ...] = ()  # source folders scanned for os.environ look-ups
    scripts: tuple[str, ...] = ()  # shell scripts scanned for ${VAR} look-ups
    third_party: dict[str, str] = field(default_factory=dict)
    # Settings whose defaults suit a developer's machine, not a container: host 127.0.0.1, relative
    # dirs, localhost URLs, no keys. Each entry is a set of names of which one must be set.
    deploy_required: tuple[frozenset[str], ...] = ()

    def settings_classes(self) -> list[type[BaseSettings]]:
        classes = []
        for ref in self.settings:
            module, _, cls = ref.partition(":")
            classes.append(getattr(importlib.import_module(module), cls))
        return classes

    def setting_names(self) -> dict[str, frozenset[str]]:
        """`Class.field` -> the variable names that set it."""
        names = {}
        for cls in self.settings_classes():
            prefix = cls.model_config.get("env_prefix", "")
            for name, info in cls.model_fields.items():
                alias = info.validation_alias
                if isinstance(alias, AliasChoices):
                    found = frozenset(c.upper() for c in alias.choices if isinstance(c, str))
                elif isinstance(alias, str):
                    found = frozenset({alias.upper()})
                else:
                    found = frozenset({(prefix + name).upper()})
                names[f"{cls.__name__}.{name}"] = found
        return names

    def required(self) -> tuple[frozenset[str], ...]:
        names = self.setting_names()
        no_default = tuple(
            names[f"{cls.__name__}.{n}"]
            for cls in self.settings_classes()
            for n, info in cls.model_fields.items()
            if info.is_required()
        )
        return no_default + self.deploy_required

    def reads(self) -> set[str]:
        found = set(self.third_party) | set(PYTHON)
        for names in self.setting_names().values():
            found |= names
        for package in self.packages:
            for path in (ROOT / package).rglob("*.py"):
                for match in _ENVIRON.finditer(path.read_text()):
                    found.add(match[1] or match[2])
        for script in self.scripts:
            found |= set(_SHELL.findall((ROOT / script).read_text()))
        return found


# Look-ups only: `os.environ["X"] = ...` sets a variable for a child process, it does not read one.
_ENVIRON = re.compile(
    r"""os\.(?:environ\.get\(|getenv\()\s*["']([A-Z][A-Z0-9_]*)["']"""
    r"""|os\.environ\[\s*["']([A-Z][A-Z0-9_]*)["']\s*\](?!\s*=[^=])"""
)
_SHELL = re.compile(r"\$\{([A-Z][A-Z0-9_]*)")

SHARED = "shared/crucible_shared"
# Where a job may read files (crucible_shared.paths): read by the gateway and the trainer alike.
PATH_ROOTS = "crucible_shared.paths:PathRoots"
ROOT_VARIABLES = ("CRUCIBLE_DATA_ROOTS", "CRUCIBLE_MODEL_ROOTS", "CRUCIBLE_ADAPTER_ROOTS")
# Their defaults (the working directory) suit a checkout, not a container.
ROOTS_REQUIRED = tuple(frozenset({name}) for name in ROOT_VARIABLES)

READERS = {
    "gateway": Reader(
        "gateway",
        settings=("crucible_gateway.settings:Settings", PATH_ROOTS),
        packages=("services/gateway/crucible_gateway", SHARED),
        deploy_required=(
            *ROOTS_REQUIRED,
            frozenset({"CRUCIBLE_GATEWAY_HOST"}),
            frozenset({"CRUCIBLE_GATEWAY_REDIS_URL", "REDIS_URL"}),
            frozenset({"CRUCIBLE_GATEWAY_API_KEYS"}),
            frozenset({"CRUCIBLE_GATEWAY_RUNS_DIR"}),
            frozenset({"CRUCIBLE_GATEWAY_ADAPTER_DIR"}),
        ),
    ),
    "sandbox": Reader(
        "sandbox",
        settings=("crucible_sandbox.server.settings:Settings",),
        packages=("services/sandbox/crucible_sandbox", SHARED),
        deploy_required=(frozenset({"CRUCIBLE_SANDBOX_HOST"}), frozenset({"CRUCIBLE_SANDBOX_API_KEYS"})),
    ),
    "generator": Reader(
        "generator",
        settings=("crucible_generator.settings:Settings",),
        packages=("services/generator/crucible_generator", SHARED),
        third_party=MODEL_RUNTIME,
        deploy_required=(
            frozenset({"CRUCIBLE_GENERATOR_HOST"}),
            frozenset({"CRUCIBLE_CACHE_DIR"}),
            frozenset({"CRUCIBLE_GENERATOR_ADAPTER_ROOTS"}),
        ),
    ),
    "generator-vllm": Reader(
        "generator-vllm",
        scripts=("services/generator/vllm/serve.sh",),
        third_party=VLLM_RUNTIME,
        deploy_required=(frozenset({"GENERATOR_MODEL"}), frozenset({"HF_HOME"})),
    ),
    "trainer": Reader(
        "trainer",
        settings=("crucible_trainer.settings:Settings", PATH_ROOTS),
        packages=("services/trainer/crucible_trainer", SHARED),
        third_party={**MODEL_RUNTIME, "WANDB_API_KEY": "wandb: logging in when a job turns W&B on"},
        deploy_required=(
            *ROOTS_REQUIRED,
            frozenset({"CRUCIBLE_TRAINER_REDIS_URL", "REDIS_URL"}),
            frozenset({"CRUCIBLE_TRAINER_GENERATOR_URLS"}),
            frozenset({"CRUCIBLE_TRAINER_SANDBOX_URL"}),
            frozenset({"CRUCIBLE_TRAINER_SANDBOX_API_KEY"}),
            frozenset({"CRUCIBLE_TRAINER_ADAPTER_DIR"}),
            frozenset({"CRUCIBLE_TRAINER_RUNS_DIR"}),
            frozenset({"CRUCIBLE_CACHE_DIR"}),
            frozenset({"CRUCIBLE_DATA_DIR"}),
        ),
    ),
}

# Image name (without tag) -> (Dockerfile, reader). Compose and k8s use the same names.
IMAGES = {
    "crucible/gateway": ("services/gateway/Dockerfile", "gateway"),
    "crucible/sandbox": ("services/sandbox/Dockerfile", "sandbox"),
    "crucible/generator": ("services/generator/Dockerfile", "generator"),
    "crucible/generator-vllm": ("services/generator/vllm/Dockerfile", "generator-vllm"),
    "crucible/trainer": ("services/trainer/Dockerfile", "trainer"),
    "crucible/trainer-cpu": ("services/trainer/Dockerfile", "trainer"),
}
