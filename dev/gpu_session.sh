#!/usr/bin/env bash
# One device call on a lent GPU machine (no internet, its own python3 and torch): the gpu plan's rehearsal at the
# default vocabulary against dev/hub_stand_in.py, every stage through chat, then optionally bench.py's battery rows.
# Everything it writes goes to $OUT as a few files (the device tool brings back at most 8).
#
#   on the GPU:  bash dev/gpu_session.sh rehearse              (carry: .whl, the wheels below)
#                bash dev/gpu_session.sh resume                (the next call, on the warm machine: the same
#                                                               rehearsal, its finished stages skipped)
#                bash dev/gpu_session.sh bench mfu_d20         (carry: .whl .bench, after dev/gpu_carry.py prepare)
#   after the calls, here: python dev/gpu_carry.py merge A/bench/gpu_bench.json B/bench/gpu_bench.json --out DIR
#   on the CPU:  OUT=/tmp/gs SPEEDRUN_PYTHON=.venv/bin/python bash dev/gpu_session.sh rehearse --gpus 2 --depth 2
#
# .whl holds wheels for the device's Python 3.12 that its image lacks or has at another version (rustbpe,
# huggingface_hub 2.4.0 and its needs): dev/LOG.md names the pip download command.
# SESSION_TIMEOUT caps the phase in seconds (default 420), so $OUT is filled before the device call's own limit:
# give the call's timeout_s at least 100 s more (a stopped stage gets SPEEDRUN_KILL_WAIT, 10 s here, plus twice its
# last save, ~25 s at d20, to checkpoint; the phase is killed 70 s after its SIGINT). The battery's phases end with it.
# Budget the device time: a fresh H200 took ~8 minutes to start on 2026-11-26, ~40 s on 2026-11-27; the d20 rehearsal
# needs ~13 minutes of it, so two calls: rehearse (SESSION_TIMEOUT=495, timeout_s 600), then resume (dev/LOG.md).
#
# Expected GPU time of each row of bench.py gpu (bench_gpu.py), both sides, on one H100 or H200 (estimated, not
# measured: the step times from the one H100 run of dev/LOG.md, d20 at 106,942 tok/s and d12 at 347,139, d26 scaled by
# FLOPs/token; ~1.5 min of start-up and compilation per side, ~0.7 min per probe):
#   mfu_d20      ~7.5 min: probe; ours and nanochat each ~3.4 (20 steps of 2^19 at ~4.9 s, the last 17 timed)
#   bpb_d12_b19  ~6 min: probe; each side ~2.7 (64 steps of 2^19 at ~1.5 s, evaluation of 2^18 tokens)
#   bpb_d12_b17  ~6 min: as bpb_d12_b19, 256 steps of 2^17 at ~0.4 s (no probe after bpb_d12_b19 in the same call)
#   mfu_d26      ~8.5 min: probe; each side ~3.8 (11 steps of 2^19 at ~10 s, the last 8 timed)
#   demo         ~3.5 min: speedrun.sh --plan demo, every stage on the demo world (166 s of stages on the H100)
#   chat_decode  ~1 min: bench.py decode in bf16: compilation of the decode step, 5 trials of 64 tokens per path, the
#                second turn's first token, 16 x 16 rollouts
set -u
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
OUT=${OUT:-/tmp/gpu_session}
mkdir -p "$OUT"
WORK=${WORK:-/tmp/gpu_session_work}
PHASE=${1:?usage: bash dev/gpu_session.sh rehearse|resume|bench ROWS... [flags]}
shift
LIMIT=${SESSION_TIMEOUT:-420}
exec > >(tee -a "$OUT/session_$PHASE.log") 2>&1
echo "gpu_session: $PHASE at $(date -u +%FT%TZ), commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
if [ -d .whl ] && compgen -G ".whl/*.whl" > /dev/null && [ -z "${SPEEDRUN_PYTHON:-}" ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl ||
        exit 1
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
PY=${SPEEDRUN_PYTHON:-python3}
command -v nvidia-smi > /dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
"$PY" -c 'import sys, torch, huggingface_hub as h; print("python", sys.version.split()[0], "torch", torch.__version__,
    "cuda", torch.version.cuda, "gpus", torch.cuda.device_count(), "huggingface_hub", h.__version__)'

if [ "$PHASE" = rehearse ] || [ "$PHASE" = resume ]; then
    [ "$PHASE" = rehearse ] && rm -rf "$WORK"  # resume: the same work dir, so speedrun.sh skips what finished
    mkdir -p "$WORK"
    rm -f "$WORK/stand_in.log"  # a resume's: its line must be the new stand-in's
    "$PY" dev/hub_stand_in.py --port 8765 > "$WORK/stand_in.log" 2>&1 &
    STAND_IN=$!
    for _ in $(seq 600); do grep -q "point the gpu plan" "$WORK/stand_in.log" 2>/dev/null && break; sleep 0.5; done
    cat "$WORK/stand_in.log"
    export HF_ENDPOINT=http://127.0.0.1:8765 NO_PROXY=127.0.0.1 HF_HOME="$WORK/hf" NANOCHAT_CACHE="$WORK/cache"
    export CORE_ARGS="--bundle http://127.0.0.1:8765/eval_bundle.zip" SPEEDRUN_PYTHON="$PY" SPEEDRUN_KILL_WAIT=10
    # a fixed micro-batch (no probe: its tries cost a minute at d20) and no stage evaluations: the rehearsal's stages
    export PRETRAIN_ARGS=${PRETRAIN_ARGS:---micro_batch 32}
    rc=0
    # a stopped stage gets SPEEDRUN_KILL_WAIT plus twice its last save (~25 s at d20): 70 s before the SIGKILL
    timeout --signal=INT --kill-after=70 "$LIMIT" bash speedrun.sh --plan gpu --rehearse --no_chat \
        --stage_evals none --runs_dir "$WORK/runs" --data_dir "$WORK/data" "$@" || rc=$?
    echo "gpu_session: the rehearsal exited $rc"
    kill "$STAND_IN" 2>/dev/null
    tar -czf "$OUT/rehearsal.tar.gz" -C "$WORK" --exclude='ckpt' --exclude='*.parquet' --exclude='*.pt' runs \
        stand_in.log 2>/dev/null
    cat "$WORK"/runs/*/rehearsed.json 2>/dev/null
    exit "$rc"
fi
if [ "$PHASE" = bench ]; then
    rc=0
    timeout --signal=INT --kill-after=30 "$LIMIT" "$PY" dev/bench.py gpu --rows "$@" --out "$WORK/bench" || rc=$?
    echo "gpu_session: the battery exited $rc"
    tar -czf "$OUT/bench.tar.gz" -C "$WORK" bench 2>/dev/null
    cat "$WORK"/bench/*.md 2>/dev/null
    exit "$rc"
fi
echo "gpu_session: unknown phase $PHASE (rehearse or bench)" >&2
exit 2
