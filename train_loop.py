"""The training loop all stages share (train): a stage gives its model, optimizers and loaders;
loss, NaN stop, signals, health checks, metrics and checkpoints live here. Also batch planning,
wrapping (DDP, torch.compile) and a run's status:

    python train_loop.py status runs/<run>
"""
import argparse
import functools
import gc
import itertools
import json
import math
import os
import signal
import sys
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from checkpoint import INHERITED, list_checkpoints, resume_command, save_checkpoint, saved_layout
from distributed import (
    CACHE_DIR,
    all_reduce,
    all_reduce_tensor,
    append_jsonl,
    device_name,
    fmt_bytes,
    fmt_duration,
    is_dtensor,
    is_sharded,
    keep_freed_memory,
    keep_progress,
    local,
    mark_progress,
    now,
    peak_flops,
    run_main,
)
from model import (
    autocast_context,
    memory_estimate,
    param_breakdown,
    parse_args,
    parse_bool,
)
from optim import add_schedule_args, apply_schedule, build_optimizers

# -----------------------------------------------------------------------------
# Health

def sample(p, n=4096):
    """Up to n fixed elements of a parameter: the optimizers change every element, so an
    unchanged sample means an unchanged tensor."""
    p = local(p).detach()  # sharded: this rank's shard
    return p.reshape(-1)[::max(1, p.numel() // n)][:n]


def param_samples(model):
    return {name: sample(p).clone() for name, p in model.named_parameters()}


def frozen_parameters(model, samples):
    return [name for name, p in model.named_parameters()
            if samples[name].numel() and torch.equal(sample(p), samples[name])]


def update_ratios(optimizers, before):
    """RMS(update) / RMS(param) per param group, from samples taken before the step."""
    ratios = {}
    for group in (group for opt in optimizers for group in opt.param_groups):
        num = sum((sample(p) - before[id(p)]).float().pow(2).sum().item() for p in group["params"])
        den = sum(before[id(p)].float().pow(2).sum().item() for p in group["params"])
        ratios[group["name"]] = math.sqrt(num / den) if den > 0 else None
    return ratios


def samples_by_id(optimizers):
    return {id(p): sample(p).clone() for opt in optimizers for g in opt.param_groups
            for p in g["params"]}


def memory_growing(history, min_steps=50, min_growth=64 * 2**20):
    """A leak: allocated never fell over min_steps and grew > min_growth."""
    if len(history) < min_steps:
        return False
    window = history[-min_steps:]
    return all(b >= a for a,
               b in itertools.pairwise(window)) and window[-1] - window[0] > min_growth


def health_warning(model, initial, mem_history, record, steps_done, args):
    """Frozen parameters (checked at frozen_check_step) or a memory leak; None when healthy."""
    if record["cuda_mem_alloc"] is not None:
        mem_history.append(record["cuda_mem_alloc"])
        if memory_growing(mem_history):
            mem_history.clear()  # warn again only after another 50 steps of growth
            return "CUDA memory allocated grew every step for the last 50 steps: a leak?"
    if initial is not None and steps_done == args.frozen_check_step:
        frozen = frozen_parameters(model, initial)
        if frozen and len(frozen) == sum(1 for sample in initial.values() if sample.numel()):
            # a compiled run can get every gradient 0 and show hours of plausible MFU
            raise RuntimeError(f"no parameter changed in {args.frozen_check_step} steps: every "
                               "gradient is zero or no optimizer steps; stopped. Rerun with "
                               "--compile false to tell whether compilation is the cause")
        if frozen:
            return f"parameters unchanged after {args.frozen_check_step} steps: {', '.join(frozen)}"
    return None


class Health:
    """One call a step: update ratios every health_every steps, and health_warning's warnings,
    printed on rank 0."""

    def __init__(self, model, optimizers, args, start, master, frozen_check=True):
        self.model, self.optimizers, self.args = model, optimizers, args
        self.start, self.master = start, master
        self.initial = param_samples(model) if frozen_check else None
        self.memory = []  # CUDA memory allocated, step by step
        self.before = self.samples(start)

    def samples(self, step):
        """Samples before step `step` where its update ratios are due."""
        return samples_by_id(self.optimizers) if step % self.args.health_every == 0 else None

    def check(self, record):
        step = record["step"]
        if self.before is not None:
            record["update_rms_ratio"] = update_ratios(self.optimizers, self.before)
        warning = health_warning(self.model, self.initial, self.memory, record, step - self.start,
                                 self.args)
        if warning:
            record["warning"] = warning
            if self.master:
                print(f"WARNING step {step}: {warning}")
        self.before = self.samples(step)


class StopSignal:
    """SIGTERM/SIGINT/SIGHUP set a flag; the loop finishes its step, checkpoints and exits with
    a resume line."""

    def __init__(self):
        self.signum = None
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, self._handle)

    def _handle(self, signum, frame):
        self.signum = signum

    def requested(self):
        """True on every rank if any got a signal (torchrun forwards it, not always at once)."""
        return all_reduce(1.0 if self.signum else 0.0, dist.ReduceOp.MAX) > 0


# -----------------------------------------------------------------------------
# Budget flags (--steps, --tokens, ...): the last one given wins, so one appended to a command
# line replaces its budget

class BudgetFlag(argparse.Action):
    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, values)
        namespace.budget_order = [d for d in getattr(namespace, "budget_order",
                                                     None) or [] if d != self.dest] + \
            [self.dest]


