#!/usr/bin/env bash
# The in-step update's suspects: the generator's idle-time graph captures, micro-batch 256
cd "$(dirname "$0")/.."
R=/root/results/step; mkdir -p $R/alone
export CRUCIBLE_GENERATOR_LOG_LEVEL=info
run() { # NAME CAPTURE [sets...]
  name=$1 cap=$2; shift 2; mkdir -p $R/$name
  OUT=$R/$name CRUCIBLE_GENERATOR_GRAPH_CAPTURE=$cap bash bench/gpu.sh multi-gpu-135m 1 --set optim.steps=8 "$@" || echo "$name failed"
}
OUT=$R/alone bash bench/gpu.sh update-arms logprobs 135m --min-tokens 140
run start-1 start --set optim.micro_batch=128
run idle-1 idle --set optim.micro_batch=128
run start-mb256 start --set optim.micro_batch=256
run idle-2 idle --set optim.micro_batch=128
run start-2 start --set optim.micro_batch=128
