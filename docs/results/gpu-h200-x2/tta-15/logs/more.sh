cd /root/src
R=qwen-tta-all-b24-v; g() { bash bench/gpu.sh "$@"; }
c() { TTA_RECIPE=$R g tta-crucible "b24g-s$2" "$1" - --rows 512 --every 5 --set seed="$2" --set data.seed="$2" && g tta-eval "$1" "b24g-s$2"; }
(c 0 4) & (c 1 5) & wait
echo more-done
