#!/usr/bin/env bash
# speedrun.sh: the main job. From nothing to a model you chat with, every stage in order, resumable.
#
#   bash speedrun.sh                    # gpu plan with CUDA GPUs, else the offline demo plan on the CPU
#   bash speedrun.sh --plan demo --no_chat
#   bash speedrun.sh --rehearse         # every stage of the plan for a few steps or items, in minutes
#   bash speedrun.sh --help             # every flag with its default
#
# Each stage is one of this repository's scripts, run under torchrun with one process per GPU (one on the CPU), in
# its own process group, its output going to the terminal and to runs/<run>/logs/<stage>.log. A rerun skips the
# stages that finished and resumes an interrupted training stage from its last checkpoint. docs/speedrun.md.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")" && pwd)  # the scripts; relative paths (--runs_dir, --data_dir) are the caller's

PLAN=auto DEPTH=20 RUN_NAME=speedrun DATA_DIR="" GPUS=auto NO_CHAT=0 RUNS_DIR=runs FORCE=0 TOKENIZER=""
SHARDS="" STOP_AFTER="" PROBE_ONLY=0 VOCAB="" REHEARSE=0 NO_REHEARSE=0 STAGE_EVALS="pretrain,midtrain,sft,rl" RL_STAGE=auto
# the conversation datasets the gpu plan's midtraining and SFT read (dataset.py download-chat names): checked and
# fetched at the start, with the CORE bundle and the ChatCORE tasks, so a gated or missing one fails in minutes
CHAT_SOURCES=(smoltalk ultrachat mmlu arc-easy arc-challenge gsm8k identity)

usage() {
    cat <<EOF
usage: bash speedrun.sh [flags]

  --plan gpu|demo     gpu: d20-class model on FineWeb-Edu, every stage; demo: the offline demo world, preset tiny,
                      on the CPU (default: gpu when torch sees CUDA GPUs, else demo; GPUs that nvidia-smi lists
                      but torch cannot use stop the run with the driver and wheel versions)
  --depth N           gpu plan: model depth, the d{N} preset (default: $DEPTH)
  --run_name NAME     everything goes to <runs_dir>/NAME/ (default: $RUN_NAME)
  --runs_dir DIR      (default: $RUNS_DIR)
  --data_dir DIR      gpu: the FineWeb-Edu corpus directory (default: dataset.py's cache); demo: the demo world
                      (default: <runs_dir>/<run_name>/demo, written by demo.py when missing)
  --gpus N            processes per stage = GPUs used (default: all CUDA GPUs; 0 = CPU, one process)
  --shards N          gpu plan: FineWeb-Edu training shards to download (default: what the budget needs: its
                      tokens / the first shard's tokens counted with the tokenizer, plus one)
  --vocab_size N      tokenizer vocabulary (default: 65536 gpu, 1024 demo)
  --tokenizer DIR     use this trained tokenizer instead of training one (default: train <run>/tokenizer)
  --stop_after STAGE  stop after this stage: data tokenizer download pretrain core_eval midtrain sft rl chat_eval
                      report (download: gpu plan, every shard and the prefetched chat and evaluation data are in)
  --rl on|off         the reinforcement-learning stage after sft (default: on for the gpu plan; off for the demo
                      plan, where it lowered held-out accuracy: docs/rl.md)
  --stage_evals LIST  the stages whose final models get CORE and ChatCORE for the report's table of what each
                      stage taught, comma-separated, or none (default: $STAGE_EVALS; a column left out says unknown)
  --no_chat           do not start chat.py at the end (it starts only when stdin is a terminal anyway)
  --rehearse          run every stage of the plan with its own command lines, data and world size, on a tiny budget
                      (a few steps or items each), into <run_name>-rehearsal; it ends with the report and one chat.py
                      answer and prints each stage's time. Without CUDA, --gpus N rehearses the gpu plan on N CPU
                      processes (gloo), its sequences cut to 128 tokens (the same sequences per step)
  --no_rehearse       gpu plan: skip the rehearsal it runs before pretraining (default: rehearse once per run)
  --force             start although other processes hold the GPUs
  --probe_only        run the NCCL check, record the transport and its measured bandwidth, and exit
  -h, --help          this text

environment:
  PRETRAIN_ARGS MIDTRAIN_ARGS SFT_ARGS RL_ARGS CORE_ARGS CHAT_EVAL_ARGS   extra flags appended to that stage's command line
                      (the last of a repeated flag wins), e.g. PRETRAIN_ARGS="--steps 100"
  NCCL_SAFE=1         skip the NCCL probe and run with the safe flags (P2P and InfiniBand off)
  SPEEDRUN_PYTHON     the interpreter (default: .venv/bin/python, installed from requirements.txt unless .venv
                      records a completed install of this requirements.txt)
  SPEEDRUN_PROBE_TIMEOUT  seconds before the NCCL probe counts as hung (default: 120)
  SPEEDRUN_PROBE_MB   size of the probe's timed all-reduce in MB (default: 64)
  SPEEDRUN_KILL_WAIT  seconds a stopped stage gets to end before SIGKILL, plus twice its last measured checkpoint
                      save, plus as long as a checkpoint is still being written, and as much again once it is saved
                      (default: 30)
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
        --stage_evals) STAGE_EVALS=$2; shift 2 ;;
        --rl) RL_STAGE=$2; shift 2 ;;
        --force) FORCE=1; shift ;;
        --probe_only) PROBE_ONLY=1; shift ;;
        --rehearse) REHEARSE=1; shift ;;
        --no_rehearse) NO_REHEARSE=1; shift ;;
        -h|--help) usage; exit 0 ;;
        *) echo "speedrun.sh: error: unknown flag $1 (bash speedrun.sh --help lists them)" >&2; exit 2 ;;
    esac
done
case "$PLAN" in auto|gpu|demo) ;; *) echo "speedrun.sh: error: --plan $PLAN: use gpu or demo" >&2; exit 2 ;; esac
case "$STOP_AFTER" in ""|data|tokenizer|download|pretrain|core_eval|midtrain|sft|rl|chat_eval|report) ;;
    *) echo "speedrun.sh: error: --stop_after $STOP_AFTER: not a stage (bash speedrun.sh --help)" >&2; exit 2 ;; esac
