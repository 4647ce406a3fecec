"""Record a running vLLM server's answers as the test fixtures in tests/fixtures/vllm.

Sends the requests each fixture stands for (completions with `n`, logprobs and token ids; chat with
top logprobs; LoRA load / list / unload; each error the client must parse) and writes one JSON file
per answer: `{"status": ..., "body": ...}`, or `"content_type": "text/plain"` for plain-text bodies.

    python bench/vllm_fixtures.py --url http://127.0.0.1:8101 --model smollm2-135m-instruct \\
        --model-dir /path/to/dense/model --out tests/fixtures/vllm
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench import common


def main() -> None:
    parser = common.argument_parser(__doc__)
    args = common.options(
        parser, url=str, model=(str, "the served base model name"), model_dir=str, out=Path
    ).parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp())
    load = {"lora_name": "job42-v10", "lora_path": common.random_adapter(args.model_dir, root / "v10")}
    sampled = {"model": args.model, "prompt": "def add(a, b):", "n": 2, "max_tokens": 32, "seed": 7}
    chat = {"model": args.model, "messages": [{"role": "user", "content": "Write add(a, b) in Python."}]}
    chat |= {"max_tokens": 24, "temperature": 0, "logprobs": True, "top_logprobs": 2}
    completion, ids = {"model": args.model, "prompt": "x", "max_tokens": 4}, {"return_token_ids": True}
    # Each fixture's request, in the order sent: (file name, path, body; None: a GET).
    requests = [
        ("completion_n2_logprobs_token_ids", "/v1/completions", sampled | {"logprobs": 0} | ids),
        ("chat_completion_logprobs_token_ids", "/v1/chat/completions", chat | ids),
        ("load_lora_adapter_ok", "/v1/load_lora_adapter", load),
        ("error_lora_already_loaded", "/v1/load_lora_adapter", load),
        ("models_with_lora", "/v1/models", None),
        ("error_lora_path_not_found", "/v1/load_lora_adapter",
         {"lora_name": "job42-v11", "lora_path": str(root / "missing")}),
        ("error_model_not_found", "/v1/completions", completion | {"model": "job42-v9"}),
        ("error_validation", "/v1/completions", completion | {"max_tokens": "many"}),
        ("error_bad_sampling_param", "/v1/completions", completion | {"temperature": -1}),
        ("unload_lora_adapter_ok", "/v1/unload_lora_adapter", {"lora_name": "job42-v10"}),
        ("error_unload_not_found", "/v1/unload_lora_adapter", {"lora_name": "job42-v10"}),
    ]  # fmt: skip
    # A fresh connection per request: vLLM 0.22 resets the connection after an unhandled error.
    with httpx.Client(base_url=args.url, timeout=120, headers={"Connection": "close"}) as http:
        for name, path, body in requests:
            response = http.get(path) if body is None else http.post(path, json=body)
            try:
                record = {"status": response.status_code, "body": response.json()}
            except ValueError:
                record = {"status": response.status_code, "content_type": "text/plain", "body": response.text}
            (args.out / f"{name}.json").write_text(json.dumps(record, indent=2) + "\n")
            print(name, response.status_code)


if __name__ == "__main__":
    main()
