#!/usr/bin/env bash
# Real vLLM 0.22.0 (torch 2.11.0+cu130) on the GPU machine, carried in two parts of at most 64 MiB:
# without the FA2 kernels (Hopper runs FA3), the MoE kernels and the Rust frontend, one ~117 MB xz
# tarball. Here: `bash bench/gpu-vllm.sh prepare` (.carry/vllm/{s1,s2,site.sha256}); there, call 1
# carries s1: `stage .carry/vllm/s1`; call 2 carries s2 and site.sha256: `stage .carry/vllm/s2 &&
# install .carry/vllm/site.sha256`; then `bench/gpu.sh part-a`, `setup`, `vllm-up` (`profile`
# below), `vllm-check`. The server outlives its call. Environment: NAME (served name for `check`,
# default "base"), PORT (8001), GPU_UTIL (0.3), WAIT (health wait, s, 420).
set -euo pipefail
VLLM_VERSION=${VLLM_VERSION:-0.22.0}
# What vLLM's server imports that the GPU image lacks (from import failures under --no-deps);
# xgrammar 0.2.6 is the small build; openai stays on 2.x (3.x imports httpx2, which the machine lacks).
DEPS="fastapi==0.165.0 starlette==1.10.0 pydantic==2.14.4 pydantic_core==2.50.5 annotated_types==0.8.0
typing_inspection==0.4.5 typing_extensions==4.16.0 uvicorn==0.54.0 python-multipart==0.0.34
prometheus-fastapi-instrumentator==8.1.0 opentelemetry-api==1.45.2 openai==2.54.0 distro==1.9.0 jiter==0.19.0 sniffio==1.3.1
openai_harmony==0.0.8 cbor2==6.3.0 pyzmq==27.3.0 msgspec==0.22.0 pybase64==1.5.1 cachetools==8.0.2
blake3==1.0.11 setproctitle==1.3.8 gguf==0.19.0 llguidance==1.7.6 xgrammar==0.2.6 apache-tvm-ffi==0.1.10
watchfiles==1.3.0 partial-json-parser==0.2.1.1.post7 model-hosting-container-standards==0.1.16
jmespath==1.1.0 ijson==3.6.0 mistral_common==1.13.1 pydantic_extra_types==2.11.1 pycountry==26.2.16
jsonschema==4.26.0 referencing==0.37.0 rpds-py==2026.9.1 jsonschema-specifications==2025.9.1"
PLAT="--python-version 3.12 --implementation cp --only-binary=:all:"
for n in 39 35 34 31 28 27 26 24 17 5; do PLAT="$PLAT --platform manylinux_2_${n}_x86_64"; done
PLAT="$PLAT --platform manylinux2014_x86_64 --platform manylinux1_x86_64"

NAME=${NAME:-base} PORT=${PORT:-8001}
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1
# Otherwise vLLM imports flashinfer (~1 GB, not carried) for its sampler; off, it samples with PyTorch.
export VLLM_USE_FLASHINFER_SAMPLER=0
# The machine's NVLink-multicast guards; keep them in every process we start.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1

wait_healthy() {  # LOG T0: until /health answers, the server exits, or WAIT seconds pass
  for _ in $(seq 1 "${WAIT:-420}"); do
    if python3 -c "import urllib.request as u; u.urlopen('http://127.0.0.1:$PORT/health', timeout=2)" 2>/dev/null; then
      echo "vLLM healthy after $(( $(date +%s) - $2 )) s (pid $(cat /tmp/vllm.pid), log $1)"; return 0
    fi
    if ! kill -0 "$(cat /tmp/vllm.pid)" 2>/dev/null; then
      echo "vLLM exited during start-up:"; grep -E "Error|error|Traceback" "$1" | tail -20; tail -30 "$1"; return 1
    fi
    sleep 1
  done
  echo "vLLM not healthy after ${WAIT:-420} s"; tail -40 "$1"; return 1
}

case "${1:-}" in
prepare)  # here: wheels -> slim install tree -> xz tarball -> parts under .carry/vllm
  PY=${PY:-python3}
  mkdir -p .vllm-wheels .carry/vllm
  for p in /.carry/ /.whl/; do grep -qx "$p" .git/info/exclude 2>/dev/null || echo "$p" >> .git/info/exclude; done
  # shellcheck disable=SC2086
  "$PY" -m pip download -q --no-deps $PLAT -d .vllm-wheels "vllm==$VLLM_VERSION" $DEPS
  tree=$(mktemp -d)
  # shellcheck disable=SC2086
  "$PY" -m pip install -q --no-deps --no-compile --no-index --find-links .vllm-wheels --target "$tree" $PLAT \
    "vllm==$VLLM_VERSION" $DEPS
  rm -rf "$tree/bin" "$tree/vllm/vllm-rs" "$tree/vllm/_moe_C.abi3.so" \
         "$tree/vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so" \
         "$tree"/vllm/third_party/deep_gemm/_C.cpython-31[0134]-*.so
  tar -C "$tree" -cf - . | xz -6 -T2 > .carry/vllm/site.tar.xz
  rm -rf "$tree"
  sha256sum .carry/vllm/site.tar.xz | cut -d' ' -f1 > .carry/vllm/site.sha256
  size=$(stat -c %s .carry/vllm/site.tar.xz); half=$(( (size + 1) / 2 ))
  head -c "$half" .carry/vllm/site.tar.xz > .carry/vllm/s1
  tail -c +"$((half + 1))" .carry/vllm/site.tar.xz > .carry/vllm/s2
  rm .carry/vllm/site.tar.xz
  ls -la .carry/vllm; echo "each part must stay under ~60 MiB (64 MiB per call, the tree included)" ;;

