#!/bin/bash
# This lease's chain (2 x H200), every run saving its adapter every 5 steps. Card 0: qwen-tta-all-b16-len
# on seeds 0-2 (named before the lease), then qwen-tta-all-b16 on seeds 3-4. Card 1: TRL 1.16 on
# qwen-tta-all-b16 seeds 0-2 (issue 34 §4). Then qwen-tta-all-b16 seed 0 as DDP over both cards (§5).
# Each run alone on its card, evaluated after it.
cd /root/src
T=/root/results/tta; g() { bash bench/gpu.sh "$@"; }
run() { TTA_RECIPE=$1 g tta-crucible "$2-s$3" "$4" - --every 5 --set "seed=$3" --set "data.seed=$3"; g tta-eval "$4" "$2-s$3"; }
trl() { TTA_RECIPE=qwen-tta-all-b16 CUDA_VISIBLE_DEVICES=1 g tta-trl --out "$T/trl-b16-s$1" --every 5 --set "seed=$1" --set "data.seed=$1"
        g tta-eval 1 "trl-b16-s$1"; }
(run qwen-tta-all-b16-len b16len 0 0; run qwen-tta-all-b16-len b16len 1 0; run qwen-tta-all-b16-len b16len 2 0
 run qwen-tta-all-b16 b16 3 0; run qwen-tta-all-b16 b16 4 0) &
(trl 0; trl 1; trl 2) &
wait
TTA_RECIPE=qwen-tta-all-b16 g tta-crucible ddp-b16-s0 0,1 0,1 --every 5 --set seed=0 --set data.seed=0
g tta-eval 0 ddp-b16-s0
echo chain-done
