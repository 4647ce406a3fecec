#!/usr/bin/env bash
# One H200: the benchmark's 135M step (bench/multi_gpu.py, micro-batches of 128) with the rollout of
# 0906995 (.carry/base: one request, programs after the last completion) and this tree's streamed
# rollout, alternating twice; then vLLM: the recorded fixtures (a streamed answer among them) and a
# GRPO job whose rollouts stream from vLLM.
set -x
R=/root/results
for round in 1 2; do
  for arm in base stream; do
    dir=.; [ $arm = base ] && dir=.carry/base
    mkdir -p $R/$arm-$round
    OUT=$R/$arm-$round bash $dir/bench/gpu.sh multi-gpu-135m 1 --set optim.micro_batch=128 > $R/$arm-$round/run.log 2>&1
    grep -E '"(s_per_step|generate_s|execute_tail_s|update_s|samples_per_s)"' $R/$arm-$round/multi-gpu-135m.json | head -5
  done
done
PYTHONPATH=/tmp/site:/tmp/crucible-pkgs:$PWD CRUCIBLE_CACHE_DIR=/root/cache python3 .carry/prof.py 128 > $R/prof-128.txt 2>&1
bash bench/gpu.sh gpu-tests tests/integration/test_generator_gpu.py > $R/gpu-tests.log 2>&1; tail -3 $R/gpu-tests.log
OUT=$R bash bench/gpu.sh vllm-up > $R/vllm-up.log 2>&1 || tail -30 $R/vllm-up.log
OUT=$R bash bench/gpu.sh vllm-fixtures > $R/vllm-fixtures.log 2>&1
PYTHONPATH=/tmp/site:/tmp/crucible-pkgs:$PWD CRUCIBLE_CACHE_DIR=/root/cache WANDB_MODE=disabled \
  timeout 400 python3 bench/grpo_race.py recipes/grpo_smollm2.yaml --set optim.steps=3 --set eval=null \
  --generator-url http://127.0.0.1:8101 --json $R/vllm-grpo.json > $R/vllm-grpo.log 2>&1
tail -5 $R/vllm-grpo.log
bash bench/gpu-vllm.sh stop