case "$RL_STAGE" in auto|on|off) ;; *) echo "speedrun.sh: error: --rl $RL_STAGE: use on or off" >&2; exit 2 ;; esac
[ "$STAGE_EVALS" = none ] && STAGE_EVALS=""
for name in ${STAGE_EVALS//,/ }; do
    case "$name" in pretrain|midtrain|sft|rl) ;; *) echo "speedrun.sh: error: --stage_evals $STAGE_EVALS: $name is" \
        "not a stage with a model (use pretrain, midtrain, sft, rl, comma-separated, or none)" >&2; exit 2 ;; esac
done

REAL_RUN_NAME=$RUN_NAME
[ "$REHEARSE" = 1 ] && RUN_NAME="$RUN_NAME-rehearsal"  # never mixed with the real run's outputs
RUN="$RUNS_DIR/$RUN_NAME"
LOGS="$RUN/logs"
REDONE=""  # a rehearsal that passed is redone from the start (it checks this code); an interrupted one resumes
if [ "$REHEARSE" = 1 ] && [ -f "$RUN/rehearsed.json" ]; then rm -rf -- "$RUN"; REDONE=1; fi
mkdir -p "$LOGS"
say() { echo "speedrun: $*" | tee -a "$LOGS/speedrun.log"; }
[ -n "$REDONE" ] && say "rehearsing again from the start: $RUN held a rehearsal that passed (now deleted)"
STAGES_BEFORE=$({ cat "$LOGS/stages.tsv" 2>/dev/null || true; } | wc -l)  # this invocation's stages follow

# --- process hygiene: every stage runs in its own process group and carries this run's mark in its environment
# (SPEEDRUN_MARK, inherited by everything it starts: torchrun's workers too, whose sessions are their own and which
# outlive torchrun's process group). On exit, INT, TERM or HUP: torchrun's workers get SIGTERM themselves (torchrun
# is not signalled, so its own grace does not start while rank 0 checkpoints), other stages' groups too; they get
# KILL_WAIT seconds plus twice the last measured checkpoint save of the running stage (<stage>/ckpt/save_seconds),
# more while a checkpoint is still being written, and KILL_WAIT more once it is saved; then every marked process
# and group gets SIGKILL. Workers also die with torchrun (distributed.die_with_launcher).
STAGE_PGIDS=() BG_PGIDS=()  # the running stage's group; a background download's
KILL_WAIT=${SPEEDRUN_KILL_WAIT:-30}
MARK="speedrun-$$-$(date +%s%N)"  # not exported: only the stages carry it (run_stage, probe, the download)
STAGE_CKPT=""  # the running training stage's checkpoint directory
marked() {  # pids of the live processes carrying this run's mark; with an argument, only torchrun's workers
    local files f
    files=$(grep -lzxF -e "SPEEDRUN_MARK=$MARK" -e "SPEEDRUN_MARK=$MARK.probe" /proc/[0-9]*/environ 2>/dev/null || true)
    [ -n "$files" ] && [ -n "${1:-}" ] && files=$(grep -lz '^LOCAL_RANK=' $files 2>/dev/null || true)
    for f in $files; do f=${f#/proc/}; echo "${f%/environ}"; done
}
checkpoint_grace() {  # KILL_WAIT plus twice the running stage's last measured save, in whole seconds
    local saved=0
    [ -n "$STAGE_CKPT" ] && [ -f "$STAGE_CKPT/save_seconds" ] && saved=$(head -c 32 "$STAGE_CKPT/save_seconds")
    awk -v k="$KILL_WAIT" -v s="$saved" 'BEGIN { g = k + 2 * s; printf "%d", g == int(g) ? g : int(g) + 1 }'
}
writing_checkpoint() {  # a file of a checkpoint in progress changed in the last 5 seconds
    [ -n "$STAGE_CKPT" ] && [ -d "$STAGE_CKPT" ] &&
        [ -n "$(find "$STAGE_CKPT" -path '*/.tmp_step_*' -newermt '-5 seconds' -print -quit 2>/dev/null)" ]
}
saved_since() {  # a checkpoint of the running stage was saved since $1 (seconds since the epoch)
    [ -n "$STAGE_CKPT" ] && [ -n "$(find "$STAGE_CKPT" -maxdepth 1 -name save_seconds -newermt "@$1" 2>/dev/null)" ]
}
end_groups() {
    local pg alive deadline workers grace t told=() since exiting=0
    since=$(date +%s.%N)
    workers=$(marked workers)
    # shellcheck disable=SC2086  # a list of pids
    if [ -n "$workers" ]; then
        kill -TERM $workers 2>/dev/null || true
        told=("${BG_PGIDS[@]}")  # the stage's group (torchrun, tee, awk) ends when its workers have
    else
        told=("${STAGE_PGIDS[@]}" "${BG_PGIDS[@]}")
    fi
    STAGE_PGIDS+=("${BG_PGIDS[@]}")
    BG_PGIDS=()
    for pg in "${told[@]}"; do kill -TERM -- "-$pg" 2>/dev/null || true; done
    grace=$(checkpoint_grace)
    deadline=$((SECONDS + grace))
    while :; do
        alive=$(marked)
        for pg in "${STAGE_PGIDS[@]}"; do kill -0 -- "-$pg" 2>/dev/null && alive+=" $pg"; done
        [ -z "${alive// /}" ] && break
        if [ "$SECONDS" -ge "$deadline" ]; then
            if writing_checkpoint; then
                deadline=$((SECONDS + 5))
            elif [ "$exiting" = 0 ] && saved_since "$since"; then  # checkpointed: KILL_WAIT more to exit
                exiting=1 deadline=$((SECONDS + KILL_WAIT)) grace=$((grace + KILL_WAIT))
            else
                break
            fi
        fi
        sleep 0.1
    done
    if [ -n "${alive// /}" ]; then
        echo "speedrun: stage processes still running after ${grace}s: killing them (SIGKILL)" >&2 || true
    fi
    for pg in "${STAGE_PGIDS[@]}"; do kill -KILL -- "-$pg" 2>/dev/null || true; done
    # shellcheck disable=SC2046  # a list of pids
    kill -KILL $(marked) 2>/dev/null || true
    for ((t = 0; t < 100; t++)); do [ -z "$(marked)" ] && break; sleep 0.1; done  # gone, not just signalled
    STAGE_PGIDS=()
}
on_signal() {
    trap - INT TERM HUP
    echo "speedrun: stopped by SIG$1: ending every stage (each training stage checkpoints first); rerun the same" \
        "command to resume" >&2 || true  # (after SIGHUP the terminal may be gone)
    end_groups
    exit "$2"
}
trap 'end_groups' EXIT
trap 'on_signal INT 130' INT
trap 'on_signal TERM 143' TERM
trap 'on_signal HUP 129' HUP

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
print_progress() {  # NAME: a failed training stage's ranks, each with its last step and phase and how long ago (under
    # NCCL a hung collective aborts in C++ and no rank can say which one was stuck; these files say where each was)
    local f now
    compgen -G "$RUN/$1/progress/rank*.txt" > /dev/null || return 0
    now=$(date +%s.%N)
    echo "speedrun: where each rank of stage $1 was last ($RUN/$1/progress/):" >&2
    for f in "$RUN/$1/progress"/rank*.txt; do
        awk -v now="$now" '{ for (i = 1; i < NF; i++) if ($i == "at") t = $(i + 1)
            printf "speedrun:   %s (%.0f s before this)\n", $0, now - t }' "$f" >&2
    done
}
run_stage() {
    local name=$1 log=$SPEEDRUN_LOG rc=0 start
    shift
    start=$(date +%s.%N)
    say "stage $name: $*"
    # shellcheck disable=SC2016  # expanded by the inner bash
    # tee and awk ignore TERM, INT and HUP: the stage's processes get them, checkpoint, print their last lines, exit,
    # and only then do tee and awk see the end of their input (a KILL of the group ends them regardless)
    SPEEDRUN_MARK=$MARK TORCH_ELASTIC_SHUTDOWN_TIMEOUT=$(checkpoint_grace) setsid bash -c 'set -o pipefail
        "$@" 2>&1 < /dev/null | (trap "" TERM INT HUP; exec tee -a "$SPEEDRUN_LOG") |
        (trap "" TERM INT HUP; exec awk $SPEEDRUN_AWK_FLAGS -v eta="$SPEEDRUN_ETA" "$SPEEDRUN_AWK")' \
        speedrun-stage "$@" &
    STAGE_PGIDS+=("$!")
    wait "$!" || rc=$?
    STAGE_PGIDS=()
    printf '%s\t%s\t%s\n' "$name" "$(awk -v s="$start" -v e="$(date +%s.%N)" 'BEGIN { printf "%.1f", e - s }')" "$rc" \
        >> "$LOGS/stages.tsv"
    if [ "$rc" != 0 ]; then
        echo "speedrun: stage $name failed (exit $rc); log: $log" >&2
        print_progress "$name"
        exit "$rc"
    fi
    say "stage $name done in $(tail -n 1 "$LOGS/stages.tsv" | cut -f2) s"
}
SPEEDRUN_AWK_FLAGS=""  # mawk reads a pipe in large blocks unless told to read it line by line
if [[ "$(awk -W version 2>&1)" == *mawk* ]]; then SPEEDRUN_AWK_FLAGS="-W interactive"; fi
# shellcheck disable=SC2090
export SPEEDRUN_LOG SPEEDRUN_ETA=0 SPEEDRUN_AWK SPEEDRUN_AWK_FLAGS

