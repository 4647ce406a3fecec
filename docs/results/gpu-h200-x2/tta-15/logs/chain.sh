#!/bin/bash
# Lease G's chain (2 x H200): gradient checkpointing per micro-batch in the recipe that met issue 34 §3
# (qwen-tta-all-b24-v). Card 0: the memory estimate's GPU test, then Crucible seeds 0, 1, 2. Card 1: TRL
# 1.16 + vLLM 0.22 colocate, seed 0 (this session's anchor), then Crucible seed 0 with checkpointing
# forced on (the behaviour before: the paired figure), then Crucible seed 3. Each run alone on its
# card, evaluated after it (MBPP test at steps 5, 10, 15, 20; HumanEval at 20). Seeds named before the lease.
cd /root/src
T=/root/results/tta; R=qwen-tta-all-b24-v; g() { bash bench/gpu.sh "$@"; }
t() { TTA_RECIPE=$R CUDA_VISIBLE_DEVICES=$1 g tta-trl --out "$T/trl-b24g-s$2" --every 5 --set seed="$2" --set data.seed="$2"
      g tta-eval "$1" "trl-b24g-s$2"; }
c() { local card=$1 seed=$2 label=b24g-s$2$3; shift 3
      TTA_RECIPE=$R g tta-crucible "$label" "$card" - --rows 512 --every 5 --set seed="$seed" --set data.seed="$seed" "$@" \
        && g tta-eval "$card" "$label"; }
(CUDA_VISIBLE_DEVICES=0 g gpu-tests -s --noconftest tests/integration/test_update_memory_gpu.py > /root/results/memory-test.log 2>&1
 c 0 0 ""; c 0 1 ""; c 0 2 "") &
(t 1 0; c 1 0 -ckpt --set model.gradient_checkpointing=true; c 1 3 "") &
wait
echo chain-done
