#!/bin/bash
# This lease's chain (2 x H200), code at 64239ac: serving captures a prefill shape it has run eagerly
# 8 times at its next use (a247bbf), as it already did for decode windows.
# Card 0: qwen-tta-all-b16 seeds 16, 17, 18, 19, 20 (named before the lease), generator at 512 rows.
# Card 1: random-weight Qwen2.5-Coder-7B shape, the serving race beside vLLM 0.22 fitted to the adapter
# (issue 38 §1: the paged cache at 7B, rows at the model's full context); then seeds 21, 22 of Crucible.
# Each learning run alone on its card, evaluated after it.
cd /root/src
g() { bash bench/gpu.sh "$@"; }
c() { TTA_RECIPE=qwen-tta-all-b16 g tta-crucible "b16p-s$2" "$1" - --rows 512 --every 5 --set seed="$2" --set data.seed="$2"
      g tta-eval "$1" "b16p-s$2"; }
(for s in 16 17 18 19 20; do c 0 $s; done) &
(CUDA_VISIBLE_DEVICES=1 g seq shapes serve-sizes:qwen2.5-coder-7b
 for s in 21 22; do c 1 $s; done) &
wait
echo chain-done
