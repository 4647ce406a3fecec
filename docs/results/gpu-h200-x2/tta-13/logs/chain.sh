#!/bin/bash
# This lease's chain (2 x H200): two recipes on more distinct problems (MBPP train + validation,
# ids 511-974), one per card, seeds 0, 1, 2, ... until the lease ends; each run alone on its card,
# generator at 512 rows, evaluated (MBPP test at steps 10 and 20, HumanEval at 20) after it.
# Card 0: qwen-tta-all-b16-v. Card 1: qwen-tta-all-b24-v.
cd /root/src
g() { bash bench/gpu.sh "$@"; }
c() { TTA_RECIPE=$3 g tta-crucible "$4-s$2" "$1" - --rows 512 --every 10 --set seed="$2" --set data.seed="$2"
      g tta-eval "$1" "$4-s$2"; }
(for s in 0 1 2 3 4 5 6; do c 0 $s qwen-tta-all-b16-v b16v; done) &
(for s in 0 1 2 3 4 5 6; do c 1 $s qwen-tta-all-b24-v b24v; done) &
wait
echo chain-done