stage() {  # stage NAME CMD...: run_stage with its log file
    SPEEDRUN_LOG="$LOGS/$1.log"
    if [ "${4:-}" = torch.distributed.run ]; then reprobe "$1"; fi  # a torchrun stage ("${LAUNCH[@]}" ...)
    run_stage "$@"
    if [ "$STOP_AFTER" = "$1" ]; then say "stopping after $1 (--stop_after)"; exit 0; fi
}
skip() { say "stage $1 skipped: $2"; if [ "$STOP_AFTER" = "$1" ]; then exit 0; fi; }

export PYTHONUNBUFFERED=1  # every line reaches the log and the terminal when printed

# --- the interpreter
# .venv counts as installed only when it holds the sha256 of the requirements.txt whose pip install completed: an
# interrupted pip, or a venv made without pip (python3-venv missing), is repaired or redone, never skipped
if [ -n "${SPEEDRUN_PYTHON:-}" ]; then
    PY=$SPEEDRUN_PYTHON
else
    VENV=$ROOT/.venv
    want=$(sha256sum "$ROOT/requirements.txt" | cut -d' ' -f1)
    have=$(cat "$VENV/installed-requirements.sha256" 2>/dev/null || true)
    if [ "$have" != "$want" ]; then
        if [ ! -x "$VENV/bin/python" ] || ! "$VENV/bin/python" -m pip --version > /dev/null 2>&1; then
            if [ -e "$VENV" ]; then
                say "$VENV has no working python or pip (an interrupted creation, or python3-venv missing):" \
                    "recreating it"
            else
                say "creating $VENV from requirements.txt"
            fi
            rm -rf "$VENV"
            if ! python3 -m venv "$VENV"; then
                rm -rf "$VENV"
                echo "speedrun.sh: error: \`python3 -m venv $VENV\` failed: install the venv module (Debian/Ubuntu:" \
                    "\`apt-get install python3-venv\`) and rerun, or set SPEEDRUN_PYTHON to an interpreter with" \
                    "requirements.txt installed" >&2
                exit 1
            fi
        elif [ -n "$have" ]; then
            say "requirements.txt changed since $VENV was installed: installing it again"
        else
            say "$VENV is a half install (no record that pip install -r requirements.txt completed): repairing it"
        fi
        if ! "$VENV/bin/python" -m pip install -q -r "$ROOT/requirements.txt"; then
            echo "speedrun.sh: error: pip install -r $ROOT/requirements.txt into $VENV failed (above); fix the cause" \
                "and rerun: the install is repaired then (or delete $VENV to start it afresh)" >&2
            exit 1
        fi
        echo "$want" > "$VENV/installed-requirements.sha256"
        say "$VENV: requirements.txt installed (sha256 ${want:0:12}... recorded in $VENV/installed-requirements.sha256)"
    fi
    PY=$VENV/bin/python
fi

