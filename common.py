"""What every stage uses and no one part owns: facts about the machine and the code (device, bf16,
precision, peak FLOP/s, versions, commit), formatting and timing helpers, append_jsonl. It imports
none of this project's modules, so any may import it. Not a stage; one command line, what this
machine and this code are, as every stage records them:

    python common.py        # the device, whether bf16 is native, the matmul dtype, the versions, the code's commit
"""
import argparse
import fcntl
import json
import math
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

# -----------------------------------------------------------------------------
# The machine and the code


def device_name(device):
    """The GPU's name, or the CPU's model (from /proc/cpuinfo on Linux) and the vector ISA torch's
    kernels use."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    model = platform.processor() or "cpu"
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        model = next((line.split(":", 1)[1].strip() for line in cpuinfo.read_text().splitlines()
                      if line.startswith("model name")), model)
    return f"{model}, {torch.backends.cpu.get_cpu_capability()}"


def native_bf16(device):
    """Whether bf16 matmuls run natively: CUDA with bf16 support, or a CPU with AVX512-BF16 or AMX
    (emulated, ~20-100x slower than fp32). torch's CPU flags are private functions: if missing, no
    (fp32 is never slow)."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    flags = [getattr(torch.cpu, name, lambda: False) for name in ("_is_avx512_bf16_supported",
                                                                  "_is_amx_tile_supported")]
    return device.type == "cpu" and any(flag() for flag in flags)


# dataset.py's cache dir, by the same rule (its own line there: dataset.py runs without torch, which
# this loads)
CACHE_DIR = Path(os.environ.get("NANOCHAT_CACHE", Path.home() / ".cache" / "nanochat"))


def time_linear(dtype, width, rows=1024, reps=3):
    """Seconds of forward and backward of a (rows x width) @ (width x 4 width) linear layer under
    `dtype`'s autocast, best of `reps`: weight casts included, with which native bf16 can still lose
    to fp32."""
    x = torch.randn(rows, width, requires_grad=True)
    w = torch.randn(4 * width, width, requires_grad=True)
    times = []
    for _ in range(reps + 1):  # the first call pays for oneDNN's kernel selection: not timed
        start = time.perf_counter()
        with torch.autocast("cpu", torch.bfloat16, enabled=dtype == "bfloat16"):
            y = torch.nn.functional.linear(x, w)
        # a scalar's backward: a given gradient tensor makes autograd import sympy
        y.sum().backward()
        times.append(time.perf_counter() - start)
    return min(times[1:])


def pick_precision(seconds):
    """(dtype, why) from {"float32": s, "bfloat16": s}: the faster; a tie goes to fp32, which rounds
    less."""
    fast, slow = sorted(("float32", "bfloat16"), key=lambda d: (seconds[d], d != "float32"))
    short = {"float32": "fp32", "bfloat16": "bf16"}
    return fast, f"{short[fast]}: {seconds[slow] / seconds[fast]:.1f}x faster than {short[slow]} here, measured"


def precision(device, width=256):
    """(compute dtype, why) for matmuls on `device` at width `width`. CUDA: bf16 where supported. A
    CPU with emulated bf16: fp32, untimed (timing it takes seconds). Native bf16: the faster here
    (time_linear; native alone is not enough, dev/LOG.md), measured once and kept in
    <cache>/precision.json under CPU, torch, threads and width."""
    if device.type == "cuda":
        native = native_bf16(device)
        return ("bfloat16" if native
                else "float32"), f"bf16 is {'' if native else 'not '}supported on this GPU"
    if not native_bf16(device):
        return "float32", "bf16 is not native on this CPU (emulated), so not timed"
    path = CACHE_DIR / "precision.json"
    key = f"{device_name(device)} | torch {torch.__version__} | {torch.get_num_threads()} threads | width {width}"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.with_suffix(".lock").touch()
    except OSError as e:
        dtype, why = pick_precision({d: time_linear(d, width) for d in ("float32", "bfloat16")})
        return dtype, f"{why} (not kept: {e}; set $NANOCHAT_CACHE to a writable directory)"
    with open(path.with_suffix(".lock")) as lock:
        # ranks starting together: one measures, the others read its answer
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            stored, note = json.loads(path.read_text()), f" earlier ({path})"
        except (OSError, ValueError):  # none yet, or damaged: measured again
            stored = {}
        if key not in stored:
            stored[key], note = {d: time_linear(d, width) for d in (
                    "float32", "bfloat16")}, f" (kept in {path})"
            path.with_suffix(".tmp").write_text(json.dumps(stored, indent=1))
            # whole or not at all: a reader without the lock sees either
            path.with_suffix(".tmp").replace(path)
    dtype, why = pick_precision(stored[key])
    return dtype, why + note


