cd /root/src
R=qwen-tta-all-b24-v; g() { bash bench/gpu.sh "$@"; }
TTA_RECIPE=$R g tta-crucible "b24e-s4" 0 - --rows 512 --every 5 --set seed=4 --set data.seed=4 && g tta-eval 0 b24e-s4