# --- GPUs: how many, and whether something else holds them (zombie workers of an earlier run hold GPU memory)
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
# GPUs the driver sees but torch cannot use (a driver older than the CUDA the torch wheel was built for): an error,
# never a silent CPU run on a rented GPU box
explain_driver() {  # torch sees no GPU: when nvidia-smi lists some, the driver and wheel versions and the fix
    local smi_gpus=0 driver driver_cuda torch_version torch_cuda
    command -v nvidia-smi > /dev/null 2>&1 &&
        smi_gpus=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | grep -c . || true)
    [ "$smi_gpus" -gt 0 ] || return 0
    driver=$(nvidia-smi --query-gpu=driver_version --format=csv,noheader 2>/dev/null | sed -n '1{s/ //g;p;}')
    driver_cuda=$(nvidia-smi 2>/dev/null | sed -n 's/.*CUDA Version: *\([0-9.]*\).*/\1/p' | sed -n 1p)
    read -r torch_version torch_cuda <<< "$("$PY" -c 'import torch; print(torch.__version__, torch.version.cuda)')"
    echo "speedrun.sh: error: nvidia-smi lists $smi_gpus GPU(s) but torch $torch_version sees none. The driver" \
        "is ${driver:-unknown} (it supports CUDA ${driver_cuda:-unknown}); this torch wheel was built for CUDA" \
        "$([ "$torch_cuda" = None ] && echo "none (a CPU-only wheel)" || echo "$torch_cuda")." >&2
    echo "Install a torch wheel built for a CUDA the driver supports, e.g. \`$PY -m pip install" \
        "torch==${torch_version%%+*} --index-url https://download.pytorch.org/whl/cuXYZ\` with XYZ at most" \
        "${driver_cuda:-that of the driver} without the dot (pytorch.org lists the builds), or update" \
        "the driver; --gpus 0 runs on the CPU regardless." >&2
    exit 1
}
check_torch_sees_gpus() {  # --gpus N: torch must see N CUDA GPUs, else N CPU processes would train the gpu plan
    local seen
    [ "$PROBE_ONLY" = 1 ] && [ -n "${SPEEDRUN_PROBE_CMD:-}" ] && return 0  # a stand-in probe (tests) uses no GPU
    case "$STOP_AFTER" in data|tokenizer|download) return 0 ;; esac  # nothing trains: a CPU box may fetch the data
    seen=$("$PY" -c 'import torch; print(torch.cuda.device_count())')
    [ "$seen" -ge "$GPUS" ] && return 0
    if [ "$seen" = 0 ] && { [ "$PLAN" = demo ] || [ "${REHEARSE:-0}" = 1 ]; }; then
        say "--gpus $GPUS and torch sees no CUDA GPU: $GPUS CPU processes on gloo (only the demo plan and a" \
            "rehearsal run so)"
        return 0
    fi
    [ "$seen" = 0 ] && explain_driver
    echo "speedrun.sh: error: --gpus $GPUS, but torch sees $seen CUDA GPU(s): pass --gpus $seen$([ "$seen" = 0 ] &&
        echo " (the CPU)"), or make the GPUs visible (CUDA_VISIBLE_DEVICES)" >&2
    exit 1
}
if [ "$GPUS" = auto ]; then
    GPUS=$("$PY" -c 'import torch; print(torch.cuda.device_count())')
    [ "$GPUS" = 0 ] && explain_driver
elif [ "$GPUS" -gt 0 ]; then
    check_torch_sees_gpus
fi
[ "$PLAN" = auto ] && { [ "$GPUS" -gt 0 ] && PLAN=gpu || PLAN=demo; }
[ "$RL_STAGE" = auto ] && { [ "$PLAN" = gpu ] && RL_STAGE=on || RL_STAGE=off; }
# only a rehearsal runs the gpu plan on the CPU: there --gpus N without CUDA means N CPU processes on gloo
ON_CPU=0
if [ "$PLAN" = gpu ] && [ "$REHEARSE" = 1 ] &&
    { [ "$GPUS" = 0 ] || [ "$("$PY" -c 'import torch; print(torch.cuda.device_count())')" = 0 ]; }; then
    ON_CPU=1
fi
if [ "$PLAN" = gpu ] && [ "$GPUS" -lt 1 ] && [ "$PROBE_ONLY" = 0 ] && [ "$REHEARSE" = 0 ]; then
    echo "speedrun.sh: error: --plan gpu needs CUDA GPUs and torch sees none; use --plan demo on the CPU (or" \
        "--rehearse --gpus N: the gpu plan's rehearsal on N CPU processes)" >&2
    exit 2
fi
if [ "$PLAN" = demo ] && [ "$STOP_AFTER" = download ]; then
    echo "speedrun.sh: error: --stop_after download: the demo plan has no download stage (use data)" >&2
    exit 2
fi
NPROC=$((GPUS > 0 ? GPUS : 1))
LAUNCH=("$PY" -m torch.distributed.run --standalone "--nproc_per_node=$NPROC")
say "plan $PLAN$([ "$REHEARSE" = 1 ] && echo " (rehearsal)"), run $RUN, $NPROC process(es) per stage" \
    "($([ "$GPUS" -gt 0 ] && [ "$ON_CPU" = 0 ] && echo "$GPUS GPUs" || echo CPU))," \
    "commit $(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo unknown)"

# --- the batch: the gpu plan's tokens a step must split over the processes (524,288 over 3, 5, 6 or 7 does not, and
# then no micro-batch fits): refused now, not after the downloads, the tokenizer and the memory probe
GPU_BUDGET=(--preset "d$DEPTH" --tokens_per_param 20 --total_batch_tokens 524288)  # the gpu plan's pretraining
if [ "$PLAN" = gpu ] && [ "$PROBE_ONLY" = 0 ]; then
    read -r -a extra <<< "${PRETRAIN_ARGS:-}"
    checked=$("$PY" "$ROOT/pretrain.py" --check_batch "$NPROC" "${GPU_BUDGET[@]}" "${extra[@]}") || exit 1
    say "$checked"
fi