def add_budget_args(group, flags):
    """flags: [(name, type, help)], each a BudgetFlag."""
    for name, kind, text in flags:
        group.add_argument(f"--{name}", type=kind, action=BudgetFlag, help=text)


def resolve_budget(args, names, default=None):
    """Keep the last budget flag of `names`, the others None; none given: `default` (name, value)
    or an error. Returns the line saying which is in force."""
    given = [d for d in getattr(args, "budget_order", None) or [] if d in names]
    if not given and default is None:
        raise ValueError("give a budget: " + " or ".join(f"--{n}" for n in names))
    used = given[-1] if given else default[0]
    if not given:
        setattr(args, *default)
    replaced = [f"--{d} {getattr(args, d):g}" for d in given[:-1]]
    for d in names:
        if d != used:
            setattr(args, d, None)
    args.budget_order = [used]
    why = (f", given after {' and '.join(replaced)}, which it replaces (the last budget flag given "
           "wins)" if replaced
           else "" if given else " (the default: no budget flag given)")
    return f"budget in force: --{used} {getattr(args, used):g}{why}"


def parse_stage_args(parser, argv, budgets, default=None):
    """A stage's flags and its budget (a bad one a usage error), unless --status."""
    args = parse_args(parser, argv)
    if args.status is None:
        try:
            args.budget_line = resolve_budget(args, budgets, default)
        except ValueError as e:
            parser.error(str(e))
        # before any step, not a division by 0 after training
        if args.ckpt_every < 1:
            parser.error(f"--ckpt_every {args.ckpt_every}: give N >= 1 (the last step saves too, "
                         "so an N above the stage's steps saves there only)")
    return args


# -----------------------------------------------------------------------------
# Memory: what a step holds, whether to shard, whether N CPU processes fit

def device_memory(device):
    """Bytes one process may use: the GPU's, or the RAM shared by this node's processes."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return machine_memory() // int(os.environ.get("LOCAL_WORLD_SIZE", "1"))


def machine_memory():
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def process_memory(device):
    """Bytes in use: the CUDA device's, or this process's resident set."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return total - free
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


# A CPU rank's memory beside the model: torch, gloo, the loader; unsharded it also keeps what
# it frees (keep_freed_memory). Fitted to pretrain.py's peaks (dev/LOG.md)
CPU_RUNTIME = {"sharded": 0.4 * 2**30, "unsharded": 1.3 * 2**30}


def step_estimate(config, args, micro, device_type):
    optimizer = "adam8bit" if args.optimizer == "adamw" and args.adam8bit else args.optimizer
    return memory_estimate(config, micro, optimizer=optimizer, bf16=args.dtype != "float32",
                           device_type=device_type)


def rank_memory(config, estimate, world, sharded, device_type):
    """A rank's peak bytes. Unsharded: the whole step (DDP adds its buckets, a second gradient).
    FSDP2: weights and optimizer state split over ranks, plus the root module (embeddings, head)
    whole, 12 bytes a parameter (fp32, gradient, buffer), plus activations."""
    runtime = CPU_RUNTIME["sharded" if sharded else "unsharded"] if device_type == "cpu" else 0
    in_flight = estimate["activations"] + estimate["transient"]
    if not sharded:
        buckets = estimate["gradients"] if world > 1 else 0
        return runtime + estimate["total"] + buckets
    counts = param_breakdown(config)
    root = counts["total"] - counts["attention"] - counts["mlp"]
    shared = (estimate["weights"] + estimate["optimizer"]) / world
    return runtime + shared + 12 * root + in_flight