stage)  # device: keep a carried file in /root/stage (optionally under another name) for a later call
  mkdir -p /root/stage
  cp "$2" "/root/stage/${3:-$(basename "$2")}"
  ls -la /root/stage ;;

install)  # device: reassemble and unpack into /tmp/site, then a quick import check
  sha=$(cat "${2:-.carry/vllm/site.sha256}")
  cat /root/stage/s1 /root/stage/s2 > /root/stage/site.tar.xz
  echo "$sha  /root/stage/site.tar.xz" | sha256sum -c
  mkdir -p /tmp/site
  python3 -c "import tarfile; tarfile.open('/root/stage/site.tar.xz', 'r:xz').extractall('/tmp/site', filter='tar')"
  python3 - <<'PY'
import importlib.metadata as md, time
t = time.perf_counter()
import torch, vllm, vllm._C, vllm._C_stable_libtorch  # noqa: F401
from vllm.vllm_flash_attn import flash_attn_interface as fa
import vllm.entrypoints.openai.api_server  # noqa: F401
print("vllm", vllm.__version__, "torch", torch.__version__, "transformers", md.version("transformers"),
      "triton", md.version("triton"), "| FA3:", fa.FA3_AVAILABLE, fa.FA3_UNAVAILABLE_REASON or "",
      f"| import {time.perf_counter() - t:.1f} s")
PY
  ;;

profile)  # device: Crucible's own launch profile (services/generator/vllm/serve.sh) on MODEL_DIR,
  # in its own session like `serve`; GPU_UTIL (default 0.3) leaves the card to a trainer beside it
  model=$2; shift 2
  mkdir -p /tmp/vllm-bin /root/logs
  printf '#!/bin/sh\nexec python3 -m vllm.entrypoints.cli.main "$@"\n' > /tmp/vllm-bin/vllm  # the wheel's script is trimmed
  chmod +x /tmp/vllm-bin/vllm
  export PATH=/tmp/vllm-bin:$PATH GENERATOR_MODEL=$model GENERATOR_PORT=$PORT
  export GENERATOR_GPU_MEMORY_UTILIZATION=${GPU_UTIL:-0.3}
  t0=$(date +%s)
  setsid bash services/generator/vllm/serve.sh "$@" > /root/logs/vllm.log 2>&1 < /dev/null &
  echo $! > /tmp/vllm.pid
  wait_healthy /root/logs/vllm.log "$t0" ;;

stop)
  [ -f /tmp/vllm.pid ] && kill -- -"$(cat /tmp/vllm.pid)" 2>/dev/null || true ;;

check)  # device: the hot-swap contract the trainer relies on, against the running server
  python3 - "$2" <<'PY'
import concurrent.futures as cf, json, os, sys, time, urllib.error, urllib.request
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, AutoTokenizer

model_dir = sys.argv[1]
url = f"http://127.0.0.1:{os.environ.get('PORT', '8001')}"
base = os.environ.get("NAME", "base")
out = {}

def call(method, path, body=None):
    req = urllib.request.Request(url + path, method=method, data=None if body is None else json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    t = time.perf_counter()
    try:
        with urllib.request.urlopen(req, timeout=300) as r:
            code, text = r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        code, text = e.code, e.read().decode()
    return code, text, round(time.perf_counter() - t, 4)

def complete(model, prompt, **kw):
    body = {"model": model, "prompt": prompt, "max_tokens": 24, "temperature": 0, "return_token_ids": True, **kw}
    code, text, dt = call("POST", "/v1/completions", body)
    if code != 200:
        return {"status": code, "error": text[:300], "s": dt}
    c = json.loads(text)["choices"][0]
    r = {"status": code, "s": dt, "text": c["text"], "token_ids": c.get("token_ids")}
    if c.get("logprobs"):
        lp = c["logprobs"]
        r["token_logprobs"] = [round(x, 4) for x in lp["token_logprobs"]]
        r["top_logprobs_first"] = lp.get("top_logprobs", [None])[0]
    return r

prompt = "def fibonacci(n):\n"
out["models"] = [m["id"] for m in json.loads(call("GET", "/v1/models")[1])["data"]]
out["base"] = complete(base, prompt)

# Random rank-16 all-linear LoRA adapters (B random too, so they change the output).
tok = AutoTokenizer.from_pretrained(model_dir)
hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).cuda().eval()
paths = {}
for i in (1, 2, 3):
    torch.manual_seed(i)
    peft_model = get_peft_model(hf, LoraConfig(r=16, lora_alpha=32, target_modules="all-linear",
                                               init_lora_weights=False), adapter_name=f"a{i}")
    with torch.no_grad():  # default init leaves B random too; shrink it to a modest change
        for n, w in peft_model.named_parameters():
            if "lora_B" in n:
                w.mul_(0.3)
    p = f"/tmp/lora/a{i}"
    peft_model.save_pretrained(p, selected_adapters=[f"a{i}"])
    # peft writes a non-default adapter under a subfolder named after it
    paths[f"a{i}"] = p + f"/a{i}" if os.path.isdir(p + f"/a{i}") else p
    hf = peft_model.unload()  # back to the plain model for the next adapter
