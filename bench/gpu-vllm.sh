#!/usr/bin/env bash
# Real vLLM 0.22.0 (torch 2.11.0+cu130) on the GPU machine, without the FA2 kernels (Hopper runs FA3),
# the MoE kernels and the Rust frontend: one ~117 MB xz tarball in three parts (a call carries 64 MiB,
# the tree included). Here: `prepare` (.carry/vllm/{p0,p1,p2,site.sha256}); there, a call per part:
# `stage .carry/vllm/pN`, the last one then `install .carry/vllm/site.sha256`; then bench/gpu.sh's
# `part-a`, `setup`, `vllm-up` (`profile` below), `vllm-check`. The server outlives its call.
# Environment: NAME (served name for `check`, default "base"), PORT (8001), GPU_UTIL (0.3), WAIT (health wait, s, 420).
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
PLAT="--python-version 3.12 --implementation cp --only-binary=:all:"  # in pip's order of preference
for n in 39 35 34 31 28 27 26 24 17 5; do PLAT="$PLAT --platform manylinux_2_${n}_x86_64"; done
PLAT="$PLAT --platform manylinux2014_x86_64 --platform manylinux1_x86_64"
NAME=${NAME:-base} PORT=${PORT:-8001}
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1
# Otherwise vLLM imports flashinfer (~1 GB, not carried) for its sampler; off, it samples with PyTorch.
# The machine's NVLink-multicast guards: in every process we start.
export VLLM_USE_FLASHINFER_SAMPLER=0 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1

case "${1:-}" in
prepare)  # here: wheels -> slim install tree -> xz tarball -> parts under .carry/vllm (git-ignored)
  PY=${PY:-python3} tree=$(mktemp -d) v=.carry/vllm
  exclude=$(git rev-parse --git-path info/exclude); mkdir -p "$(dirname "$exclude")" .vllm-wheels $v
  for d in /.carry/ /.whl/ /.vllm-wheels/; do grep -qx "$d" "$exclude" 2>/dev/null || echo "$d" >> "$exclude"; done
  # shellcheck disable=SC2086  # PLAT and DEPS: a word each
  "$PY" -m pip download -q --no-deps $PLAT -d .vllm-wheels "vllm==$VLLM_VERSION" $DEPS
  # shellcheck disable=SC2086
  "$PY" -m pip install -q --no-deps --no-compile --no-index --find-links .vllm-wheels --target "$tree" $PLAT \
    "vllm==$VLLM_VERSION" $DEPS
  rm -rf "${tree:?}/bin" "$tree/vllm/vllm-rs" "$tree/vllm/_moe_C.abi3.so" "$tree/vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so" \
    "$tree"/vllm/third_party/deep_gemm/_C.cpython-31[0134]-*.so
  tar -C "$tree" -cf - . | xz -6 -T2 > $v/site.tar.xz; rm -rf "$tree" $v/p[0-9]
  sha256sum $v/site.tar.xz | cut -d' ' -f1 > $v/site.sha256
  split -n 3 -d -a 1 $v/site.tar.xz $v/p; rm $v/site.tar.xz
  ls -la $v ;;
stage)  # device: keep a carried part in /root/stage for a later call
  mkdir -p /root/stage && cp "$2" /root/stage/ && ls -la /root/stage ;;
install)  # device: the staged parts joined in name order (p0 p1 p2), checked, unpacked into /tmp/site
  cat /root/stage/p[0-9] > /root/stage/site.tar.xz
  echo "$(cat "${2:-.carry/vllm/site.sha256}")  /root/stage/site.tar.xz" | sha256sum -c
  mkdir -p /tmp/site
  python3 -c "import tarfile; tarfile.open('/root/stage/site.tar.xz', 'r:xz').extractall('/tmp/site', filter='tar')"
  python3 -c 'import importlib.metadata as md, time; t = time.perf_counter()
