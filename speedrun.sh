#!/usr/bin/env bash
# speedrun.sh: the main job. From nothing to a model you chat with, every stage in order,
# resumable. docs/speedrun.md.
#   bash speedrun.sh             # gpu plan with CUDA GPUs, else the offline demo plan on the CPU
#   bash speedrun.sh --rehearse  # every stage of the plan for a few steps or items, in minutes
#   bash speedrun.sh --print     # every stage's command line for these flags; nothing runs
#   bash speedrun.sh --corpus DIR --chat FILE.jsonl  # your own data (docs/own-data.md)
#   bash speedrun.sh --help      # every flag with its default
# Each stage is one of this repository's scripts, run by launch.py in its own process group (under
# torchrun: one process per GPU, or per CPU process given by --gpus N; --gpus 0: one process), its
# output to the terminal and to runs/<run>/logs/<stage>.log. A rerun skips the stages that finished
# and resumes a training stage from its checkpoint.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")" && pwd)  # the scripts; relative paths (--runs_dir ...) are the caller's
export PYTHONUNBUFFERED=1  # every line reaches the log and the terminal when printed
L=(python3 "$ROOT/launch.py")  # the standard library only, so it runs before .venv exists
say() {
    if [ "$PRINT" = 1 ]; then echo "# $*"
    else echo "speedrun: $*" | tee -a "$LOGS/speedrun.log"; fi
}

# --- launch.py setup checks the flags (--help), the interpreter, the machine and the plan before
# any stage, and writes the variables: the flags (DEPTH ... PRINT; INGEST: --corpus), RUN LOGS PY
# (SPEEDRUN_PYTHON, else .venv) PLAN GPUS NPROC ON_CPU LAUNCH DATA_DIR CORPUS OWN_TEXT VOCAB MARK,
# *_EXTRA (*_ARGS' words), R_*, gpu_plan.py's arrays
SETUP=$(mktemp)  # the file removes itself
"${L[@]}" setup "$SETUP" "$@" || { rc=$?; rm -f "$SETUP"; exit "$rc"; }
. "$SETUP"
if [ "$PRINT" = 1 ]; then L+=(--print); fi  # launch.py prints each stage's command line instead

# Stopping: a signal is passed on to the running launch.py, which ends the stage (a training stage
# checkpoints first, given SPEEDRUN_KILL_WAIT); on any exit, every process still carrying this
# run's MARK is ended the same way.
launch() {
    "${L[@]}" "$1" --run "$RUN" "${@:2}" & LAUNCHER=$!
    wait "$LAUNCHER" || exit
    LAUNCHER=""
}
stopped() {  # SIGNAL STATUS
    trap '' INT TERM HUP  # a second Ctrl-C must not cut the checkpoint short
    echo "speedrun: stopped by SIG$1: ending every stage (each training stage checkpoints first);" \
        "rerun the same command to resume" >&2 || true  # the terminal may be gone (SIGHUP)
    if [ -n "${LAUNCHER:-}" ]; then
        kill -s "$1" "$LAUNCHER" 2> /dev/null || true
        wait "$LAUNCHER" || true
    fi
    exit "$2"
}
trap '"${L[@]}" end --run "$RUN"' EXIT
trap 'stopped INT 130' INT; trap 'stopped TERM 143' TERM; trap 'stopped HUP 129' HUP
# stage NAME [--train] [--skip_if PATH] COMMAND...: --train: skipped once NAME/done.json exists,
# else resumed from its last checkpoint; --skip_if: skipped when PATH exists. A failed stage stops
# the run with its exit status.
stage() {
    launch stage "$@"
    if [ "$STOP_AFTER" = "$1" ]; then say "stopping after $1 (--stop_after)"; exit 0; fi
}
skip() { say "stage $1 skipped: $2"; if [ "$STOP_AFTER" = "$1" ]; then exit 0; fi; }

