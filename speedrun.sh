#!/usr/bin/env bash
# speedrun.sh: the main job. From nothing to a model you chat with, every stage in order, resumable.
#
#   bash speedrun.sh                    # gpu plan with CUDA GPUs, else the offline demo plan on the CPU
#   bash speedrun.sh --plan demo --no_chat
#   bash speedrun.sh --help             # every flag with its default
#
# Each stage is one of this repository's scripts, run under torchrun with one process per GPU (one on the CPU), in
# its own process group, its output going to the terminal and to runs/<run>/logs/<stage>.log. A rerun skips the
# stages that finished and resumes an interrupted training stage from its last checkpoint. README: The speedrun.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")" && pwd)  # the scripts; relative paths (--runs_dir, --data_dir) are the caller's

PLAN=auto DEPTH=20 RUN_NAME=speedrun DATA_DIR="" GPUS=auto NO_CHAT=0 RUNS_DIR=runs FORCE=0 TOKENIZER=""
SHARDS=240 STOP_AFTER="" PROBE_ONLY=0 VOCAB=""

usage() {
    cat <<EOF
usage: bash speedrun.sh [flags]

  --plan gpu|demo     gpu: d20-class model on FineWeb-Edu, every stage; demo: the offline demo world, preset tiny,
                      on the CPU (default: gpu when CUDA GPUs are present, else demo)
  --depth N           gpu plan: model depth, the d{N} preset (default: $DEPTH)
  --run_name NAME     everything goes to <runs_dir>/NAME/ (default: $RUN_NAME)
  --runs_dir DIR      (default: $RUNS_DIR)
  --data_dir DIR      gpu: the FineWeb-Edu corpus directory (default: dataset.py's cache); demo: the demo world
                      (default: <runs_dir>/<run_name>/demo, written by demo.py when missing)
  --gpus N            processes per stage = GPUs used (default: all CUDA GPUs; 0 = CPU, one process)
  --shards N          gpu plan: FineWeb-Edu training shards to download (default: $SHARDS)
  --vocab_size N      tokenizer vocabulary (default: 65536 gpu, 1024 demo)
  --tokenizer DIR     use this trained tokenizer instead of training one (default: train <run>/tokenizer)
  --stop_after STAGE  stop after this stage: data tokenizer pretrain core_eval midtrain sft chat_eval report
  --no_chat           do not start chat.py at the end (it starts only when stdin is a terminal anyway)
  --force             start although other processes hold the GPUs
  --probe_only        run the NCCL check, record the transport, and exit
  -h, --help          this text

environment:
  PRETRAIN_ARGS MIDTRAIN_ARGS SFT_ARGS CORE_ARGS CHAT_EVAL_ARGS   extra flags appended to that stage's command line
                      (the last of a repeated flag wins), e.g. PRETRAIN_ARGS="--steps 100"
  NCCL_SAFE=1         skip the NCCL probe and run with seed 003's safe flags
  SPEEDRUN_PYTHON     the interpreter (default: .venv/bin/python, created from requirements.txt when missing)
  SPEEDRUN_PROBE_TIMEOUT  seconds before the NCCL probe counts as hung (default: 120)
  SPEEDRUN_KILL_WAIT  seconds a stage gets to checkpoint after SIGTERM before SIGKILL (default: 30)
EOF
}

while [ $# -gt 0 ]; do
    case "$1" in
        --plan) PLAN=$2; shift 2 ;;
        --depth) DEPTH=$2; shift 2 ;;
        --run_name) RUN_NAME=$2; shift 2 ;;
        --runs_dir) RUNS_DIR=$2; shift 2 ;;
        --data_dir) DATA_DIR=$2; shift 2 ;;
        --gpus) GPUS=$2; shift 2 ;;
        --shards) SHARDS=$2; shift 2 ;;
        --vocab_size) VOCAB=$2; shift 2 ;;
        --tokenizer) TOKENIZER=$2; shift 2 ;;
        --stop_after) STOP_AFTER=$2; shift 2 ;;
        --no_chat) NO_CHAT=1; shift ;;
        --force) FORCE=1; shift ;;
        --probe_only) PROBE_ONLY=1; shift ;;
        -h|--help) usage; exit 0 ;;
        *) echo "speedrun.sh: error: unknown flag $1 (bash speedrun.sh --help lists them)" >&2; exit 2 ;;
    esac