# --- NCCL: a 4-byte and a timed gradient-bucket-sized all-reduce before training; on a hang or failure, the safe
# flags (P2P and InfiniBand off, sockets over loopback: what stopped multi-GPU runs from hanging), their cost printed
SAFE_FLAGS="NCCL_P2P_DISABLE=1 NCCL_IB_DISABLE=1 NCCL_SOCKET_IFNAME=lo NCCL_NET=Socket NCCL_NET_PLUGIN=none"
PROBE_TIMEOUT=${SPEEDRUN_PROBE_TIMEOUT:-120}
PROBE_MB=${SPEEDRUN_PROBE_MB:-64}  # a gradient bucket's size: where NVLS and P2P over NVSwitch take over
PROBE_BW=""  # the last probe's measured bus bandwidth ("12.34 GB/s"), empty when it printed none
end_probe() {  # PGID: nothing of a (hung) probe survives: its group, and torchrun's workers (sessions of their own,
    # found by the probe's own mark, so a background download of this run is left alone)
    local t pids
    kill -KILL -- "-$1" 2>/dev/null || true
    for ((t = 0; t < 100; t++)); do
        pids=$(grep -lzxF "SPEEDRUN_MARK=$MARK.probe" /proc/[0-9]*/environ 2>/dev/null | cut -d/ -f3 || true)
        [ -z "$pids" ] && break
        # shellcheck disable=SC2086  # a list of pids
        kill -KILL $pids 2>/dev/null || true
        sleep 0.1
    done
    STAGE_PGIDS=()
}
probe() {  # the probe in its own process group under a hard timeout; its status
    local rc=0 before pid
    before=$({ cat "$LOGS/probe.log" 2>/dev/null || true; } | wc -l)
    if [ -n "${SPEEDRUN_PROBE_CMD:-}" ]; then  # tests inject a hang here
        SPEEDRUN_MARK=$MARK.probe setsid timeout -k 5 "$PROBE_TIMEOUT" bash -c "$SPEEDRUN_PROBE_CMD" \
            >> "$LOGS/probe.log" 2>&1 &
    else
        SPEEDRUN_MARK=$MARK.probe setsid timeout -k 5 "$PROBE_TIMEOUT" "${LAUNCH[@]}" "$ROOT/distributed.py" probe \
            --timeout "$PROBE_TIMEOUT" --mbytes "$PROBE_MB" >> "$LOGS/probe.log" 2>&1 < /dev/null &
    fi
    pid=$!
    STAGE_PGIDS+=("$pid")
    wait "$pid" || rc=$?
    end_probe "$pid"
    PROBE_BW=$(tail -n "+$((before + 1))" "$LOGS/probe.log" 2>/dev/null |
        sed -n 's/.*all-reduce over .*: ok, .* bus bandwidth \([0-9.]* GB\/s\|n\/a: one GPU\).*/\1/p' | tail -1)
    return "$rc"
}
declare -A NCCL_BEFORE=()  # the NCCL variables the safe flags replace, as the caller had them (unset: absent)
use_safe_flags() {
    local kv name
    for kv in $SAFE_FLAGS; do
        name=${kv%%=*}
        if [ "$FALLBACK" = 0 ] && [ -n "${!name+set}" ]; then NCCL_BEFORE[$name]=${!name}; fi
        export "${kv?}"
    done
}
use_default_flags() {  # the caller's own NCCL variables back
    local kv name
    for kv in $SAFE_FLAGS; do
        name=${kv%%=*}
        if [ -n "${NCCL_BEFORE[$name]+set}" ]; then export "$name=${NCCL_BEFORE[$name]}"; else unset "$name"; fi
    done
}
FALLBACK=0 SAFE_BW="" DEFAULT_BW=""  # FALLBACK=1: on the safe flags because the default flags failed their probe
if [ "$GPUS" -eq 0 ] || [ "$ON_CPU" = 1 ]; then
    TRANSPORT="gloo (cpu)"
elif [ "${NCCL_SAFE:-0}" = 1 ]; then
    use_safe_flags
    TRANSPORT="nccl safe flags (NCCL_SAFE=1: $SAFE_FLAGS)"
elif probe; then
    TRANSPORT="nccl default, all-reduce bus bandwidth ${PROBE_BW:-unknown} (${PROBE_MB} MB message)"
else
    rc=$?
    DEFAULT_BW=${PROBE_BW:-none: it $([ "$rc" = 124 ] || [ "$rc" = 137 ] && echo hung || echo failed)}
    say "NCCL probe failed (exit $rc$([ "$rc" = 124 ] || [ "$rc" = 137 ] && echo ", hung past ${PROBE_TIMEOUT}s")):" \
        "retrying with the safe flags $SAFE_FLAGS; log: $LOGS/probe.log"
    use_safe_flags
    FALLBACK=1
    if probe; then
        SAFE_BW=${PROBE_BW:-unknown}
        TRANSPORT="nccl safe flags ($SAFE_FLAGS), all-reduce bus bandwidth ${PROBE_BW:-unknown}"
        TRANSPORT+=" (${PROBE_MB} MB message; default flags: $DEFAULT_BW)"
        say "the safe flags cost: all-reduce bus bandwidth ${PROBE_BW:-unknown} with them (P2P and InfiniBand off:" \
            "gradients go through host memory and sockets); with the default flags: $DEFAULT_BW"
    else
        rc=$?
        echo "speedrun: stage nccl_probe failed (exit $rc) even with the safe flags; log: $LOGS/probe.log" >&2
        exit "$rc"
    fi
fi
echo "$TRANSPORT" > "$RUN/transport.txt"
say "transport: $TRANSPORT"
[ "$PROBE_ONLY" = 1 ] && exit 0
# one failed probe (a slow cold start, a transient fault) must not pin the safe flags for hours: before each later
# torchrun stage the default flags are probed again, and used again once they pass
reprobe() {  # STAGE
    [ "$FALLBACK" = 1 ] || return 0
    local rc=0 start took
    start=$(date +%s)
    use_default_flags
    probe || rc=$?
    took=$(($(date +%s) - start))
    if [ "$rc" = 0 ]; then
        FALLBACK=0
        TRANSPORT+="; from stage $1 on: nccl default, all-reduce bus bandwidth ${PROBE_BW:-unknown}"
        say "NCCL probe before stage $1 (${took}s): the default flags pass now, all-reduce bus bandwidth" \
            "${PROBE_BW:-unknown} against $SAFE_BW with the safe flags (what the fallback cost each stage since):" \
            "stage $1 and the later ones use the defaults"
    else
        use_safe_flags
        say "NCCL probe before stage $1 (${took}s): the default flags fail again (exit $rc$([ "$rc" = 124 ] ||
            [ "$rc" = 137 ] && echo ", hung past ${PROBE_TIMEOUT}s")): stage $1 keeps the safe flags, all-reduce bus" \
            "bandwidth $SAFE_BW (default flags at the start: $DEFAULT_BW); log: $LOGS/probe.log"
    fi
    echo "$TRANSPORT" > "$RUN/transport.txt"
}

split_args() { read -r -a "$1" <<< "${2:-}"; }  # an env var's words as an array (no globbing, no eval)
split_args PRETRAIN_EXTRA "${PRETRAIN_ARGS:-}"
split_args MIDTRAIN_EXTRA "${MIDTRAIN_ARGS:-}"
split_args SFT_EXTRA "${SFT_ARGS:-}"
split_args RL_EXTRA "${RL_ARGS:-}"
split_args CORE_EXTRA "${CORE_ARGS:-}"
split_args CHAT_EVAL_EXTRA "${CHAT_EVAL_ARGS:-}"

