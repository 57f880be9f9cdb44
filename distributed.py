"""Setup and teardown under torchrun, a stage's exit (run_main), naming the ranks that died or
hung when a collective fails, all-reduce and FSDP2 helpers, and speedrun.sh's NCCL check. Not a
stage. Its command lines (probe: under torchrun):

    python -m torch.distributed.run --standalone --nproc_per_node=8 distributed.py probe
    python distributed.py machine    # device, bf16, matmul dtype, versions, commit
"""
import argparse
import atexit
import contextlib
import ctypes
import ctypes.util
import fcntl
import json
import math
import os
import platform
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

# -----------------------------------------------------------------------------
# The machine and the code


def device_name(device):
    """The GPU's name, or the CPU's model and the vector ISA torch uses."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    model = platform.processor() or "cpu"
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        model = next((line.split(":", 1)[1].strip() for line in cpuinfo.read_text().splitlines()
                      if line.startswith("model name")), model)
    return f"{model}, {torch.backends.cpu.get_cpu_capability()}"


def native_bf16(device):
    """Whether bf16 matmuls are native: CUDA with bf16, or a CPU with AVX512-BF16 or AMX (else
    emulated, far slower than fp32). torch's CPU flags are private: if missing, no."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    flags = [getattr(torch.cpu, name, lambda: False) for name in ("_is_avx512_bf16_supported",
                                                                  "_is_amx_tile_supported")]
    return device.type == "cpu" and any(flag() for flag in flags)


# dataset.py's cache dir (its own copy: dataset.py runs without torch)
CACHE_DIR = Path(os.environ.get("NANOCHAT_CACHE", Path.home() / ".cache" / "nanochat"))


def time_linear(dtype, width, rows=1024, reps=3):
    """Best seconds of a linear layer's forward and backward under `dtype`, weight casts
    included (with them native bf16 can lose to fp32)."""
    x = torch.randn(rows, width, requires_grad=True)
    w = torch.randn(4 * width, width, requires_grad=True)
    times = []
    for _ in range(reps + 1):  # the first pays for oneDNN's kernel selection: untimed
        start = time.perf_counter()
        with torch.autocast("cpu", torch.bfloat16, enabled=dtype == "bfloat16"):
            y = torch.nn.functional.linear(x, w)
        # a scalar's backward: a gradient tensor makes autograd import sympy
        y.sum().backward()
        times.append(time.perf_counter() - start)
    return min(times[1:])


def pick_precision(seconds):
    """(the faster dtype, why); a tie goes to fp32, which rounds less."""
    fast, slow = sorted(("float32", "bfloat16"), key=lambda d: (seconds[d], d != "float32"))
    short = {"float32": "fp32", "bfloat16": "bf16"}
    ratio = seconds[slow] / seconds[fast]
    return fast, f"{short[fast]}: {ratio:.1f}x faster than {short[slow]} here, measured"


def precision(device, width=256):
    """(compute dtype, why). CUDA: bf16 where supported. Emulated bf16: fp32. Native bf16 on a
    CPU: the faster, measured, kept in <cache>/precision.json."""
    if device.type == "cuda":
        native = native_bf16(device)
        return ("bfloat16" if native
                else "float32"), f"bf16 is {'' if native else 'not '}supported on this GPU"
    if not native_bf16(device):
        return "float32", "bf16 is not native on this CPU (emulated), so not timed"
    path = CACHE_DIR / "precision.json"
    key = (f"{device_name(device)} | torch {torch.__version__} | {torch.get_num_threads()} threads"
           f" | width {width}")
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
        except (OSError, ValueError):  # none yet, or damaged
            stored = {}
        if key not in stored:
            stored[key], note = {d: time_linear(d, width) for d in (
                    "float32", "bfloat16")}, f" (kept in {path})"
            path.with_suffix(".tmp").write_text(json.dumps(stored, indent=1))
            path.with_suffix(".tmp").replace(path)
    dtype, why = pick_precision(stored[key])
    return dtype, why + note


