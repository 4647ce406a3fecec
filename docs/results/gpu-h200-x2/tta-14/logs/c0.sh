cd /root/src
T=/root/results/tta; R=qwen-tta-all-b24-v; g() { bash bench/gpu.sh "$@"; }
while kill -0 2412 2>/dev/null; do sleep 2; done
g tta-eval 0 trl-b24v-s2
TTA_RECIPE=$R CUDA_VISIBLE_DEVICES=0 g tta-trl --out "$T/trl-b24v-s0" --every 5 --set seed=0 --set data.seed=0
g tta-eval 0 trl-b24v-s0
echo c0-done