# --- a rehearsal: every stage with the plan's own command line, data and world size, and a tiny budget appended last
# (the last of a repeated flag wins): a few steps, items or checkpoints each, so that a bug in any stage shows in
# minutes instead of after hours of pretraining
R_DATA=() R_TOK=() R_PRETRAIN=() R_SHAPE=() R_CORE=() R_MIDTRAIN=() R_SFT=() R_RL=() R_CHAT_EVAL=()
REHEARSAL_STEPS=(3 3 3)  # pretrain, midtrain, sft: each saves a checkpoint at step 2 and at its end
REHEARSAL_PROMPT="Why do plants need light?"
if [ "$REHEARSE" = 1 ]; then
    R_DATA=(--shards 2)  # the first shard (the tokenizer's and the data plan's) and one more; the data plan asks
    R_TOK=(--max_chars 20000000)
    # one sample prompt per evaluation, and short samples: generating them is most of a tiny evaluation
    R_PRETRAIN=(--steps "${REHEARSAL_STEPS[0]}" --eval_every 0 --ckpt_every 2 --keep 1 --bpb_tokens 32768
                --sample_prompt "The capital of France is")
    R_MIDTRAIN=(--steps "${REHEARSAL_STEPS[1]}" --eval_every 0 --eval_rows 16 --ckpt_every 2 --keep 1
                --sample_prompt "$REHEARSAL_PROMPT")
    R_SFT=(--steps "${REHEARSAL_STEPS[2]}" --eval_every 0 --eval_rows 16 --ckpt_every 2 --keep 1
           --sample_prompt "$REHEARSAL_PROMPT")
    # rl.py deals each step's questions over the ranks: at least one each (8 GPUs: 8 questions a step)
    R_RL=(--steps 2 --questions_per_step $((NPROC > 2 ? NPROC : 2)) --samples 2 --max_new_tokens 16 --eval_every 0
          --eval_items $((NPROC > 2 ? NPROC : 2)) --eval_samples 2 --ckpt_every 1 --keep 1)
    R_CORE=(--max_items 4 --bpb_tokens 32768 --max_new_tokens 8)
    R_CHAT_EVAL=(--max_items 2 --max_new_tokens 32)
    # the gpu plan on CPU processes: the plan's 256 sequences a step, each 128 tokens instead of 2048 (midtraining's
    # streams per rank are the same at any micro-batch); the later stages inherit the shape
    [ "$ON_CPU" = 1 ] && R_SHAPE=(--sequence_len 128 --total_batch_tokens 32768)
    say "rehearsal: pretrain ${REHEARSAL_STEPS[0]} steps, midtrain ${REHEARSAL_STEPS[1]}, sft ${REHEARSAL_STEPS[2]}" \
        "(a checkpoint every 2), CORE ${R_CORE[1]} items a task," \
        "ChatCORE ${R_CHAT_EVAL[1]}$([ "$ON_CPU" = 1 ] && echo "; on the CPU: ${R_SHAPE[*]}")"
fi

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
    STAGE_CKPT="$RUN/$name/ckpt"
    stage "$name" "${LAUNCH[@]}" "$script" "$@" --runs_dir "$RUN" --run_name "$name" "${resume[@]}"
    STAGE_CKPT="" SPEEDRUN_ETA=0
}

# --- data and tokenizer
PREFETCH_PID=""
wait_prefetch() {  # [WHERE]: wait for the background fetch of the chat data and CORE bundle; its failure stops the run
    local rc=0
    [ -n "$PREFETCH_PID" ] || return 0
    say "waiting for the prefetch of the chat data and the CORE bundle (log: $LOGS/prefetch.log)"
    wait "$PREFETCH_PID" || rc=$?
    PREFETCH_PID="" BG_PGIDS=()
    if [ "$rc" != 0 ]; then
        echo "speedrun: stage prefetch failed (exit $rc)$1; log: $LOGS/prefetch.log; fix its cause and rerun (what" \
            "finished is kept)" >&2
        exit "$rc"
    fi
}
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
    # fail in minutes, not hours: the later stages' datasets are listed now (a gated or missing one stops the run
    # here; the ChatCORE tasks' test files are small and fetched now), then the chat data and the CORE bundle are
    # fetched in the background
    stage preflight "$PY" "$ROOT/dataset.py" download-chat --check "${CHAT_SOURCES[@]}"
    stage chatcore_tasks "$PY" "$ROOT/chat_eval.py" --download_only "${CHAT_EVAL_EXTRA[@]}"
    say "fetching ${CHAT_SOURCES[*]} and the CORE bundle in the background (log: $LOGS/prefetch.log)"
    # the inner bash gets: python, root, the number of chat sources, the sources, then CORE_ARGS (its --bundle is
    # the bundle fetched)
    # shellcheck disable=SC2016  # expanded by the inner bash
    SPEEDRUN_MARK=$MARK setsid bash -c 'py=$1 root=$2 n=$3; shift 3
        "$py" "$root/dataset.py" download-chat "${@:1:n}" && "$py" "$root/core_eval.py" --download_only "${@:n+1}"' \
        prefetch "$PY" "$ROOT" "${#CHAT_SOURCES[@]}" "${CHAT_SOURCES[@]}" "${CORE_EXTRA[@]}" \
        >> "$LOGS/prefetch.log" 2>&1 < /dev/null &
    PREFETCH_PID=$!
    BG_PGIDS+=("$PREFETCH_PID")
    # 8 shards first (what the tokenizer trains on, and what the budget's shard count is measured on). A complete
    # shard is never fetched again.
    stage data "$PY" "$ROOT/dataset.py" download --shards 8 --data_dir "$CORPUS" "${R_DATA[@]}"
fi
if [ -n "$TOKENIZER" ]; then
    TOK=$TOKENIZER
    skip tokenizer "using --tokenizer $TOK"
elif [ -f "$RUN/tokenizer/tokenizer.json" ]; then
    TOK="$RUN/tokenizer"
    skip tokenizer "$TOK/tokenizer.json exists"
else
    TOK="$RUN/tokenizer"
    stage tokenizer "$PY" "$ROOT/tokenizer.py" train --data_dir "$CORPUS" --vocab_size "$VOCAB" --out "$TOK" "${R_TOK[@]}"
