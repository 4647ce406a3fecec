#!/usr/bin/env bash
# Session 30's GPU runs (issue 38 §2: the unmasked forward), in the background; results under /root/results.
cd "$(dirname "$0")/.."
R=/root/results; mkdir -p $R
step() { echo "== $(date +%T) $*"; }
step gpu-tests
bash bench/gpu.sh gpu-tests --noconftest tests/unit/test_update_unmasked.py 2>&1 | tail -25 > $R/gpu-tests.log
step arms-1p5b
mkdir -p $R/arms && OUT=$R/arms bash bench/gpu.sh update-arms padding 1p5b --profile /root/prof1p5b > /dev/null 2>&1
cp /root/prof1p5b/kernels.txt $R/arms/kernels-1p5b.txt 2>/dev/null
step 1p5b-64
mkdir -p $R/m1p5b-64 && OUT=$R/m1p5b-64 bash bench/gpu.sh multi-gpu-1p5b 1 --set optim.steps=8 --set optim.micro_batch=64 > /dev/null 2>&1
step 135m-128
mkdir -p $R/m135-128 && OUT=$R/m135-128 bash bench/gpu.sh multi-gpu-135m 1 --set optim.steps=8 --set optim.micro_batch=128 > /dev/null 2>&1
step 1p5b-64b
mkdir -p $R/m1p5b-64b && OUT=$R/m1p5b-64b bash bench/gpu.sh multi-gpu-1p5b 1 --set optim.steps=8 --set optim.micro_batch=64 > /dev/null 2>&1
step arms-135m
mkdir -p $R/arms135 && OUT=$R/arms135 bash bench/gpu.sh update-arms padding 135m > /dev/null 2>&1
step 1p5b-128
mkdir -p $R/m1p5b-128 && OUT=$R/m1p5b-128 bash bench/gpu.sh multi-gpu-1p5b 1 --set optim.steps=8 --set optim.micro_batch=128 > /dev/null 2>&1
step done
