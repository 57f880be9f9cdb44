"""What every stage uses and no one part owns: facts about the machine and the code (device_name, native_bf16,
matmul_dtype, peak_flops, versions, code_version) and the formatting and timing helpers every stage prints with
(fmt_bytes, fmt_duration, now). A stage's exit (run_main) is in distributed.py: it tears the process group down.

Not a stage: import it (`import common`). It imports none of this project's modules, so any of them may import it.
One command line, what this machine and this code are, as every stage records them:

    python common.py        # the device, whether bf16 is native, the matmul dtype, the versions, the code's commit
"""
import argparse
import math
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
    """The GPU's name, or the CPU's model (from /proc/cpuinfo on Linux) and the vector ISA torch's kernels use."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    model = platform.processor() or "cpu"
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        model = next((line.split(":", 1)[1].strip() for line in cpuinfo.read_text().splitlines()
                      if line.startswith("model name")), model)
    return f"{model}, {torch.backends.cpu.get_cpu_capability()}"


def native_bf16(device):
    """Whether bf16 matmuls run natively: CUDA with bf16 support, or a CPU with AVX512-BF16 or AMX. Elsewhere they
    are emulated: on an AVX2-only CPU a bf16 matmul is ~20-100x slower than the same one in fp32. torch exposes the
    CPU's flags only through private functions; if they are missing the answer is no (fp32 is never slow)."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    flags = [getattr(torch.cpu, name, lambda: False) for name in ("_is_avx512_bf16_supported", "_is_amx_tile_supported")]
    return device.type == "cpu" and any(flag() for flag in flags)


def matmul_dtype(device):
    """The dtype for matmuls that need no more: bf16 where native, else fp32."""
    return "bfloat16" if native_bf16(device) else "float32"


def versions():
    return {"python": sys.version.split()[0], "torch": torch.__version__, "cuda": torch.version.cuda,
            "numpy": np.__version__}


def code_version():
    """The git commit of the code that runs and whether tracked files differ from it; "unknown" outside a git
    checkout (a copied tree), never a guess."""
    here = Path(__file__).resolve().parent
    try:
        commit = subprocess.run(["git", "-C", str(here), "rev-parse", "HEAD"], capture_output=True, text=True,
                                timeout=10, check=True).stdout.strip()
        changes = subprocess.run(["git", "-C", str(here), "status", "--porcelain", "--untracked-files=no"],
                                 capture_output=True, text=True, timeout=10, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return {"commit": "unknown", "dirty": "unknown"}
    return {"commit": commit, "dirty": bool(changes.strip())}


# -----------------------------------------------------------------------------
# Measurement and formatting

# Dense bf16 tensor-core peak FLOP/s by device name (first match wins: a variant before its family). A device not
# listed gets MFU "unknown". NVIDIA's datasheets give BF16 with sparsity, twice the dense figure here: H200 NVL 1,671
# TFLOP/s (the H200 datasheet; the SXM's 1,979), B200 4.5 PFLOP/s (the B200 / HGX B200 datasheet): dense 836 and 2,250.
PEAK_BF16_FLOPS = [("H100 PCIe", 756e12), ("H100 NVL", 835e12), ("H100", 989e12), ("H200 NVL", 836e12),
                   ("H200", 989e12), ("B200", 2250e12), ("A100", 312e12), ("L40S", 362e12), ("A10G", 70e12),
                   ("L4", 121e12)]


def peak_flops(name, dtype):
    if dtype != "bfloat16":
        return None
    return next((flops for key, flops in PEAK_BF16_FLOPS if key in name), None)


def fmt_bytes(count):
    return f"{count / 2**30:.2f} GiB" if count >= 2**30 else f"{count / 2**20:.1f} MiB"


def fmt_duration(seconds):
    if seconds is None or not math.isfinite(seconds):
        return "unknown"
    seconds = int(seconds)
    return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


def now():
    return time.perf_counter()


def renamed_flags(argv, renames):
    """argv with each old flag name in `renames` ({old: new}) replaced by its new name, and a deprecation line on
    stderr for each: old names stay accepted for one release (hidden from --help), so scripts and habits keep
    working while they move to the one vocabulary every script shares."""
    argv = [str(a) for a in (sys.argv[1:] if argv is None else argv)]
    for i, arg in enumerate(argv):
        name, equals, value = arg.partition("=")
        if name in renames:
            print(f"warning: {name} is now {renames[name]}; the old name goes in the next release", file=sys.stderr)
            argv[i] = renames[name] + equals + value
    return argv


def main(argv=None):
    argparse.ArgumentParser(description="what this machine and this code are, as every stage records them: the "
                            "device, whether bf16 is native, the matmul dtype, the versions, the code's commit"
                            ).parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    peak = peak_flops(device_name(device), "bfloat16")
    print(f"device: {device_name(device)}; bf16 {'native' if native_bf16(device) else 'not native (emulated)'}; "
          f"matmuls in {matmul_dtype(device)}; dense bf16 peak {f'{peak:.3g} FLOP/s' if peak else 'unknown'}")
    print(f"versions: {versions()}; code: {code_version()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
