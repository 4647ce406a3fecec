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
from bench.common import argument_parser, random_adapter


def record(response: httpx.Response) -> dict:
    try:
        body = response.json()
    except ValueError:
        return {"status": response.status_code, "content_type": "text/plain", "body": response.text}
    return {"status": response.status_code, "body": body}


def main() -> None:
    parser = argument_parser(__doc__)
    parser.add_argument("--url", required=True)
    parser.add_argument("--model", required=True, help="the served base model name")
    parser.add_argument("--model-dir", required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp())
    adapter = random_adapter(args.model_dir, root / "v10")
    bodies: dict[str, httpx.Response] = {}
    # A fresh connection per request: vLLM 0.22 resets the connection after an unhandled error.
    with httpx.Client(base_url=args.url, timeout=120, headers={"Connection": "close"}) as http:
        bodies["completion_n2_logprobs_token_ids"] = http.post(
            "/v1/completions",
            json={"model": args.model, "prompt": "def add(a, b):", "n": 2, "max_tokens": 32, "seed": 7,
                  "logprobs": 0, "return_token_ids": True},
        )  # fmt: skip
        bodies["chat_completion_logprobs_token_ids"] = http.post(
            "/v1/chat/completions",
            json={"model": args.model, "messages": [{"role": "user", "content": "Write add(a, b) in Python."}],
                  "max_tokens": 24, "temperature": 0, "logprobs": True, "top_logprobs": 2, "return_token_ids": True},
        )  # fmt: skip
        load = {"lora_name": "job42-v10", "lora_path": adapter}
        bodies["load_lora_adapter_ok"] = http.post("/v1/load_lora_adapter", json=load)
        bodies["error_lora_already_loaded"] = http.post("/v1/load_lora_adapter", json=load)
        bodies["models_with_lora"] = http.get("/v1/models")
        bodies["error_lora_path_not_found"] = http.post(
            "/v1/load_lora_adapter", json={"lora_name": "job42-v11", "lora_path": str(root / "missing")}
        )
        bodies["error_model_not_found"] = http.post(
            "/v1/completions", json={"model": "job42-v9", "prompt": "x", "max_tokens": 4}
        )
        bodies["error_validation"] = http.post(
            "/v1/completions", json={"model": args.model, "prompt": "x", "max_tokens": "many"}
        )
        bodies["error_bad_sampling_param"] = http.post(
            "/v1/completions", json={"model": args.model, "prompt": "x", "max_tokens": 4, "temperature": -1}
        )
        bodies["unload_lora_adapter_ok"] = http.post(
            "/v1/unload_lora_adapter", json={"lora_name": "job42-v10"}
        )
        bodies["error_unload_not_found"] = http.post(
            "/v1/unload_lora_adapter", json={"lora_name": "job42-v10"}
        )
    for name, response in bodies.items():
        (args.out / f"{name}.json").write_text(json.dumps(record(response), indent=2) + "\n")
        print(name, response.status_code)


if __name__ == "__main__":
    main()
