#!/bin/bash
# One H200 (nvidia-h200): the chunked head (rl/head.py) measured. 1) the GPU tests of the update's memory
# estimate, checkpointing switch and chunked head; 2) the update alone at a real batch's lengths, full
# logits against the chunked head, micro-batches of 32 and 64 (bench/update_speed.py on the installed Qwen);
# 3) qwen-tta-all-b24-v end to end, seeds 0 and 1, each alone on the card in turn: the code before
# (ffac2a9, /root/old), this code, and this code with micro-batches of 64; then each run's step 20
# evaluated (MBPP test, HumanEval).
R=qwen-tta-all-b24-v
cd /root/src
bash bench/gpu.sh gpu-tests -s --noconftest tests/integration/test_update_memory_gpu.py > /root/results/memory-test.log 2>&1
OUT=/root/results bash bench/gpu.sh update-head 32 64 > /root/results/update-head.log 2>&1
run() { (cd "$1" && TTA_RECIPE=$R bash bench/gpu.sh tta-crucible "$2" 0 - --rows 512 --every 20 \
          --set seed="$3" --set data.seed="$3" "${@:4}") || echo "$2 failed"; }
for s in 0 1; do
  run /root/old "old-s$s" "$s"
  run /root/src "head-s$s" "$s"
  run /root/src "head64-s$s" "$s" --set optim.micro_batch=64
done
cd /root/src && bash bench/gpu.sh tta-eval 0 old-s0 head-s0 head64-s0 old-s1 head-s1 head64-s1
echo chain-done