def matmul_dtype(device, width=256):
    """The compute dtype a stage and Muon's Newton-Schulz use unless --dtype says otherwise:
    precision()'s choice."""
    return precision(device, width)[0]


def versions():
    return {"python": sys.version.split()[0], "torch": torch.__version__,
            "cuda": torch.version.cuda,
            "numpy": np.__version__}


def code_version():
    """The git commit of the code that runs and whether tracked files differ from it; "unknown"
    outside a git checkout (a copied tree), never a guess."""
    here = Path(__file__).resolve().parent
    try:
        commit = subprocess.run(["git", "-C", str(here), "rev-parse", "HEAD"], capture_output=True,
                                text=True,
                                timeout=10, check=True).stdout.strip()
        changes = subprocess.run(["git", "-C", str(here), "status", "--porcelain",
                                  "--untracked-files=no"],
                                 capture_output=True, text=True, timeout=10, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return {"commit": "unknown", "dirty": "unknown"}
    return {"commit": commit, "dirty": bool(changes.strip())}


# -----------------------------------------------------------------------------
# Measurement and formatting

# Dense bf16 peak FLOP/s by device name (first match wins: a variant before its family; unlisted:
# MFU "unknown").
# NVIDIA's datasheets give BF16 with sparsity, twice these (H200 NVL 1,671 TFLOP/s, B200 4.5
# PFLOP/s)
PEAK_BF16_FLOPS = [("H100 PCIe", 756e12), ("H100 NVL", 835e12), ("H100", 989e12), ("H200 NVL",
                                                                                   836e12),
                   ("H200", 989e12), ("B200", 2250e12), ("A100", 312e12), ("L40S", 362e12), ("A10G",
                                                                                             70e12),
                   ("L4", 121e12)]


def peak_flops(name, dtype):
    return next((flops for key, flops in PEAK_BF16_FLOPS if key in name),
                None) if dtype == "bfloat16" else None


def fmt_bytes(count):
    return f"{count / 2**30:.2f} GiB" if count >= 2**30 else f"{count / 2**20:.1f} MiB"


def fmt_duration(seconds):
    if seconds is None or not math.isfinite(seconds):
        return "unknown"
    seconds = int(seconds)
    return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


def now():
    """The training loop's clock, a name of its own: tests step it (train_loop.now)."""
    return time.perf_counter()


def append_jsonl(path, *records):
    """Records as lines of JSON at the end of a file: a run's metrics.jsonl, samples.jsonl."""
    with open(path, "a") as f:
        f.writelines(json.dumps(record) + "\n" for record in records)


def main(argv=None):
    argparse.ArgumentParser(description="what this machine and this code are, as every stage "
                            "records them: the device, whether bf16 is native, the matmul dtype, "
                            "the versions, the code's commit"
                            ).parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    peak = peak_flops(device_name(device), "bfloat16")
    dtype, why = precision(device)
    print(f"device: {device_name(device)}; bf16 "
          f"{'native' if native_bf16(device) else 'not native (emulated)'}; matmuls in {dtype} "
          f"({why}); dense bf16 peak {f'{peak:.3g} FLOP/s' if peak else 'unknown'}")
    print(f"versions: {versions()}; code: {code_version()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