def matmul_dtype(device, width=256):
    return precision(device, width)[0]


def versions():
    return {"python": sys.version.split()[0], "torch": torch.__version__,
            "cuda": torch.version.cuda,
            "numpy": np.__version__}


def code_version():
    """The git commit and whether tracked files differ; "unknown" outside git."""
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

# Dense bf16 peak FLOP/s by device name, first match wins (unlisted: MFU "unknown"); NVIDIA's
# datasheets give twice these, with sparsity
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
    """The training loop's clock: tests step it (train_loop.now)."""
    return time.perf_counter()


def append_jsonl(path, *records):
    with open(path, "a") as f:
        f.writelines(json.dumps(record) + "\n" for record in records)


# -----------------------------------------------------------------------------
# Processes and ranks

def keep_freed_memory(keep=True):
    """Have glibc keep freed memory: fresh mmap pages each step slow a CPU step (dev/LOG.md).
    keep=False restores the defaults and trims the heap."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"))
        # M_MMAP_THRESHOLD: allocations under 1 GiB from the heap...
        libc.mallopt(-3, 1 << 30 if keep else 128 * 1024)
        # M_TRIM_THRESHOLD: ...which is not trimmed (a C int)
        libc.mallopt(-1, 2 ** 31 - 1 if keep else 128 * 1024)
        if not keep:
            libc.malloc_trim(0)
    except (OSError, AttributeError, TypeError):
        pass


# the world as setup_distributed printed it, recorded for report.py
WORLD = "unknown"


def setup_distributed(timeout_s=600):
    """(rank, local_rank, world_size, device) from torchrun's environment, or one process.
    Prints each rank's host and device, so one GPU cannot pass as four."""
    if not torch.cuda.is_available():
        keep_freed_memory()
    if "TORCHELASTIC_RUN_ID" in os.environ:  # torchrun (other launchers set RANK too)
        die_with_launcher()
    global WORLD
    if "RANK" not in os.environ:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        WORLD = f"single process, device {device_name(device)}"
        print(f"distributed: {WORLD}")
        return 0, 0, 1, device
    rank, local_rank, world_size = (int(os.environ[k])
                                    for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE"))
    device = init_process_group(local_rank, timeout_s)
    names = [None] * world_size
    dist.all_gather_object(names, f"{device} ({device_name(device)}) on {platform.node()}")
    ranks = ", ".join(f"rank {r} {n}" for r, n in enumerate(names))
    WORLD = f"world size {dist.get_world_size()} ({dist.get_backend()}): {ranks}"
    if rank == 0:
        print(f"distributed: {WORLD}", flush=True)
        # ranks compile at their own speed: the others wait in the first all-reduce
        print(f"distributed: a collective waits at most {timeout_s:.0f} s for the other ranks "
              "(--dist_timeout), the slowest rank's first compile included", flush=True)
    return rank, local_rank, world_size, device


def die_with_launcher():
    """SIGKILL this worker when its launcher dies: a stuck one would keep its GPU. Linux only."""
    if not sys.platform.startswith("linux"):
        return
    parent = os.getppid()
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(1, signal.SIGKILL, 0, 0, 0) != 0:  # PR_SET_PDEATHSIG
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    # the launcher died before the line above: nobody would stop us
    try:
        command = Path(f"/proc/{parent}/cmdline").read_bytes()
        orphaned = os.getppid() != parent or b"torch" not in command
    except OSError:
        orphaned = True
    # (torchrun itself may be pid 1 in a container)
    if orphaned and (parent == 1 or os.getppid() != parent):
        raise RuntimeError("the launcher (torchrun) that started this worker has already exited: "
                           "nothing to run for")


def init_process_group(local_rank, timeout_s):
    """NCCL on CUDA, gloo on CPU; returns this rank's device. torch.distributed.nn.functional is
    imported first: imported with a live group, it keeps gloo's threads alive and a rank aborts
    at exit."""
    from datetime import timedelta

    import torch.distributed.nn.functional
    timeout = timedelta(seconds=timeout_s)
    if not torch.cuda.is_available():
        dist.init_process_group("gloo", timeout=timeout)
        return torch.device("cpu")
    device = torch.device("cuda", local_rank)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device, timeout=timeout)
    return device


