"""What the stages (pretrain.py, midtrain.py, sft.py, core_eval.py) share: distributed setup and teardown,
optimizers and their learning-rate rule, schedules, checkpoints and finding/loading them, validation bits per byte,
metrics logging, MFU, health checks.

Not a stage: `python common.py` does nothing. Import it.
"""
import itertools
import json
import math
import os
import platform
import random
import shutil
import signal
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from dataset import iter_texts
from model import GPTConfig, autocast_context, build_model

# -----------------------------------------------------------------------------
# Distributed


def setup_distributed():
    """Initialize from torchrun's environment (or run as one process). Returns (rank, local_rank, world_size, device).
    NCCL on CUDA, gloo on CPU. Prints the world as initialized: each rank reports the device it actually holds."""
    if "RANK" not in os.environ:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        print(f"distributed: single process, device {device_name(device)}")
        return 0, 0, 1, device
    rank, local_rank, world_size = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"]), int(os.environ["WORLD_SIZE"])
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    names = [None] * world_size
    dist.all_gather_object(names, f"{device} ({device_name(device)}) on {platform.node()}")
    if rank == 0:
        print(f"distributed: world size {dist.get_world_size()} ({dist.get_backend()}): "
              + ", ".join(f"rank {r} {n}" for r, n in enumerate(names)))
    return rank, local_rank, world_size, device


def teardown_distributed():
    """Barrier, then destroy the process group: exiting without it can abort torch at exit or strand workers."""
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def device_name(device):
    return torch.cuda.get_device_name(device) if device.type == "cuda" else (platform.processor() or "cpu")


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


# -----------------------------------------------------------------------------
# Optimizers. The rule: base learning rates are set for a width of 768 and a batch of 2^19 tokens (nanochat's
# reference point). AdamW groups scale with 1/sqrt(width/768) (wider models need smaller steps per coordinate) and
# with sqrt(batch/2^19) (the square-root rule: the gradient's noise falls with sqrt(batch)). Muon's update is
# orthogonalized, so its size depends on neither the width nor the gradient's noise: its lr is not scaled (on the demo
# world at 4K-token batches, also scaling Muon by sqrt(batch) left val bpb at 1.00 after 80 steps instead of 0.66).

REF_WIDTH, REF_BATCH = 768, 2 ** 19


def param_groups(model):
    """Split parameters by role: 'matrix' (2D weights inside the blocks), 'embedding', 'head', 'scalar' (norms and any
    other 1D parameter)."""
    groups = {"matrix": [], "embedding": [], "head": [], "scalar": []}
    for name, p in model.named_parameters():
        if name.startswith("blocks.") and p.ndim == 2:
            groups["matrix"].append(p)
        elif name.startswith("wte."):
            groups["embedding"].append(p)
        elif name.startswith("lm_head."):
            groups["head"].append(p)
        else:
            groups["scalar"].append(p)
    return {k: v for k, v in groups.items() if v}


def build_optimizers(model, args, width, batch_tokens, device):
    """Muon for the block matrices and AdamW for the rest (args.optimizer == 'muon'), or AdamW everywhere ('adamw');
    args.adam8bit swaps AdamW for bitsandbytes' AdamW8bit. Returns a list of optimizers; every param group carries
    'name' and 'base_lr' (the lr at multiplier 1) and 'wd_on' (whether weight decay applies)."""
    width_factor, batch_factor = (width / REF_WIDTH) ** -0.5, (batch_tokens / REF_BATCH) ** 0.5
    lrs = {"matrix": args.matrix_lr * (1 if args.optimizer == "muon" else width_factor * batch_factor),
           "embedding": args.embedding_lr * width_factor * batch_factor,
           "head": args.head_lr * width_factor * batch_factor,
           "scalar": args.scalar_lr * width_factor * batch_factor}
    groups = param_groups(model)
    adam_groups = [{"params": ps, "name": k, "base_lr": lrs[k], "lr": lrs[k], "wd_on": k == "matrix"}
                   for k, ps in groups.items() if k != "matrix" or args.optimizer == "adamw"]
    if args.adam8bit:
        try:
            import bitsandbytes
        except ImportError as e:
            raise SystemExit("--adam8bit needs bitsandbytes: `pip install bitsandbytes` (CUDA only), or drop the "
                             "flag to use torch's AdamW") from e
        adam = bitsandbytes.optim.AdamW8bit(adam_groups, betas=(0.8, 0.95), eps=1e-10, weight_decay=0.0)
    else:
        adam = torch.optim.AdamW(adam_groups, betas=(0.8, 0.95), eps=1e-10, weight_decay=0.0,
                                 fused=device.type == "cuda")
    optimizers = [adam]
    if args.optimizer == "muon":
        optimizers.append(torch.optim.Muon([{"params": groups["matrix"], "name": "matrix", "base_lr": lrs["matrix"],
                                             "lr": lrs["matrix"], "wd_on": True}], momentum=0.95, nesterov=True,
                                           weight_decay=0.0, adjust_lr_fn="original"))
    return optimizers


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


