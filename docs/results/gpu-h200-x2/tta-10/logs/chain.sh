#!/bin/bash
# This lease's chain (2 x H200), code with the generator's idle-time graph capture and standby DDP ranks;
# every run saves its adapter every 5 steps and logs its generators' counters (generator.jsonl).
# Card 0: qwen-tta-all-b16 seed 7 (named before the lease), generator at 512 rows. Card 1: TRL 1.16 on
# qwen-tta-all-b16 seed 4, this lease's baseline (§4). Then qwen-tta-all-b16 seed 0 as DDP over both
# cards with standby ranks (§5). Each run alone on its card(s), evaluated after it.
cd /root/src
T=/root/results/tta; g() { bash bench/gpu.sh "$@"; }
(TTA_RECIPE=qwen-tta-all-b16 g tta-crucible b16i-s7 0 - --rows 512 --every 5 --set seed=7 --set data.seed=7
 g tta-eval 0 b16i-s7) &
(TTA_RECIPE=qwen-tta-all-b16 CUDA_VISIBLE_DEVICES=1 g tta-trl --out "$T/trl-b16-s4" --every 5 --set seed=4 --set data.seed=4
 g tta-eval 1 trl-b16-s4) &
wait
TTA_RECIPE=qwen-tta-all-b16 g tta-crucible ddpsb-b16-s0 0,1 0,1 --rows 512 --every 5 --set seed=0 --set data.seed=0
g tta-eval 0 ddpsb-b16-s0
echo chain-done
