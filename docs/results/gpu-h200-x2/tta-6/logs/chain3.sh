#!/bin/bash
cd /root/src
g() { bash bench/gpu.sh "$@"; }
run() { TTA_RECIPE=qwen-tta-all-s30 g tta-crucible "s30-s$1" "$2" - --set "seed=$1" --set "data.seed=$1"; }
(run 11 0; g tta-eval 0 s30-s11) &
(run 12 1; g tta-eval 1 s30-s12) &
wait
echo chain3-done
