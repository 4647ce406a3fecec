#!/bin/bash
# After chain.sh's card 0 and chain2.sh's card 1 runs: qwen-tta-all-len on unseen seeds 3 (card 0) and 4
# (card 1); then its seed 0 over both cards as DDP ranks with a generator replica each (issue 34 §5).
cd /root/src
g() { bash bench/gpu.sh "$@"; }
run() { TTA_RECIPE=qwen-tta-all-len g tta-crucible "len-s$1" "$2" - --set "seed=$1" --set "data.seed=$1"; g tta-eval "$2" "len-s$1"; }
after() { while kill -0 "$(cat "/root/bg/$1.pid")" 2>/dev/null; do sleep 5; done; }
(after chain; run 3 0) &
(after chain2; run 4 1) &
wait
TTA_RECIPE=qwen-tta-all-len g tta-crucible ddp-len-s0 0,1 0,1 --set seed=0 --set data.seed=0
g tta-eval 0 ddp-len-s0
echo chain3-done