import torch, vllm, vllm._C, vllm._C_stable_libtorch
from vllm.vllm_flash_attn import flash_attn_interface as fa; import vllm.entrypoints.openai.api_server
print("vllm", vllm.__version__, "torch", torch.__version__, "transformers", md.version("transformers"),
      "triton", md.version("triton"), "| FA3:", fa.FA3_AVAILABLE, fa.FA3_UNAVAILABLE_REASON or "",
      f"| import {time.perf_counter() - t:.1f} s")' ;;
profile)  # device: Crucible's own launch profile (services/generator/vllm/serve.sh) on MODEL_DIR, in its own
  # session; GPU_UTIL (default 0.3) leaves the card to a trainer beside it
  model=$2; shift 2
  mkdir -p /tmp/vllm-bin /root/logs
  printf '#!/bin/sh\nexec python3 -m vllm.entrypoints.cli.main "$@"\n' > /tmp/vllm-bin/vllm  # the wheel's script is trimmed
  chmod +x /tmp/vllm-bin/vllm
  export PATH=/tmp/vllm-bin:$PATH GENERATOR_MODEL=$model GENERATOR_PORT=$PORT
  export GENERATOR_GPU_MEMORY_UTILIZATION=${GPU_UTIL:-0.3}
  t0=$(date +%s) log=/root/logs/vllm.log
  setsid bash services/generator/vllm/serve.sh "$@" > $log 2>&1 < /dev/null &
  echo $! > /tmp/vllm.pid
  for _ in $(seq 1 "${WAIT:-420}"); do  # until /health answers, the server exits, or WAIT seconds pass
    if python3 -c "import urllib.request as u; u.urlopen('http://127.0.0.1:$PORT/health', timeout=2)" 2>/dev/null; then
      echo "vLLM healthy after $(( $(date +%s) - t0 )) s (pid $(cat /tmp/vllm.pid), log $log)"; exit 0
    fi
    if ! kill -0 "$(cat /tmp/vllm.pid)" 2>/dev/null; then
      echo "vLLM exited during start-up:"; grep -E "Error|error|Traceback" $log | tail -20 || true; tail -30 $log; exit 1
    fi
    sleep 1
  done
  echo "vLLM not healthy after ${WAIT:-420} s"; tail -40 $log; exit 1 ;;
stop)  # device: the server `profile` started
  [ -f /tmp/vllm.pid ] && kill -- -"$(cat /tmp/vllm.pid)" 2>/dev/null || true ;;
check)  # device: MODEL_DIR: the hot-swap contract the trainer relies on, against the running server: check.json
  python3 - "$2" <<'PY'
import concurrent.futures as cf, json, os, sys, time
import httpx, torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM, AutoTokenizer

model_dir, base, prompt = sys.argv[1], os.environ.get("NAME", "base"), "def fibonacci(n):\n"
http = httpx.Client(base_url=f"http://127.0.0.1:{os.environ.get('PORT', '8001')}", timeout=300)

def call(method, path, body=None):
    t = time.perf_counter()
    r = http.request(method, path, json=body)
    return r.status_code, r.text, round(time.perf_counter() - t, 4)

def complete(model, **kw):
    code, text, dt = call("POST", "/v1/completions", {"model": model, "prompt": prompt, "max_tokens": 24,
                                                      "temperature": 0, "return_token_ids": True, **kw})
    if code != 200:
        return {"status": code, "error": text[:300], "s": dt}
    c = json.loads(text)["choices"][0]
    r = {"status": code, "s": dt, "text": c["text"], "token_ids": c.get("token_ids")}
    if lp := c.get("logprobs"):
        r["token_logprobs"] = [round(x, 4) for x in lp["token_logprobs"]]
        r["top_logprobs_first"] = lp.get("top_logprobs", [None])[0]
    return r

def adapter(op, **body):  # load or unload: status, seconds, the answer's start
    code, text, dt = call("POST", f"/v1/{op}_lora_adapter", body)
    return {"status": code, "s": dt, "body": text[:200]}

def models():
    return [m["id"] for m in json.loads(call("GET", "/v1/models")[1])["data"]]

