"""Checkpoints and runs: saving, listing, finding and loading checkpoints (any world size, sharded or not), their
tokenizer checks, the run directory (runs/<run>/: its flags, what it resumes from, the command that resumes it), and
what a stage after pretraining inherits from its parent checkpoint (inherit, warm_start, parent_record).

Not a stage: import it (`import checkpoint`). One command line, for a sharded checkpoint:

    python checkpoint.py consolidate runs/<run>[/ckpt/step_N]     # write its model.pt, in one process
"""
import argparse
import hashlib
import json
import os
import random
import shlex
import shutil
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from common import versions
from distributed import barrier, check_shared_dir, is_sharded
from model import GPTConfig, build_model, parse_bool
from tokenizer import SPECIAL_TOKENS, Tokenizer

# torch.distributed.checkpoint warns on every save and load in a process without torch.distributed (one-process runs
# and `consolidate`), which is how this code means to use it
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")


# -----------------------------------------------------------------------------
# Checkpoints: runs/<run>/ckpt/step_XXXXXX/, written to a temporary directory and renamed into place, so a directory
# with that name is always complete. Everything loads with weights_only=True. In each:
#   state/      model and optimizer state by parameter name, torch.distributed.checkpoint: every rank writes its own
#               shards in parallel, and any world size reads them back (what --resume loads)
#   rankNNN.pt  that rank's data-loader positions and RNG state
#   model.pt    the whole model in one file (what chat, evaluation, export and the next stage read): written by rank 0
#               when the model is not sharded; for a sharded run at its last step, or by `python checkpoint.py
#               consolidate CHECKPOINT`
#   meta.json   what the run is, the step, the versions

def rng_state():
    np_state = np.random.get_state(legacy=False)
    return {"python": list(random.getstate()[1]), "python_pos": random.getstate()[2],
            "numpy_key": torch.from_numpy(np_state["state"]["key"].astype(np.int64)),
            "numpy_pos": np_state["state"]["pos"], "torch": torch.get_rng_state(),
            # this rank's own GPU only: all visible GPUs' states (get_rng_state_all) made a resume on a box with fewer
            # GPUs index past the last one (IndexError)
            "cuda_device": torch.cuda.get_rng_state() if torch.cuda.is_available() else None}


def set_rng_state(s):
    random.setstate((3, tuple(s["python"]), s["python_pos"]))
    np.random.set_state({"bit_generator": "MT19937", "state": {"key": s["numpy_key"].numpy().astype(np.uint32),
                                                               "pos": s["numpy_pos"]},
                         "has_gauss": 0, "gauss": 0.0})
    torch.set_rng_state(s["torch"])
    if not torch.cuda.is_available():
        return
    if s.get("cuda_device") is not None:
        torch.cuda.set_rng_state(s["cuda_device"])  # this rank's device (setup_distributed made it the current one)
    elif s.get("cuda"):  # written before: every visible GPU's state; this rank's device's is the one at its index
        device = torch.cuda.current_device()
        if device < len(s["cuda"]):
            torch.cuda.set_rng_state(s["cuda"][device])


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


# the order chat.py and export.py look for a checkpoint when --checkpoint is not given: the newer of RL's and SFT's, else midtraining's,
# else pretraining's
PICK_ORDER = [("rl", "sft"), ("midtrain",), ("pretrain",)]


def pick_checkpoint(args):
    """(checkpoint, how it was chosen): --checkpoint, else the newest checkpoint of the first group of stages in
    PICK_ORDER that has one (chat.py and export.py pick this way)."""
    if args.checkpoint is not None:
        return find_checkpoint(args.checkpoint, args.runs_dir), "--checkpoint"
    for stages in PICK_ORDER:
        found = [(c, stage) for stage in stages for c in [newest_checkpoint(args.runs_dir, stage)] if c]
        if found:
            newest, stage = max(found, key=lambda pair: (pair[0] / "meta.json").stat().st_mtime)
            return newest, f"newest {stage} checkpoint under {args.runs_dir}"
    raise FileNotFoundError(f"no checkpoint under {args.runs_dir}/*/ckpt/: train one (python pretrain.py, then "
                            f"midtrain.py, sft.py, rl.py), or pass --checkpoint runs/<run> (or --runs_dir DIR)")


