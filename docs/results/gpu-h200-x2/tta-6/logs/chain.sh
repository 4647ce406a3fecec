#!/bin/bash
# This lease's chain (2 x H200): qwen-tta-all-s30 on unseen seeds 6-8 (card 0), TRL 1.16 on qwen-tta-all
# seeds 0 and 1 (card 1), then TRL seed 2 on card 0. Each run alone on its card, evaluated after it.
cd /root/src
T=/root/results/tta; g() { bash bench/gpu.sh "$@"; }
run() { TTA_RECIPE=qwen-tta-all-s30 g tta-crucible "s30-s$1" 0 - --set "seed=$1" --set "data.seed=$1"; }
trl() { TTA_RECIPE=qwen-tta-all CUDA_VISIBLE_DEVICES=$2 g tta-trl --out "$T/trl-all-s$1" --set "seed=$1" --set "data.seed=$1"; }
(run 6; g tta-eval 0 s30-s6; run 7; g tta-eval 0 s30-s7; run 8; g tta-eval 0 s30-s8; trl 2 0; g tta-eval 0 trl-all-s2) &
(trl 0 1; g tta-eval 1 trl-all-s0; trl 1 1; g tta-eval 1 trl-all-s1) &
wait
echo chain-done