done
case "$PLAN" in auto|gpu|demo) ;; *) echo "speedrun.sh: error: --plan $PLAN: use gpu or demo" >&2; exit 2 ;; esac
case "$STOP_AFTER" in ""|data|tokenizer|pretrain|core_eval|midtrain|sft|chat_eval|report) ;;
    *) echo "speedrun.sh: error: --stop_after $STOP_AFTER: not a stage (bash speedrun.sh --help)" >&2; exit 2 ;; esac

RUN="$RUNS_DIR/$RUN_NAME"
LOGS="$RUN/logs"
mkdir -p "$LOGS"
say() { echo "speedrun: $*" | tee -a "$LOGS/speedrun.log"; }

# --- process hygiene: every stage runs in its own process group; on exit, INT or TERM each live group is ended
STAGE_PGIDS=() BG_PGIDS=()  # the running stage's group; a background download's
KILL_WAIT=${SPEEDRUN_KILL_WAIT:-30}
end_groups() {
    local pg alive t
    STAGE_PGIDS+=("${BG_PGIDS[@]}")
    BG_PGIDS=()
    for pg in "${STAGE_PGIDS[@]}"; do kill -TERM -- "-$pg" 2>/dev/null || true; done
    for ((t = 0; t < KILL_WAIT * 10; t++)); do
        alive=0
        for pg in "${STAGE_PGIDS[@]}"; do kill -0 -- "-$pg" 2>/dev/null && alive=1; done
        [ "$alive" = 0 ] && break
        sleep 0.1
    done
    for pg in "${STAGE_PGIDS[@]}"; do kill -KILL -- "-$pg" 2>/dev/null || true; done
    STAGE_PGIDS=()
}
on_signal() {
    trap - INT TERM
    echo "speedrun: stopped by SIG$1: ending every stage (each training stage checkpoints first); rerun the same" \
        "command to resume" >&2
    end_groups
    exit "$2"
}
trap 'end_groups' EXIT
trap 'on_signal INT 130' INT
trap 'on_signal TERM 143' TERM

# run_stage NAME CMD...: CMD in a new session (its own process group), stdout+stderr to the terminal and the log,
# stdin from /dev/null. A failure stops the run naming the stage. The pipeline's status is CMD's (pipefail); the awk
# at its end passes every line through and, for pretraining, adds the expected time once 20 steps are timed.
# shellcheck disable=SC2016,SC2089,SC2090  # an awk program, read by awk
SPEEDRUN_AWK='{ print; fflush() }
eta && !said && $1 == "step" && split($2, s, "/") == 2 && s[1] >= 20 && /ETA/ {
    for (i = 2; i < NF; i++) { if ($i == "tok/s") rate = $(i - 1); if ($i == "tokens") done = $(i + 1) }
    gsub(",", "", rate); gsub(",", "", done)
    if (rate > 0) {
        left = (s[2] - s[1]) * done / s[1] / rate
        printf "speedrun: expected pretraining time left: %d:%02d:%02d for %d more steps (measured: %s tok/s at " \
            "step %d, after compilation and warm-up)\n", left / 3600, left % 3600 / 60, left % 60, s[2] - s[1], rate, s[1]
        fflush(); said = 1 } }'
run_stage() {
    local name=$1 log=$SPEEDRUN_LOG rc=0 start
    shift
    start=$(date +%s.%N)
    say "stage $name: $*"
    # shellcheck disable=SC2016  # expanded by the inner bash
    # tee and awk ignore TERM and INT: the stage's processes get them, checkpoint, print their last lines and exit,
    # and only then do tee and awk see the end of their input (a KILL of the group ends them regardless)
    setsid bash -c 'set -o pipefail; "$@" 2>&1 < /dev/null | (trap "" TERM INT; exec tee -a "$SPEEDRUN_LOG") |
        (trap "" TERM INT; exec awk $SPEEDRUN_AWK_FLAGS -v eta="$SPEEDRUN_ETA" "$SPEEDRUN_AWK")' speedrun-stage "$@" &
    STAGE_PGIDS+=("$!")
    wait "$!" || rc=$?
    STAGE_PGIDS=()
    printf '%s\t%s\t%s\n' "$name" "$(awk -v s="$start" -v e="$(date +%s.%N)" 'BEGIN { printf "%.1f", e - s }')" "$rc" \
        >> "$LOGS/stages.tsv"
    if [ "$rc" != 0 ]; then
        echo "speedrun: stage $name failed (exit $rc); log: $log" >&2
        exit "$rc"
    fi
    say "stage $name done"
}
SPEEDRUN_AWK_FLAGS=""  # mawk reads a pipe in large blocks unless told to read it line by line
if awk -W version 2>&1 | grep -q mawk; then SPEEDRUN_AWK_FLAGS="-W interactive"; fi
# shellcheck disable=SC2090
export SPEEDRUN_LOG SPEEDRUN_ETA=0 SPEEDRUN_AWK SPEEDRUN_AWK_FLAGS

