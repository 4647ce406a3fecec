#!/bin/bash
# Second chain: qwen-tta-all over seeds 0-3, two runs at a time, one per card, each alone on its card.
cd /root/src
export TTA_RECIPE=qwen-tta-all
g() { bash bench/gpu.sh "$@"; }
run() { g tta-crucible "all-s$1" "$2" - --set "seed=$1" --set "data.seed=$1"; }
(run 0 0; g tta-eval 0 all-s0; run 2 0; g tta-eval 0 all-s2) &
(run 1 1; g tta-eval 1 all-s1; run 3 1; g tta-eval 1 all-s3) &
wait
echo chain2-done