out["adapter_files"] = sorted(os.listdir(paths["a1"]))

def hf_logprobs(model, gen_ids):
    """Teacher-forced logprobs of vLLM's greedy tokens under the HF model (parity check)."""
    ids = tok(prompt).input_ids
    x = torch.tensor([ids + gen_ids], device="cuda")
    with torch.no_grad():
        lp = torch.log_softmax(model(x).logits[0].float(), -1)
    return [lp[len(ids) - 1 + k, t].item() for k, t in enumerate(gen_ids)]

def parity(vllm_result, model):
    ids, lps = vllm_result.get("token_ids") or [], vllm_result.get("token_logprobs") or []
    if not ids or len(ids) != len(lps):
        return None
    return round(max(abs(a - b) for a, b in zip(hf_logprobs(model, ids), lps)), 4)

code, text, dt = call("POST", "/v1/load_lora_adapter", {"lora_name": "a1", "lora_path": paths["a1"]})
out["load_a1"] = {"status": code, "s": dt, "body": text[:200]}
out["a1_first"] = complete("a1", prompt)
out["a1_second"] = complete("a1", prompt)
out["a1_differs_from_base"] = out["a1_second"].get("text") != out["base"].get("text")
base_lp = complete(base, prompt, logprobs=0)
a1_lp = complete("a1", prompt, logprobs=0)
out["base_max_abs_logprob_diff_vllm_vs_hf"] = parity(base_lp, hf)
from peft import PeftModel
hf_a1 = PeftModel.from_pretrained(hf, paths["a1"]).eval()
out["a1_max_abs_logprob_diff_vllm_vs_hf_peft"] = parity(a1_lp, hf_a1)
with hf_a1.disable_adapter():  # the same tokens scored without the adapter: should differ clearly
    out["a1_max_abs_logprob_diff_vllm_a1_vs_hf_base"] = parity(a1_lp, hf_a1)

code, text, dt = call("POST", "/v1/load_lora_adapter", {"lora_name": "a2", "lora_path": paths["a2"]})
out["load_a2"] = {"status": code, "s": dt}
with cf.ThreadPoolExecutor(8) as ex:  # base + two adapters in one batch, several times
    futs = [ex.submit(complete, m, prompt) for m in ("a1", "a2", base) * 4]
    res = [f.result() for f in futs]
out["mixed_batch_ok"] = all(r["status"] == 200 for r in res)
out["mixed_batch_consistent"] = all(res[k].get("text") == res[k % 3].get("text") for k in range(len(res)))
code, text, dt = call("POST", "/v1/load_lora_adapter", {"lora_name": "a3", "lora_path": paths["a3"]})
out["load_a3_beyond_max_loras"] = {"status": code, "s": dt}
out["a3"] = {k: v for k, v in complete("a3", prompt).items() if k in ("status", "s")}
out["a1_after_a3"] = complete("a1", prompt).get("text") == out["a1_second"].get("text")
out["logprobs"] = complete(base, prompt, max_tokens=4, logprobs=5)
out["logprobs0_adapter"] = complete("a1", prompt, max_tokens=4, logprobs=0)
code, text, dt = call("POST", "/v1/unload_lora_adapter", {"lora_name": "a1"})
out["unload_a1"] = {"status": code, "s": dt, "body": text[:200]}
out["a1_after_unload"] = {k: v for k, v in complete("a1", prompt).items() if k in ("status", "error")}
code, text, dt = call("POST", "/v1/load_lora_adapter", {"lora_name": "a1v2", "lora_path": paths["a1"]})
out["reload_as_new_name"] = {"status": code, "s": dt}
out["models_after"] = [m["id"] for m in json.loads(call("GET", "/v1/models")[1])["data"]]
print(json.dumps(out, indent=1))
open(os.path.join(os.environ.get("OUT") or "/tmp", "check.json"), "w").write(json.dumps(out, indent=1))
PY
  ;;

*)
  sed -n '2,/^set -euo/p' "$0" | sed '$d'; exit 2 ;;
esac