stage() {  # stage NAME CMD...: run_stage with its log file
    SPEEDRUN_LOG="$LOGS/$1.log"
    run_stage "$@"
    if [ "$STOP_AFTER" = "$1" ]; then say "stopping after $1 (--stop_after)"; exit 0; fi
}
skip() { say "stage $1 skipped: $2"; if [ "$STOP_AFTER" = "$1" ]; then exit 0; fi; }

export PYTHONUNBUFFERED=1  # every line reaches the log and the terminal when printed

# --- the interpreter
if [ -n "${SPEEDRUN_PYTHON:-}" ]; then
    PY=$SPEEDRUN_PYTHON
else
    if [ ! -x "$ROOT/.venv/bin/python" ]; then
        say "creating .venv from requirements.txt"
        python3 -m venv "$ROOT/.venv" && "$ROOT/.venv/bin/pip" install -q -r "$ROOT/requirements.txt"
    fi
    PY=$ROOT/.venv/bin/python
fi

# --- GPUs: how many, and whether something else holds them (seed 000: zombie workers from an earlier run)
if command -v nvidia-smi > /dev/null 2>&1; then
    holders=$(nvidia-smi --query-compute-apps=pid,process_name --format=csv,noheader 2>/dev/null || true)
    if [ -n "$holders" ] && [ "$FORCE" = 0 ]; then
        pids=$(echo "$holders" | cut -d, -f1 | tr -d ' ' | paste -sd ' ')
        echo "speedrun.sh: error: processes hold the GPUs (pid, name):" >&2
        echo "$holders" >&2
        echo "They would leave this run short of memory (a zombie worker of an earlier run?). Stop them with" \
            "\`kill $pids\` (\`kill -9 $pids\` if they stay), or rerun with --force." >&2
        exit 1
    fi
fi
if [ "$GPUS" = auto ]; then
    GPUS=$("$PY" -c 'import torch; print(torch.cuda.device_count())')
fi
[ "$PLAN" = auto ] && { [ "$GPUS" -gt 0 ] && PLAN=gpu || PLAN=demo; }
if [ "$PLAN" = gpu ] && [ "$GPUS" -lt 1 ] && [ "$PROBE_ONLY" = 0 ]; then
    echo "speedrun.sh: error: --plan gpu needs CUDA GPUs and torch sees none; use --plan demo on the CPU" >&2
    exit 2
fi
NPROC=$((GPUS > 0 ? GPUS : 1))
LAUNCH=("$PY" -m torch.distributed.run --standalone "--nproc_per_node=$NPROC")
say "plan $PLAN, run $RUN, $NPROC process(es) per stage ($([ "$GPUS" -gt 0 ] && echo "$GPUS GPUs" || echo CPU))," \
    "commit $(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo unknown)"

# --- NCCL: one all-reduce with a timeout before training; on a hang or failure, seed 003's safe flags
SAFE_FLAGS="NCCL_P2P_DISABLE=1 NCCL_IB_DISABLE=1 NCCL_SOCKET_IFNAME=lo NCCL_NET=Socket NCCL_NET_PLUGIN=none"
PROBE_TIMEOUT=${SPEEDRUN_PROBE_TIMEOUT:-120}
probe() {  # the probe in its own process group under a hard timeout; its status
    local rc=0
    if [ -n "${SPEEDRUN_PROBE_CMD:-}" ]; then  # tests inject a hang here
        setsid timeout -k 5 "$PROBE_TIMEOUT" bash -c "$SPEEDRUN_PROBE_CMD" >> "$LOGS/probe.log" 2>&1 &
    else
        setsid timeout -k 5 "$PROBE_TIMEOUT" "${LAUNCH[@]}" "$ROOT/common.py" probe --timeout "$PROBE_TIMEOUT" \
            >> "$LOGS/probe.log" 2>&1 < /dev/null &
    fi
    STAGE_PGIDS+=("$!")
    wait "$!" || rc=$?
    end_groups  # nothing of a hung probe survives it
    return "$rc"
}
use_safe_flags() { local kv; for kv in $SAFE_FLAGS; do export "${kv?}"; done; }
if [ "$GPUS" -eq 0 ]; then
    TRANSPORT="gloo (cpu)"
