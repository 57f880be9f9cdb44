"""What the stages (pretrain.py, midtrain.py, sft.py, core_eval.py) share: distributed setup and teardown,
optimizers and their learning-rate rule, schedules, checkpoints and finding/loading them, the run directory and its
resume, the training loop with its policies (exact loss over masked targets, NaN stop, SIGTERM, health checks,
metrics, progress), validation bits per byte, a run's status.

Not a stage: import it. One command line, speedrun.sh's NCCL check, run under torchrun with one process per GPU
(`python common.py probe` alone has no peers and says so):

    python -m torch.distributed.run --standalone --nproc_per_node=8 common.py probe --timeout 60
"""
import argparse
import ctypes
import ctypes.util
import hashlib
import itertools
import json
import math
import os
import platform
import random
import shlex
import shutil
import signal
import subprocess
import sys
import time
import traceback
import warnings
from contextlib import nullcontext
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from calculator import ToolUse, reply_text
from loader import chat_loader, text_loader
from model import GPTConfig, autocast_context, build_model, generate, memory_estimate, parse_bool
from tokenizer import SPECIAL_TOKENS, Tokenizer

# torch.distributed.checkpoint warns on every save and load in a process without torch.distributed (one-process runs
# and `consolidate`), which is how this code means to use it
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")

# -----------------------------------------------------------------------------
# Distributed


def keep_freed_memory(keep=True):
    """Have glibc keep freed memory for reuse instead of giving it back to the OS. A training step allocates the same
    large tensors every time (the tiny shape's 2048 x 8192 logits among them); by default glibc serves each from fresh
    mmap pages and unmaps them when freed, and the page faults that follow cost a quarter of a CPU step (compiled
    bf16 forward+backward at the tiny shape: 330-350 ms with this, 430-490 without). The price: the process keeps
    its peak heap, fragments included. keep=False restores glibc's thresholds and returns what is free to the OS
    (malloc_trim also releases pages in the middle of the heap): shard_model does, since a sharded run is one short
    of memory (llama3-1b on 2 CPU processes: 8.4 GiB per rank after a step with glibc's defaults; with this kept, 24
    GB ran out). A no-op where the C library has no mallopt (macOS; musl's does nothing)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"))
        libc.mallopt(-3, 1 << 30 if keep else 128 * 1024)  # M_MMAP_THRESHOLD: allocations under 1 GiB from the heap...
        libc.mallopt(-1, 2 ** 31 - 1 if keep else 128 * 1024)  # M_TRIM_THRESHOLD: ...which is not trimmed (a C int)
        if not keep:
            libc.malloc_trim(0)
    except (OSError, AttributeError, TypeError):
        pass


def setup_distributed(timeout_s=600):
    """Initialize from torchrun's environment (or run as one process). Returns (rank, local_rank, world_size, device).
    NCCL on CUDA, gloo on CPU; a collective that waits longer than timeout_s (a dead or hung peer) raises instead of
    hanging. Prints the world as initialized, as the first line: each rank reports its host and the device it holds
    (seed 000: one GPU passed off as four)."""
    from datetime import timedelta
    if not torch.cuda.is_available():
        keep_freed_memory()
    if "TORCHELASTIC_RUN_ID" in os.environ:  # started by torchrun (other launchers set RANK too)
        die_with_launcher()
    if "RANK" not in os.environ:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        print(f"distributed: single process, device {device_name(device)}")
        return 0, 0, 1, device
    rank, local_rank, world_size = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"]), int(os.environ["WORLD_SIZE"])
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device, timeout=timedelta(seconds=timeout_s))
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo", timeout=timedelta(seconds=timeout_s))
    names = [None] * world_size
    dist.all_gather_object(names, f"{device} ({device_name(device)}) on {platform.node()}")
    if rank == 0:
        print(f"distributed: world size {dist.get_world_size()} ({dist.get_backend()}): "
              + ", ".join(f"rank {r} {n}" for r, n in enumerate(names)), flush=True)
    return rank, local_rank, world_size, device


def die_with_launcher():
    """Under torchrun: this worker gets SIGKILL when its launcher dies. torchrun starts each worker in a session of
    its own, so a kill of torchrun's process group never reaches it, and a torchrun killed before it stopped a slow
    or stuck worker (a rank inside an NCCL call that never returns) would leave that worker holding its GPU. The
    kernel sends the signal when the thread that started us ends: torchrun starts its workers from its main thread.
    Linux only (prctl); elsewhere nothing is set."""
    if not sys.platform.startswith("linux"):
        return
    parent = os.getppid()
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(1, signal.SIGKILL, 0, 0, 0) != 0:  # PR_SET_PDEATHSIG
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    try:  # the launcher died before the line above (we were handed to init): nobody would ever stop us
        orphaned = os.getppid() != parent or b"torch" not in Path(f"/proc/{parent}/cmdline").read_bytes()
    except OSError:
        orphaned = True
    if orphaned and (parent == 1 or os.getppid() != parent):  # (torchrun itself may be pid 1 in a container)
        raise RuntimeError("the launcher (torchrun) that started this worker has already exited: nothing to run for")


def teardown_distributed():
    """Barrier, then destroy the process group: exiting without it can abort torch at exit or strand workers."""
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


PROBE_MBYTES = 64  # the probe's message: a DDP gradient bucket is 25 MB; NVLS and P2P over NVSwitch start near here


def probe_all_reduce(timeout_s, mbytes=PROBE_MBYTES, iters=5):
    """All-reduces over torchrun's ranks (NCCL on CUDA, gloo on CPU) whose collectives time out after timeout_s:
    speedrun.sh runs it before training, under an outer `timeout` as the hard stop for a hang inside NCCL. First 4
    bytes, then a message of `mbytes` MB (a gradient bucket's size: the large-message algorithms a 4-byte probe never
    reaches), timed over `iters` repeats after one warm-up, and the bus bandwidth printed (algorithm bandwidth x
    2(n-1)/n, nccl-tests' figure). Returns the exit status: 0 when every rank got the right sums."""
    from datetime import timedelta
    if "RANK" not in os.environ:
        print("probe: not under torchrun: one process, nothing to all-reduce")
        return 0
    rank, local_rank, world = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"]), int(os.environ["WORLD_SIZE"])
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", timeout=timedelta(seconds=timeout_s), device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo", timeout=timedelta(seconds=timeout_s))
    expected = world * (world + 1) / 2
    t = torch.full((1,), float(rank + 1), device=device)
    dist.all_reduce(t)
    ok = t.item() == expected
    where = f"{world} ranks ({dist.get_backend()}, {device_name(device)})"
    if rank == 0:
        print(f"probe: 4-byte all-reduce over {where}: {'ok' if ok else f'wrong sum {t.item()}'}", flush=True)
    numel = int(mbytes * 1e6) // 4
    big = torch.full((numel,), float(rank + 1), device=device)  # small integers: exact sums in fp32
    dist.all_reduce(big)  # warm-up: connections and buffers of the large-message path
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda *_: None)
    sync(device)
    good = bool((big == expected).all())
    big.fill_(float(rank + 1))
    dist.barrier()
    start = time.perf_counter()
    for _ in range(iters):
        dist.all_reduce(big)
    sync(device)
    seconds = (time.perf_counter() - start) / iters
    seconds = all_reduce(seconds, dist.ReduceOp.MAX)  # the slowest rank's time is the collective's
    good = good and bool(torch.isfinite(big).all())
    ok = ok and good
    if rank == 0:
        bus = numel * 4 / seconds * 2 * (world - 1) / world / 1e9
        print(f"probe: {numel * 4 / 1e6:.0f} MB all-reduce over {where}: {'ok' if good else 'wrong sums'}, "
              f"{seconds * 1e3:.1f} ms each ({iters} timed), bus bandwidth {bus:.2f} GB/s", flush=True)
    dist.destroy_process_group()
    return 0 if ok else 1


def run_main(main):
    """A stage's exit: 0 when main() finished, 128 + signal when a signal stopped it after its checkpoint
    (non-zero, so a script chaining stages stops), 1 with a one-line error when this project's code raised one
    naming the fix (an error raised elsewhere, in torch say, also gets its traceback). Every rank tears the process group down; after an error without the barrier, since the other ranks
    may never reach it (torchrun stops them when this one exits)."""
    script = Path(sys.argv[0]).name
    try:
        signum = main()
    except (ValueError, FileNotFoundError, RuntimeError, ImportError) as e:
        stopped = stopped_ranks()
        if stopped:  # a collective failed: its peer died (connection reset) or hung (--dist_timeout)
            print(f"{script}: error on rank {dist.get_rank()}: a collective failed ({str(e).splitlines()[0][:160]}): "
                  f"{stopped}", file=sys.stderr, flush=True)
            return 1  # no teardown: its barrier would wait for the stopped rank
        frame = traceback.extract_tb(e.__traceback__)[-1]
        ours = Path(frame.filename).resolve().parent == Path(__file__).resolve().parent and \
            (frame.line or "").lstrip().startswith("raise")
        if not ours:  # raised by torch or another library, or a bug: the traceback is what locates it
            traceback.print_exception(e)
        print(f"{script}: error: {e}", file=sys.stderr)
        if dist.is_initialized():
            dist.destroy_process_group()
        return 1
    teardown_distributed()
    return 128 + signum if signum else 0


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


def mark_progress(step):
    """Record in torchrun's store (one small message) that this rank, this process, entered `step`: what
    stopped_ranks reads when a collective fails."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.distributed_c10d._get_default_store().set(f"progress/{dist.get_rank()}",
                                                       f"{step} {os.getpid()} {platform.node()}")


def process_alive(pid):
    """Whether a process of this host runs: not gone, not a zombie (killed, not yet reaped by torchrun)."""
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
    """After an error under torchrun: the ranks that died (process gone, checked on this host) or did not reach this
    rank's step (hung, or slower than --dist_timeout), from mark_progress's records; "" when none is behind."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return ""
    try:
        store, here = dist.distributed_c10d._get_default_store(), platform.node()
        records = {r: store.get(f"progress/{r}").decode().split() if store.check([f"progress/{r}"]) else None
                   for r in range(dist.get_world_size())}
    except (RuntimeError, ValueError):  # the store went with a node
        return "another rank died or hung (torchrun's store is unreachable; its failure summary names the rank)"
    mine = int(records[dist.get_rank()][0]) if records[dist.get_rank()] else 0
    found = []
    for r, record in records.items():
        if record is None:
            found.append(f"rank {r} never reached step 1")
            continue
        step, pid, host = int(record[0]), int(record[1]), record[2]
        if host == here and not process_alive(pid):
            found.append(f"rank {r} died (process {pid} on {host} is gone; it last entered step {step})")
        elif step < mine:
            found.append(f"rank {r} is stuck: it last entered step {step}, this rank is in step {mine} (process "
                         f"{pid} on {host})")
    return "; ".join(found)


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


def all_reduce_tensor(t, op=None):
    """Sum (or `op`) a tensor over ranks, in place (through the GPU under NCCL); identity when not distributed."""
    if dist.is_initialized():
        on = t.cuda() if dist.get_backend() == "nccl" else t
        dist.all_reduce(on, op=op or dist.ReduceOp.SUM)
        if on is not t:
            t.copy_(on)
    return t


def all_reduce(value, op=None):
    """Sum (or `op`) a float over ranks; identity when not distributed."""
    return all_reduce_tensor(torch.tensor(float(value), dtype=torch.float64), op).item()


# FSDP2, DTensor and torch.distributed.checkpoint are imported where they are used: together they cost ~1.4 s of CPU
# per process (sympy among them), which a run that never shards does not pay. Until shard_model or a sharded
# checkpoint imports them, no parameter can be a DTensor.

def is_dtensor(tensor):
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(tensor, module.DTensor)


def local(tensor):
    """A tensor's part on this rank: the shard of an FSDP-sharded parameter (a DTensor), else the tensor itself."""
    return tensor.to_local() if is_dtensor(tensor) else tensor


def is_sharded(model):
    module = sys.modules.get("torch.distributed.fsdp")
    return module is not None and isinstance(model, module.FSDPModule)


