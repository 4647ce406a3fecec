#!/bin/bash
# This lease's chain (2 x H200), code with the generator's serving-path graph capture (a decode window
# stepped eagerly 8 times is captured at its next step) besides idle-time capture.
# Card 0: qwen-tta-all-b16 seeds 8, 9, 10, 11 (named before the lease), generator at 512 rows.
# Card 1: TRL 1.16 on qwen-tta-all-b16 seed 5, this lease's baseline (§4); then seeds 12, 13 of Crucible.
# Each run alone on its card, evaluated after it.
cd /root/src
T=/root/results/tta; g() { bash bench/gpu.sh "$@"; }
c() { TTA_RECIPE=qwen-tta-all-b16 g tta-crucible "b16c-s$2" "$1" - --rows 512 --every 5 --set seed="$2" --set data.seed="$2"
      g tta-eval "$1" "b16c-s$2"; }
(for s in 8 9 10 11; do c 0 $s; done) &
(TTA_RECIPE=qwen-tta-all-b16 CUDA_VISIBLE_DEVICES=1 g tta-trl --out "$T/trl-b16-s5" --every 5 --set seed=5 --set data.seed=5
 g tta-eval 1 trl-b16-s5
 for s in 12 13; do c 1 $s; done) &
wait
echo chain-done
# After chain-done, one more call of the same lease ran seeds 14 (card 0) and 15 (card 1) at once, the
# same command `c` above, each alone on its card (logs/extra-s14-s15.log.gz).