def shard_model(model, args, world, device):
    """FSDP2 (each block, then the root) with --fsdp true, or auto when the step would not fit
    one device. Returns the line saying whether and why."""
    micro = getattr(args, "micro_batch", None) or 1  # the probe chooses later
    estimate = step_estimate(model.config, args, micro, device.type)
    in_use = process_memory(device)
    step = in_use + sum(estimate[k] for k in ("gradients", "optimizer", "activations", "transient"))
    capacity = device_memory(device)
    fits = (f"in use now {fmt_bytes(in_use)} + gradients, optimizer state and micro-batch "
            f"{micro}'s activations = {fmt_bytes(step)} {'<=' if step <= capacity else '>'} "
            f"{fmt_bytes(capacity)} per process ({device_name(device)})")
    shard = args.fsdp == "true" or (args.fsdp == "auto" and step > capacity)
    if shard and world == 1:
        return f"sharding: none: one process has nothing to shard with ({fits})"
    if not shard:
        how = "DDP" if world > 1 else "one process"
        return f"sharding: none, {how} (--fsdp {args.fsdp}: {fits})"
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    compute = getattr(torch, args.dtype)
    # blocks gathered in the compute dtype (half the traffic), reduced in fp32; inputs not cast,
    # so the residual stream stays fp32 as under autocast
    block_policy = MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=torch.float32,
                                        cast_forward_inputs=False)
    for block in model.blocks:
        fully_shard(block, mp_policy=block_policy)
    fully_shard(model, mp_policy=MixedPrecisionPolicy(reduce_dtype=torch.float32,
                                                      cast_forward_inputs=False))
    if device.type == "cpu":
        keep_freed_memory(False)
    peak = rank_memory(model.config, estimate, world, True, device.type)
    return (f"sharding: FSDP2 over {world} ranks (--fsdp {args.fsdp}: {fits}); about "
            f"{fmt_bytes(peak)} per rank at its peak")


# -----------------------------------------------------------------------------
# Batch planning: the micro-batch that fits, the accumulation steps that make the batch

# the probe's ceiling without --total_batch_tokens
MAX_MICRO_BATCH = 1024