def apply_schedule(optimizers, step, total, args):
    multiplier, wd = lr_multiplier(step, total, args), weight_decay_at(step, args)
    for opt in optimizers:
        for group in opt.param_groups:
            group["lr"] = group["base_lr"] * multiplier
            group["weight_decay"] = wd if group["wd_on"] else 0.0
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
# with that name is always complete. Everything loads with weights_only=True.

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


def save_checkpoint(ckpt_dir, step, model, optimizers, loader_state, meta, rank, keep):
    """Every rank writes its loader state and RNG state; rank 0 the model, optimizers and meta.json; then rank 0 renames
    the temporary directory into place and deletes all but the newest `keep` checkpoints."""
    final = Path(ckpt_dir) / f"step_{step:06d}"
    tmp = Path(ckpt_dir) / f".tmp_step_{step:06d}"
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    barrier()
    torch.save({"loader": loader_state, "rng": rng_state()}, tmp / f"rank{rank:03d}.pt")
    if rank == 0:
        torch.save(model.state_dict(), tmp / "model.pt")
        torch.save([opt.state_dict() for opt in optimizers], tmp / "optimizers.pt")
        (tmp / "meta.json").write_text(json.dumps({**meta, "step": step, "versions": versions()}, indent=1))
    barrier()
    if rank == 0:
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        for old in list_checkpoints(ckpt_dir)[:-keep]:
            shutil.rmtree(old)
    barrier()
    return final


def list_checkpoints(ckpt_dir):
    return sorted(p for p in Path(ckpt_dir).glob("step_*") if p.is_dir())


def load_checkpoint(path, rank, device):
    path = Path(path)
    if not (path / "meta.json").is_file():
        raise FileNotFoundError(f"{path} is not a checkpoint (no meta.json): checkpoints are runs/<run>/ckpt/step_*")
    meta = json.loads((path / "meta.json").read_text())
    rank_file = path / f"rank{rank:03d}.pt"
    if not rank_file.is_file():
        raise ValueError(f"{path} has no state for rank {rank}: it was written by {meta['world_size']} ranks; resume "
                         f"with the same number of processes")
    return {"meta": meta, "model": torch.load(path / "model.pt", map_location=device, weights_only=True),
            "optimizers": torch.load(path / "optimizers.pt", map_location=device, weights_only=True),
            "rank": torch.load(rank_file, weights_only=True)}


def newest_checkpoint(runs_dir, stage=None):
    """The most recently written checkpoint under runs_dir/*/ckpt/ (of that stage only, if given), or None."""
    found = [c for run in Path(runs_dir).glob("*/ckpt") for c in list_checkpoints(run)
             if stage is None or json.loads((c / "meta.json").read_text()).get("stage") == stage]
    return max(found, key=lambda c: (c / "meta.json").stat().st_mtime, default=None)


def find_checkpoint(path=None, runs_dir="runs"):
    """A checkpoint directory from a checkpoint path, a run directory (its newest checkpoint), or nothing (the newest
    checkpoint of any run under runs_dir): how each stage picks up the output of the one before it."""
    if path is None:
        found = newest_checkpoint(runs_dir)
        if found is None:
            raise SystemExit(f"no checkpoint under {runs_dir}/*/ckpt/: train one first (python pretrain.py), or pass "
                             f"--checkpoint runs/<run>")
        return found
    path = Path(path)
    if (path / "meta.json").is_file():
        return path
    found = list_checkpoints(path / "ckpt")
    if not found:
        raise SystemExit(f"--checkpoint {path}: neither a checkpoint (runs/<run>/ckpt/step_*/meta.json) nor a run "
                         f"directory with checkpoints in {path}/ckpt/")
    return found[-1]


def load_model(path, device):
    """(model in eval mode, meta) from a checkpoint's model.pt and meta.json, on any number of processes (the rank
    files, which a resume needs, are not read)."""
    meta = json.loads((Path(path) / "meta.json").read_text())
    model = build_model(GPTConfig(**meta["model_config"]), device)
    model.load_state_dict(torch.load(Path(path) / "model.pt", map_location=device, weights_only=True))
    model.eval()
    return model, meta