def load_model(path, device):
    """(model in eval mode, meta) from a checkpoint's model.pt and meta.json, on any number of processes (the rank
    files, which a resume needs, are not read)."""
    meta = json.loads((Path(path) / "meta.json").read_text())
    if not (Path(path) / "model.pt").is_file():
        raise FileNotFoundError(f"{path} holds a sharded model (state/) and no model.pt yet: write it with `python "
                                f"checkpoint.py consolidate {path}`")
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


# -----------------------------------------------------------------------------
# The run directory: runs/<run>/ with config.json, metrics.jsonl, samples.jsonl, ckpt/step_XXXXXX/. Where a run
# lives, what it resumes from, and the exact command that resumes it.

def add_run_args(parser, stage):
    """The flags every training stage has for its run directory, checkpoints and health checks, and the hidden
    testing hooks."""
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
    g = parser.add_argument_group("distributed (under torchrun)")
    g.add_argument("--fsdp", default="auto", choices=["auto", "true", "false"], help="shard weights, gradients and "
                   "optimizer state over the ranks with FSDP2; auto: when they would not fit one device by model.py's "
                   "estimate (default: %(default)s)")
    g.add_argument("--dist_timeout", type=float, default=600, help="seconds a collective may wait for the other ranks "
                   "before the run stops with an error (a dead or hung rank) (default: %(default)s)")
    # Testing hooks, hidden from --help: the tests' way to make a run fail as real runs do. Steps count from 1, as
    # logged; -1: never (train_loop.testing_hooks).
    g = parser.add_argument_group("testing hooks")
    g.add_argument("--inject_nan_step", type=int, default=-1, help=argparse.SUPPRESS)  # poison the loss at this step
    g.add_argument("--signal_at_step", type=int, default=-1, help=argparse.SUPPRESS)  # SIGTERM this process after it
    g.add_argument("--die_at_step", type=int, default=-1, help=argparse.SUPPRESS)  # the last rank SIGKILLs itself
    g.add_argument("--hang_at_step", type=int, default=-1, help=argparse.SUPPRESS)  # the last rank stops taking part
    # in collectives
    g.add_argument("--stuck_at_step", type=int, default=-1, help=argparse.SUPPRESS)  # as --hang_at_step, and the
    # rank ignores SIGTERM, SIGINT and SIGHUP: a rank inside an NCCL call never returns to run its handler
    g.add_argument("--checkpoint_delay", type=float, default=0, help=argparse.SUPPRESS)  # rank 0 takes this many
    # seconds longer to write each checkpoint (a d20's 15 GB)


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
        check_shared_dir(path.parent.parent)
        return path.parent.parent, path
    if args.resume and args.run_name is None:
        newest = newest_checkpoint(args.runs_dir, stage=stage)
        if newest is None:
            raise FileNotFoundError(f"--resume: no {stage} checkpoint under {args.runs_dir}/*/ckpt/")
        args.run_name = newest.parent.parent.name
    args.run_name = args.run_name or f"{stage}_{args.preset}_{time.strftime('%Y%m%d_%H%M%S')}"
    run_dir = Path(args.runs_dir) / args.run_name
    check_shared_dir(run_dir)  # several nodes: every rank must see what rank 0 writes there
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


def truncate_metrics(path, last_step):
    """After a resume from `last_step`, drop the lines a killed run logged past it, so each step appears once."""
    path = Path(path)
    if path.is_file():
        lines = [line for line in path.read_text().splitlines() if json.loads(line).get("step", 0) <= last_step]
        path.write_text("".join(line + "\n" for line in lines))


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


def main(argv=None):
    parser = argparse.ArgumentParser(description="a sharded checkpoint's model.pt (consolidate); otherwise import "
                                     "checkpoint")
    parser.add_argument("command", choices=["consolidate"], help="consolidate: write CHECKPOINT/model.pt from its "
                        "shards, in one process")
    parser.add_argument("checkpoint", nargs="?", help="a step_* directory or a run directory (its newest)")
    args = parser.parse_args(argv)
    if args.checkpoint is None:
        parser.error("consolidate needs a checkpoint: python checkpoint.py consolidate runs/<run>[/ckpt/step_N]")
    try:
        path = find_checkpoint(args.checkpoint)
        written = consolidate(path)
        count = sum(t.numel() for t in torch.load(written, weights_only=True).values())
        print(f"consolidate: wrote {written} ({count:,} parameters)")
    except (FileNotFoundError, ValueError) as e:
        print(f"checkpoint.py: error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