def micro_batch_candidates(total, seq_len, world):
    """Divisors of the per-rank sequences, or without a total powers of two."""
    if total:
        per_rank = max(1, total // (seq_len * world))
        return [m for m in range(1, per_rank + 1) if per_rank % m == 0]
    return [2 ** k for k in range(MAX_MICRO_BATCH.bit_length())]


def find_micro_batch(try_step, candidates):
    for micro in sorted(candidates, reverse=True):
        try:
            try_step(micro)
            return micro
        except torch.OutOfMemoryError:
            torch.cuda.empty_cache()
    raise RuntimeError(f"even micro_batch={min(candidates)} runs out of memory: lower "
                       "--sequence_len, use --activation_checkpointing true, or a smaller model")


def probe_step(model, optimizers, seq_len, vocab_size, dtype, device):
    """try_step reaching a real step's peak: activations, gradients and optimizer state, from a
    step at lr 0 of throw-away optimizers."""
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


def nearest_batch(total, seq_len, world, micro=0, within=0.03):
    """Tokens a step nearest `total` (within `within`) that split into micro-batches of `micro`
    over `world` ranks; micro 0 prefers the largest power-of-two divisor. None if none."""
    unit = (micro or 1) * seq_len * world
    if total % unit == 0:
        return total
    want = total / unit
    options = range(max(1, math.ceil(want * (1 - within))), math.floor(want * (1 + within)) + 1)
    return max(options, key=lambda s: (0 if micro else s & -s,
                                       -abs(s - want))) * unit if options else None


def processes(world):
    return f"{world} process{'es' if world > 1 else ''}"


def batch_line(total, used, seq_len, world, micro=0):
    """plan_batch's line when it uses `used` tokens a step instead of `total`."""
    from optim import BATCH_EXPONENT
    micro_x = f"micro_batch {micro} x " if micro else ""
    what = f"{micro_x}sequence_len {seq_len} x {processes(world)}"
    steps = f", {used // (micro * seq_len * world)} accumulation steps" if micro else ""
    return (f"batch: --total_batch_tokens {total:,} is not a whole number of {what}: {used:,} "
            f"tokens a step instead ({100 * (used / total - 1):+.1f}%, {used // (seq_len * world)} "
            f"sequences a process{steps}); a token budget takes proportionally "
            f"{'fewer' if used > total else 'more'} steps, and the AdamW lrs of the embeddings, "
            f"head and scalars follow the batch (x{(used / total) ** BATCH_EXPONENT:.4f}, "
            "optim.py)")


def add_micro_batch_arg(group):
    group.add_argument("--micro_batch", type=int, default=0, help="sequences per rank per forward "
                       "(rl.py: replies); 0 = the checkpoint's when resuming (--resume), else the "
                       "parent checkpoint's, else the largest that fits on CUDA (a divisor of "
                       "the per-rank batch, or a power of two), on the CPU the whole per-rank "
                       "batch (8 without --total_batch_tokens) (default: %(default)s)")


def plan_batch(args, config, world, model, device, resume_from=None, parent_meta=None,
               accumulate=True):
    """(micro_batch, accumulation steps, its source), as --micro_batch's help says;
    accumulate=False: no accumulation."""
    seq_len, total = config.sequence_len, args.total_batch_tokens if accumulate else None
    master = not dist.is_initialized() or dist.get_rank() == 0
    resumed = saved_layout(resume_from)["micro_batch"] if resume_from else None
    parents = ((parent_meta or {}).get("hparams") or {}).get("micro_batch")
    micro, source = 0, ""
    if args.micro_batch:
        micro, source = args.micro_batch, "flag"
    elif resumed:
        micro, source = resumed, "the checkpoint's (--resume)"
        if master:
            print(f"batch: micro_batch {micro}, the checkpoint's (--micro_batch 0 and --resume)")
    elif parents:
        micro, source = parents, "parent (meta.json)"
    nearest = nearest_batch(total, seq_len, world, micro) if total else None
    # 3, 5, 6 or 7 GPUs: the nearest batch that splits (none: refused below)
    if nearest not in (None, total):
        if master:
            print(batch_line(total, nearest, seq_len, world, micro))
        total = nearest
    if not micro and device.type == "cuda":
        throwaway = build_optimizers(model, args, config.n_embd, 1, device)
        micro = find_micro_batch(probe_step(model, throwaway, seq_len, config.vocab_size,
                                            args.dtype, device),
                                 micro_batch_candidates(total, seq_len, world))
        del throwaway
        torch.cuda.empty_cache()
        # the probe's peak is not the run's: said once, then reset
        if master:
            print("batch: the probe's peak CUDA memory "
                  f"{fmt_bytes(torch.cuda.max_memory_allocated(device))}")
        torch.cuda.reset_peak_memory_stats(device)
        micro, source = int(all_reduce(micro, dist.ReduceOp.MIN)), "probed"
        if master:
            print(f"batch: micro_batch {micro} is the largest that fits on every rank (probed with "
                  "optimizer state)")
    elif not micro:  # CPU: no probe; 8 sequences keep a step short
        micro, source = max(micro_batch_candidates(total, seq_len,
                                                   world)) if total else 8, "the CPU's choice"
    step_unit = micro * seq_len * world
    total = total or step_unit
    if total % step_unit:
        lo, hi = total // step_unit * step_unit, (total // step_unit + 1) * step_unit
        raise ValueError(f"--total_batch_tokens {total} is not a multiple of micro_batch {micro} x "
                         f"sequence_len {seq_len} x world size {world} = {step_unit}: nearest "
                         f"valid values are {lo or hi} and {hi}")
    return micro, total // step_unit, source


def add_init_args(parser, parents, lr_scale, schedule, warmdown_frac, why):
    """--checkpoint (of `parents`, in order), warm start, schedule (`why`: where the defaults
    come from) and the inherited flags."""
    add_schedule_args(parser)
    g = parser.add_argument_group("warm start: the parent's optimizer state and this stage's lrs")
    g.add_argument("--warm_start", type=parse_bool, default=True,
                   help="continue from the parent checkpoint's optimizer state, the lrs reset to "
                   "this stage's (a state that does not fit: fresh, said); false: fresh "
                   "(default: %(default)s)")
    g.add_argument("--lr_scale", type=float, default=lr_scale,
                   help="every lr is this fraction of the parent's (its base lrs at this stage's "
                   f"batch; {why}) (default: %(default)s)")
    parser.set_defaults(schedule=schedule, warmdown_frac=warmdown_frac)
    g = parser.add_argument_group("start: the parent checkpoint and what is inherited from it")
    g.add_argument("--checkpoint", default=None,
                   help=f"checkpoint to start from: a step_* directory or a run directory "
                   f"(default: the newest {' checkpoint, else the newest '.join(parents)} "
                   f"checkpoint under --runs_dir)")
    g.add_argument("--tokenizer", default=None, help="tokenizer directory (default: the parent's)")
    g.add_argument("--sequence_len", type=int, default=None,
                   help="row length, at most the parent's (default: the parent's)")
    add_micro_batch_arg(g)
    g.add_argument("--total_batch_tokens", type=int, default=None,
                   help="tokens per optimizer step over all ranks (default: the parent's)")
    g.add_argument("--dtype", default=None, choices=["bfloat16", "float32"],
                   help="compute dtype (default: the parent's)")
    g.add_argument("--compile", type=parse_bool, default=None,
                   help="torch.compile the model: true or false (default: the parent's)")
    own = ("tokenizer", "sequence_len", "micro_batch", "total_batch_tokens", "dtype", "compile")
    for action in parser._actions:  # the schedule's lr flags: the parent's unless given
        if action.dest in INHERITED and action.dest not in own:
            action.default = None
            action.help = action.help.split(" (default")[0] + " (default: the parent's)"


def add_loader_threads_arg(group):
    group.add_argument("--loader_threads", type=int, default=0, help="tokenizer threads per "
                       "loader; 0 = 1 when training on the CPU, else the cores per process "
                       "(default: %(default)s)")


def loader_threads(args, device):
    """On the CPU one (the cores run the step), else this process's share."""
    if args.loader_threads:
        return args.loader_threads
    if device.type == "cpu":
        return 1
    return max(1, os.cpu_count() // int(os.environ.get("LOCAL_WORLD_SIZE", "1")))


# read at import: importing torch._dynamo (the first optimizer does) writes its own default
USER_COMPILE_CACHE = os.environ.get("TORCHINDUCTOR_CACHE_DIR")


def compile_cache():
    """torch.compile's cache, shared so later stages start warm: $TORCHINDUCTOR_CACHE_DIR, else
    one per torch version."""
    ours = CACHE_DIR / "compile" / f"torch-{torch.__version__}"
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = USER_COMPILE_CACHE or str(ours)
    return Path(os.environ["TORCHINDUCTOR_CACHE_DIR"])


def wrap_model(model, args, world, local_rank, device):
    """DDP unless sharded, then torch.compile with static shapes."""
    train_model = model
    if world > 1 and not is_sharded(model):
        train_model = DDP(model, device_ids=[local_rank] if device.type == "cuda" else None,
                          gradient_as_bucket_view=True)
    if not args.compile:
        return train_model
    cache = compile_cache()
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(f"compile: torch.compile, cache {cache} (warm where a stage compiled the same shapes "
              "before)")
    return torch.compile(train_model, dynamic=False)


# -----------------------------------------------------------------------------
# Validation bits per byte, the same on 1 or N processes

def val_bpb(model, rows, token_bytes, batch_rows, dtype, rank, world, device):
    """(bits per byte, tokens scored) over val_rows; special (BOS) and -1 targets are left
    out."""
    token_bytes = torch.as_tensor(token_bytes, device=device)

    def batch_sums(b):
        batch = rows[b * batch_rows:(b + 1) * batch_rows].to(device)
        # -1 padding would index out of the embedding; its targets are -1, so any id serves
        x, y = batch[:, :-1].clamp(min=0), batch[:, 1:]
        nbytes = token_bytes[y.clamp(min=0)] * (y != -1)
        text = nbytes > 0
        with autocast_context(device.type, dtype):
            losses = model(x, torch.where(text, y, -1), reduction="none")
        return torch.stack([losses.sum().double(), nbytes.sum().double(),
                            text.sum().double()]).cpu()
    nats, total_bytes, scored = dealt_sums(model, math.ceil(len(rows) / batch_rows), 3, rank, world,
                                           batch_sums)
    return nats / (math.log(2) * total_bytes), int(scored)


@torch.no_grad()
def dealt_sums(model, n_batches, width, rank, world, batch_sums):
    """Sums of batch_sums(b) over batches dealt round robin, added in batch order after the
    all-reduce: the same bits on 1 or N processes. Sharded forwards need every rank: one past
    the last batch redoes one, uncounted."""
    sums = torch.zeros(n_batches, width, dtype=torch.float64)
    was_training = model.training
    model.eval()
    for b in range(rank, math.ceil(n_batches / world) * world if is_sharded(model) else n_batches,
                   world):
        row = batch_sums(b % n_batches)
        if b < n_batches:
            sums[b] = row
    model.train(was_training)
    return all_reduce_tensor(sums).sum(0).tolist()


# -----------------------------------------------------------------------------
# The training loop

def forward_backward(train_model, batches, dtype, device, world):
    """Forward and backward over a step's micro-batches; returns (summed loss, targets) over all
    ranks. Each loss is over the whole batch's target count, not a mean per micro-batch."""
    count = all_reduce_tensor(torch.stack([(targets != -1).sum() for _,
                                           targets in batches]).sum().double())
    scale = world / count.clamp(min=1)
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    for j, (inputs, targets) in enumerate(batches):
        last = j == len(batches) - 1
        with (train_model.no_sync() if not last and hasattr(train_model,
                                                            "no_sync") else nullcontext()), \
                autocast_context(device.type, dtype):
            loss = train_model(inputs, targets, reduction="sum")
            (loss * scale).backward()
        loss_sum += loss.detach().double()
    return all_reduce_tensor(loss_sum), count


def clip_grad_norm(parameters, max_norm, host_branches=None):
    """clip_grad_norm_, each row's fp32 norm squared and summed in fp64: the same bits at any
    world size (FSDP2 shards dim 0). Returns the norm on the device. Off the CPU nothing is read
    back: both branches are computed, chosen on the device."""
    grads = [p.grad for p in parameters if p.grad is not None]
    shards = [local(g) for g in grads]
    if host_branches is None:
        host_branches = shards[0].device.type == "cpu"
    rows = [torch.linalg.vector_norm(
            g, dim=-1).flatten() if g.ndim > 1 else g.abs().flatten() for g in shards]
    squares = torch.cat(rows).double().square().sum()

    # where a row's squares passed fp32's range (|g| > ~1e19): fp64 norms of whole gradients
    def whole():
        return torch.stack([torch.linalg.vector_norm(
                g, dtype=torch.float64) ** 2 for g in shards]).sum()
    if not host_branches:
        squares = torch.where(torch.isfinite(squares), squares, whole())
    elif not torch.isfinite(squares):
        squares = whole()
    # FSDP2: add the other ranks' shards
    if any(is_dtensor(g) for g in grads):
        squares = all_reduce_tensor(squares)
    norm = squares.sqrt().float()
    # a NaN norm: the gradients untouched
    factor = (max_norm / (norm + 1e-6)).clamp(max=1.0).nan_to_num(nan=1.0)
    if not host_branches or factor < 1:
        torch._foreach_mul_(shards, factor)
    return norm


def optimizer_step(model, optimizers, args, loss_sum, count, world, device, step, run_dir):
    """Clip, step, zero gradients, the step's one read and the NaN stop. Returns (loss, targets,
    grad norm)."""
    norm = clip_grad_norm(model.parameters(), args.grad_clip or float("inf"))
    for opt in optimizers:
        opt.step()
    # DDP's gradients are views into its buckets
    model.zero_grad(set_to_none=world == 1 or is_sharded(model))
    loss, count, grad_norm = read_step(loss_sum, count, norm, device)
    stop_if_not_finite(loss, grad_norm, step, run_dir)
    return loss, count, grad_norm


def read_step(loss_sum, count, norm, device):
    """The step's one read from the device, in one transfer that waits for the step's queued
    work. Returns (loss, targets, grad norm)."""
    loss_sum, count, grad_norm = torch.stack([torch.as_tensor(loss_sum, dtype=torch.float64,
                                                              device=device),
                                              torch.as_tensor(count, dtype=torch.float64,
                                                              device=device),
                                              norm.double()]).tolist()
    return loss_sum / max(1.0, count), count, grad_norm


def stop_if_not_finite(loss, grad_norm, step, run_dir):
    """A non-finite loss or grad norm stops the run; that update is never saved."""
    if not (math.isfinite(loss) and math.isfinite(grad_norm)):
        last = list_checkpoints(run_dir / "ckpt")
        raise RuntimeError(f"step {step}: loss {loss} / grad norm {grad_norm} is not finite: run "
                           "stopped before its checkpoint; last good checkpoint: "
                           f"{last[-1] if last else 'none'} (resume with --resume, perhaps a lower "
                           "lr)")


def cuda_memory(device):
    cuda = device.type == "cuda"
    return {"cuda_mem_alloc": torch.cuda.memory_allocated(device) if cuda else None,
            "cuda_mem_reserved": torch.cuda.memory_reserved(device) if cuda else None,
            "cuda_mem_peak": torch.cuda.max_memory_allocated(device) if cuda else None}


def open_wandb(args, master):
    if not (args.wandb and master):
        return None
    try:
        import wandb
    except ImportError:
        raise ImportError("--wandb needs `pip install wandb`") from None
    wandb.init(project=args.wandb, name=args.run_name, config=vars(args))
    return wandb


class Log:
    """Rank 0's records: metrics.jsonl, wandb, a progress line every log_every steps, its ETA
    timed from the end of the first step (compilation)."""

    def __init__(self, args, run_dir, start, total_steps, master):
        if master and start == 0:
            # a restart before the first checkpoint starts over: old lines would count twice
            for name in ("metrics.jsonl", "samples.jsonl"):
                if (run_dir / name).is_file():
                    (run_dir / name).unlink()
                    print(f"run dir: {run_dir / name} of an earlier start without a checkpoint "
                          "removed: starting over")
        self.metrics = run_dir / "metrics.jsonl" if master else None
        self.wandb = open_wandb(args, master)
        self.args, self.start, self.total_steps, self.master = args, start, total_steps, master
        self.first_done = None

    def write(self, record):
        if self.metrics:
            append_jsonl(self.metrics, record)

    def step(self, record, line=None):
        step = record["step"]
        self.write(record)
        if self.wandb:
            self.wandb.log({k: v for k, v in record.items() if isinstance(v, (int, float))},
                           step=step)
        if step == self.start + 1:
            self.first_done = now()
        if self.master and (step % self.args.log_every == 0 or step in (self.start + 1,
                                                                        self.total_steps)):
            timed = step - 1 - self.start
            per_step = (now() - self.first_done) / timed if timed else None
            print(line or progress_line(record, self.total_steps, per_step), flush=True)


class Saver:
    """save(step) writes a checkpoint if every rank's parameters are finite; stopped() saves on
    a signal and says how to resume."""

    def __init__(self, args, run_dir, model, optimizers, loaders, ckpt_meta, rank, start, log,
                 stop):
        self.args, self.run_dir, self.model = args, run_dir, model
        self.optimizers, self.loaders = optimizers, loaders
        self.meta, self.rank, self.log, self.stop = ckpt_meta, rank, log, stop
        self.saved = start  # step of the newest checkpoint on disk (0: none)

    def save(self, step, last=False):
        mark_progress(step, "checkpoint")
        # each rank checks its shards
        finite = all(torch.isfinite(local(p)).all() for p in self.model.parameters())
        if all_reduce(0.0 if finite else 1.0, dist.ReduceOp.MAX):
            raise RuntimeError(f"step {step}: parameters are not finite; not writing a checkpoint")
        path = save_checkpoint(self.run_dir / "ckpt", step, self.model, self.optimizers,
                               [ld.state_dict() for ld in self.loaders], self.meta, self.rank,
                               self.args.keep,
                               consolidate=last, metrics=self.log.metrics)
        self.saved = step
        return path

    def stopped(self, step, when):
        path = self.save(step) if step > self.saved else None
        if self.rank == 0:
            print(f"stopped by signal {when}; " + (f"checkpoint {path}" if path else "step "
                  f"{step}'s checkpoint is on "
                  "disk" if step else "no step finished, nothing to resume: a rerun starts over") +
                  (f". Resume with: {resume_command(self.args)}" if step else ""), flush=True)
        return self.stop.signum or signal.SIGTERM


def frozen_heap(train_fn):
    """train with start-up's objects frozen so full collections skip them."""
    @functools.wraps(train_fn)
    def wrapped(*args, **kwargs):
        try:
            return train_fn(*args, **kwargs)
        finally:
            gc.unfreeze()
    return wrapped


@frozen_heap
def train(args, model, train_model, optimizers, loaders, *, run_dir, start, total_steps, ckpt_meta,
          evaluate,
          flops_per_token, rank, world, device):
    """Steps start..total_steps-1; returns None, or the signal that stopped the run.
    evaluate(step): fields for the step's record."""
    tokens_per_step = sum(ld.B * ld.T for ld in loaders) * world
    log, stop = Log(args, run_dir, start, total_steps, rank == 0), StopSignal()
    saver = Saver(args, run_dir, model, optimizers, loaders, ckpt_meta, rank, start, log, stop)
    peak = peak_flops(device_name(device), args.dtype)
    health = Health(model, optimizers, args, start, rank == 0)
    keep_progress(run_dir, ckpt_meta.get("stage", "train"))
    mark_progress(start, "starting")
    gc.collect()
    gc.freeze()
    for step in range(start, total_steps):
        t0 = now()
        lr_mult, wd = apply_schedule(optimizers, step, total_steps, args)
        batches = [next(loader) for loader in loaders]
        # the loaders prefetch: time spent waiting for data
        data_wait = now() - t0
        mark_progress(step + 1, "forward/backward")
        loss_sum, count = forward_backward(train_model, batches, args.dtype, device, world)
        loss, count, grad_norm = optimizer_step(model, optimizers, args, loss_sum, count, world,
                                                device, step + 1, run_dir)
        dt = now() - t0
        record = {"step": step + 1, "loss": loss, "targets": int(count), "lr_mult": lr_mult,
                  "weight_decay": wd,
                  "lr": {g["name"]: g["lr"] for opt in optimizers for g in opt.param_groups},
                  "grad_norm": grad_norm,
                  "tokens": int(all_reduce(sum(ld.state["stats"]["tokens"] for ld in loaders))),
                  "tok_per_s": tokens_per_step / dt, "data_wait": data_wait / dt,
                  "epoch": max(ld.epoch for ld in loaders) + 1,  # this rank's; 1: the first pass
                  "mfu": tokens_per_step * flops_per_token / dt / (peak * world) if peak
                  else "unknown",
                  "step_time": dt, **cuda_memory(device)}
        health.check(record)
        last_step = step + 1 == total_steps
        if args.eval_every and (step + 1) % args.eval_every == 0 and not last_step:
            mark_progress(step + 1, "evaluation")
            record.update(evaluate(step + 1))
        log.step(record)
        if stop.requested():
            return saver.stopped(step + 1, f"at step {step + 1}")
        # --final_checkpoint: pretrain.py's
        if (step + 1) % args.ckpt_every == 0 or (last_step and getattr(args, "final_checkpoint",
                                                                       True)):
            # the final checkpoint comes before the final evaluation (nanochat #446)
            saver.save(step + 1, last_step)
    mark_progress(total_steps, "trained: final evaluation")
    return None


def progress_line(record, total_steps, seconds_per_step):
    mfu = f"{100 * record['mfu']:.1f}%" if record["mfu"] != "unknown" else "unknown"
    eta = None if seconds_per_step is None else seconds_per_step * (total_steps - record["step"])
    return (f"step {record['step']}/{total_steps} loss {record['loss']:.4f} lr "
            f"x{record['lr_mult']:.3f} gnorm {record['grad_norm']:.3f} {record['tok_per_s']:,.0f} "
            f"tok/s MFU {mfu} data wait {100 * record['data_wait']:.0f}% tokens "
            f"{record['tokens']:,} epoch "
            f"{record['epoch']}{' (repeating data)' if record['epoch'] > 1 else ''} ETA "
            f"{fmt_duration(eta)}")


def print_status(run_dir):
    if not (run_dir / "metrics.jsonl").is_file():
        raise FileNotFoundError(f"{run_dir} has no metrics.jsonl: not a run directory "
                                "(runs/<run>/)")
    config = json.loads((run_dir / "config.json").read_text())
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "loss" in r]
    total, last = config["total_steps"], steps[-1]
    print(f"run {run_dir} ({config.get('stage')}): "
          f"{'finished' if (run_dir / 'done.json').is_file() else 'not finished'}; step "
          f"{last['step']}/{total}, tokens {last['tokens']:,}")
    # rl.py's: its mean reward
    window, key = max(1, len(steps) // 5), "reward" if "reward" in last else "loss"
    trend = [sum(r[key] for r in steps[i:i + window]) / len(steps[i:i + window])
             for i in range(0, len(steps), window)]
    print(f"{'mean reward' if key == 'reward' else 'loss trend'} (means of fifths): "
          + " -> ".join(f"{v:.3f}" for v in trend))
    recent = steps[-20:]
    rate = sum(r["tok_per_s"] for r in recent) / len(recent)
    # rl.py's tokens a step vary: use step time
    step_s = sum(r["step_time"] for r in recent) / len(recent)
    print(f"speed {rate:,.0f} tok/s, MFU {last['mfu']}; ETA "
          f"{fmt_duration((total - last['step']) * step_s)}")
    vals = [r for r in records if {"val_bpb", "final_val_bpb", "held_out"} & r.keys()]
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
    parser = argparse.ArgumentParser(description="a run's status from its files, for every stage, "
                                     "live or finished (as each stage's --status)")
    parser.add_argument("command", choices=["status"], help="status: what the run in RUN_DIR has "
                        "done so far")
    parser.add_argument("run_dir", metavar="RUN_DIR", help="a run directory (runs/<run>/)")
    args = parser.parse_args(argv)
    print_status(Path(args.run_dir))


if __name__ == "__main__":
    sys.exit(run_main(main))
