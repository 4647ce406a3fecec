#!/bin/bash
# This lease's chain (2 x H200): issue 34 §4 on the recipe that met §3, qwen-tta-all-b24-v.
# Card 0: TRL 1.16 + vLLM 0.22 colocate on it, seeds 0 then 2. Card 1: TRL seed 1, then Crucible
# (with optim.early_update, auto: on) seeds 0, 1, 2, 3 until the lease ends (a run that fails falls
# back to early_update=false, labelled -plain). Every run alone on its card, evaluated after it
# (MBPP test at steps 5, 10, 15, 20; HumanEval at 20). Seeds named before the lease.
cd /root/src
T=/root/results/tta; R=qwen-tta-all-b24-v; g() { bash bench/gpu.sh "$@"; }
t() { TTA_RECIPE=$R CUDA_VISIBLE_DEVICES=$1 g tta-trl --out "$T/trl-b24v-s$2" --every 5 --set seed="$2" --set data.seed="$2"
      g tta-eval "$1" "trl-b24v-s$2"; }
c() { if TTA_RECIPE=$R g tta-crucible "b24e-s$2" "$1" - --rows 512 --every 5 --set seed="$2" --set data.seed="$2"; then
        g tta-eval "$1" "b24e-s$2"
      else
        TTA_RECIPE=$R g tta-crucible "b24e-s$2-plain" "$1" - --rows 512 --every 5 --set seed="$2" --set data.seed="$2" \
          --set optim.early_update=false
        g tta-eval "$1" "b24e-s$2-plain"
      fi; }
(t 0 0; t 0 2; c 0 4) &
(t 1 1; for s in 0 1 2 3; do c 1 $s; done) &
wait
echo chain-done