def check_tokenizer(meta, tokenizer, tokenizer_path, checkpoint):
    """Refuse a tokenizer the checkpoint was not trained with: ids would mean other strings and every score would be
    silently wrong."""
    vocab = meta["model_config"]["vocab_size"]
    if tokenizer.vocab_size != vocab:
        raise SystemExit(f"tokenizer {tokenizer_path} has {tokenizer.vocab_size} tokens, the model in {checkpoint} "
                         f"has {vocab}: pass the tokenizer it was trained with (--tokenizer {meta.get('tokenizer')})")
    recorded = meta.get("tokenizer_sha256")
    if recorded and recorded != tokenizer.fingerprint():
        raise SystemExit(f"tokenizer {tokenizer_path} (sha256 {tokenizer.fingerprint()[:12]}) is not the one {checkpoint} "
                         f"was trained with (sha256 {recorded[:12]}, from {meta.get('tokenizer')}): pass that one "
                         f"with --tokenizer")


def barrier():
    if dist.is_initialized():
        dist.barrier()


# -----------------------------------------------------------------------------
# Validation bits per byte, shared by pretrain.py (during training) and core_eval.py (on a checkpoint)

def val_tokens(data_dir, tokenizer, max_tokens):
    """The validation split's first max_tokens + 1 tokens as one stream, each document led by BOS (fewer if the split
    is smaller). The same tokens on every rank and in every stage, so two val bpb figures are comparable."""
    stream, texts = [], iter_texts(data_dir, "val")
    while len(stream) <= max_tokens and (batch := list(itertools.islice(texts, 256))):
        for ids in tokenizer.encode_batch(batch):
            stream += [tokenizer.bos_id, *ids]
    return torch.tensor(stream[:max_tokens + 1], dtype=torch.long)


@torch.no_grad()
def val_bpb(model, tokens, token_bytes, seq_len, batch_rows, dtype, rank, world, device):
    """(bits per byte, tokens scored) over rows of seq_len + 1 tokens cut from `tokens` with stride seq_len. Targets
    that are special tokens (BOS) are excluded from both the loss and the bytes: they stand for no text. Batches are
    formed from the whole stream and dealt to ranks round robin, and their sums are added in batch order after the
    all-reduce, so the figure is bitwise the same on 1 or N processes."""
    n_rows = (len(tokens) - 1) // seq_len
    if n_rows == 0:
        raise ValueError(f"the validation split has {len(tokens)} tokens, fewer than one row of {seq_len + 1}")
    token_bytes = torch.as_tensor(token_bytes, device=device)
    n_batches = math.ceil(n_rows / batch_rows)
    sums = torch.zeros(n_batches, 3, dtype=torch.float64)
    was_training = model.training
    model.eval()
    for b in range(rank, n_batches, world):
        starts = range(b * batch_rows * seq_len, min(n_rows, (b + 1) * batch_rows) * seq_len, seq_len)
        rows = torch.stack([tokens[s:s + seq_len + 1] for s in starts]).to(device)
        x, y = rows[:, :-1], rows[:, 1:]
        with autocast_context(device.type, dtype):
            losses = model(x, y, reduction="none")
        nbytes = token_bytes[y]
        text = nbytes > 0
        sums[b] = torch.stack([(losses * text).sum().double(), nbytes.sum().double(), text.sum().double()]).cpu()
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
    return p.detach().reshape(-1)[::max(1, p.numel() // n)][:n]


def param_samples(model):
    return {name: sample(p).clone() for name, p in model.named_parameters()}


def frozen_parameters(model, samples):
    """Names of parameters whose sample has not changed (seed 001: bf16 norm weights that never move)."""
    now = param_samples(model)
    return [name for name in samples if torch.equal(now[name], samples[name])]


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
    """SIGTERM/SIGINT set a flag; the training loop finishes its step, checkpoints and exits with a resume line."""

    def __init__(self):
        self.signum = None
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._handle)

    def _handle(self, signum, frame):
        self.signum = signum

    def requested(self):
        """True on every rank if any rank got a signal (torchrun forwards it to all, but not always at once)."""
        return all_reduce(1.0 if self.signum else 0.0, dist.ReduceOp.MAX if dist.is_initialized() else None) > 0


def now():
    return time.perf_counter()