def device_memory(device):
    """Bytes one process may use: the GPU's memory, or on a CPU the machine's RAM shared by this node's processes."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return ram // int(os.environ.get("LOCAL_WORLD_SIZE", "1"))


def shard_model(model, args, world, device):
    """FSDP2 (fully_shard on each block, then the root) when --fsdp true, or with --fsdp auto when fp32 weights +
    gradients + optimizer state would not fit one device by model.py's estimate; prints the decision and its figures.
    Weights stay fp32 shards; each block is all-gathered in the compute dtype (bf16: half the traffic) and its
    gradients reduce-scattered in fp32. The block's input is not cast, so the residual stream stays fp32 as under
    autocast, and the root (embedding, final norm, head) gathers in fp32: the same numbers as DDP + autocast.
    Returns the line that says whether it did and why (common.is_sharded(model) tells later)."""
    optimizer = "adam8bit" if args.optimizer == "adamw" and args.adam8bit else args.optimizer
    estimate = memory_estimate(model.config, 1, optimizer=optimizer, bf16=args.dtype == "bfloat16")
    state = estimate["weights"] + estimate["gradients"] + estimate["optimizer"]
    capacity = device_memory(device)
    fits = f"weights + gradients + optimizer state {fmt_bytes(state)} {'<=' if state <= capacity else '>'} " \
           f"{fmt_bytes(capacity)} per process ({device_name(device)})"
    shard = args.fsdp == "true" or (args.fsdp == "auto" and state > capacity)
    if shard and world == 1:
        return f"sharding: none: one process has nothing to shard with ({fits})"
    if not shard:
        return f"sharding: none, {'DDP' if world > 1 else 'one process'} (--fsdp {args.fsdp}: {fits})"
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    compute = getattr(torch, args.dtype)
    block_policy = MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=torch.float32, cast_forward_inputs=False)
    for block in model.blocks:
        fully_shard(block, mp_policy=block_policy)
    fully_shard(model, mp_policy=MixedPrecisionPolicy(reduce_dtype=torch.float32, cast_forward_inputs=False))
    if device.type == "cpu":
        keep_freed_memory(False)
    return f"sharding: FSDP2 over {world} ranks (--fsdp {args.fsdp}: {fits}); about {fmt_bytes(state / world)} of it " \
        "per rank"


# -----------------------------------------------------------------------------
# Optimizers. The rule: base learning rates are set for a width of 768 and a batch of 2^19 tokens (nanochat's
# reference point). AdamW groups scale with 1/sqrt(width/768) (wider models need smaller steps per coordinate) and
# with (batch/2^19)^(1/8). The square-root rule nanochat uses (the gradient's noise falls with sqrt(batch)) starved the
# embedding and the head at CPU batches: at 2^11 tokens (nanochat's tiny CPU shape, realtext, 300 steps) 8x its lrs
# took val bpb from 2.127 to 1.854 (README: Model quality). The exponent 1/8 keeps nanochat's tuned lrs at 2^19 and
# gives that measured optimum at 2^11. Muon's update is orthogonalized, so its size depends on neither the width nor
# the gradient's noise: its lr is not scaled (at 2^11 tokens, scaling it by sqrt(batch) cost 0.016 bpb; on the demo
# world at 4K-token batches it left val bpb at 1.00 after 80 steps instead of 0.66).

REF_WIDTH, REF_BATCH, BATCH_EXPONENT = 768, 2 ** 19, 1 / 8


def param_groups(model):
    """Split parameters by role: 'matrix' (2D weights inside the blocks), 'embedding', 'value_embedding', 'head',
    'resid_lambdas', 'x0_lambdas', 'scalar' (norms and any other 1D parameter). A tied embedding (tie_embeddings:
    the head reuses wte) is in 'head': its gradient is mostly the output's (every position scores the whole
    vocabulary against it, while an input row gets gradient only where its token occurs), and at the embedding's
    lr (50x the head's) AdamW moves every coordinate of every logit's weights by that lr each step."""
    groups = {"matrix": [], "embedding": [], "value_embedding": [], "head": [], "resid_lambdas": [], "x0_lambdas": [],
              "scalar": []}
    tied = model.config.tie_embeddings
    for name, p in model.named_parameters():
        if name in ("resid_lambdas", "x0_lambdas"):
            groups[name].append(p)
        elif name.startswith("blocks.") and p.ndim == 2:
            groups["matrix"].append(p)
        elif name.startswith("wte."):
            groups["head" if tied else "embedding"].append(p)
        elif name.startswith("value_embeds."):
            groups["value_embedding"].append(p)
        elif name.startswith("lm_head."):
            groups["head"].append(p)
        else:
            groups["scalar"].append(p)
    return {k: v for k, v in groups.items() if v}


def build_optimizers(model, args, width, batch_tokens, device, lr_scale=1.0):
    """Muon for the block matrices and AdamW for the rest (args.optimizer == 'muon'), or AdamW everywhere ('adamw');
    args.adam8bit swaps AdamW for bitsandbytes' AdamW8bit. Every lr is multiplied by lr_scale (a chat stage's
    fraction of its parent's). Returns a list of optimizers; every param group carries 'name' and 'base_lr' (the lr
    at multiplier 1) and 'wd_on' (whether weight decay applies)."""
    width_factor, batch_factor = (width / REF_WIDTH) ** -0.5, (batch_tokens / REF_BATCH) ** BATCH_EXPONENT
    # AdamW on the block matrices keeps the square-root rule: at 2^11 tokens, 8x its lr cost 0.036 bpb (1.899 -> 1.935)
    sqrt_factor = (batch_tokens / REF_BATCH) ** 0.5
    lrs = {"matrix": args.matrix_lr * (1 if args.optimizer == "muon" else width_factor * sqrt_factor),
           "embedding": args.embedding_lr * width_factor * batch_factor,
           "head": args.head_lr * width_factor * batch_factor,
           "scalar": args.scalar_lr * width_factor * batch_factor,
           "value_embedding": args.embedding_lr * width_factor * batch_factor / 2,  # nanochat's: half the embedding's
           # nanochat's, not scaled: scaled by the batch rule (5.8x at 2^11 tokens) one seed in three diverged to
           # +0.03 bpb; unscaled, the three agreed within 0.004
           "resid_lambdas": 0.005, "x0_lambdas": 0.5}
    lrs = {name: lr * lr_scale for name, lr in lrs.items()}
    groups = param_groups(model)
    adam_groups = [{"params": ps, "name": k, "base_lr": lrs[k], "lr": lrs[k], "wd_on": k == "matrix",
                    **({"betas": (0.96, 0.95)} if k == "x0_lambdas" else {})}  # nanochat's, for the x0 mix
                   for k, ps in groups.items() if k != "matrix" or args.optimizer == "adamw"]
    if args.adam8bit:
        try:
            import bitsandbytes
        except ImportError as e:
            raise ImportError("--adam8bit needs bitsandbytes: `pip install bitsandbytes` (CUDA only), or drop the "
                             "flag to use torch's AdamW") from e
        adam = bitsandbytes.optim.AdamW8bit(adam_groups, betas=(0.8, 0.95), eps=1e-10, weight_decay=0.0)
    else:
        adam = torch.optim.AdamW(adam_groups, betas=(0.8, 0.95), eps=1e-10, weight_decay=0.0,
                                 fused=device.type == "cuda")
    optimizers = [adam]
    if args.optimizer == "muon":
        optimizers.append(Muon([{"params": groups["matrix"], "name": "matrix", "base_lr": lrs["matrix"],
                                 "lr": lrs["matrix"], "wd_on": True}], ns_dtype=matmul_dtype(device)))
    return optimizers


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


def precision_line(args, device, optimizers):
    """What runs in which dtype, and why: printed before step 1."""
    muon = [g["ns_dtype"] for opt in optimizers if isinstance(opt, Muon) for g in opt.param_groups]
    return (f"precision: fp32 weights, compute {args.dtype}" + (f", Muon Newton-Schulz {muon[0]}" if muon else "")
            + f"; bf16 is {'native' if native_bf16(device) else 'not native (emulated: not used by default)'} on "
            f"{device_name(device)}")


# Polar Express (Amsel et al. 2025; the coefficients modded-nanogpt and nanochat use): a different quintic a x + b x^3
# + c x^5 at each step, each the best for the singular values the steps before can leave, with a 2% safety margin
# (the input is divided by 1.02 x its Frobenius norm). 5 steps; a 6th and later reuse the last.
POLAR_EXPRESS = ((8.156554524902461, -22.48329292557795, 15.878769915207462),
                 (4.042929935166739, -2.808917465908714, 0.5000178451051316),
                 (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
                 (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
                 (2.3465413258596377, -1.7097828382687081, 0.42323551169305323))


def quintic_coefficients(steps):
    return [POLAR_EXPRESS[min(step, len(POLAR_EXPRESS) - 1)] for step in range(steps)]


def newton_schulz(stack, steps, dtype):
    """Approximately orthogonalize a stack of same-shape matrices, rows <= columns (U S V^T -> U S' V^T with S' ~ 1),
    all at once, with matmuls in `dtype`: X <- a X + (b G + c G^2) X, G = X X^T, with Polar Express's (a, b, c) at
    each step (torch.optim.Muon's iteration uses one fixed triple). torch.optim.Muon always casts to bf16, which a CPU
    without native bf16 emulates (an AVX2-only EPYC: 70% of the step). Wide matrices (columns > 1.5 x rows, an MLP's)
    take the same iteration in its Gram form (newton_schulz_gram): fewer FLOPs, the same result up to rounding. Only in fp32 or fp64: in bf16 the Gram matrix loses the small singular
    values (error 0.37 against an fp64 iteration where the singular values fall to 0.01 of the largest; torch's form:
    0.03)."""
    x = stack.to(getattr(torch, dtype))  # in place from here on: `stack` itself when it is in `dtype` already
    x.div_(x.norm(dim=(-2, -1), keepdim=True).mul_(1.02).clamp_(min=1e-7))  # spectral norm < Frobenius norm: the basin
    rows, columns = x.shape[-2:]
    gram_flops = 4 * rows * rows * columns + (8 * steps - 6) * rows ** 3  # each form's, as newton_schulz_gram counts
    direct_flops = steps * (4 * rows * rows * columns + 2 * rows ** 3)
    if x.dtype in (torch.float32, torch.float64) and gram_flops < direct_flops:
        return newton_schulz_gram(x, steps)
    for a, b, c in quintic_coefficients(steps):
        gram = x @ x.mT  # rows x rows: the smaller Gram matrix
        x = torch.baddbmm(x, torch.baddbmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)  # a x + (b G + c G^2) x
    return x


def newton_schulz_gram(x, steps):
    """newton_schulz's iteration for normalized wide x (m rows, n columns): every step multiplies X on the left by
    P = p(G) = aI + bG + cG^2, so X_k = Q X_0 with Q = P_k ... P_1, and G_k+1 = P G_k P (P commutes with G_k). Only the
    m x m matrices G, P, Q are iterated; X is touched twice. FLOPs 4m^2n + (8 steps - 6) m^3 against steps x (4m^2n +
    2m^3): 44% fewer for the tiny MLP's 256 x 1024 (fp32: 84 -> 46 ms). In fp32 it stays within 1.1e-3 of an fp64
    iteration even where the singular values span 1e-4 (tested; 1.3e-4 with the fixed quintic of before), 200x below
    bf16's rounding of the direct form there (0.26)."""
    gram, product = x @ x.mT, None
    for step, (a, b, c) in enumerate(quintic_coefficients(steps)):
        poly = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)
        poly.diagonal(dim1=-2, dim2=-1).add_(a)
        product = poly if product is None else poly @ product
        if step + 1 < steps:  # the last step's Gram matrix is never used
            gram = poly @ gram @ poly
    return product @ x


def whole(shard, param):
    """The whole matrix of a sharded parameter's update from each rank's shard (an all-gather); else the update."""
    if not is_dtensor(param):
        return shard
    return type(param).from_local(shard, param.device_mesh, param.placements, shape=param.shape,
                              stride=param.stride()).full_tensor()


def shard_of(matrix, param):
    """This rank's rows of a whole matrix that every rank holds, laid out as `param` is sharded (no communication)."""
    if not is_dtensor(param):
        return matrix
    from torch.distributed.tensor import distribute_tensor
    return distribute_tensor(matrix, param.device_mesh, param.placements, src_data_rank=None).to_local()


class Muon(torch.optim.Optimizer):
    """Muon for 2D weights: momentum (Nesterov by default; the schedule sets it, common.muon_momentum), the update
    orthogonalized by newton_schulz (Polar Express) in ns_dtype, then NorMuon's per-neuron normalization
    (neuron_normalized), scaled by sqrt(max(1, rows/cols)) (Keller's shape scaling, torch.optim.Muon's "original"),
    decoupled weight decay lr x wd. Tested against the rule written out in fp64 (tests/test_train.py).
    Matrices of one shape up to a transpose (an MLP's up and down projections) are orthogonalized as one stack: one
    batched matmul instead of one per matrix halves the bf16 Muon step at the tiny shape (107 -> ~55 ms; compiling
    it measured no faster). FSDP-sharded parameters: the momentum is updated on each rank's shard; Newton-Schulz needs
    whole matrices, so the updates go in rounds of one matrix per rank: each is all-gathered, rank i orthogonalizes
    the round's i-th and broadcasts it, and every rank keeps its rows of each. The compute is divided by the ranks;
    at most `world size` whole matrices are in memory at once. Under DDP (whole parameters, the same gradients on
    every rank) each rank orthogonalizes its contiguous share of a shape's stack and an all-gather gives every rank
    all of them, instead of every rank computing every matrix (divide_work=False: the old way, for comparison)."""

    def __init__(self, params, lr=0.02, momentum=0.95, nesterov=True, weight_decay=0.0, ns_steps=5,
                 ns_dtype="bfloat16", neuron_beta2=0.95, divide_work=True):
        super().__init__(params, {"lr": lr, "momentum": momentum, "nesterov": nesterov, "weight_decay": weight_decay,
                                  "ns_steps": ns_steps, "ns_dtype": ns_dtype, "neuron_beta2": neuron_beta2})
        self.divide_work = divide_work

    @torch.no_grad()
    def step(self, closure=None):  # closure: torch.distributed.checkpoint initializes state with step(closure=None)
        for group in self.param_groups:
            by_shape = {}  # (rows, columns) with rows <= columns -> the parameters of that shape or its transpose
            for p in group["params"]:
                if p.grad is not None:
                    by_shape.setdefault((min(p.shape), max(p.shape)), []).append(p)
            for same_shape in by_shape.values():
                sharded = is_dtensor(same_shape[0])  # then in rounds of one matrix per rank
                size = dist.get_world_size() if sharded else len(same_shape)
                for start in range(0, len(same_shape), size):
                    self.update(group, same_shape[start:start + size], sharded)

    def update(self, group, params, sharded):
        """Momentum, Newton-Schulz and the step for matrices of one shape up to a transpose. Sharded: rank i
        orthogonalizes params[i] and broadcasts it; every rank keeps its rows of each."""
        for p in params:
            if not self.state[p]:
                self.state[p]["momentum_buffer"] = torch.zeros_like(p)  # a DTensor shard for a sharded p
        buffers = [local(self.state[p]["momentum_buffer"]) for p in params]
        grads = [local(p.grad) for p in params]
        torch._foreach_lerp_(buffers, grads, 1 - group["momentum"])
        updates = torch._foreach_lerp(grads, buffers, group["momentum"]) if group["nesterov"] else buffers
        updates = [whole(u, p) for u, p in zip(updates, params, strict=True)]  # all-gathered when sharded
        talls, shape = [p.size(0) > p.size(1) for p in params], min(params[0].shape, params[0].shape[::-1])
        share = 0  # under DDP: matrices per rank, each rank the next `share` of the stack
        if not sharded and self.divide_work and dist.is_initialized() and dist.get_world_size() > 1:
            share = math.ceil(len(params) / dist.get_world_size())
            mine = range(dist.get_rank() * share, min(len(params), (dist.get_rank() + 1) * share))
        else:
            mine = [i for i in ([dist.get_rank()] if sharded else range(len(params))) if i < len(params)]
        wide = torch.empty((len(mine), *shape), device=updates[0].device, dtype=getattr(torch, group["ns_dtype"]))
        done = {}
        if mine:  # sharded, a round with fewer matrices than ranks (one value-embedding gate) leaves some rank none
            torch._foreach_copy_([w.mT if talls[i] else w for w, i in zip(wide, mine, strict=True)],
                                 [updates[i] for i in mine])  # stacked and cast in one pass
            done = dict(zip(mine, newton_schulz(wide, group["ns_steps"], group["ns_dtype"]).unbind(0), strict=True))
        for i in range(len(params)) if sharded else ():  # each result from the rank that computed it
            done[i] = done.get(i, torch.empty(shape, device=wide.device, dtype=wide.dtype))
            dist.broadcast(done[i], src=i)
        if share:  # every rank's share, padded to `share` matrices (the last rank's may be short or empty)
            padded = torch.zeros((share, *shape), device=wide.device, dtype=wide.dtype)
            padded[:len(mine)] = torch.stack([done[i] for i in mine]) if mine else padded[:0]
            gathered = [torch.empty_like(padded) for _ in range(dist.get_world_size())]
            dist.all_gather(gathered, padded)
            done = dict(enumerate(torch.cat(gathered)[:len(params)].unbind(0)))
        fulls = [self.neuron_normalized(done[i].mT if talls[i] else done[i], p, group) for i, p in enumerate(params)]
        shards = [shard_of(full, p) for full, p in zip(fulls, params, strict=True)]
        rows, columns = params[0].shape  # the first's: the others are the same or its transpose
        params = [local(p) for p in params]
        torch._foreach_mul_(params, 1 - group["lr"] * group["weight_decay"])
        for tall in (False, True):  # shape scale sqrt(max(1, rows/cols)), folded into the step as torch does
            chosen = [i for i, t in enumerate(talls) if t == tall]
            if chosen:
                scale = (max(rows, columns) / min(rows, columns)) ** 0.5 if tall else 1
                torch._foreach_add_([params[i] for i in chosen], [shards[i] for i in chosen],
                                    alpha=-group["lr"] * scale)

    def neuron_normalized(self, update, param, group):
        """NorMuon (Li et al. 2025), on the whole orthogonalized update in the parameter's orientation: each neuron's
        step (a row of a tall or square matrix, a column of a wide one: the longer side) is divided by the root of
        the running mean (beta2) of its mean square, then the whole is rescaled to the norm it had. Orthogonalization
        leaves neurons' step sizes uneven; this evens them out and keeps the update's size. The state is that running
        mean, one number per neuron, the same on every rank (every rank sees every whole update)."""
        reduce = -1 if update.size(0) >= update.size(1) else -2
        precise = update.to(torch.promote_types(update.dtype, torch.float32))  # bf16 -> fp32; fp64 stays
        mean_square = precise.square().mean(dim=reduce, keepdim=True)
        state = self.state[param]
        if "neuron_second_moment" not in state:
            state["neuron_second_moment"] = torch.zeros_like(mean_square)
        second_moment = state["neuron_second_moment"]
        second_moment.lerp_(mean_square, 1 - group["neuron_beta2"])
        scale = second_moment.clamp(min=1e-10).rsqrt()
        norm_ratio = (mean_square.sum() / (mean_square * scale.square()).sum().clamp(min=1e-20)).sqrt()
        return (precise * (scale * norm_ratio)).to(update.dtype)


# -----------------------------------------------------------------------------
# Schedules: the learning-rate multiplier and the weight decay at each step, a pure function of (step, args), so a
# resumed run needs no schedule state beyond the step.

def decay(progress, start, end, shape, warmdown_frac):
    """Multiplier going from `start` to `end` as progress goes 0 -> 1."""
    progress = min(max(progress, 0.0), 1.0)
    if shape == "cosine":
        return end + (start - end) * 0.5 * (1 + math.cos(math.pi * progress))
    if shape == "linear":
        return start + (end - start) * progress
    if shape == "wsd":  # constant, then a linear warmdown over the last warmdown_frac
        flat = 1 - warmdown_frac
        return start if progress <= flat else start + (end - start) * (progress - flat) / warmdown_frac
    return start  # constant


def lr_multiplier(step, total, args):
    """Warmup, then one decay segment; with a stage boundary (seed 002's two-stage schedule) a second segment that
    restarts the decay at the boundary."""
    if step < args.warmup_steps:
        return (step + 1) / args.warmup_steps
    boundary = args.stage2_step
    if boundary and step >= boundary:
        return decay((step - boundary) / max(1, total - boundary), args.stage2_lr_frac, args.min_lr_frac,
                     args.schedule, args.warmdown_frac)
    end = boundary or total
    return decay((step - args.warmup_steps) / max(1, end - args.warmup_steps), 1.0,
                 args.stage1_end_frac if boundary else args.min_lr_frac, args.schedule, args.warmdown_frac)


def weight_decay_at(step, args):
    return args.stage2_weight_decay if args.stage2_step and step >= args.stage2_step else args.weight_decay


def muon_momentum(step, args):
    """Muon's momentum: 0.85 rising linearly to 0.95 over the first --muon_momentum_warmup steps (nanochat's; at the
    tiny CPU shape, 3 seeds each: val bpb 1.8247 -> 1.8113 alone, 1.8169 -> 1.8063 with NorMuon)."""
    return 0.95 if step >= args.muon_momentum_warmup else 0.85 + 0.10 * step / args.muon_momentum_warmup


def apply_schedule(optimizers, step, total, args):
    multiplier, wd = lr_multiplier(step, total, args), weight_decay_at(step, args)
    for opt in optimizers:
        for group in opt.param_groups:
            group["lr"] = group["base_lr"] * multiplier
            group["weight_decay"] = wd if group["wd_on"] else 0.0
            if isinstance(opt, Muon):
                group["momentum"] = muon_momentum(step, args)
    return multiplier, wd


def add_schedule_args(parser):
    g = parser.add_argument_group("optimization")
    g.add_argument("--optimizer", default="muon", choices=["muon", "adamw"],
                   help="muon: Muon for block matrices + AdamW for the rest; adamw: AdamW everywhere (default: "
                        "%(default)s)")
    g.add_argument("--adam8bit", action="store_true", help="bitsandbytes AdamW8bit instead of AdamW (seed 004)")
    g.add_argument("--matrix_lr", type=float, default=None, help="block matrices, at width 768 and batch 2^19 tokens "
                   "(default: 0.02 with muon, 0.003 with adamw)")
    g.add_argument("--embedding_lr", type=float, default=0.2, help="token embedding, same reference (default: "
                   "%(default)s)")
    g.add_argument("--head_lr", type=float, default=0.004, help="output head, same reference (default: %(default)s)")
    g.add_argument("--scalar_lr", type=float, default=0.04, help="norms and other 1D parameters, same reference "
                   "(default: %(default)s)")
    g.add_argument("--muon_momentum_warmup", type=int, default=300, help="Muon's momentum rises from 0.85 to 0.95 "
                   "over this many steps of the stage; 0 = 0.95 throughout (default: %(default)s)")
    g.add_argument("--weight_decay", type=float, default=0.0, help="decoupled weight decay of the block matrices "
                   "(default: %(default)s)")
    g.add_argument("--grad_clip", type=float, default=1.0, help="clip the global gradient norm; 0 = off (default: "
                   "%(default)s)")
    g.add_argument("--schedule", default="wsd", choices=["cosine", "linear", "wsd", "constant"],
                   help="decay shape after warmup (default: %(default)s)")
    g.add_argument("--warmup_steps", type=int, default=0, help="linear warmup steps (default: %(default)s)")
    g.add_argument("--warmdown_frac", type=float, default=0.2, help="wsd: share of the segment spent decaying "
                   "(default: %(default)s)")
    g.add_argument("--min_lr_frac", type=float, default=0.0, help="final lr as a fraction of the peak (default: "
                   "%(default)s)")
    g.add_argument("--stage2_step", type=int, default=0, help="two-stage schedule (seed 002): step where the decay "
                   "restarts and weight decay changes; 0 = one stage (default: %(default)s)")
    g.add_argument("--stage1_end_frac", type=float, default=0.667, help="two-stage: lr fraction reached at the "
                   "boundary (default: %(default)s)")
    g.add_argument("--stage2_lr_frac", type=float, default=0.667, help="two-stage: lr fraction the second stage "
                   "starts from (default: %(default)s)")
    g.add_argument("--stage2_weight_decay", type=float, default=0.0, help="two-stage: weight decay from the boundary "
                   "on (default: %(default)s)")


# -----------------------------------------------------------------------------
# Checkpoints: runs/<run>/ckpt/step_XXXXXX/, written to a temporary directory and renamed into place, so a directory
# with that name is always complete. Everything loads with weights_only=True. In each:
#   state/      model and optimizer state by parameter name, torch.distributed.checkpoint: every rank writes its own
#               shards in parallel, and any world size reads them back (what --resume loads)
#   rankNNN.pt  that rank's data-loader positions and RNG state
#   model.pt    the whole model in one file (what chat, evaluation, export and the next stage read): written by rank 0
#               when the model is not sharded; for a sharded run at its last step, or by `python common.py
#               consolidate CHECKPOINT`
#   meta.json   what the run is, the step, the versions

def rng_state():
    np_state = np.random.get_state(legacy=False)
    return {"python": list(random.getstate()[1]), "python_pos": random.getstate()[2],
            "numpy_key": torch.from_numpy(np_state["state"]["key"].astype(np.int64)),
            "numpy_pos": np_state["state"]["pos"], "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []}


def set_rng_state(s):
    random.setstate((3, tuple(s["python"]), s["python_pos"]))
    np.random.set_state({"bit_generator": "MT19937", "state": {"key": s["numpy_key"].numpy().astype(np.uint32),
                                                               "pos": s["numpy_pos"]},
                         "has_gauss": 0, "gauss": 0.0})
    torch.set_rng_state(s["torch"])
    if s["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(s["cuda"])


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


def save_checkpoint(ckpt_dir, step, model, optimizers, loader_state, meta, rank, keep, consolidate=False, delay_s=0):
    """Every rank writes its loader and RNG state; a sharded model's ranks their shards of state/ (and with
    `consolidate`, model.pt gathered to rank 0); an unsharded model's rank 0 model.pt and optimizers.pt; rank 0
    meta.json. Then rank 0 renames the temporary directory into place and deletes all but the newest `keep`, and
    writes how long the save took into ckpt_dir/save_seconds: what speedrun.sh gives a stopped stage to checkpoint
    before it kills it (a d20 checkpoint is about 15 GB). delay_s: testing, rank 0 writes that much slower."""
    started = time.perf_counter()
    final = Path(ckpt_dir) / f"step_{step:06d}"
    tmp = Path(ckpt_dir) / f".tmp_step_{step:06d}"
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    barrier()
    torch.save({"loader": loader_state, "rng": rng_state()}, tmp / f"rank{rank:03d}.pt")
    if is_sharded(model):
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_state_dict
        model_state, optimizer_state = get_state_dict(model, optimizers)
        dcp.save({"model": model_state, "optimizers": optimizer_state}, checkpoint_id=tmp / "state")
        if consolidate:  # gathered to rank 0, shard by shard, into CPU memory
            model_state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
            if rank == 0:
                torch.save(model_state, tmp / "model.pt")
    elif rank == 0:
        torch.save(model.state_dict(), tmp / "model.pt")
        torch.save(named_optimizer_state(model, optimizers), tmp / "optimizers.pt")
    if rank == 0:
        time.sleep(delay_s)
        (tmp / "meta.json").write_text(json.dumps({**meta, "step": step, "sharded": is_sharded(model),
                                                   "optimizers": optimizer_layout(optimizers),
                                                   "versions": versions()}, indent=1))
    barrier()
    if rank == 0:
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        for old in list_checkpoints(ckpt_dir)[:-keep]:
            shutil.rmtree(old)
    barrier()
    if rank == 0:
        (Path(ckpt_dir) / "save_seconds").write_text(f"{time.perf_counter() - started:.1f}\n")
    return final


def checkpoint_step(path):
    """The step of a checkpoint directory step_N; None for anything else."""
    name = Path(path).name
    return int(name[5:]) if name.startswith("step_") and name[5:].isdigit() else None


def list_checkpoints(ckpt_dir):
    """Complete checkpoints, oldest first by step (by name, step_1000000 would sort before step_999999)."""
    found = [p for p in Path(ckpt_dir).glob("step_*") if p.is_dir() and checkpoint_step(p) is not None]
    return sorted(found, key=checkpoint_step)


def set_aside_newer(ckpt_dir, step):
    """Resuming from an older checkpoint abandons the newer ones (another branch of the run): move them, never delete
    them, into ckpt_dir/../ckpt_abandoned/<time>/ where no --resume looks. Returns where they went, or None."""
    newer = [c for c in list_checkpoints(ckpt_dir) if checkpoint_step(c) > step]
    if not newer:
        return None
    aside = Path(ckpt_dir).parent / "ckpt_abandoned" / time.strftime("%Y%m%d_%H%M%S")
    aside.mkdir(parents=True, exist_ok=True)
    for c in newer:
        os.replace(c, aside / c.name)
    return aside


def optimizer_layout(optimizers):
    """[[class name, [param group names (None where unnamed)]], ...]: what a checkpoint's optimizer state is,
    recorded in its meta.json so a child stage can tell whether that state fits its own optimizers before loading it
    (warm_start)."""
    return [[type(opt).__name__, [group.get("name") for group in opt.param_groups]] for opt in optimizers]


def named_optimizer_state(model, optimizers):
    """The optimizers' state dicts as one, keyed by parameter name instead of position: the form of
    torch.distributed.checkpoint's full optimizer state dict, which a sharded run loads too."""
    names, merged = {id(p): name for name, p in model.named_parameters()}, {"state": {}, "param_groups": []}
    for opt in optimizers:
        state, params = opt.state_dict(), [p for group in opt.param_groups for p in group["params"]]
        merged["state"].update({names[id(params[i])]: s for i, s in state["state"].items()})
        merged["param_groups"] += [{**g, "params": [names[id(params[i])] for i in g["params"]]}
                                   for g in state["param_groups"]]
    return merged


def load_named_optimizer_state(model, optimizers, merged):
    """named_optimizer_state's dict back into unsharded optimizers (positions from this run's parameter order)."""
    names, groups = {id(p): name for name, p in model.named_parameters()}, iter(merged["param_groups"])
    for opt in optimizers:
        saved = [next(groups) for _ in opt.param_groups]
        order = [name for group in saved for name in group["params"]]
        if order != [names[id(p)] for group in opt.param_groups for p in group["params"]]:
            raise ValueError("the checkpoint's optimizer holds other parameters than this run's: resume with the same "
                             "--optimizer and model")
        index = {name: i for i, name in enumerate(order)}
        opt.load_state_dict({"state": {index[name]: s for name, s in merged["state"].items() if name in index},
                             "param_groups": [{**g, "params": [index[name] for name in g["params"]]} for g in saved]})


def load_state(path, model, optimizers, device):
    """Model and optimizer state from a checkpoint into `model` (sharded or not) and `optimizers`, whatever the world
    size that wrote it: a sharded checkpoint's state/ through torch.distributed.checkpoint (optimizer state must exist
    to be loaded into: get_state_dict creates it with a step at lr 0, which changes no weight), an unsharded one's
    model.pt and optimizers.pt (into a sharded model: as full state dicts that set_state_dict shards)."""
    path = Path(path)
    if (path / "state").is_dir() or is_sharded(model):
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
    if (path / "state").is_dir():
        model_state, optimizer_state = get_state_dict(model, optimizers)
        dcp.load({"model": model_state, "optimizers": optimizer_state}, checkpoint_id=path / "state",
                 no_dist=not dist.is_initialized())
        return set_state_dict(model, optimizers, model_state_dict=model_state, optim_state_dict=optimizer_state)
    model_state = torch.load(path / "model.pt", map_location=device, weights_only=True)
    optimizer_state = torch.load(path / "optimizers.pt", map_location=device, weights_only=True)
    if "state" not in optimizer_state:  # a list, one state dict per optimizer
        raise ValueError(f"{path}/optimizers.pt is in the format of an older version of this code (by position): "
                         f"it cannot be resumed; start the run again, or use its model.pt with --checkpoint")
    if is_sharded(model):
        return set_state_dict(model, optimizers, model_state_dict=model_state, optim_state_dict=optimizer_state,
                              options=StateDictOptions(full_state_dict=True))
    model.load_state_dict(model_state)
    load_named_optimizer_state(model, optimizers, optimizer_state)


def load_rank_states(path, meta, rank, accum):
    """(loader states, RNG state) for this rank's `accum` virtual ranks rank*accum+j from the rank files of a run
    with another world size, as long as the virtual ranks (world size x accumulation) are as many."""
    old_accum, virtuals = meta["accum"], range(rank * accum, (rank + 1) * accum)
    files = {old: torch.load(Path(path) / f"rank{old:03d}.pt", weights_only=True)  # each file once
             for old in sorted({virtual // old_accum for virtual in virtuals})}
    loaders = [files[virtual // old_accum]["loader"][virtual % old_accum] for virtual in virtuals]
    return loaders, files[virtuals[0] // old_accum]["rng"]


def consolidate(path):
    """Write model.pt (the whole model, one file) from a sharded checkpoint's state/, in this one process. Returns
    its path."""
    path = Path(path)
    meta = json.loads((path / "meta.json").read_text())
    import torch.distributed.checkpoint as dcp
    model = build_model(GPTConfig(**meta["model_config"]), "cpu")
    model_state = model.state_dict()
    dcp.load({"model": model_state}, checkpoint_id=path / "state", no_dist=True)
    torch.save(model_state, path / ".model.pt.tmp")
    os.replace(path / ".model.pt.tmp", path / "model.pt")
    return path / "model.pt"


def newest_checkpoint(runs_dir, stage=None):
    """The most recently written checkpoint under runs_dir/*/ckpt/ (of that stage only, if given), or None."""
    found = [c for run in Path(runs_dir).glob("*/ckpt") for c in list_checkpoints(run)
             if stage is None or json.loads((c / "meta.json").read_text()).get("stage") == stage]
    return max(found, key=lambda c: (c / "meta.json").stat().st_mtime, default=None)


def find_checkpoint(path=None, runs_dir="runs", flag="--checkpoint"):
    """A checkpoint directory from a checkpoint path, a run directory (its newest checkpoint), or nothing (the newest
    checkpoint of any run under runs_dir): how each stage picks up the output of the one before it."""
    if path is None:
        found = newest_checkpoint(runs_dir)
        if found is None:
            raise FileNotFoundError(f"no checkpoint under {runs_dir}/*/ckpt/: train one first (python pretrain.py), "
                                    f"or pass --checkpoint runs/<run>")
        return found
    path = Path(path)
    if (path / "meta.json").is_file():
        return path
    found = list_checkpoints(path / "ckpt")
    if not found:
        raise FileNotFoundError(f"{flag} {path}: neither a checkpoint (runs/<run>/ckpt/step_*/meta.json) nor a "
                                f"run directory with checkpoints in {path}/ckpt/")
    return found[-1]


def load_model(path, device):
    """(model in eval mode, meta) from a checkpoint's model.pt and meta.json, on any number of processes (the rank
    files, which a resume needs, are not read)."""
    meta = json.loads((Path(path) / "meta.json").read_text())
    if not (Path(path) / "model.pt").is_file():
        raise FileNotFoundError(f"{path} holds a sharded model (state/) and no model.pt yet: write it with `python "
                                f"common.py consolidate {path}`")
    model = build_model(GPTConfig(**meta["model_config"]), device)
    model.load_state_dict(torch.load(Path(path) / "model.pt", map_location=device, weights_only=True))
    model.eval()
    return model, meta


def checkpoint_tokenizer(meta, checkpoint, flag=None):
    """(tokenizer, its path) for a checkpoint: --tokenizer's value if given, else the one its meta records (else
    runs/tokenizer), refused unless the checkpoint was trained with it (check_tokenizer)."""
    path = flag or meta.get("tokenizer") or "runs/tokenizer"
    try:
        tokenizer = Tokenizer.load(path)
    except FileNotFoundError as e:
        raise FileNotFoundError(f"--tokenizer {path}: {e} (or pass the checkpoint's tokenizer directory with "
                                f"--tokenizer DIR)") from None
    check_tokenizer(meta, tokenizer, path, checkpoint)
    return tokenizer, path


def check_tokenizer(meta, tokenizer, tokenizer_path, checkpoint):
    """Refuse a tokenizer the checkpoint was not trained with: ids would mean other strings and every score would be
    silently wrong."""
    vocab = meta["model_config"]["vocab_size"]
    if tokenizer.vocab_size != vocab:
        raise ValueError(f"tokenizer {tokenizer_path} has {tokenizer.vocab_size} tokens, the model in {checkpoint} "
                         f"has {vocab}: pass the tokenizer it was trained with (--tokenizer {meta.get('tokenizer')})")
    recorded = meta.get("tokenizer_sha256")
    if recorded and recorded != tokenizer.fingerprint():
        raise ValueError(f"tokenizer {tokenizer_path} (sha256 {tokenizer.fingerprint()[:12]}) is not the one "
                         f"{checkpoint} was trained with (sha256 {recorded[:12]}, from {meta.get('tokenizer')}): pass "
                         f"that one with --tokenizer")


def barrier():
    if dist.is_initialized():
        dist.barrier()


# -----------------------------------------------------------------------------
# The run directory: runs/<run>/ with config.json, metrics.jsonl, samples.jsonl, ckpt/step_XXXXXX/. Where a run
# lives, what it resumes from, and the exact command that resumes it.

def add_run_args(parser, stage):
    """The flags every training stage has for its run directory, checkpoints and testing hooks."""
    g = parser.add_argument_group("run directory, checkpoints, health")
    g.add_argument("--run_name", default=None, help=f"outputs go to <runs_dir>/<run_name>/ (default: {stage}_<preset>_"
                   f"<time>; not --run, which torchrun would take for its own --run-path)")
    g.add_argument("--runs_dir", default="runs", help="where runs live (default: %(default)s)")
    g.add_argument("--resume", nargs="?", const="latest", default=None, help="continue from the newest checkpoint of "
                   "--run_name (or of the newest run of this stage), or from the checkpoint directory given")
    g.add_argument("--ckpt_every", type=int, default=500, help="checkpoint every N steps (default: %(default)s)")
    g.add_argument("--keep", type=int, default=3, help="checkpoints kept, newest first; at least 1 (default: "
                   "%(default)s)")
    g.add_argument("--frozen_check_step", type=int, default=10, help="steps after the start at which unchanged "
                   "parameters are named (default: %(default)s)")
    g.add_argument("--health_every", type=int, default=50, help="log update/parameter RMS ratios every N steps "
                   "(default: %(default)s)")
    g.add_argument("--log_every", type=int, default=10, help="progress line every N steps (default: %(default)s)")
    g.add_argument("--wandb", default=None, help="wandb project to log to (needs `pip install wandb`)")
    g.add_argument("--status", default=None, metavar="RUN_DIR", help="print a run's status and exit")
    g.add_argument("--inject_nan_step", type=int, default=-1, help="testing: poison the loss at this step (steps "
                   "count from 1, as logged)")
    g.add_argument("--signal_at_step", type=int, default=-1, help="testing: SIGTERM this process after this step")
    g = parser.add_argument_group("distributed (under torchrun)")
    g.add_argument("--fsdp", default="auto", choices=["auto", "true", "false"], help="shard weights, gradients and "
                   "optimizer state over the ranks with FSDP2; auto: when they would not fit one device by model.py's "
                   "estimate (default: %(default)s)")
    g.add_argument("--dist_timeout", type=float, default=600, help="seconds a collective may wait for the other ranks "
                   "before the run stops with an error (a dead or hung rank) (default: %(default)s)")
    g.add_argument("--die_at_step", type=int, default=-1, help="testing: the last rank SIGKILLs itself at this step")
    g.add_argument("--hang_at_step", type=int, default=-1, help="testing: the last rank stops taking part in "
                   "collectives at this step")
    g.add_argument("--stuck_at_step", type=int, default=-1, help=argparse.SUPPRESS)  # testing: as --hang_at_step,
    # and the rank ignores SIGTERM, SIGINT and SIGHUP: a rank inside an NCCL call never returns to run its handler
    g.add_argument("--checkpoint_delay", type=float, default=0, help=argparse.SUPPRESS)  # testing: rank 0 takes
    # this many seconds longer to write each checkpoint (a d20's 15 GB)


def resolve_run(args, stage):
    """(run directory, checkpoint to resume from or None) from --runs_dir, --run_name and --resume [PATH]; sets
    args.runs_dir and args.run_name to the run's, so the resume command and config.json name it."""
    if args.keep < 1:
        raise ValueError(f"--keep {args.keep}: keep at least 1 checkpoint (the newest is the one a resume needs)")
    if args.resume not in (None, "latest"):  # a checkpoint path: <runs_dir>/<run_name>/ckpt/step_XXXXXX
        path = Path(args.resume)
        if not (path / "meta.json").is_file() or checkpoint_step(path) is None:
            raise FileNotFoundError(f"--resume {path}: not a checkpoint (runs/<run>/ckpt/step_*/ with meta.json)")
        args.runs_dir, args.run_name = str(path.parent.parent.parent), path.parent.parent.name
        return path.parent.parent, path
    if args.resume and args.run_name is None:
        newest = newest_checkpoint(args.runs_dir, stage=stage)
        if newest is None:
            raise FileNotFoundError(f"--resume: no {stage} checkpoint under {args.runs_dir}/*/ckpt/")
        args.run_name = newest.parent.parent.name
    args.run_name = args.run_name or f"{stage}_{args.preset}_{time.strftime('%Y%m%d_%H%M%S')}"
    run_dir = Path(args.runs_dir) / args.run_name
    if not args.resume:
        return run_dir, None
    found = list_checkpoints(run_dir / "ckpt")
    if not found:
        raise FileNotFoundError(f"--resume: {run_dir}/ckpt has no checkpoint yet")
    return run_dir, found[-1]


def resume(path, run_dir, model, optimizers, loaders, layout, rank, device):
    """Restore model, optimizers, loaders and RNG from a checkpoint whose model and micro-batch agree with `layout`
    and whose virtual ranks (world size x accumulation: one data stream each) are as many, so every stream continues
    where it stopped: 2 processes x 1 micro-step resume as 1 x 2 (else a ValueError naming the difference). Newer
    checkpoints of an abandoned branch are set aside. Returns its step."""
    meta = json.loads((Path(path) / "meta.json").read_text())
    for key in ("model_config", "micro_batch"):
        if meta.get(key) != layout[key]:
            raise ValueError(f"--resume {path}: its {key} is {meta.get(key)}, this run's is {layout[key]}: resume with "
                             f"the same settings (the command is in {run_dir}/config.json)")
    virtual, mine = meta["world_size"] * meta["accum"], layout["world_size"] * layout["accum"]
    if virtual != mine:
        raise ValueError(f"--resume {path}: written by {meta['world_size']} processes x {meta['accum']} "
                         f"accumulation steps = {virtual} data streams, this run has {layout['world_size']} x "
                         f"{layout['accum']} = {mine}: pick --total_batch_tokens and the process count so that "
                         f"processes x accumulation = {virtual}")
    load_state(path, model, optimizers, device)
    loader_states, rng = load_rank_states(path, meta, rank, layout["accum"])
    for loader, state in zip(loaders, loader_states, strict=True):
        loader.load_state_dict(state)
    set_rng_state(rng)
    if rank == 0:
        truncate_metrics(run_dir / "metrics.jsonl", meta["step"])
        truncate_metrics(run_dir / "samples.jsonl", meta["step"])
        aside = set_aside_newer(run_dir / "ckpt", meta["step"])
        sharding = ["sharded" if flag else "not sharded" for flag in (meta.get("sharded"), is_sharded(model))]
        print(f"resume: from {path} at step {meta['step']} ({meta['world_size']} -> {layout['world_size']} processes, "
              f"{sharding[0]} -> {sharding[1]})"
              + (f"; the newer checkpoints of the abandoned branch were moved to {aside}" if aside else ""))
    barrier()
    return meta["step"]


def resume_command(args):
    """The exact command that continues this run: this one's arguments without --resume [PATH], --run_name and
    --runs_dir, then the run's own; under torchrun, the same launch (the workers see its world, not its argv)."""
    argv, skip = [], False
    for i, arg in enumerate(sys.argv[1:], start=1):
        if skip:
            skip = False
            continue
        flag = arg.split("=", 1)[0]
        if flag in ("--run_name", "--runs_dir") and "=" not in arg:
            skip = True
        elif flag == "--resume" and "=" not in arg:  # its value is optional: the next word, unless it is a flag
            skip = i + 1 < len(sys.argv) and not sys.argv[i + 1].startswith("-")
        if flag not in ("--run_name", "--runs_dir", "--resume"):
            argv.append(arg)
    command = [sys.argv[0], *argv, "--runs_dir", args.runs_dir, "--run_name", args.run_name, "--resume"]
    if "LOCAL_WORLD_SIZE" not in os.environ:
        return shlex.join([sys.executable, *command])
    per_node, world = int(os.environ["LOCAL_WORLD_SIZE"]), int(os.environ["WORLD_SIZE"])
    nodes = ["--standalone"] if per_node == world else [
        f"--nnodes={world // per_node}", "--rdzv_backend=c10d",
        f"--rdzv_endpoint={os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"]
    prefix = "on every node: " if per_node != world else ""
    return prefix + shlex.join([sys.executable, "-m", "torch.distributed.run", *nodes, f"--nproc_per_node={per_node}",
                                *command])


def write_config(run_dir, record):
    """config.json: what the run is (rank 0 only), rewritten by a resume with its own command line."""
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.json").write_text(json.dumps({**record, "argv": sys.argv, "versions": versions()}, indent=1,
                                                    default=str))


# -----------------------------------------------------------------------------
# Stages after pretraining: the parent checkpoint they start from, and what they inherit from it. Every checkpoint's
# meta records its stage, its hyperparameters ("hparams") and its parent (path and the sha256 of its model.pt).

INHERITED = ["tokenizer", "sequence_len", "micro_batch", "total_batch_tokens", "optimizer", "matrix_lr",
             "embedding_lr", "head_lr", "scalar_lr", "weight_decay", "grad_clip", "dtype", "compile"]


def hparams(args, seq_len, micro, tokens_per_step):
    """What a child stage inherits from this run, as its checkpoints record it."""
    values = {name: getattr(args, name, None) for name in INHERITED}
    return {**values, "sequence_len": seq_len, "micro_batch": micro, "total_batch_tokens": tokens_per_step}


def add_init_args(parser, parents):
    """--checkpoint and the inherited flags of a stage that starts from a checkpoint of one of `parents` (newest first in
    that order of preference): their defaults become None, meaning "the parent's value"."""
    g = parser.add_argument_group("start: the parent checkpoint and what is inherited from it")
    g.add_argument("--checkpoint", default=None, help=f"checkpoint to start from: a step_* directory or a run directory "
                   f"(default: the newest {' checkpoint, else the newest '.join(parents)} checkpoint under --runs_dir)")
    g.add_argument("--tokenizer", default=None, help="tokenizer directory (default: the parent's)")
    g.add_argument("--sequence_len", type=int, default=None, help="row length, at most the parent's (default: the "
                   "parent's)")
    g.add_argument("--micro_batch", type=int, default=None, help="sequences per rank per forward (default: the "
                   "parent's)")
    g.add_argument("--total_batch_tokens", type=int, default=None, help="tokens per optimizer step over all ranks "
                   "(default: the parent's)")
    g.add_argument("--dtype", default=None, choices=["bfloat16", "float32"], help="compute dtype (default: the "
                   "parent's)")
    g.add_argument("--compile", type=parse_bool, default=None,
                   help="torch.compile the model: true or false (default: the parent's)")
    for action in parser._actions:  # the schedule's lr flags: the parent's value unless given
        if action.dest in INHERITED and action.dest not in ("tokenizer", "sequence_len", "micro_batch",
                                                             "total_batch_tokens", "dtype", "compile"):
            action.default, action.help = None, action.help.split(" (default")[0] + " (default: the parent's)"


def find_parent(init, runs_dir, parents):
    """The checkpoint a stage starts from: --checkpoint (a checkpoint or a run directory), else the newest checkpoint of
    the first of `parents` that has one."""
    if init is not None:
        return find_checkpoint(init, runs_dir, flag="--checkpoint")
    for stage in parents:
        found = newest_checkpoint(runs_dir, stage=stage)
        if found is not None:
            return found
    raise FileNotFoundError(f"no {' or '.join(parents)} checkpoint under {runs_dir}/*/ckpt/: run `python "
                            f"{parents[-1]}.py` first, or pass --checkpoint runs/<run>")


def inherit(args, meta, parent):
    """Fill every inherited flag left at None from the parent's recorded hparams; returns the table of (name, value,
    where it came from), the one place a stage's starting settings are resolved."""
    recorded = meta.get("hparams") or {}
    config_file = Path(parent).parent.parent / "config.json"  # checkpoints from before hparams were recorded
    older = json.loads(config_file.read_text()).get("args", {}) if not recorded and config_file.is_file() else {}
    table = []
    for name in INHERITED:
        if getattr(args, name) is not None:
            table.append((name, getattr(args, name), "flag"))
            continue
        value = recorded.get(name, older.get(name))
        if value is None:
            raise ValueError(f"{parent}: its meta.json records no {name}; pass --{name}")
        setattr(args, name, value)
        table.append((name, value, f"parent ({'meta.json' if name in recorded else 'its run config.json'})"))
    if args.sequence_len > meta["model_config"]["sequence_len"]:
        raise ValueError(f"--sequence_len {args.sequence_len} exceeds the parent's "
                         f"{meta['model_config']['sequence_len']} (its rotary tables end there): pass at most that")
    return table


def add_warm_start_args(parser, lr_scale, schedule, warmdown_frac, why):
    """A chat stage's start from its parent's optimizer and its own lr scale and schedule (defaults per stage, `why`
    says where they come from)."""
    g = parser.add_argument_group("warm start: the parent's optimizer state and this stage's lrs")
    g.add_argument("--warm_start", type=parse_bool, default=True, help="continue from the parent checkpoint's "
                   "optimizer state (AdamW moments, Muon momentum) with the lrs reset to this stage's; a state that "
                   "does not fit this stage's optimizers is reported and replaced by a fresh one; false: fresh "
                   "(default: %(default)s)")
    g.add_argument("--lr_scale", type=float, default=lr_scale, help="every lr is this fraction of the parent's (its "
                   f"base lrs at this stage's batch; {why}) (default: %(default)s)")
    parser.set_defaults(schedule=schedule, warmdown_frac=warmdown_frac)


def warm_start(parent, parent_meta, model, optimizers, args, device):
    """Load the parent checkpoint's optimizer state into this stage's optimizers (unsharded or sharded, whatever the
    parent's world size: load_state), then put back this stage's own hyperparameters (lr, base_lr, weight decay,
    betas, momentum): the moments continue, the lrs are the stage's. A fresh optimizer at full lr moves every
    embedding coordinate by about the lr on its first step, since AdamW's first update is sign(gradient); warm
    moments keep the first steps the size of the parent's last ones. When the parent's state does not fit (another
    optimizer or other param groups, or a checkpoint that does not record them) the state stays fresh. Returns the
    line that says which, and why."""
    if not args.warm_start:
        return "optimizer: fresh state (--warm_start false)"
    recorded, mine = parent_meta.get("optimizers"), optimizer_layout(optimizers)
    if recorded is None:
        return (f"optimizer: fresh state: {parent}/meta.json does not record its optimizers (written by an older "
                f"version of this code), so its state cannot be checked against this stage's")
    if recorded != mine:
        return (f"optimizer: fresh state: the parent's optimizers {recorded} are not this stage's {mine} (another "
                f"--optimizer or --adam8bit, or another model)")
    own = [{k: v for k, v in group.items() if k != "params"} for opt in optimizers for group in opt.param_groups]
    try:
        load_state(parent, model, optimizers, device)
        error = None
    except (ValueError, KeyError, RuntimeError, FileNotFoundError) as e:
        error = e
    for group, hyper in zip((g for opt in optimizers for g in opt.param_groups), own, strict=True):
        group.update(hyper)
    if error is not None:
        for opt in optimizers:  # a partly loaded state is no state
            opt.state.clear()
        return f"optimizer: fresh state: the parent's could not be loaded ({type(error).__name__}: {error})"
    tensors = sum(len(opt.state) for opt in optimizers)
    return (f"optimizer: warm start from {parent}'s state ({tensors} parameters' moments, step {parent_meta['step']}),"
            f" lrs reset to {args.lr_scale:g} x the parent's")


def resume_or_warm_start(resume_from, parent, parent_meta, args, run_dir, model, optimizers, loaders, layout, rank,
                         device):
    """A chat stage's first step: its own last checkpoint's (resume), else 0 from the parent's optimizer state with
    this stage's lrs (warm_start, whose line is printed)."""
    if resume_from:
        return resume(resume_from, run_dir, model, optimizers, loaders, layout, rank, device)
    line = warm_start(parent, parent_meta, model, optimizers, args, device)
    if rank == 0:
        print(line)
    return 0


def pretraining_run(checkpoint, meta):
    """(data_dir, sequence_len, eval_tokens) of the pretraining run a checkpoint descends from, following each
    meta.json's parent; None where a link is missing (a parent moved or deleted, or written before it was
    recorded)."""
    while meta.get("stage") != "pretrain":
        path = (meta.get("parent") or {}).get("path")
        if path is None or not (Path(path) / "meta.json").is_file():
            return None
        checkpoint, meta = path, json.loads((Path(path) / "meta.json").read_text())
    config = Path(checkpoint).parent.parent / "config.json"
    recorded = json.loads(config.read_text()).get("args", {}) if config.is_file() else {}
    eval_tokens = recorded.get("bpb_tokens", recorded.get("eval_tokens"))  # a run made before the rename: the old name
    seq_len = (meta.get("hparams") or {}).get("sequence_len")
    if not meta.get("data_dir") or not seq_len:
        return None
    return meta["data_dir"], seq_len, eval_tokens


def add_forgetting_args(parser):
    g = parser.add_argument_group("forgetting")
    g.add_argument("--bpb_tokens", type=int, default=None, help="at the end, the pretraining val bpb of this stage's "
                   "model on the first N tokens of the pretraining corpus's val split, in the rows the pretraining "
                   "run's final evaluation used, so the figures of the stages compare; 0 = skip (default: the "
                   "pretraining run's --bpb_tokens)")


def forgetting(model, tokenizer, parent, parent_meta, args, rank, world, device):
    """How much of its pretraining the stage's model kept: common.val_bpb on the pretraining run's val split, with
    its row length and token count (pretraining_run), unless --bpb_tokens says otherwise. A dict for done.json whose
    val_bpb is None, with a note saying why, when the figure cannot be computed."""
    found = pretraining_run(parent, parent_meta)
    if args.bpb_tokens == 0:
        return {"val_bpb": None, "note": "skipped (--bpb_tokens 0)"}
    if found is None:
        return {"val_bpb": None, "note": f"unknown: the pretraining run of {parent} is not found through its parents'"
                                         f" meta.json"}
    data_dir, seq_len, eval_tokens = found
    tokens = args.bpb_tokens or eval_tokens
    if not tokens:
        return {"val_bpb": None, "note": "unknown: the pretraining run records no --bpb_tokens; pass --bpb_tokens"}
    if not Path(data_dir).is_dir():
        return {"val_bpb": None, "note": f"unknown: the pretraining corpus {data_dir} is not here"}
    rows = val_rows(data_dir, tokenizer, tokens, seq_len)
    bpb, scored = val_bpb(model, rows, tokenizer.token_bytes, 8, args.dtype, rank, world, device)
    return {"val_bpb": bpb, "tokens": scored, "data_dir": str(data_dir), "sequence_len": seq_len}


def forgetting_line(kept):
    return "pretraining val bpb: " + (f"{kept['val_bpb']:.4f} over {kept['tokens']:,} tokens of {kept['data_dir']} "
                                      f"(rows of {kept['sequence_len']} tokens)" if kept["val_bpb"] is not None
                                      else kept["note"])


def parent_record(parent, meta):
    """The parent as a child's checkpoints record it: path, stage, step, and the sha256 of its weights."""
    digest = hashlib.sha256()
    with open(Path(parent) / "model.pt", "rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            digest.update(block)
    return {"path": str(parent), "stage": meta.get("stage"), "step": meta.get("step"), "sha256": digest.hexdigest()}


def check_chat_tokenizer(tokenizer, tokenizer_path):
    """A chat stage needs the chat special tokens; a tokenizer without them cannot render a conversation."""
    missing = [name for name in SPECIAL_TOKENS if name not in tokenizer.special_tokens]
    if missing:
        raise ValueError(f"tokenizer {tokenizer_path} lacks the chat special tokens {', '.join(missing)}: train one "
                         f"with tokenizer.py (it adds {', '.join(SPECIAL_TOKENS)}) and pretrain with it")


def rounds(n_batches, world, model):
    """Batches dealt round robin: n_batches, rounded up to a multiple of world for a sharded model, whose every forward
    needs every rank (a rank with one batch fewer would leave the others waiting in an all-gather)."""
    return math.ceil(n_batches / world) * world if is_sharded(model) else n_batches


@torch.no_grad()
def chat_val_loss(model, batches, dtype, rank, world, device):
    """Mean loss per supervised token over validation batches [(inputs, targets)], dealt to ranks round robin and
    summed in batch order: the same figure on 1 or N processes."""
    sums = torch.zeros(len(batches), 2, dtype=torch.float64)
    was_training = model.training
    model.eval()
    for b in range(rank, rounds(len(batches), world, model), world):
        inputs, targets = (t.to(device) for t in batches[b % len(batches)])
        if b >= len(batches):  # sharded: a forward every rank joins (its all-gathers), not counted
            with autocast_context(device.type, dtype):
                model(inputs, targets, reduction="sum")
            continue
        with autocast_context(device.type, dtype):
            loss_sum = model(inputs, targets, reduction="sum")
        sums[b] = torch.stack([loss_sum.double().cpu(), (targets != -1).sum().double().cpu()])
    model.train(was_training)
    loss, count = all_reduce_tensor(sums).sum(0).tolist()
    return loss / max(count, 1)


CHAT_QUESTIONS = ["What is the capital of France?", "How many legs does a spider have?", "What is two plus three?",
                  "Who are you?"]


def chat_val_batches(chat_dir, tokenizer, seq_len, max_rows):
    """The first max_rows rows of a chat directory's held-out (test*/val*) conversations, padded whole as sft.py packs
    them, the same on every rank."""
    batches, rows = [], 0
    for inputs, targets in chat_loader(chat_dir, "val", tokenizer, 8, seq_len, max_epochs=1, threads=1):
        batches.append((inputs, targets))
        rows += len(inputs)
        if rows >= max_rows:
            break
    return batches


def chat_validation(model, tokenizer, questions, dtype, rank, world, device, run_dir, batches, step):
    """A chat stage's evaluation: the validation loss per supervised token, and greedy answers to `questions`
    (rank 0: printed and appended to samples.jsonl). Returns the loss."""
    loss = chat_val_loss(model, batches, dtype, rank, world, device)
    answers = chat_answers(model, tokenizer, questions, dtype) if rank == 0 or is_sharded(model) else None
    if rank == 0:
        with open(run_dir / "samples.jsonl", "a") as f:
            f.writelines(json.dumps({"step": step, **a}) + "\n" for a in answers)
        print(f"eval step {step}: val loss {loss:.4f}; " + " | ".join(
            f"{a['question']!r} -> {a['answer']!r}" + ("" if a["ended"] else " [no end]") for a in answers))
    return loss


@torch.no_grad()
def chat_answers(model, tokenizer, questions, dtype, max_tokens=64):
    """Greedy answers to one-turn questions, each up to <|assistant_end|> (whether it came is recorded). A sharded
    model is run by every rank, each answer to its full length (the same number of forwards on every rank)."""
    end, answers = tokenizer.special_id("<|assistant_end|>"), []
    was_training = model.training
    model.eval()
    for question in questions:
        prompt = tokenizer.render_for_completion([{"role": "user", "content": question}])
        out, tools = [], ToolUse(tokenizer)  # the calculator on, as in chat.py and chat_eval.py
        for token in generate(model, prompt, min(max_tokens, model.config.sequence_len - len(prompt)), temperature=0,
                              dtype=dtype, tools=tools):
            out.append(token)
            if token == end and not is_sharded(model):
                break
        ended = end in out
        answers.append({"question": question, "answer": reply_text(tokenizer, out[:out.index(end)] if ended else out),
                        "ended": ended, **({"calculator": [list(c) for c in tools.calls]} if tools.calls else {})})
    model.train(was_training)
    return answers


# -----------------------------------------------------------------------------
# Validation bits per byte, shared by pretrain.py (during training) and core_eval.py (on a checkpoint)

def val_rows(data_dir, tokenizer, max_tokens, seq_len):
    """Validation rows of seq_len + 1 tokens, enough for max_tokens targets (fewer if the split is smaller), built
    the way training rows are: the text loader's BOS-led best-fit packing, one pass over the split, as one virtual
    rank. So every row starts with BOS as in training (a window starting mid-document would score tokens without
    their context), and every process and every stage builds the same rows. A last, partly filled row has -1
    targets after its text."""
    n_rows = max(1, math.ceil(max_tokens / seq_len))
    loader = text_loader(data_dir, "val", tokenizer, min(n_rows, 64), seq_len, max_epochs=1, name="val")
    rows, have = [], 0
    try:
        for inputs, targets in loader:
            rows.append(torch.cat([inputs[:, :1], targets], dim=1))
            have += len(inputs)
            if have >= n_rows:
                break
    finally:
        loader.close()
    return torch.cat(rows)[:n_rows]


@torch.no_grad()
def val_bpb(model, rows, token_bytes, batch_rows, dtype, rank, world, device):
    """(bits per byte, tokens scored) over validation rows (val_rows). Targets that are special tokens (BOS) or -1
    (padding) are excluded from both the loss and the bytes: they stand for no text. Batches are dealt to ranks round
    robin, and their sums are added in batch order after the all-reduce, so the figure is bitwise the same on 1 or N
    processes."""
    token_bytes = torch.as_tensor(token_bytes, device=device)
    n_batches = math.ceil(len(rows) / batch_rows)
    sums = torch.zeros(n_batches, 3, dtype=torch.float64)
    was_training = model.training
    model.eval()
    for b in range(rank, rounds(n_batches, world, model), world):
        if b >= n_batches:  # sharded: a forward every rank joins (its all-gathers), on batch 0, not counted
            with autocast_context(device.type, dtype):
                model(rows[:batch_rows].to(device)[:, :-1].clamp(min=0))
            continue
        batch = rows[b * batch_rows:(b + 1) * batch_rows].to(device)
        # a last, partly filled row pads with -1: as an input that would index out of the embedding; it only
        # follows the row's text (causal attention) and its targets are -1, so any token id serves
        x, y = batch[:, :-1].clamp(min=0), batch[:, 1:]
        nbytes = token_bytes[y.clamp(min=0)] * (y != -1)
        text = nbytes > 0
        with autocast_context(device.type, dtype):
            losses = model(x, torch.where(text, y, -1), reduction="none")
        sums[b] = torch.stack([losses.sum().double(), nbytes.sum().double(), text.sum().double()]).cpu()
    model.train(was_training)
    nats, total_bytes, scored = all_reduce_tensor(sums).sum(0).tolist()
    return nats / (math.log(2) * total_bytes), int(scored)


# -----------------------------------------------------------------------------
# Logging and measurement

# Dense bf16 tensor-core peak FLOP/s by device name (first match wins). A device not listed gets MFU "unknown".
PEAK_BF16_FLOPS = [("H100 PCIe", 756e12), ("H100", 989e12), ("H200", 989e12), ("A100", 312e12), ("L40S", 362e12),
                   ("A10G", 70e12), ("L4", 121e12)]


def peak_flops(name, dtype):
    if dtype != "bfloat16":
        return None
    return next((flops for key, flops in PEAK_BF16_FLOPS if key in name), None)


class Metrics:
    """Appends one JSON object per line to a file (rank 0 only)."""

    def __init__(self, path, enabled):
        self.path, self.enabled = Path(path), enabled

    def log(self, record):
        if self.enabled:
            with open(self.path, "a") as f:
                f.write(json.dumps(record) + "\n")


def truncate_metrics(path, last_step):
    """After a resume from `last_step`, drop the lines a killed run logged past it, so each step appears once."""
    path = Path(path)
    if path.is_file():
        lines = [line for line in path.read_text().splitlines() if json.loads(line).get("step", 0) <= last_step]
        path.write_text("".join(line + "\n" for line in lines))


def fmt_bytes(count):
    return f"{count / 2**30:.2f} GiB" if count >= 2**30 else f"{count / 2**20:.1f} MiB"


def fmt_duration(seconds):
    if seconds is None or not math.isfinite(seconds):
        return "unknown"
    seconds = int(seconds)
    return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


# -----------------------------------------------------------------------------
# Health

def sample(p, n=4096):
    """A strided sample of up to n elements of a parameter: cheap to keep, and an optimizer update (dense for AdamW
    and Muon) changes every element, so an unchanged sample means an unchanged tensor. The same p and n always give
    the same elements."""
    p = local(p).detach()  # a sharded parameter: this rank's shard
    return p.reshape(-1)[::max(1, p.numel() // n)][:n]


def param_samples(model):
    return {name: sample(p).clone() for name, p in model.named_parameters()}


def frozen_parameters(model, samples):
    """Names of parameters whose sample has not changed (seed 001: bf16 norm weights that never move)."""
    now = param_samples(model)
    return [name for name in samples if samples[name].numel() and torch.equal(now[name], samples[name])]


def update_ratios(optimizers, before):
    """RMS(update) / RMS(param) per param group, from samples taken just before optimizer.step()."""
    ratios = {}
    for opt in optimizers:
        for group in opt.param_groups:
            num = den = 0.0
            for p in group["params"]:
                old = before[id(p)]
                num += (sample(p) - old).float().pow(2).sum().item()
                den += old.float().pow(2).sum().item()
            ratios[group["name"]] = math.sqrt(num / den) if den > 0 else None
    return ratios


def samples_by_id(optimizers):
    return {id(p): sample(p).clone() for opt in optimizers for g in opt.param_groups for p in g["params"]}


def memory_growing(history, min_steps=50, min_growth=64 * 2**20):
    """Steadily growing CUDA memory (seed 003's leak): allocated never fell over the last min_steps and grew by more
    than min_growth bytes."""
    if len(history) < min_steps:
        return False
    window = history[-min_steps:]
    return all(b >= a for a, b in itertools.pairwise(window)) and window[-1] - window[0] > min_growth


class StopSignal:
    """SIGTERM/SIGINT/SIGHUP (torchrun forwards each; SIGHUP: the terminal closed) set a flag; the training loop
    finishes its step, checkpoints and exits with a resume line."""

    def __init__(self):
        self.signum = None
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, self._handle)

    def _handle(self, signum, frame):
        self.signum = signum

    def requested(self):
        """True on every rank if any rank got a signal (torchrun forwards it to all, but not always at once)."""
        return all_reduce(1.0 if self.signum else 0.0, dist.ReduceOp.MAX if dist.is_initialized() else None) > 0


def now():
    return time.perf_counter()


# -----------------------------------------------------------------------------
# Batch planning: the micro-batch that fits, and the accumulation steps that make up the global batch

MAX_MICRO_BATCH = 1024  # the probe's ceiling without --total_batch_tokens: sequences per rank per forward


def micro_batch_candidates(total, seq_len, world):
    """The micro-batches plan_batch probes: with --total_batch_tokens, the divisors of its per-rank sequences; without,
    the powers of two up to MAX_MICRO_BATCH (the largest that fits is the help text's promise, not a cap of 8)."""
    if total:
        per_rank = max(1, total // (seq_len * world))
        return [m for m in range(1, per_rank + 1) if per_rank % m == 0]
    return [2 ** k for k in range(MAX_MICRO_BATCH.bit_length())]


def find_micro_batch(try_step, candidates):
    """The largest candidate for which try_step(micro_batch) does not run out of CUDA memory."""
    for micro in sorted(candidates, reverse=True):
        try:
            try_step(micro)
            return micro
        except torch.OutOfMemoryError:
            torch.cuda.empty_cache()
    raise RuntimeError(f"even micro_batch={min(candidates)} runs out of memory: lower --sequence_len, use "
                       f"--activation_checkpointing true, or a smaller model")


def probe_step(model, optimizers, seq_len, vocab_size, dtype, device):
    """try_step for find_micro_batch that allocates what a real training step holds at its peak: activations and
    gradients (forward + backward at that micro-batch), and the optimizer state, which AdamW and Muon create at their
    first step (a step at lr 0 creates it without changing a weight; pass throw-away optimizers). DDP's buckets are
    the gradients themselves (wrap_model uses gradient_as_bucket_view), so nothing else is missing."""
    def try_step(micro):
        idx = torch.randint(0, vocab_size, (micro, seq_len), device=device)
        try:
            with autocast_context(device.type, dtype):
                model(idx, idx, reduction="sum").backward()
            for opt in optimizers:
                for group in opt.param_groups:
                    group["lr"] = 0.0
                opt.step()
        finally:
            model.zero_grad(set_to_none=True)
    return try_step


def plan_batch(args, config, world, model, device):
    """(micro_batch, accumulation steps) for --total_batch_tokens; the error names the nearest valid values."""
    seq_len, total = config.sequence_len, args.total_batch_tokens
    if args.micro_batch == 0:
        candidates = micro_batch_candidates(total, seq_len, world)
        if device.type == "cuda":
            throwaway = build_optimizers(model, args, config.n_embd, 1, device)
            micro = find_micro_batch(probe_step(model, throwaway, seq_len, config.vocab_size, args.dtype, device),
                                     candidates)
            del throwaway
            torch.cuda.empty_cache()
            micro = int(all_reduce(micro, dist.ReduceOp.MIN if dist.is_initialized() else None))
            print(f"batch: micro_batch {micro} is the largest that fits on every rank (probed with optimizer state)")
        else:
            micro = max(candidates) if total else 8  # the CPU: no memory probe; 8 sequences keep a step short
    else:
        micro = args.micro_batch
    step_unit = micro * seq_len * world
    total = total or step_unit
    if total % step_unit:
        lo, hi = total // step_unit * step_unit, (total // step_unit + 1) * step_unit
        raise ValueError(f"--total_batch_tokens {total} is not a multiple of micro_batch {micro} x sequence_len "
                         f"{seq_len} x world size {world} = {step_unit}: nearest valid values are {lo or hi} and {hi}")
    return micro, total // step_unit


def loader_threads(args, device):
    """Tokenizer threads for a loader. Training on the CPU, its cores are busy with torch's threads: one tokenizer
    thread keeps up (~1M tok/s against a few thousand trained) without taking a core from the step. On a GPU the
    cores are free: all of this process's share."""
    if args.loader_threads:
        return args.loader_threads
    return 1 if device.type == "cpu" else max(1, os.cpu_count() // int(os.environ.get("LOCAL_WORLD_SIZE", "1")))


def wrap_model(model, args, world, local_rank, device):
    """DDP (gradients are views into its all-reduce buckets: no second copy) unless shard_model sharded it, then
    torch.compile (after DDP, not before: seed 004)."""
    train_model = model
    if world > 1 and not is_sharded(model):
        train_model = DDP(model, device_ids=[local_rank] if device.type == "cuda" else None,
                          gradient_as_bucket_view=True)
    return torch.compile(train_model) if args.compile else train_model


# -----------------------------------------------------------------------------
# The training loop, shared by every training stage: a stage builds its model, optimizers and loaders and hands
# them over; the policies (exact loss, NaN stop, signals, health, metrics, checkpoints) live here once.

def forward_backward(train_model, batches, dtype, device, world, poison=False):
    """Forward and backward over one optimizer step's micro-batches [(inputs, targets), ...]. Returns the step's
    (summed token loss, number of targets) over every micro-batch and rank. The loss is exact for masked targets
    (-1): each micro-batch's backward takes its sum of token losses divided by the count of targets in the whole
    global batch, counted over all micro-batches and ranks before any backward. (The mean of each micro-batch divided
    by the accumulation steps weighs a token by how full its micro-batch is: the gradient-accumulation bug of 2024.)
    DDP averages gradients over ranks, so the local scale is world / count."""
    count = all_reduce_tensor(torch.stack([(targets != -1).sum() for _, targets in batches]).sum().double())
    scale = world / count.clamp(min=1)
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    for j, (inputs, targets) in enumerate(batches):
        last = j == len(batches) - 1
        with (train_model.no_sync() if not last and hasattr(train_model, "no_sync") else nullcontext()), \
                autocast_context(device.type, dtype):
            loss = train_model(inputs, targets, reduction="sum")
            if poison:
                loss = loss * float("nan")
            (loss * scale).backward()
        loss_sum += loss.detach().double()
    return all_reduce_tensor(loss_sum), count


def clip_grad_norm(parameters, max_norm):
    """torch.nn.utils.clip_grad_norm_'s scaling (by max_norm / (norm + 1e-6) when that is below 1), with the squares
    summed in fp64: sharded gradients are summed shard by shard and then over ranks, and in fp32 that other order
    moved the clip factor's last bit, so a resume at another world size drifted from the straight run. In fp64 the
    orders agree to ~1e-16, far below fp32's rounding. Returns the norm (fp32)."""
    grads = [p.grad for p in parameters if p.grad is not None]
    squares = torch.stack([torch.linalg.vector_norm(local(g), dtype=torch.float64) ** 2 for g in grads]).sum()
    if any(is_dtensor(g) for g in grads):  # FSDP2 shards every parameter: add the other ranks' shards
        squares = all_reduce_tensor(squares)
    norm = squares.sqrt().float()
    torch._foreach_mul_([local(g) for g in grads], (max_norm / (norm + 1e-6)).clamp(max=1.0))
    return norm


def open_wandb(args, master):
    if not (args.wandb and master):
        return None
    try:
        import wandb
    except ImportError:
        raise ImportError("--wandb needs `pip install wandb`") from None
    wandb.init(project=args.wandb, name=args.run_name, config=vars(args))
    return wandb


def train(args, model, train_model, optimizers, loaders, *, run_dir, start, total_steps, ckpt_meta, evaluate,
          flops_per_token, rank, world, device):
    """Steps start..total_steps-1. evaluate(step) returns fields for that step's metrics record (and prints).
    Returns None when every step ran, or the signal number that stopped the run after its checkpoint."""
    master, tokens_per_step = rank == 0, sum(ld.B * ld.T for ld in loaders) * world
    if master and start == 0:
        # a stage restarted before its first checkpoint starts over: the lines of the earlier start would count its
        # steps twice (the report sums them)
        for name in ("metrics.jsonl", "samples.jsonl"):
            if (run_dir / name).is_file():
                (run_dir / name).unlink()
                print(f"run dir: {run_dir / name} of an earlier start without a checkpoint removed: starting over")
    metrics, wandb, stop = Metrics(run_dir / "metrics.jsonl", master), open_wandb(args, master), StopSignal()
    peak = peak_flops(device_name(device), args.dtype)
    initial, mem_history, run_start = param_samples(model), [], now()

    def checkpoint(step, last=False):
        finite = all(torch.isfinite(local(p)).all() for p in model.parameters())  # each rank checks its shards
        if all_reduce(0.0 if finite else 1.0, dist.ReduceOp.MAX if dist.is_initialized() else None):
            raise RuntimeError(f"step {step}: parameters are not finite; not writing a checkpoint")
        return save_checkpoint(run_dir / "ckpt", step, model, optimizers, [ld.state_dict() for ld in loaders],
                               ckpt_meta, rank, args.keep, consolidate=last, delay_s=args.checkpoint_delay)

    for step in range(start, total_steps):
        t0 = now()
        lr_mult, wd = apply_schedule(optimizers, step, total_steps, args)
        batches = [next(loader) for loader in loaders]
        data_wait = now() - t0  # the loaders prefetch: this is time the step stood still waiting for data
        if rank == world - 1 and step + 1 in (args.die_at_step, args.hang_at_step, args.stuck_at_step):
            die_or_hang(step + 1 == args.die_at_step, step + 1 == args.stuck_at_step)
        mark_progress(step + 1)
        loss_sum, count = forward_backward(train_model, batches, args.dtype, device, world,
                                           poison=step + 1 == args.inject_nan_step)
        norm = clip_grad_norm(model.parameters(), args.grad_clip or float("inf"))
        # the step's one read from the device, which the non-finite stop below needs before the optimizer step: one
        # transfer for the three figures instead of one wait per .item() (values exact: fp64, fp32 -> fp64)
        loss_sum, count, grad_norm = torch.stack([loss_sum, count, norm.double()]).tolist()
        loss = loss_sum / max(1.0, count)
        if not (math.isfinite(loss) and math.isfinite(grad_norm)):
            last = list_checkpoints(run_dir / "ckpt")
            raise RuntimeError(f"step {step + 1}: loss {loss} / grad norm {grad_norm} is not finite: run stopped "
                               f"before the optimizer step; last good checkpoint: {last[-1] if last else 'none'} "
                               f"(resume with --resume, perhaps a lower lr)")
        health = step % args.health_every == 0
        before = samples_by_id(optimizers) if health else None
        for opt in optimizers:
            opt.step()
        model.zero_grad(set_to_none=world == 1 or is_sharded(model))  # DDP's gradients are views into its buckets
        if device.type == "cuda":
            torch.cuda.synchronize()
        dt = now() - t0
        tokens_seen = int(all_reduce(sum(ld.state["stats"]["tokens"] for ld in loaders)))
        record = {"step": step + 1, "loss": loss, "targets": int(count), "lr_mult": lr_mult,
                  "weight_decay": wd, "lr": {g["name"]: g["lr"] for opt in optimizers for g in opt.param_groups},
                  "grad_norm": grad_norm, "tokens": tokens_seen, "tok_per_s": tokens_per_step / dt,
                  "data_wait": data_wait / dt, "epoch": max(ld.epoch for ld in loaders) + 1,  # this rank's; 1: first pass
                  "mfu": tokens_per_step * flops_per_token / dt / (peak * world) if peak else "unknown",
                  "step_time": dt, "cuda_mem_alloc": torch.cuda.memory_allocated(device) if device.type == "cuda"
                  else None, "cuda_mem_reserved": torch.cuda.memory_reserved(device) if device.type == "cuda" else None,
                  "cuda_mem_peak": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None}
        if health:
            record["update_rms_ratio"] = update_ratios(optimizers, before)
        warning = health_warning(model, initial, mem_history, record, step + 1 - start, args)
        if warning:
            record["warning"] = warning
            if master:
                print(f"WARNING step {step + 1}: {warning}")
        last_step = step + 1 == total_steps
        if args.eval_every and (step + 1) % args.eval_every == 0 and not last_step:
            record.update(evaluate(step + 1))
        metrics.log(record)
        if wandb:
            wandb.log({k: v for k, v in record.items() if isinstance(v, (int, float))}, step=step + 1)
        if master and ((step + 1) % args.log_every == 0 or last_step or step == start):
            print(progress_line(record, total_steps, (now() - run_start) / (step + 1 - start)), flush=True)
        if step + 1 == args.signal_at_step:
            os.kill(os.getpid(), signal.SIGTERM)
        if stop.requested():
            path = checkpoint(step + 1)
            if master:
                print(f"stopped by signal at step {step + 1}; checkpoint {path}. Resume with: {resume_command(args)}")
            return stop.signum or signal.SIGTERM
        if (step + 1) % args.ckpt_every == 0 or last_step:
            checkpoint(step + 1, last_step)  # the final checkpoint comes before the final evaluation (nanochat #446)
    return None


def die_or_hang(die, stuck=False):
    """Testing hooks (--die_at_step, --hang_at_step, --stuck_at_step): this rank dies by SIGKILL, or stops taking
    part in collectives until it is stopped (a rank wedged mid-step), just before the step's first collective; stuck:
    only SIGKILL stops it (a rank inside a C call that never returns runs no handler)."""
    if die:
        os.kill(os.getpid(), signal.SIGKILL)
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP) if stuck else (signal.SIGTERM,):
        # hang: torchrun's SIGTERM ends it at once, not after its 30 s grace; stuck: nothing but SIGKILL ends it
        signal.signal(sig, signal.SIG_IGN if stuck else signal.SIG_DFL)
    while True:
        time.sleep(1)


def health_warning(model, initial, mem_history, record, steps_done, args):
    """Seed 001's frozen parameters (checked once, frozen_check_step steps after the start) and seed 003's CUDA
    memory leak (once per 50 steps of growth); None when healthy."""
    if record["cuda_mem_alloc"] is not None:
        mem_history.append(record["cuda_mem_alloc"])
        if memory_growing(mem_history):
            mem_history.clear()  # warned once; a later warning needs another 50 steps of growth
            return "CUDA memory allocated grew every step for the last 50 steps: a leak?"
    if steps_done == args.frozen_check_step:
        frozen = frozen_parameters(model, initial)
        if frozen and len(frozen) == sum(1 for sample in initial.values() if sample.numel()):
            # nothing learns (an H100 run under torch.compile with torch 2.11 got every gradient 0 from the loss):
            # hours of such a run would only print plausible tok/s and MFU
            raise RuntimeError(f"no parameter changed in {args.frozen_check_step} steps: every gradient is zero or no "
                               f"optimizer steps; stopped. Rerun with --compile false to tell whether compilation "
                               f"is the cause")
        if frozen:
            return f"parameters unchanged after {args.frozen_check_step} steps: {', '.join(frozen)}"
    return None


def progress_line(record, total_steps, seconds_per_step):
    mfu = f"{100 * record['mfu']:.1f}%" if record["mfu"] != "unknown" else "unknown"
    eta = seconds_per_step * (total_steps - record["step"])
    return (f"step {record['step']}/{total_steps} loss {record['loss']:.4f} lr x{record['lr_mult']:.3f} gnorm "
            f"{record['grad_norm']:.3f} {record['tok_per_s']:,.0f} tok/s MFU {mfu} data wait "
            f"{100 * record['data_wait']:.0f}% tokens {record['tokens']:,} epoch {record['epoch']}"
            f"{' (repeating data)' if record['epoch'] > 1 else ''} ETA {fmt_duration(eta)}")


def print_status(run_dir):
    """What a run has done so far, from its files: works while it runs and after it ends, for every stage."""
    if not (run_dir / "metrics.jsonl").is_file():
        raise FileNotFoundError(f"{run_dir} has no metrics.jsonl: not a run directory (runs/<run>/)")
    config = json.loads((run_dir / "config.json").read_text())
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "loss" in r]
    total, last = config["total_steps"], steps[-1]
    print(f"run {run_dir} ({config.get('stage')}): {'finished' if (run_dir / 'done.json').is_file() else 'not finished'}"
          f"; step {last['step']}/{total}, tokens {last['tokens']:,}")
    window = max(1, len(steps) // 5)
    trend = [sum(r["loss"] for r in steps[i:i + window]) / len(steps[i:i + window])
             for i in range(0, len(steps), window)]
    print("loss trend (means of fifths): " + " -> ".join(f"{v:.3f}" for v in trend))
    recent = steps[-20:]
    rate = sum(r["tok_per_s"] for r in recent) / len(recent)
    tokens_left = (total - last["step"]) * config["tokens_per_step"]
    print(f"speed {rate:,.0f} tok/s, MFU {last['mfu']}; ETA {fmt_duration(tokens_left / rate if rate else None)}")
    vals = [r for r in records if "val_bpb" in r or "final_val_bpb" in r]
    print(f"last validation: {vals[-1] if vals else 'none yet'}")
    warnings = [f"step {r['step']}: {r['warning']}" for r in records if "warning" in r]
    print("health warnings: " + ("; ".join(warnings) if warnings else "none"))
    samples_path = run_dir / "samples.jsonl"
    if samples_path.is_file():
        samples = [json.loads(line) for line in samples_path.read_text().splitlines()]
        for s in [s for s in samples if s["step"] == samples[-1]["step"]]:
            print(f"sample step {s['step']}: {s['prompt']!r} -> {s['completion']!r}")
    ckpts = list_checkpoints(run_dir / "ckpt")
    print(f"checkpoints: {', '.join(c.name for c in ckpts) if ckpts else 'none'}")


def main(argv=None):
    parser = argparse.ArgumentParser(description="speedrun.sh's NCCL check (probe, under torchrun), and a sharded "
                                     "checkpoint's model.pt (consolidate); otherwise import common")
    parser.add_argument("command", choices=["probe", "consolidate"], help="probe: a 4-byte and a timed large all-reduce "
                        "over torchrun's ranks; consolidate: write CHECKPOINT/model.pt from its shards, in one process")
    parser.add_argument("checkpoint", nargs="?", help="consolidate: a step_* directory or a run directory (its newest)")
    parser.add_argument("--timeout", type=float, default=60.0, help="probe: seconds before a collective counts as "
                        "hung (default: %(default)s)")
    parser.add_argument("--mbytes", type=float, default=PROBE_MBYTES, help="probe: size of the timed all-reduce in MB "
                        "(default: %(default)s)")
    args = parser.parse_args(argv)
    if args.command == "probe":
        return probe_all_reduce(args.timeout, args.mbytes)
    if args.checkpoint is None:
        parser.error("consolidate needs a checkpoint: python common.py consolidate runs/<run>[/ckpt/step_N]")
    try:
        path = find_checkpoint(args.checkpoint)
        written = consolidate(path)
        count = sum(t.numel() for t in torch.load(written, weights_only=True).values())
        print(f"consolidate: wrote {written} ({count:,} parameters)")
    except (FileNotFoundError, ValueError) as e:
        print(f"common.py: error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
