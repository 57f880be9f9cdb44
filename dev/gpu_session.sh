#!/usr/bin/env bash
# One device call on a lent GPU machine (no internet, its own python3 and torch): the gpu plan's rehearsal at the
# default vocabulary against dev/hub_stand_in.py, every stage through chat, then optionally bench.py's battery rows.
# Everything it writes goes to $OUT as a few files (the device tool brings back at most 8).
#
#   on the GPU:  bash dev/gpu_session.sh rehearse              (carry: .whl, the wheels below)
#                bash dev/gpu_session.sh bench mfu_d20         (carry: .whl .bench, after bench.py gpu_prepare)
#   on the CPU:  OUT=/tmp/gs SPEEDRUN_PYTHON=.venv/bin/python bash dev/gpu_session.sh rehearse --gpus 2 --depth 2
#
# .whl holds wheels for the device's Python 3.12 that its image lacks or has at another version (rustbpe,
# huggingface_hub 2.4.0 and its needs): dev/LOG.md names the pip download command.
# SESSION_TIMEOUT caps the phase in seconds (default 420), so $OUT is filled before the device call's own limit:
# give the call's timeout_s at least 60 s more (a stopped stage gets SPEEDRUN_KILL_WAIT, 10 s here, to checkpoint).
# Budget the device time: on 2026-11-26 a fresh H200 took ~8 minutes to start (dev/LOG.md).
set -u
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
OUT=${OUT:-/tmp/gpu_session}
mkdir -p "$OUT"
WORK=${WORK:-/tmp/gpu_session_work}
PHASE=${1:?usage: bash dev/gpu_session.sh rehearse|bench ROWS... [flags]}
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

if [ "$PHASE" = rehearse ]; then
    rm -rf "$WORK"
    mkdir -p "$WORK"
    "$PY" dev/hub_stand_in.py --port 8765 > "$WORK/stand_in.log" 2>&1 &
    STAND_IN=$!
    for _ in $(seq 600); do grep -q "point the gpu plan" "$WORK/stand_in.log" 2>/dev/null && break; sleep 0.5; done
    cat "$WORK/stand_in.log"
    export HF_ENDPOINT=http://127.0.0.1:8765 NO_PROXY=127.0.0.1 HF_HOME="$WORK/hf" NANOCHAT_CACHE="$WORK/cache"
    export CORE_ARGS="--bundle http://127.0.0.1:8765/eval_bundle.zip" SPEEDRUN_PYTHON="$PY" SPEEDRUN_KILL_WAIT=10
    rc=0
    timeout --signal=INT --kill-after=30 "$LIMIT" bash speedrun.sh --plan gpu --rehearse --no_chat \
        --runs_dir "$WORK/runs" --data_dir "$WORK/data" "$@" || rc=$?
    echo "gpu_session: the rehearsal exited $rc"
    kill "$STAND_IN" 2>/dev/null
    tar -czf "$OUT/rehearsal.tar.gz" -C "$WORK" --exclude='ckpt' --exclude='*.parquet' --exclude='*.pt' runs \
        stand_in.log 2>/dev/null
    cat "$WORK"/runs/*/rehearsed.json 2>/dev/null
    exit "$rc"
fi
if [ "$PHASE" = bench ]; then
    rc=0
    timeout --signal=INT --kill-after=30 "$LIMIT" "$PY" bench.py gpu --rows "$@" --out "$WORK/bench" || rc=$?
    echo "gpu_session: the battery exited $rc"
    tar -czf "$OUT/bench.tar.gz" -C "$WORK" bench 2>/dev/null
    cat "$WORK"/bench/*.md 2>/dev/null
    exit "$rc"
fi
echo "gpu_session: unknown phase $PHASE (rehearse or bench)" >&2
exit 2