# --- the plan: each stage's flags (the gpu plan's: gpu_plan.py), then *_EXTRA, then R_* (the last
# repeated flag wins)
# the demo plan: about 12 minutes on a 2-core Xeon with AMX, over 20 without bf16 (dev/LOG.md)
if [ "$PLAN" = demo ]; then
    PRETRAIN=(--preset tiny --steps 400 --micro_batch 16 --compile true --eval_every 200
              --ckpt_every 100)
    # the shapes ChatCORE asks for: letters (choice), bare answers, the calculator (calc), word
    # problems
    ASK=(--sample_prompt "What is the capital of Pellan?"
         --sample_prompt "Which animal stands for Brenia?" --sample_prompt "What is 17 plus 25?"
         --sample_prompt
    "Mira has 5 plums. She buys 3 bags with 4 plums in each. How many plums does Mira have now?"
         --sample_prompt "Who are you?")
    MIDTRAIN=(--source "text:$CORPUS:0.2" --source "chat:$DATA_DIR/conversations:0.4"
              --source "chat:$DATA_DIR/choice:0.1" --source "chat:$DATA_DIR/answers:0.1"
              --source "chat:$DATA_DIR/calc:0.1" --source "chat:$DATA_DIR/problems:0.1"
              --supervise assistant --steps 200 --eval_every 0 --ckpt_every 100 "${ASK[@]}")
    # SFT: about one epoch of its sources; at 200 steps: up to 20 fewer problems (dev/LOG.md)
    SFT=(--source "$DATA_DIR/conversations:1" --source "$DATA_DIR/choice:1"
         --source "$DATA_DIR/answers:1" --source "$DATA_DIR/calc:1" --source "$DATA_DIR/problems:1"
         --steps 300 --eval_every 0 --ckpt_every 100 "${ASK[@]}")
    # RL on problems_rl/: forms SFT saw 60 of, and four or five steps; 160 tokens: whole answers;
    # lrs 0.3 of SFT's: more problems than 0.2 or 0.4 (dev/LOG.md)
    RL=(--demo "$DATA_DIR" --steps 26 --questions_per_step 8 --samples 8 --max_new_tokens 160
        --lr_scale 0.3 --micro_batch 32 --eval_every 0 --eval_items 40 --eval_samples 2
        --ckpt_every 10)
    CHAT_EVAL=(--demo "$DATA_DIR" --max_new_tokens 160
               --tasks demo-choice,demo-answer,demo-problems,demo-words)
    CORE=(--bundle "$DATA_DIR/eval_bundle")  # the demo world's, whatever corpus pretraining read
fi
# --chat: the file beside the plan's conversations, held out: the plan's (docs/own-data.md)
if [ -n "$CHAT" ]; then
    SFT+=(--add_source "$CHAT:2")
    MIDTRAIN+=(--add_source "chat:$CHAT:0.2")
fi
# NCCL (GPUs): a timed all-reduce; on a hang or failure the safe flags, the defaults probed again
# before each stage
launch probe "${LAUNCH[@]}" "$ROOT/distributed.py" probe; [ "$PROBE_ONLY" = 0 ] || exit 0

# --- data and tokenizer
TOK=${TOKENIZER:-$RUN/tokenizer}
if [ "$PLAN" = demo ] && [ "$PRINT" = 0 ] \
    && compgen -G "$DATA_DIR/pretrain/shard_*.parquet" > /dev/null \
    && [ -d "$DATA_DIR/chat_eval" ] && [ -d "$DATA_DIR/calc" ]; then
    skip data "the demo world is in $DATA_DIR"
elif [ "$PLAN" = demo ]; then stage data "$PY" "$ROOT/demo.py" --out "$DATA_DIR"
else
    # fail in minutes, not hours: a gated or missing chat source stops the run here; then the chat
    # data and the CORE bundle in the background, and 8 shards (the tokenizer's, and what the
    # budget's shard count is measured on)
    stage preflight "$PY" "$ROOT/prepare.py" chat --check "${CHAT_SOURCES[@]}"
    stage chatcore_tasks "$PY" "$ROOT/chat_eval.py" --download_only "${CHAT_EVAL_EXTRA[@]}"
    say "fetching ${CHAT_SOURCES[*]} and the CORE bundle in the background" \
        "(log: $LOGS/prefetch.log)"
    # each fetch in a session of its own (no Ctrl-C of the terminal reaches it) carrying the run's
    # MARK: the run's end stops it; its log only, no row in stages.tsv
    prefetch() {
        "$@" "$PY" "$ROOT/prepare.py" chat "${CHAT_SOURCES[@]}" &&
            "$@" "$PY" "$ROOT/core_eval.py" --download_only "${CORE_EXTRA[@]}"
    }
    if [ "$PRINT" = 1 ]; then
        prefetch "${L[@]}" stage --run "$RUN" prefetch; PREFETCH=""
    else
        prefetch env "SPEEDRUN_MARK=$MARK" setsid --wait >> "$LOGS/prefetch.log" 2>&1 < /dev/null &
        PREFETCH=$!
    fi
    if [ "$OWN_TEXT" = 0 ]; then
        stage data "$PY" "$ROOT/prepare.py" shards --shards 8 --data_dir "$CORPUS" "${R_DATA[@]}"
    fi
