#!/bin/bash
# This lease's chain (2 x H200). Card 0: qwen-tta-all-b16 over seeds 0-2, then qwen-tta-all-len seed 2.
# Card 1: the built-in model's dense copy, the fused-LoRA GPU tests and the update benchmark
# (PEFT's LoRA layers against rl/fused.lora_forward, 135M and the real 1.5B), then qwen-tta-all-len
# seeds 0-1. Each run alone on its card, evaluated after it.
cd /root/src
R=/root/results; g() { bash bench/gpu.sh "$@"; }
run() { TTA_RECIPE=$1 g tta-crucible "$2-s$3" "$4" - --set "seed=$3" --set "data.seed=$3"; g tta-eval "$4" "$2-s$3"; }
upd() {
  CUDA_VISIBLE_DEVICES=1 python3 bench/update_speed.py --compare lora --prompts 64 --group 8 --min-tokens 256 \
    --max-tokens 256 --repeats 2 --out "$R/$1.json" "${@:2}" 2>&1 | grep -vE "it/s]|^\s*warnings.warn" > "$R/$1.log"
}
mkdir -p $R
(run qwen-tta-all-b16 b16 0 0; run qwen-tta-all-b16 b16 1 0; run qwen-tta-all-b16 b16 2 0; run qwen-tta-all-len len 2 0) &
(python3 -c 'import pathlib, crucible_models as m; target = m.dense_dir(m.DEFAULT_MODEL)
target.mkdir(parents=True, exist_ok=True); m._convert_gguf(pathlib.Path("/root/m/smol.gguf"), target)
print("dense checkpoint:", target)'
 CUDA_VISIBLE_DEVICES=1 g gpu-tests tests/unit/test_fused_gpu.py > $R/fused-gpu-tests.log 2>&1
 upd update-lora-135m --model smollm2-135m-instruct --micro-batch 128
 upd update-lora-1p5b --model qwen2.5-coder-1.5b-instruct --micro-batch 32
 run qwen-tta-all-len len 0 1; run qwen-tta-all-len len 1 1) &
wait
echo chain-done