def parity(result, model):  # max |logprob diff| of the server's greedy tokens, teacher-forced through `model`
    ids, lps = result.get("token_ids") or [], result.get("token_logprobs") or []
    if not ids or len(ids) != len(lps):
        return None
    start = tok(prompt).input_ids
    with torch.no_grad():
        lp = torch.log_softmax(model(torch.tensor([start + ids], device="cuda")).logits[0].float(), -1)
    return round(max(abs(lp[len(start) - 1 + k, t].item() - b) for k, (t, b) in enumerate(zip(ids, lps))), 4)

out = {"models": models(), "base": complete(base)}
tok = AutoTokenizer.from_pretrained(model_dir)
hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).cuda().eval()
paths = {}
for i in (1, 2, 3):  # random rank-16 all-linear adapters, B random too (scaled to a modest change)
    torch.manual_seed(i)
    config = LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", init_lora_weights=False)
    peft_model = get_peft_model(hf, config, adapter_name=f"a{i}")
    with torch.no_grad():
        for n, w in peft_model.named_parameters():
            if "lora_B" in n:
                w.mul_(0.3)
    p = f"/tmp/lora/a{i}"
    peft_model.save_pretrained(p, selected_adapters=[f"a{i}"])
    paths[f"a{i}"] = p + f"/a{i}" if os.path.isdir(p + f"/a{i}") else p  # peft's subfolder for a named adapter
    hf = peft_model.unload()
out["adapter_files"] = sorted(os.listdir(paths["a1"]))

out["load_a1"] = adapter("load", lora_name="a1", lora_path=paths["a1"])
out["a1_first"], out["a1_second"] = complete("a1"), complete("a1")
out["a1_differs_from_base"] = out["a1_second"].get("text") != out["base"].get("text")
base_lp, a1_lp = complete(base, logprobs=0), complete("a1", logprobs=0)
out["base_max_abs_logprob_diff_vllm_vs_hf"] = parity(base_lp, hf)
hf_a1 = PeftModel.from_pretrained(hf, paths["a1"]).eval()
out["a1_max_abs_logprob_diff_vllm_vs_hf_peft"] = parity(a1_lp, hf_a1)
with hf_a1.disable_adapter():  # the same tokens scored without the adapter: should differ clearly
    out["a1_max_abs_logprob_diff_vllm_a1_vs_hf_base"] = parity(a1_lp, hf_a1)
out["load_a2"] = adapter("load", lora_name="a2", lora_path=paths["a2"])
with cf.ThreadPoolExecutor(8) as ex:  # base + two adapters in one batch, several times
    res = list(ex.map(complete, ("a1", "a2", base) * 4))
out["mixed_batch_ok"] = all(r["status"] == 200 for r in res)
out["mixed_batch_consistent"] = all(res[k].get("text") == res[k % 3].get("text") for k in range(len(res)))
out["load_a3_beyond_max_loras"] = adapter("load", lora_name="a3", lora_path=paths["a3"])
out["a3"] = {k: v for k, v in complete("a3").items() if k in ("status", "s")}
out["a1_after_a3"] = complete("a1").get("text") == out["a1_second"].get("text")
out["logprobs"] = complete(base, max_tokens=4, logprobs=5)
out["logprobs0_adapter"] = complete("a1", max_tokens=4, logprobs=0)
out["unload_a1"] = adapter("unload", lora_name="a1")
out["a1_after_unload"] = {k: v for k, v in complete("a1").items() if k in ("status", "error")}
out["reload_as_new_name"] = adapter("load", lora_name="a1v2", lora_path=paths["a1"])
out["models_after"] = models()
print(json.dumps(out, indent=1))
open(os.path.join(os.environ.get("OUT") or "/tmp", "check.json"), "w").write(json.dumps(out, indent=1))
PY
  ;;
*)
  sed -n '2,/^set -euo/p' "$0" | sed '$d'; exit 2 ;;
esac