fi
# --corpus: ingested once (its ingest.json says whole), for the tokenizer, pretraining and
# midtraining's text
if [ "$OWN_TEXT" = 1 ]; then
    stage ingest --skip_if "$CORPUS/ingest.json" "$PY" "$ROOT/prepare.py" ingest \
        --out "$CORPUS" "${INGEST[@]}"
fi
wait_prefetch() {  # [WHERE]: the chat data and the CORE bundle are in; a failed fetch stops the run
    if [ -z "${PREFETCH:-}" ]; then return; fi
    say "waiting for the prefetch of the chat data and the CORE bundle (log: $LOGS/prefetch.log)"
    wait "$PREFETCH" || {
        rc=$?
        echo "speedrun: stage prefetch failed (exit $rc)$1; log: $LOGS/prefetch.log; fix its" \
            "cause and rerun (what finished is kept)" >&2
        exit "$rc"
    }
    PREFETCH=""
}
if [ -n "$TOKENIZER" ]; then skip tokenizer "using --tokenizer $TOK"
else
    stage tokenizer --skip_if "$TOK/tokenizer.json" "$PY" "$ROOT/prepare.py" tokenizer \
        --data_dir "$CORPUS" --vocab_size "$VOCAB" --out "$TOK" "${R_TOK[@]}"
fi
if [ "$PLAN" = gpu ]; then  # the shards the budget needs, counted with this tokenizer; their disk
    stage data_plan "$PY" "$ROOT/pretrain.py" --data_plan --data_dir "$CORPUS" --tokenizer "$TOK" \
        --runs_dir "$RUN" "${PRETRAIN[@]}" "${PRETRAIN_EXTRA[@]}" "${R_PRETRAIN[@]}" "${R_SHAPE[@]}"
    # the disk plan (not enough disk stops here), then --shards, else data_plan.json's count
    # (fewer is said); --corpus: all of its text is here
    NEEDED=$("${L[@]}" shards --run "$RUN" "$SHARDS")
    if [ "$OWN_TEXT" = 0 ]; then
        launch stage download "$PY" "$ROOT/prepare.py" shards --shards "$NEEDED" \
            --data_dir "$CORPUS"
    fi
    # pretraining does not wait for the prefetch, but if it has failed already, stop before the
    # hours
    if ! kill -0 "$PREFETCH" 2>/dev/null || [ "$STOP_AFTER" = download ]; then
        wait_prefetch " before pretraining"
    fi
    if [ "$STOP_AFTER" = download ]; then
        say "stopping after download (--stop_after): every shard and the chat and evaluation" \
            "data are in"
        exit 0
    fi
    # the rehearsal, once before pretraining (not after --no_rehearse, a rehearsal that passed, a
    # pretraining that started): every stage for a few steps or items, with this tokenizer, data
    # and GPUs, into <run_name>-rehearsal
    REHEARSAL=$RUNS_DIR/$RUN_NAME-rehearsal
    if [ "$REHEARSE" = 0 ] && "${L[@]}" rehearsal_due --run "$RUN" "$REHEARSAL" "$NO_REHEARSE"
    then
        wait_prefetch " before the rehearsal"  # the rehearsal's midtraining reads the chat data
        stage rehearsal env SPEEDRUN_PYTHON="$PY" bash "$ROOT/speedrun.sh" --rehearse --no_chat \
            --plan gpu --depth "$DEPTH" --run_name "$RUN_NAME" --runs_dir "$RUNS_DIR" \
            "${REHEARSAL_DATA[@]}" --gpus "$GPUS" --tokenizer "$TOK" \
            --stage_evals "${STAGE_EVALS:-none}" --rl "$RL_STAGE" \
            $([ "$FORCE" = 1 ] && echo --force)
        # its checkpoints deleted (the disk)
        "${L[@]}" rehearsal_passed --run "$RUN" "$REHEARSAL"
    fi
fi