elif [ "${NCCL_SAFE:-0}" = 1 ]; then
    use_safe_flags
    TRANSPORT="nccl safe flags (NCCL_SAFE=1: $SAFE_FLAGS)"
elif probe; then
    TRANSPORT="nccl default"
else
    rc=$?
    say "NCCL probe failed (exit $rc$([ "$rc" = 124 ] || [ "$rc" = 137 ] && echo ", hung past ${PROBE_TIMEOUT}s")):" \
        "retrying with seed 003's safe flags $SAFE_FLAGS; log: $LOGS/probe.log"
    use_safe_flags
    if probe; then
        TRANSPORT="nccl safe flags ($SAFE_FLAGS)"
    else
        rc=$?
        echo "speedrun: stage nccl_probe failed (exit $rc) even with the safe flags; log: $LOGS/probe.log" >&2
        exit "$rc"
    fi
fi
echo "$TRANSPORT" > "$RUN/transport.txt"
say "transport: $TRANSPORT"
[ "$PROBE_ONLY" = 1 ] && exit 0

split_args() { read -r -a "$1" <<< "${2:-}"; }  # an env var's words as an array (no globbing, no eval)
split_args PRETRAIN_EXTRA "${PRETRAIN_ARGS:-}"
split_args MIDTRAIN_EXTRA "${MIDTRAIN_ARGS:-}"
split_args SFT_EXTRA "${SFT_ARGS:-}"
split_args CORE_EXTRA "${CORE_ARGS:-}"
split_args CHAT_EVAL_EXTRA "${CHAT_EVAL_ARGS:-}"

# a training stage: skipped when its done.json exists, resumed when it has a checkpoint, else started
train_stage() {  # NAME SCRIPT ARGS...
    local name=$1 script=$2
    shift 2
    if [ -f "$RUN/$name/done.json" ]; then
        skip "$name" "$RUN/$name/done.json exists"
        return
    fi
    local resume=()
    if compgen -G "$RUN/$name/ckpt/step_[0-9]*" > /dev/null; then
        resume=(--resume)
        say "stage $name was interrupted: resuming from its last checkpoint"
    fi
    [ "$name" = pretrain ] && SPEEDRUN_ETA=1
    stage "$name" "${LAUNCH[@]}" "$script" "$@" --runs_dir "$RUN" --run_name "$name" "${resume[@]}"
    SPEEDRUN_ETA=0
}

# --- data and tokenizer
SHARD_PID=""
if [ "$PLAN" = demo ]; then
    DATA_DIR=${DATA_DIR:-$RUN/demo}
    VOCAB=${VOCAB:-1024}
    if compgen -G "$DATA_DIR/pretrain/shard_*.parquet" > /dev/null && [ -d "$DATA_DIR/chat_eval" ] && [ -d "$DATA_DIR/calc" ]; then
        skip data "the demo world is in $DATA_DIR"
    else
        stage data "$PY" "$ROOT/demo.py" --out "$DATA_DIR"
    fi
    CORPUS="$DATA_DIR/pretrain"
    say "data: the embedded demo world (synthetic demo data), $CORPUS"
else
    DATA_DIR=${DATA_DIR:-$(PYTHONPATH=$ROOT "$PY" -c 'from dataset import default_data_dir as d; print(d("karpathy/fineweb-edu-100b-shuffle"))')}
    VOCAB=${VOCAB:-65536}
    CORPUS=$DATA_DIR
    # 8 shards first (what the tokenizer trains on), then the rest in the background while it trains; pretraining
    # waits for them. A complete shard is never fetched again.
    stage data "$PY" "$ROOT/dataset.py" download --shards 8 --data_dir "$CORPUS"
    say "downloading $SHARDS FineWeb-Edu training shards into $CORPUS in the background (log: $LOGS/download.log)"
    setsid "$PY" "$ROOT/dataset.py" download --shards "$SHARDS" --data_dir "$CORPUS" >> "$LOGS/download.log" 2>&1 < /dev/null &
    SHARD_PID=$!
    BG_PGIDS+=("$SHARD_PID")
fi
if [ -n "$TOKENIZER" ]; then
    TOK=$TOKENIZER
    skip tokenizer "using --tokenizer $TOK"
elif [ -f "$RUN/tokenizer/tokenizer.json" ]; then
    TOK="$RUN/tokenizer"
    skip tokenizer "$TOK/tokenizer.json exists"
else
    TOK="$RUN/tokenizer"
    stage tokenizer "$PY" "$ROOT/tokenizer.py" train --data_dir "$CORPUS" --vocab_size "$VOCAB" --out "$TOK"
