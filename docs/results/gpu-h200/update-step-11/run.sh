#!/usr/bin/env bash
# Session 29's GPU runs (issue 38 §2), in the background; results under /root/results.
cd "$(dirname "$0")/.."
R=/root/results; mkdir -p $R
step() { echo "== $(date +%T) $*"; }
step gpu-tests
bash bench/gpu.sh gpu-tests --noconftest tests/integration/test_trainer_gpu_nan.py \
  tests/integration/test_update_memory_gpu.py tests/unit/test_fused_gpu.py 2>&1 | tail -25 > $R/gpu-tests.log
step shapes
python3 bench/model_shapes.py qwen2.5-coder-1.5b --out /root/shapes > $R/shapes.json 2>&1
step 135m-1
mkdir -p $R/m135-1 && OUT=$R/m135-1 bash bench/gpu.sh multi-gpu-135m 1 --set optim.steps=8 --set optim.micro_batch=128 > /dev/null 2>&1
step 1p5b-32
mkdir -p $R/m1p5b-32 && OUT=$R/m1p5b-32 bash bench/gpu.sh multi-gpu-1p5b 1 --set optim.steps=8 --set optim.micro_batch=32 > /dev/null 2>&1
step prof-1p5b
mkdir -p $R/att && OUT=$R/att bash bench/gpu.sh update-arms attention 1p5b --profile /root/prof1p5b > /dev/null 2>&1
cp /root/prof1p5b/kernels.txt $R/att/kernels-1p5b.txt 2>/dev/null
step 135m-2
mkdir -p $R/m135-2 && OUT=$R/m135-2 bash bench/gpu.sh multi-gpu-135m 1 --set optim.steps=8 --set optim.micro_batch=128 > /dev/null 2>&1
step 1p5b-64
mkdir -p $R/m1p5b-64 && OUT=$R/m1p5b-64 bash bench/gpu.sh multi-gpu-1p5b 1 --set optim.steps=8 --set optim.micro_batch=64 > /dev/null 2>&1
step 135m-256
mkdir -p $R/m135-256 && OUT=$R/m135-256 bash bench/gpu.sh multi-gpu-135m 1 --set optim.steps=8 --set optim.micro_batch=256 > /dev/null 2>&1
step done