# --- the stages
stage pretrain --train "${LAUNCH[@]}" "$ROOT/pretrain.py" --data_dir "$CORPUS" \
    --tokenizer "$TOK" "${PRETRAIN[@]}" "${PRETRAIN_EXTRA[@]}" "${R_PRETRAIN[@]}" "${R_SHAPE[@]}" \
    --runs_dir "$RUN" --run_name pretrain
wait_prefetch ""
stage core_eval --skip_if "$RUN/core_eval/results.json" "${LAUNCH[@]}" "$ROOT/core_eval.py" \
    --checkpoint "$RUN/pretrain" --out "$RUN/core_eval" "${CORE[@]}" "${CORE_EXTRA[@]}" \
    "${R_CORE[@]}"
stage midtrain --train "${LAUNCH[@]}" "$ROOT/midtrain.py" --checkpoint "$RUN/pretrain" \
    "${MIDTRAIN[@]}" "${MIDTRAIN_EXTRA[@]}" "${R_MIDTRAIN[@]}" --runs_dir "$RUN" --run_name midtrain
stage sft --train "${LAUNCH[@]}" "$ROOT/sft.py" --checkpoint "$RUN/midtrain" "${SFT[@]}" \
    "${SFT_EXTRA[@]}" "${R_SFT[@]}" --runs_dir "$RUN" --run_name sft
if [ "$RL_STAGE" = on ]; then
    FINAL=rl
    stage rl --train "${LAUNCH[@]}" "$ROOT/rl.py" --checkpoint "$RUN/sft" "${RL[@]}" \
        "${RL_EXTRA[@]}" "${R_RL[@]}" --runs_dir "$RUN" --run_name rl
else FINAL=sft; skip rl "--rl off"; fi
stage chat_eval --skip_if "$RUN/chat_eval.json" "${LAUNCH[@]}" "$ROOT/chat_eval.py" \
    --checkpoint "$RUN/$FINAL" --out "$RUN/chat_eval.json" "${CHAT_EVAL[@]}" \
    "${CHAT_EVAL_EXTRA[@]}" "${R_CHAT_EVAL[@]}"
# what each stage taught (report.py's table): CORE and ChatCORE of each --stage_evals stage's
# model, in stage_evals/; the pretrained model, a base model that never ends a reply, gets CORE
# only (core_eval above), as nanochat scores it
for name in midtrain sft rl; do
    "${L[@]}" stage_evals --run "$RUN" "$name" "$STAGE_EVALS" "$FINAL" || continue
    E=$RUN/stage_evals/$name
    stage "core_eval_$name" --skip_if "$E/core_eval/results.json" "${LAUNCH[@]}" \
        "$ROOT/core_eval.py" --checkpoint "$RUN/$name" --out "$E/core_eval" --data_dir "$CORPUS" \
        "${CORE[@]}" "${CORE_EXTRA[@]}" "${R_CORE[@]}"
    stage "chat_eval_$name" --skip_if "$E/chat_eval.json" "${LAUNCH[@]}" "$ROOT/chat_eval.py" \
        --checkpoint "$RUN/$name" --out "$E/chat_eval.json" "${CHAT_EVAL[@]}" \
        "${CHAT_EVAL_EXTRA[@]}" "${R_CHAT_EVAL[@]}"
done
stage report "$PY" "$ROOT/report.py" "$RUN"

CHAT_COMMAND=("$PY" "$ROOT/chat.py" --runs_dir "$RUN")
if [ "$REHEARSE" = 1 ]; then  # one answer of the final model, each stage's time, the record
    stage chat "${CHAT_COMMAND[@]}" -p "$REHEARSAL_PROMPT" --temperature 0 --max_new_tokens 32
    if [ "$PLAN" != demo ]; then
        stage predict "$PY" "$ROOT/gpu_plan.py" "$RUN" --gpus "$NPROC" --out "$RUN/plan_cost.json"
    fi
    "${L[@]}" rehearsed --run "$RUN" "$SECONDS"
elif [ "$PRINT" = 1 ]; then [ "$NO_CHAT" = 1 ] || launch stage chat "${CHAT_COMMAND[@]}"
elif [ "$NO_CHAT" = 0 ] && [ -t 0 ] && [ -t 1 ]; then
    say "chat: ${CHAT_COMMAND[*]} (Ctrl-D or /quit to leave)"; "${CHAT_COMMAND[@]}"
else say "done. Chat with it: ${CHAT_COMMAND[*]}"; fi