fi
if [ "$PLAN" = gpu ]; then
    # the shards the budget needs (a deeper model needs more: d24 about 340, d26 about 415), measured with this
    # tokenizer; the same step checks the free disk against the shards and the checkpoints to come
    stage data_plan "$PY" "$ROOT/pretrain.py" --data_plan --data_dir "$CORPUS" --tokenizer "$TOK" --runs_dir "$RUN" \
        "${GPU_BUDGET[@]}" --ckpt_every 1000 "${PRETRAIN_EXTRA[@]}" "${R_PRETRAIN[@]}" \
        "${R_SHAPE[@]}"  # the stages' --ckpt_every: checkpoints on disk
    NEEDED=$(sed -n 's/^data plan shards: \([0-9]*\)$/\1/p' "$LOGS/data_plan.log" | tail -1)
    if [ -z "$SHARDS" ]; then
        SHARDS=$NEEDED
    elif [ "$SHARDS" -lt "$NEEDED" ]; then
        say "--shards $SHARDS is fewer than the $NEEDED the budget needs: pretraining will repeat data (it says so)"
    fi
    SPEEDRUN_LOG="$LOGS/download.log"
    run_stage download "$PY" "$ROOT/dataset.py" download --shards "$SHARDS" --data_dir "$CORPUS"
    # the prefetch may still run: pretraining does not wait for it, but if it has failed already, stop before the hours
    if ! kill -0 "$PREFETCH_PID" 2>/dev/null || [ "$STOP_AFTER" = download ]; then
        wait_prefetch " before pretraining"
    fi
    if [ "$STOP_AFTER" = download ]; then
        say "stopping after download (--stop_after): every shard and the chat and evaluation data are in"
        exit 0
    fi
fi

# --- the stages
if [ "$PLAN" = demo ]; then
    # measured on a 2-core Xeon with AMX (dev/LOG.md): about 10 minutes for the whole pipeline
    PRETRAIN=(--preset tiny --steps 400 --micro_batch 16 --compile true --eval_every 200 --ckpt_every 100)
    # conversations, and the shapes ChatCORE asks for: letters (choice), bare answers (answers), the calculator (calc)
    MIDTRAIN=(--source "text:$CORPUS:0.3" --source "chat:$DATA_DIR/conversations:0.4" --source "chat:$DATA_DIR/choice:0.1"
              --source "chat:$DATA_DIR/answers:0.1" --source "chat:$DATA_DIR/calc:0.1" --supervise assistant
              --steps 200 --eval_every 0 --ckpt_every 100)
    SFT=(--source "$DATA_DIR/conversations:1" --source "$DATA_DIR/choice:1" --source "$DATA_DIR/answers:1"
         --source "$DATA_DIR/calc:1" --steps 200 --eval_every 0 --ckpt_every 100)
    # reinforcement learning on the world's sums and short answers, only with --rl on; held out: chat_eval's
    # demo-answer questions (dev/LOG.md, 2026-11-25: on the baseline chain it LOWERED them, 84/109 -> 78/109)
    RL=(--demo "$DATA_DIR" --steps 20 --questions_per_step 8 --samples 8 --max_new_tokens 32 --micro_batch 32
        --lr_scale 0.05 --eval_every 0 --eval_items -1 --eval_samples 4 --ckpt_every 10)
    CHAT_EVAL=(--demo "$DATA_DIR" --max_new_tokens 32 --tasks demo-choice,demo-answer,demo-words)
    STAGE_CORE=(--bundle "$DATA_DIR/eval_bundle")
else
    PRETRAIN=("${GPU_BUDGET[@]}" --eval_every 250 --ckpt_every 1000)
    MIDTRAIN=(--tokens 500000000 --ckpt_every 1000)
    SFT=(--epochs 1 --ckpt_every 1000)  # sft.py's mixture: SmolTalk, MMLU x3, GSM8K x4, ARC, identity
    RL=(--demo none --epochs 1 --ckpt_every 60)  # GSM8K train, held out: GSM8K test (nanochat's chat_rl)
    CHAT_EVAL=(--demo none)
    STAGE_CORE=()
    if [ "$REHEARSE" = 1 ]; then
        say "plan: d$DEPTH ('python model.py --preset d$DEPTH' for its parameters) on $NPROC" \
            "$([ "$ON_CPU" = 1 ] && echo "CPU processes" || echo GPUs), the rehearsal's budget appended to each stage"
    else
        say "plan: d$DEPTH ('python model.py --preset d$DEPTH' for its parameters), 20 tokens per parameter at" \
            "524,288 tokens a step on $GPUS GPUs; pretrain.py prints the parameters, tokens and steps before step 1," \
            "and this script the expected time measured after the first timed steps"
        say "plan: rl: one epoch of GSM8K's 7,473 training questions, 16 a step, 16 replies each (up to 256 tokens):" \
            "468 steps, at most 1.9M tokens sampled. Its share of the time is not known before it runs (sampling, not" \
            "training, sets its pace): rl.py prints its ETA after its first step, report.md every stage's wall time"
    fi
fi