def teardown_distributed():
    """Barrier, then destroy the group, else exit can abort or strand workers."""
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


# the probe's message: a DDP gradient bucket is 25 MB; NVLS and P2P over NVSwitch start near here
PROBE_MBYTES = 64


def probe_all_reduce(timeout_s, mbytes=PROBE_MBYTES, iters=5, out=None):
    """speedrun.sh's check: a 4-byte all-reduce, then an `mbytes` MB one timed, its bus
    bandwidth printed and written to `out`. Returns 0 when every sum was right."""
    if "RANK" not in os.environ:
        print("probe: not under torchrun: one process, nothing to all-reduce")
        return 0
    rank, local_rank, world = (int(os.environ[k]) for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE"))
    device = init_process_group(local_rank, timeout_s)
    expected = world * (world + 1) / 2
    t = torch.full((1,), float(rank + 1), device=device)
    dist.all_reduce(t)
    ok = t.item() == expected
    where = f"{world} ranks ({dist.get_backend()}, {device_name(device)})"
    if rank == 0:
        print(f"probe: 4-byte all-reduce over {where}: {'ok' if ok else f'wrong sum {t.item()}'}",
              flush=True)
    numel = int(mbytes * 1e6) // 4
    big = torch.full((numel,), float(rank + 1), device=device)  # exact sums in fp32
    dist.all_reduce(big)  # warm-up
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda *_: None)
    sync(device)
    good = bool((big == expected).all())
    big.fill_(float(rank + 1))
    dist.barrier()
    start = time.perf_counter()
    for _ in range(iters):
        dist.all_reduce(big)
    sync(device)
    seconds = all_reduce((time.perf_counter() - start) / iters, dist.ReduceOp.MAX)
    good = good and bool(torch.isfinite(big).all())
    if rank == 0:
        bus = numel * 4 / seconds * 2 * (world - 1) / world / 1e9
        bandwidth = f"{bus:.2f} GB/s" if world > 1 else "n/a: one GPU"
        print(f"probe: {numel * 4 / 1e6:.0f} MB all-reduce over {where}: "
              f"{'ok' if good else 'wrong sums'}, {seconds * 1e3:.1f} ms each ({iters} timed), bus "
              f"bandwidth {bandwidth}", flush=True)
        if out and good:
            Path(out).write_text(json.dumps({"bus_bandwidth": bandwidth}) + "\n")
    dist.destroy_process_group()
    return 0 if ok and good else 1


def fetch_everywhere(fetch, rank, world):
    """fetch() on rank 0 (it downloads), then the others (they find the cache); rank 0's failure
    is raised on every rank."""
    result = failure = None
    if rank == 0:
        try:
            result = fetch()
        except (RuntimeError, ValueError, OSError) as e:
            failure = e
    if world > 1:
        shared = [failure and str(failure)]
        dist.broadcast_object_list(shared, src=0)
        failure = failure or (shared[0] and RuntimeError(shared[0]))
    if failure:
        raise failure
    return result if rank == 0 else fetch()


def run_main(main):
    """A stage's exit code: 0, 128 + signal, or 1 with a one-line error (and a traceback if
    raised outside this project). Under torchrun or as a script, os._exit at once: gloo threads
    in finalization make ranks abort (dev/LOG.md)."""
    code = stage_code(main)
    torchrun = "TORCHELASTIC_RUN_ID" in os.environ
    if torchrun or getattr(main, "__module__", None) == "__main__":
        if not torchrun:
            # what a normal exit runs first: logging, multiprocessing's children
            atexit._run_exitfuncs()
        with contextlib.suppress(OSError):  # a reader that left (| head)
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)
    return code


