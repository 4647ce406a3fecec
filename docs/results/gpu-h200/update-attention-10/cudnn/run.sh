#!/usr/bin/env bash
# cuDNN attention's per-shape plans in the step: the step with and without it
cd "$(dirname "$0")/.."
cp .carry/site/sitecustomize.py /tmp/site/
R=/root/results/step2; mkdir -p $R/alone-nocudnn $R/alone-cudnn
run() { # NAME NOCUDNN [args...]
  name=$1 no=$2; shift 2; mkdir -p $R/$name
  OUT=$R/$name NO_CUDNN_SDP=$no bash bench/gpu.sh "$@" --set optim.steps=8 || echo "$name failed"
}
run nocudnn-1 1 multi-gpu-135m 1 --set optim.micro_batch=128
run cudnn-1 "" multi-gpu-135m 1 --set optim.micro_batch=128
run nocudnn-2 1 multi-gpu-135m 1 --set optim.micro_batch=128
run cudnn-2 "" multi-gpu-135m 1 --set optim.micro_batch=128
OUT=$R/alone-nocudnn NO_CUDNN_SDP=1 bash bench/gpu.sh update-arms logprobs 135m --min-tokens 140 --repeats 2
bash bench/gpu.sh shapes > /dev/null 2>&1
run nocudnn-1p5b 1 multi-gpu-1p5b 1 --set optim.micro_batch=32
run cudnn-1p5b "" multi-gpu-1p5b 1 --set optim.micro_batch=32
