#!/bin/bash
# This lease's chain (2 x H200), every run saving its adapter every 5 steps and logging its generator's
# counters each second (generator.jsonl). Card 0: qwen-tta-all-b16 on seeds 5-7 (named before the lease)
# with the generator at 512 rows, then seed 5 again at the harness's former 256 rows (the pre-filter's
# A/B on one seed). Card 1: TRL 1.16 on qwen-tta-all-b16, seeds 3-5, the same lease's baseline (§4).
# Each run alone on its card, evaluated after it.
cd /root/src
T=/root/results/tta; g() { bash bench/gpu.sh "$@"; }
run() { TTA_RECIPE=qwen-tta-all-b16 g tta-crucible "$1-s$2" 0 - --rows "$3" --every 5 --set "seed=$2" --set "data.seed=$2"
        g tta-eval 0 "$1-s$2"; }
trl() { TTA_RECIPE=qwen-tta-all-b16 CUDA_VISIBLE_DEVICES=1 g tta-trl --out "$T/trl-b16-s$1" --every 5 --set "seed=$1" --set "data.seed=$1"
        g tta-eval 1 "trl-b16-s$1"; }
(run b16r512 5 512; run b16r512 6 512; run b16r512 7 512; run b16r256 5 256) &
(trl 3; trl 4; trl 5) &
wait
echo chain-done