def stage_code(main):
    script = Path(sys.argv[0]).name
    try:
        signum = main()
    except (ValueError, FileNotFoundError, RuntimeError, ImportError) as e:
        frame = traceback.extract_tb(e.__traceback__)[-1]
        ours = Path(frame.filename).resolve().parent == Path(__file__).resolve().parent and \
            (frame.line or "").lstrip().startswith("raise")
        # torch's error: a collective failed, its peer died (connection reset) or hung
        stopped = not ours and stopped_ranks()
        if stopped:
            print(f"{script}: error on rank {dist.get_rank()}: a collective failed "
                  f"({str(e).splitlines()[0][:160]}): {stopped}", file=sys.stderr, flush=True)
            return 1  # no teardown: its barrier would wait for the stopped rank
        # raised by a library, or a bug: the traceback locates it
        if not ours:
            traceback.print_exception(e)
        print(f"{script}: error: {e}", file=sys.stderr)
        if dist.is_initialized():
            dist.destroy_process_group()
        return 1
    teardown_distributed()
    return 128 + signum if signum else 0


def check_shared_dir(run_dir):
    """Across nodes, check every rank sees rank 0's file in run_dir, or raise naming the blind
    ones. Tests: NANOCHAT_TEST_NODE_VIEW=RANK:DIR."""
    view = os.environ.get("NANOCHAT_TEST_NODE_VIEW", "")
    if not dist.is_initialized() or (dist.get_world_size() <= int(os.environ.get(
            "LOCAL_WORLD_SIZE", "1")) and not view):
        return
    rank, world = dist.get_rank(), dist.get_world_size()
    path = Path(run_dir) / ".shared_filesystem_check"
    # an error now is not mistaken for a stuck rank
    mark_progress(0, "start-up")
    token = [f"{time.time_ns()} {os.getpid()} {platform.node()}" if rank == 0 else None]
    if rank == 0:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(token[0])
    # after rank 0's write
    dist.broadcast_object_list(token, src=0)
    viewed_rank, _, viewed_dir = view.partition(":")
    if viewed_rank == str(rank):
        path = Path(viewed_dir) / path.name
    try:
        seen = path.read_text()
    except OSError:
        seen = None
    views = [None] * world
    dist.all_gather_object(views, (seen == token[0], platform.node(), str(path.parent)))
    if rank == 0:
        path.unlink(missing_ok=True)
    blind = [f"rank {r} on {host} ({where})" for r, (ok, host, where) in enumerate(views) if not ok]
    if blind:
        raise RuntimeError(f"the run directory {run_dir} is not one filesystem shared by every "
                           f"node: a file rank 0 ({views[0][1]}) wrote there is not seen by "
                           f"{', '.join(blind)}. Put --runs_dir on a filesystem every node mounts "
                           "at the same path (NFS, a cluster filesystem), then rerun")


# {"dir": run_dir/progress, "stage": name}, set by keep_progress
PROGRESS = {}


def keep_progress(run_dir, stage):
    """mark_progress also writes run_dir/progress/rankNNN.txt: under NCCL a hung collective
    aborts before Python sees an error, so these files tell which rank was where."""
    PROGRESS.update(dir=Path(run_dir) / "progress", stage=stage)
    PROGRESS["dir"].mkdir(parents=True, exist_ok=True)
    # remove records of ranks an earlier, larger run had
    if not dist.is_initialized() or dist.get_rank() == 0:
        world = dist.get_world_size() if dist.is_initialized() else 1
        for old in PROGRESS["dir"].glob("rank*.txt"):
            if old.stem[4:].isdigit() and int(old.stem[4:]) >= world:
                old.unlink(missing_ok=True)


