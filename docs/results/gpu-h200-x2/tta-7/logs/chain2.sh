#!/bin/bash
# After card 1's runs of chain.sh (its subshell's pid in $1): the built-in model's dense copy and the
# update benchmark, which chain.sh had started without gpu.sh's environment (so they failed at import).
cd /root/src
export PYTHONPATH=/tmp/site:/tmp/crucible-pkgs:/root/src CRUCIBLE_CACHE_DIR=/root/cache WANDB_MODE=disabled
export PYTHONUNBUFFERED=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True CUDA_VISIBLE_DEVICES=1
R=/root/results
while kill -0 "$1" 2>/dev/null; do sleep 5; done
python3 -c 'import pathlib, crucible_models as m; target = m.dense_dir(m.DEFAULT_MODEL)
target.mkdir(parents=True, exist_ok=True); m._convert_gguf(pathlib.Path("/root/m/smol.gguf"), target)
print("dense checkpoint:", target)'
upd() {
  python3 bench/update_speed.py --compare lora --prompts 64 --group 8 --min-tokens 256 \
    --max-tokens 256 --repeats 2 --out "$R/$1.json" "${@:2}" 2>&1 | grep -vE "it/s]|^\s*warnings.warn" > "$R/$1.log"
}
upd update-lora-135m --model smollm2-135m-instruct --micro-batch 128
upd update-lora-1p5b --model qwen2.5-coder-1.5b-instruct --micro-batch 32
echo chain2-done