# --- the gpu plan rehearses before its pretraining: every stage for a few steps or items, with this tokenizer, data
# and GPUs, into <run_name>-rehearsal (once: a run whose pretraining has started, or whose rehearsal passed, does not
# rehearse again); its checkpoints are deleted after it passes (the real run needs the disk)
if [ "$PLAN" = gpu ] && [ "$REHEARSE" = 0 ]; then
    REHEARSAL_RUN="$RUNS_DIR/$RUN_NAME-rehearsal"
    if [ "$NO_REHEARSE" = 1 ]; then
        skip rehearsal "--no_rehearse"
    elif [ -f "$REHEARSAL_RUN/rehearsed.json" ]; then
        skip rehearsal "it passed before ($REHEARSAL_RUN/rehearsed.json)"
    elif [ -d "$RUN/pretrain" ]; then
        skip rehearsal "pretraining has started already"
    else
        wait_prefetch " before the rehearsal"  # the rehearsal's midtraining reads the chat data
        stage rehearsal env SPEEDRUN_PYTHON="$PY" bash "$ROOT/speedrun.sh" --rehearse --no_chat --plan gpu \
            --depth "$DEPTH" --run_name "$RUN_NAME" --runs_dir "$RUNS_DIR" --data_dir "$CORPUS" --gpus "$GPUS" \
            --tokenizer "$TOK" --stage_evals "${STAGE_EVALS:-none}" --rl "$RL_STAGE" $([ "$FORCE" = 1 ] && echo --force)
        freed=$(du -sch "$REHEARSAL_RUN"/*/ckpt 2>/dev/null | tail -1 | cut -f1)
        rm -rf "$REHEARSAL_RUN"/*/ckpt
        say "the rehearsal cost $(tail -n 1 "$LOGS/stages.tsv" | cut -f2) s before pretraining; every stage passed" \
            "($REHEARSAL_RUN/report.md; its checkpoints deleted: ${freed:-0})"
    fi
fi

train_stage pretrain "$ROOT/pretrain.py" --data_dir "$CORPUS" --tokenizer "$TOK" "${PRETRAIN[@]}" "${PRETRAIN_EXTRA[@]}" \
    "${R_PRETRAIN[@]}" "${R_SHAPE[@]}"

wait_prefetch ""
if [ -f "$RUN/core_eval/results.json" ]; then
    skip core_eval "$RUN/core_eval/results.json exists"
else
    stage core_eval "${LAUNCH[@]}" "$ROOT/core_eval.py" --checkpoint "$RUN/pretrain" --out "$RUN/core_eval" "${CORE_EXTRA[@]}" \
        "${R_CORE[@]}"
fi

train_stage midtrain "$ROOT/midtrain.py" --checkpoint "$RUN/pretrain" "${MIDTRAIN[@]}" "${MIDTRAIN_EXTRA[@]}" "${R_MIDTRAIN[@]}"
train_stage sft "$ROOT/sft.py" --checkpoint "$RUN/midtrain" "${SFT[@]}" "${SFT_EXTRA[@]}" "${R_SFT[@]}"
if [ "$RL_STAGE" = on ]; then
    train_stage rl "$ROOT/rl.py" --checkpoint "$RUN/sft" "${RL[@]}" "${RL_EXTRA[@]}" "${R_RL[@]}"
    FINAL=rl
else  # the demo world's RL questions are SFT's own, already answered (reward 0.96 at its first step): nothing to learn
    skip rl "--rl off$([ "$PLAN" = demo ] && echo " (the demo plan's default: on the demo world it lowered held-out" \
        "accuracy, docs/rl.md; --rl on runs it)")"
    FINAL=sft
fi

if [ -f "$RUN/chat_eval.json" ]; then
    skip chat_eval "$RUN/chat_eval.json exists"
else
    stage chat_eval "${LAUNCH[@]}" "$ROOT/chat_eval.py" --checkpoint "$RUN/$FINAL" --out "$RUN/chat_eval.json" \
        "${CHAT_EVAL[@]}" "${CHAT_EVAL_EXTRA[@]}" "${R_CHAT_EVAL[@]}"
fi

# what each stage taught (report.py's per-stage table): the same evaluations of every stage's final model (those of
# --stage_evals), each into runs/<run>/stage_evals/<stage>/ (the pretrained model's CORE is core_eval/ above; the
# final model's ChatCORE is chat_eval's, the same command on the same checkpoint, copied rather than run twice)
for name in pretrain midtrain sft rl; do
    [[ ",$STAGE_EVALS," == *",$name,"* ]] || continue
    compgen -G "$RUN/$name/ckpt/step_*" > /dev/null || continue
    where="$RUN/stage_evals/$name"
    if [ ! -f "$where/chat_eval.json" ] && [ -f "$RUN/chat_eval.json" ] && "$PY" -c 'import json, pathlib, sys
evaluated = pathlib.Path(json.loads(pathlib.Path(sys.argv[1]).read_text())["checkpoint"]).resolve()
sys.exit(evaluated.parent.parent != pathlib.Path(sys.argv[2]).resolve())' "$RUN/chat_eval.json" "$RUN/$name"; then
        mkdir -p "$where"
        cp "$RUN/chat_eval_items.jsonl" "$where/chat_eval_items.jsonl"
        cp "$RUN/chat_eval.json" "$where/chat_eval.json"  # last: its presence says the pair is whole
        say "stage_evals/$name/chat_eval.json: chat_eval's, of the same checkpoint"
    fi
    if [ "$name" != pretrain ] && [ ! -f "$where/core_eval/results.json" ]; then
        stage "core_eval_$name" "${LAUNCH[@]}" "$ROOT/core_eval.py" --checkpoint "$RUN/$name" --out "$where/core_eval" \
            --data_dir "$CORPUS" "${STAGE_CORE[@]}" "${CORE_EXTRA[@]}" "${R_CORE[@]}"
    fi
    if [ ! -f "$where/chat_eval.json" ]; then
        stage "chat_eval_$name" "${LAUNCH[@]}" "$ROOT/chat_eval.py" --checkpoint "$RUN/$name" --out "$where/chat_eval.json" \
            "${CHAT_EVAL[@]}" "${CHAT_EVAL_EXTRA[@]}" "${R_CHAT_EVAL[@]}"
    fi
done

stage report "$PY" "$ROOT/report.py" "$RUN"

if [ "$REHEARSE" = 1 ]; then  # one answer of the final model, the stages' times, and the record that it passed
    stage chat "$PY" "$ROOT/chat.py" --runs_dir "$RUN" -p "$REHEARSAL_PROMPT" --temperature 0 --max_new_tokens 32
    say "rehearsal passed in $SECONDS s; each stage's time (s):"
    tail -n "+$((STAGES_BEFORE + 1))" "$LOGS/stages.tsv" | awk -F '\t' '{ printf "  %-15s %8s\n", $1, $2 }' |
        tee -a "$LOGS/speedrun.log"
    tail -n "+$((STAGES_BEFORE + 1))" "$LOGS/stages.tsv" | awk -F '\t' -v s="$SECONDS" -v n="$NPROC" -v p="$PLAN" \
        -v c="$ON_CPU" 'BEGIN { printf "{\"plan\": \"%s\", \"processes\": %d, \"cpu\": %s, \"seconds\": %d, " \
        "\"stages\": {", p, n, c ? "true" : "false", s }
        { printf "%s\"%s\": %s", (NR > 1 ? ", " : ""), $1, $2 } END { print "}}" }' > "$RUN/rehearsed.json"
    exit 0
fi

if [ "$NO_CHAT" = 0 ] && [ -t 0 ] && [ -t 1 ]; then
    say "chat: $PY $ROOT/chat.py --runs_dir $RUN (Ctrl-D or /quit to leave)"
    "$PY" "$ROOT/chat.py" --runs_dir "$RUN"
else
    say "done. Chat with it: $PY $ROOT/chat.py --runs_dir $RUN"
fi