def mark_progress(step, phase="step"):
    """Record that this rank entered `step` in torchrun's store (for stopped_ranks) and its
    progress file."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.distributed_c10d._get_default_store().set(f"progress/{rank}",
                                                       f"{step} {os.getpid()} {platform.node()}")
    if PROGRESS:
        path = PROGRESS["dir"] / f"rank{rank:03d}.txt"
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(f"rank {rank}: stage {PROGRESS['stage']} step {step} {phase}, process "
                       f"{os.getpid()} on {platform.node()}, at {time.time():.3f} "
                       f"({time.strftime('%H:%M:%S')})\n")
        os.replace(tmp, path)


def process_alive(pid):
    """Whether a local process runs: not gone, not a zombie."""
    if not Path("/proc").is_dir():  # macOS: existence only
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            pass
        return True
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return False


def stopped_ranks():
    """After an error under torchrun: the ranks that died (on this host) or are behind this
    rank's step, by mark_progress's records; "" when none."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return ""
    try:
        store, here = dist.distributed_c10d._get_default_store(), platform.node()
        records = {r: store.get(f"progress/{r}").decode().split() if store.check([f"progress/{r}"])
                   else None
                   for r in range(dist.get_world_size())}
    except (RuntimeError, ValueError):  # the store went with a node
        return ("another rank died or hung (torchrun's store is unreachable; its failure summary "
                "names the rank)")
    mine = int(records[dist.get_rank()][0]) if records[dist.get_rank()] else 0
    found = []
    for r, record in records.items():
        if record is None:
            found.append(f"rank {r} never reached step 1")
            continue
        step, pid, host = int(record[0]), int(record[1]), record[2]
        if host == here and not process_alive(pid):
            found.append(f"rank {r} died (process {pid} on {host} is gone; it last entered step "
                         f"{step}; a rank gone without an error of its own was most likely killed "
                         "by the kernel's out-of-memory killer: `dmesg | grep -i oom` says, a "
                         "smaller --micro_batch or --fsdp true needs less)")
        elif step < mine:
            found.append(f"rank {r} is stuck: it last entered step {step}, this rank is in step "
                         f"{mine} (process {pid} on {host})")
    return "; ".join(found)


def all_reduce_tensor(t, op=None):
    """Sum (or `op`) a tensor over ranks, in place."""
    if dist.is_initialized():
        on = t.cuda() if dist.get_backend() == "nccl" else t
        dist.all_reduce(on, op=op or dist.ReduceOp.SUM)
        if on is not t:
            t.copy_(on)
    return t


def all_reduce(value, op=None):
    """Sum (or `op`) a float over ranks."""
    return all_reduce_tensor(torch.tensor(float(value), dtype=torch.float64), op).item()


# FSDP2, DTensor and dcp are imported where used (a second a process): until then no parameter
# is a DTensor

def is_dtensor(tensor):
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(tensor, module.DTensor)


def local(tensor):
    return tensor.to_local() if is_dtensor(tensor) else tensor


def is_sharded(model):
    module = sys.modules.get("torch.distributed.fsdp")
    return module is not None and isinstance(model, module.FSDPModule)


def barrier():
    if dist.is_initialized():
        dist.barrier()


def main(argv=None):
    parser = argparse.ArgumentParser(description="speedrun.sh's NCCL check, or what this "
                                     "machine and code are")
    parser.add_argument("command", choices=["probe", "machine"], help="probe: a 4-byte and a timed "
                        "large all-reduce over torchrun's ranks; machine: the device, bf16, the "
                        "matmul dtype, the versions, the commit")
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds before a collective "
                        "counts as hung (default: %(default)s)")
    parser.add_argument("--mbytes", type=float, default=PROBE_MBYTES,
                        help="size of the timed all-reduce in MB (default: %(default)s)")
    parser.add_argument("--out", help="a JSON file for the measured bus_bandwidth")
    args = parser.parse_args(argv)
    if args.command == "probe":
        return probe_all_reduce(args.timeout, args.mbytes, out=args.out)
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