fi
if [ -n "$SHARD_PID" ]; then
    say "waiting for the shard download (log: $LOGS/download.log)"
    rc=0
    wait "$SHARD_PID" || rc=$?
    if [ "$rc" != 0 ]; then
        echo "speedrun: stage download failed (exit $rc); log: $LOGS/download.log" >&2
        exit "$rc"
    fi
    BG_PGIDS=()
fi

# --- the stages
if [ "$PLAN" = demo ]; then
    # measured on a 2-core Xeon with AMX (README: The speedrun): about 10 minutes for the whole pipeline
    PRETRAIN=(--preset tiny --steps 400 --micro_batch 16 --compile true --eval_every 200 --ckpt_every 100)
    # conversations, and the shapes ChatCORE asks for: letters (choice), bare answers (answers), the calculator (calc)
    MIDTRAIN=(--source "text:$CORPUS:0.3" --source "chat:$DATA_DIR/conversations:0.4" --source "chat:$DATA_DIR/choice:0.1"
              --source "chat:$DATA_DIR/answers:0.1" --source "chat:$DATA_DIR/calc:0.1" --supervise assistant
              --steps 200 --eval_every 0 --ckpt_every 100)
    SFT=(--source "$DATA_DIR/conversations:1" --source "$DATA_DIR/choice:1" --source "$DATA_DIR/answers:1"
         --source "$DATA_DIR/calc:1" --steps 200 --eval_every 0 --ckpt_every 100)
    CHAT_EVAL=(--demo "$DATA_DIR" --max_new_tokens 32)
else
    PRETRAIN=(--preset "d$DEPTH" --tokens_per_param 20 --total_batch_tokens 524288 --eval_every 250 --ckpt_every 1000)
    MIDTRAIN=(--tokens 500000000 --ckpt_every 1000)
    SFT=(--epochs 1 --ckpt_every 1000)  # sft.py's mixture: SmolTalk, MMLU x3, GSM8K x4, ARC, identity
    CHAT_EVAL=(--demo none)
    say "plan: d$DEPTH ('python model.py --preset d$DEPTH' for its parameters), 20 tokens per parameter at 524,288" \
        "tokens a step on $GPUS GPUs; pretrain.py prints the parameters, tokens and steps before step 1, and" \
        "this script the expected time measured after the first timed steps"
fi

train_stage pretrain "$ROOT/pretrain.py" --data_dir "$CORPUS" --tokenizer "$TOK" "${PRETRAIN[@]}" "${PRETRAIN_EXTRA[@]}"

if [ -f "$RUN/core_eval/results.json" ]; then
    skip core_eval "$RUN/core_eval/results.json exists"
else
    stage core_eval "${LAUNCH[@]}" "$ROOT/core_eval.py" --checkpoint "$RUN/pretrain" --out "$RUN/core_eval" "${CORE_EXTRA[@]}"
fi

if [ "$PLAN" = gpu ] && [ ! -f "$RUN/midtrain/done.json" ]; then
    for chat in smoltalk ultrachat mmlu arc-easy arc-challenge gsm8k identity; do  # midtrain's and sft's sources
        stage "download_$chat" "$PY" "$ROOT/dataset.py" download-chat "$chat"
    done
fi
train_stage midtrain "$ROOT/midtrain.py" --init "$RUN/pretrain" "${MIDTRAIN[@]}" "${MIDTRAIN_EXTRA[@]}"
train_stage sft "$ROOT/sft.py" --init "$RUN/midtrain" "${SFT[@]}" "${SFT_EXTRA[@]}"

if [ -f "$RUN/chat_eval.json" ]; then
    skip chat_eval "$RUN/chat_eval.json exists"
else
    stage chat_eval "${LAUNCH[@]}" "$ROOT/chat_eval.py" --checkpoint "$RUN/sft" --out "$RUN/chat_eval.json" \
        "${CHAT_EVAL[@]}" "${CHAT_EVAL_EXTRA[@]}"
fi

stage report "$PY" "$ROOT/report.py" "$RUN"

if [ "$NO_CHAT" = 0 ] && [ -t 0 ] && [ -t 1 ]; then
    say "chat: $PY $ROOT/chat.py --runs_dir $RUN (Ctrl-D or /quit to leave)"
    "$PY" "$ROOT/chat.py" --runs_dir "$RUN"
else
    say "done. Chat with it: $PY $ROOT/chat.py --runs_dir $RUN"
fi
