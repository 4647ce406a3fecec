#!/bin/bash
# This lease's chain (2 x H200): qwen-tta-len over seeds 0-2 on card 0, TRL's seed 0 of it and seed 3 on
# card 1, then the split placement with overlap on both cards (seed 0).
cd /root/src
export TTA_RECIPE=qwen-tta-len
T=/root/results/tta; g() { bash bench/gpu.sh "$@"; }
run() { g tta-crucible "len-s$1" "$2" - --set "seed=$1" --set "data.seed=$1"; }
(run 0 0; g tta-eval 0 len-s0; run 1 0; g tta-eval 0 len-s1; run 2 0; g tta-eval 0 len-s2) &
(CUDA_VISIBLE_DEVICES=1 g tta-trl --out $T/trl-len-s0 --set seed=0 --set data.seed=0; g tta-eval 1 trl-len-s0; \
 run 3 1; g tta-eval 1 len-s3) &
wait
g tta-crucible split-len-s0 0 1 --set overlap.max_staleness=1 --set seed=0 --set data.seed=0
g tta-eval 1 split-len-s0
echo chain-done
