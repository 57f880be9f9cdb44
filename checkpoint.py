"""Checkpoints (saved, found and loaded at any world size, sharded or not), tokenizer checks,
resuming, a chat stage's start from its parent; a run's directory and record. Not a stage.

    python checkpoint.py consolidate runs/<run>[/ckpt/step_N]   # a sharded one's model.pt
    python checkpoint.py lineage runs/<run>[/ckpt/step_N]       # stage, step, hparams; parents
"""
import argparse
import concurrent.futures
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

import distributed
from distributed import (
    append_jsonl,
    barrier,
    check_shared_dir,
    code_version,
    is_sharded,
    matmul_dtype,
    run_main,
    versions,
)
from model import GPTConfig, build_model
from tokenizer import SPECIAL_TOKENS, Tokenizer

# dcp without a process group is meant here
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or "
                        "uninitialized")


# -----------------------------------------------------------------------------
# Checkpoints: runs/<run>/ckpt/step_XXXXXX/, renamed into place when complete:
#   state/      a sharded model's and optimizers' state (any world size reads it)
#   model.pt    the whole model; optimizers.pt beside it when unsharded
#   rankNNN.pt  that rank's data-loader positions and RNG state
#   meta.json   what the run is, the step, the versions

def rng_state():
    np_state = np.random.get_state(legacy=False)
    return {"python": list(random.getstate()[1]), "python_pos": random.getstate()[2],
            "numpy_key": torch.from_numpy(np_state["state"]["key"].astype(np.int64)),
            "numpy_pos": np_state["state"]["pos"], "torch": torch.get_rng_state(),
            # this rank's GPU only: all GPUs' states break a resume on fewer GPUs
            "cuda_device": torch.cuda.get_rng_state() if torch.cuda.is_available() else None}


def set_rng_state(s):
    random.setstate((3, tuple(s["python"]), s["python_pos"]))
    np.random.set_state({"bit_generator": "MT19937",
                         "state": {"key": s["numpy_key"].numpy().astype(np.uint32),
                                                               "pos": s["numpy_pos"]},
                         "has_gauss": 0, "gauss": 0.0})
    torch.set_rng_state(s["torch"])
    if torch.cuda.is_available() and s["cuda_device"] is not None:
        torch.cuda.set_rng_state(s["cuda_device"])


def save_checkpoint(ckpt_dir, step, model, optimizers, loader_state, meta, rank, keep,
                    consolidate=False,
                    metrics=None):
    """Write step `step`'s checkpoint, keep the newest `keep`; the save's seconds go to
    ckpt_dir/save_seconds (speedrun.sh's grace before a kill)."""
    started = time.perf_counter()
    final = Path(ckpt_dir) / f"step_{step:06d}"
    tmp = Path(ckpt_dir) / f".tmp_step_{step:06d}"
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    barrier()
    error = None
    try:
        write_files(tmp, step, model, optimizers, loader_state, meta, rank, consolidate)
    except (OSError, RuntimeError) as e:  # a full disk: torch's own error names neither
        error = e
    # every rank raises, not only the one whose write failed (a barrier would wait for it)
    if distributed.all_reduce(1.0 if error else 0.0, dist.ReduceOp.MAX):
        raise save_failed(error or "on another rank", tmp, step, rank) from error
    if rank == 0:
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        for old in list_checkpoints(ckpt_dir)[:-keep]:
            shutil.rmtree(old)
    barrier()
    if rank == 0:
        seconds = time.perf_counter() - started
        size = sum(f.stat().st_size for f in final.rglob("*") if f.is_file())
        (Path(ckpt_dir) / "save_seconds").write_text(f"{seconds:.1f}\n")
        print(f"checkpoint: saved {size / 1e9:.2f} GB in {seconds:.1f} s to {final}", flush=True)
        if metrics:
            append_jsonl(metrics, {"step": step, "save_s": round(seconds, 1), "save_bytes": size})
    return final


def write_files(tmp, step, model, optimizers, loader_state, meta, rank, consolidate):
    if is_sharded(model):  # first: a write that fails in dcp.save fails on every rank
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            get_state_dict,
        )
        model_state, optimizer_state = get_state_dict(model, optimizers)
        dcp.save({"model": model_state, "optimizers": optimizer_state}, checkpoint_id=tmp / "state")
        if consolidate:  # gathered to rank 0's CPU memory, shard by shard
            model_state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True,
                                                                               cpu_offload=True))
            if rank == 0:
                torch.save(model_state, tmp / "model.pt")
    elif rank == 0:
        torch.save(model.state_dict(), tmp / "model.pt")
        torch.save(named_optimizer_state(model, optimizers), tmp / "optimizers.pt")
    # after the collectives: a failure here reaches save_checkpoint's all_reduce
    torch.save({"loader": loader_state, "rng": rng_state()}, tmp / f"rank{rank:03d}.pt")
    if rank == 0:
        (tmp / "meta.json").write_text(json.dumps({**meta, "step": step,
                                                   "sharded": is_sharded(model),
                                                   "optimizers": optimizer_layout(optimizers),
                                                   "versions": versions()}, indent=1))


def save_failed(error, tmp, step, rank):
    """A save that could not write: its partial files removed, the complete checkpoints kept."""
    if rank == 0:  # once no rank writes
        shutil.rmtree(tmp, ignore_errors=True)
    free = shutil.disk_usage(tmp.parent).free / 1e9
    kept = list_checkpoints(tmp.parent)
    return RuntimeError(f"saving step {step} to {tmp.parent} failed ({error}); {free:.1f} GB free "
                        "there: free some space, then rerun with --resume (from "
                        f"{kept[-1] if kept else 'the start'}: complete checkpoints are kept)")


def checkpoint_step(path):
    name = Path(path).name
    return int(name[5:]) if name.startswith("step_") and name[5:].isdigit() else None


def list_checkpoints(ckpt_dir):
    """Complete checkpoints by step (not by name: step_1000000 sorts before step_999999)."""
    found = [p for p in Path(ckpt_dir).glob("step_*") if p.is_dir()
             and checkpoint_step(p) is not None]
    return sorted(found, key=checkpoint_step)


def set_aside_newer(ckpt_dir, step):
    """Move checkpoints newer than `step` (never delete) to ckpt_dir/../ckpt_abandoned/<time>/,
    where no --resume looks. Returns where, or None."""
    newer = [c for c in list_checkpoints(ckpt_dir) if checkpoint_step(c) > step]
    if not newer:
        return None
    aside = Path(ckpt_dir).parent / "ckpt_abandoned" / time.strftime("%Y%m%d_%H%M%S")
    aside.mkdir(parents=True, exist_ok=True)
    for c in newer:
        os.replace(c, aside / c.name)
    return aside


def optimizer_layout(optimizers):
    """[[class name, [group names]], ...], checked by warm_start."""
    return [[type(opt).__name__, [group.get("name") for group in opt.param_groups]]
            for opt in optimizers]


def named_optimizer_state(model, optimizers):
    """The optimizers' state keyed by parameter name, as dcp's full optimizer state dict is, so
    a sharded run loads it too."""
    names = {id(p): name for name, p in model.named_parameters()}
    merged = {"state": {}, "param_groups": []}
    for opt in optimizers:
        state, params = opt.state_dict(), [p for group in opt.param_groups for p in group["params"]]
        merged["state"].update({names[id(params[i])]: s for i, s in state["state"].items()})
        merged["param_groups"] += [{**g, "params": [names[id(params[i])] for i in g["params"]]}
                                   for g in state["param_groups"]]
    return merged


def load_named_optimizer_state(model, optimizers, merged):
    """named_optimizer_state's dict back into unsharded optimizers."""
    names = {id(p): name for name, p in model.named_parameters()}
    groups = iter(merged["param_groups"])
    for opt in optimizers:
        saved = [next(groups) for _ in opt.param_groups]
        order = [name for group in saved for name in group["params"]]
        if order != [names[id(p)] for group in opt.param_groups for p in group["params"]]:
            raise ValueError("the checkpoint's optimizer holds other parameters than this run's: "
                             "resume with the same --optimizer and model")
        index = {name: i for i, name in enumerate(order)}
        state = {index[name]: s for name, s in merged["state"].items() if name in index}
        param_groups = [{**g, "params": [index[name] for name in g["params"]]} for g in saved]
        opt.load_state_dict({"state": state, "param_groups": param_groups})


def load_state(path, model, optimizers, device, keep=("foreach", "fused", "ns_dtype")):
    """Load model and optimizer state. This run's param group values for `keep` stay (the
    device's choices); keep=None keeps all (a warm start)."""
    path = Path(path)
    kept = [[{k: v for k, v in g.items() if k != "params" and (keep is None or k in keep)}
             for g in opt.param_groups] for opt in optimizers]
    if (path / "state").is_dir() or is_sharded(model):
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_state_dict,
            set_state_dict,
        )
    try:
        if (path / "state").is_dir():
            model_state, optimizer_state = get_state_dict(model, optimizers)
            dcp.load({"model": model_state, "optimizers": optimizer_state},
                     checkpoint_id=path / "state",
                     no_dist=not dist.is_initialized())
            set_state_dict(model, optimizers, model_state_dict=model_state,
                           optim_state_dict=optimizer_state)
            return
        # not the optimizer state mmap'd: step 1's writes would copy its pages
        model_state = torch.load(path / "model.pt", map_location=device, weights_only=True,
                                 mmap=True)
        optimizer_state = torch.load(path / "optimizers.pt", map_location=device, weights_only=True)
        if is_sharded(model):
            set_state_dict(model, optimizers, model_state_dict=model_state,
                           optim_state_dict=optimizer_state,
                           options=StateDictOptions(full_state_dict=True))
        else:
            model.load_state_dict(model_state)
            load_named_optimizer_state(model, optimizers, optimizer_state)
    finally:
        for opt, groups in zip(optimizers, kept, strict=True):
            for group, values in zip(opt.param_groups, groups, strict=True):
                group.update(values)


def consolidate(path):
    path = Path(path)
    meta = json.loads((path / "meta.json").read_text())
    import torch.distributed.checkpoint as dcp
    model = build_model(GPTConfig(**meta["model_config"]), "cpu", init=False)
    model_state = model.state_dict()
    dcp.load({"model": model_state}, checkpoint_id=path / "state", no_dist=True)
    torch.save(model_state, path / ".model.pt.tmp")
    os.replace(path / ".model.pt.tmp", path / "model.pt")
    return path / "model.pt"


def newest_checkpoint(runs_dir, stage=None):
    """The newest checkpoint (of `stage`, if given) in runs_dir/*/ckpt/ or runs_dir/*/*/ckpt/
    (speedrun.sh), or None."""
    runs = [*Path(runs_dir).glob("*/ckpt"), *Path(runs_dir).glob("*/*/ckpt")]
    found = [c for run in runs for c in list_checkpoints(run)
             if stage is None or json.loads((c / "meta.json").read_text()).get("stage") == stage]
    return max(found, key=lambda c: (c / "meta.json").stat().st_mtime, default=None)


def find_checkpoint(path=None, runs_dir="runs"):
    """A checkpoint path, a run directory's newest, or with no path the newest under
    runs_dir."""
    if path is None:
        found = newest_checkpoint(runs_dir)
        if found is None:
            raise FileNotFoundError(f"no checkpoint in {runs_dir}/*/ckpt/ or {runs_dir}/*/*/ckpt/: "
                                    "train one first (python pretrain.py), or pass --checkpoint "
                                    "runs/<run>")
        return found
    path = Path(path)
    if (path / "meta.json").is_file():
        return path
    found = list_checkpoints(path / "ckpt")
    if not found:
        raise FileNotFoundError(f"--checkpoint {path}: neither a checkpoint "
                                "(runs/<run>/ckpt/step_*/meta.json) nor a run directory with "
                                f"checkpoints in {path}/ckpt/")
    return found[-1]


# chat.py's and export.py's pick without --checkpoint, group by group
PICK_ORDER = [("rl", "sft"), ("midtrain",), ("pretrain",)]


def pick_checkpoint(args, order=PICK_ORDER):
    """(checkpoint, how chosen): --checkpoint, else the newest of the first group of stages in
    `order` that has one."""
    if args.checkpoint is not None:
        return find_checkpoint(args.checkpoint, args.runs_dir), "--checkpoint"
    for stages in order:
        found = [(c, stage) for stage in stages for c in [newest_checkpoint(args.runs_dir,
                                                                            stage)] if c]
        if found:
            newest, stage = max(found, key=lambda pair: (pair[0] / "meta.json").stat().st_mtime)
            return newest, f"newest {stage} checkpoint under {args.runs_dir}"
    stages = " or ".join(sum(order, ()))
    raise FileNotFoundError(f"no checkpoint in {args.runs_dir}/*/ckpt/ or */*/ckpt/ of stage "
                            f"{stages}: train one (python pretrain.py, then midtrain.py, sft.py, "
                            "rl.py), or pass --checkpoint runs/<run> (or --runs_dir DIR)")


def add_checkpoint_args(parser, picked=None, eval_dtype=False):
    """`picked`: what loads without --checkpoint."""
    picked = picked or "the newest under --runs_dir of stage " + ", else ".join(" or ".join(s)
                                                                                for s in PICK_ORDER)
    parser.add_argument("--checkpoint", default=None, help="a checkpoint (runs/<run>/ckpt/step_*) "
                        f"or a run directory (its newest checkpoint) (default: {picked})")
    parser.add_argument("--runs_dir", default="runs", help="where runs live (default: %(default)s)")
    parser.add_argument("--tokenizer", default=None, help="tokenizer directory (default: the one "
                        "the checkpoint records)")
    if eval_dtype:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        parser.add_argument("--dtype", default=matmul_dtype(device),
                            choices=["bfloat16", "float32"],
                            help="compute dtype (default: %(default)s: bfloat16 where this device "
                            "runs it natively)")


def pretraining_run(checkpoint, meta):
    """(data_dir, sequence_len, eval_tokens) of the checkpoint's pretraining run; None where a
    parent moved or was deleted."""
    while meta.get("stage") != "pretrain":
        path = (meta.get("parent") or {}).get("path")
        if path is None or not (Path(path) / "meta.json").is_file():
            return None
        checkpoint, meta = path, json.loads((Path(path) / "meta.json").read_text())
    config = Path(checkpoint).parent.parent / "config.json"
    recorded = json.loads(config.read_text()).get("args", {}) if config.is_file() else {}
    seq_len = (meta.get("hparams") or {}).get("sequence_len")
    return (meta["data_dir"], seq_len,
            recorded.get("bpb_tokens")) if meta.get("data_dir") and seq_len else None


def load_model(path, device):
    """(model in eval mode, meta) from model.pt and meta.json, on any number of processes."""
    meta = json.loads((Path(path) / "meta.json").read_text())
    if not (Path(path) / "model.pt").is_file():
        raise FileNotFoundError(f"{path} holds a sharded model (state/) and no model.pt yet: write "
                                f"it with `python checkpoint.py consolidate {path}`")
    model = build_model(GPTConfig(**meta["model_config"]), device, init=False)
    # mmap: pages read as the weights are copied, not buffered first (dev/LOG.md)
    model.load_state_dict(torch.load(Path(path) / "model.pt", map_location=device,
                                     weights_only=True, mmap=True))
    model.eval()
    return model, meta


def checkpoint_tokenizer(meta, checkpoint, flag=None):
    """(tokenizer, its path): --tokenizer's, else meta's, refused unless the checkpoint was
    trained with it (every score would be silently wrong)."""
    path = flag or meta.get("tokenizer") or "runs/tokenizer"
    try:
        tokenizer = Tokenizer.load(path)
    except FileNotFoundError as e:
        raise FileNotFoundError(f"--tokenizer {path}: {e} (or pass the checkpoint's tokenizer "
                                "directory with --tokenizer DIR)") from None
    vocab = meta["model_config"]["vocab_size"]
    if tokenizer.vocab_size != vocab:
        raise ValueError(f"tokenizer {path} has {tokenizer.vocab_size} tokens, the model in "
                         f"{checkpoint} has {vocab}: pass the tokenizer it was trained with "
                         f"(--tokenizer {meta.get('tokenizer')})")
    recorded = meta.get("tokenizer_sha256")
    if recorded and recorded != tokenizer.fingerprint():
        raise ValueError(f"tokenizer {path} (sha256 {tokenizer.fingerprint()[:12]}) is not the one "
                         f"{checkpoint} was trained with (sha256 {recorded[:12]}, from "
                         f"{meta.get('tokenizer')}): pass that one with --tokenizer")
    return tokenizer, path


def check_chat_tokenizer(tokenizer, tokenizer_path):
    """A chat stage needs the chat special tokens to render a conversation."""
    missing = [name for name in SPECIAL_TOKENS if name not in tokenizer.special_tokens]
    if missing:
        raise ValueError(f"tokenizer {tokenizer_path} lacks the chat special tokens "
                         f"{', '.join(missing)}: train one with `prepare.py tokenizer` (it adds "
                         f"{', '.join(SPECIAL_TOKENS)}) and pretrain with it")


# -----------------------------------------------------------------------------
# Resuming: a checkpoint's layout, the state restored, the command that resumes

def saved_layout(path):
    """The meta.json layout a resume must match."""
    meta = json.loads((Path(path) / "meta.json").read_text())
    return {key: meta.get(key) for key in ("model_config", "world_size", "micro_batch", "accum",
                                           "step", "sharded")}


def resume(path, run_dir, model, optimizers, loaders, layout, rank, device):
    """Restore model, optimizers, loaders and RNG if model, micro-batch and world size x
    accumulation match `layout`; newer checkpoints set aside. Returns the step."""
    meta = saved_layout(path)
    for key in ("model_config", "micro_batch"):
        if meta.get(key) != layout[key]:
            raise ValueError(f"--resume {path}: its {key} is {meta.get(key)}, this run's is "
                             f"{layout[key]}: resume with the same settings (the command is in "
                             f"{run_dir}/config.json)")
    virtual, mine = meta["world_size"] * meta["accum"], layout["world_size"] * layout["accum"]
    if virtual != mine:
        raise ValueError(f"--resume {path}: written by {meta['world_size']} processes x "
                         f"{meta['accum']} accumulation steps = {virtual} data streams, this run "
                         f"has {layout['world_size']} x {layout['accum']} = {mine}: pick "
                         "--total_batch_tokens and the process count so that processes x "
                         f"accumulation = {virtual}")
    load_state(path, model, optimizers, device)
    # this rank's virtual ranks rank * accum + j, each from the rank file that holds it
    old_accum, virtuals = meta["accum"], range(rank * layout["accum"], (rank + 1) * layout["accum"])
    files = {old: torch.load(Path(path) / f"rank{old:03d}.pt", weights_only=True)
             for old in sorted({virtual // old_accum for virtual in virtuals})}
    for loader, virtual in zip(loaders, virtuals, strict=True):
        loader.load_state_dict(files[virtual // old_accum]["loader"][virtual % old_accum])
    set_rng_state(files[virtuals[0] // old_accum]["rng"])
    if rank == 0:
        truncate_metrics(run_dir / "metrics.jsonl", meta["step"])
        truncate_metrics(run_dir / "samples.jsonl", meta["step"])
        aside = set_aside_newer(run_dir / "ckpt", meta["step"])
        sharding = ["sharded" if flag else "not sharded" for flag in (meta.get("sharded"),
                                                                      is_sharded(model))]
        print(f"resume: from {path} at step {meta['step']} ({meta['world_size']} -> "
              f"{layout['world_size']} processes, {sharding[0]} -> {sharding[1]})"
              + (f"; the newer checkpoints of the abandoned branch were moved to {aside}" if aside
                 else ""))
    barrier()
    return meta["step"]


def resume_command(args):
    """The command that continues this run: its arguments with its --run_name, --runs_dir and
    --resume; under torchrun the same launch, rebuilt from the environment."""
    words, dropped = sys.argv[1:], ("--run_name", "--runs_dir", "--resume")
    # a dropped flag's value is the next word (--resume's is optional: not a flag)
    argv = [arg for before, arg in zip(["", *words], words) if arg.split("=", 1)[0] not in dropped
            and not (before in dropped and (before != "--resume" or not arg.startswith("-")))]
    command = [sys.argv[0], *argv, "--runs_dir", args.runs_dir, "--run_name", args.run_name,
               "--resume"]
    if "LOCAL_WORLD_SIZE" not in os.environ:
        return shlex.join([sys.executable, *command])
    per_node, world = int(os.environ["LOCAL_WORLD_SIZE"]), int(os.environ["WORLD_SIZE"])
    nodes = ["--standalone"] if per_node == world else [
        f"--nnodes={world // per_node}", "--rdzv_backend=c10d",
        f"--rdzv_endpoint={os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"]
    prefix = "on every node: " if per_node != world else ""
    return prefix + shlex.join([sys.executable, "-m", "torch.distributed.run", *nodes,
                                f"--nproc_per_node={per_node}",
                                *command])


def truncate_metrics(path, last_step):
    """Drop lines logged past `last_step`, so each step appears once after a resume."""
    path = Path(path)
    if path.is_file():
        lines = [line for line in path.read_text().splitlines() if json.loads(line).get(
                "step", 0) <= last_step]
        path.write_text("".join(line + "\n" for line in lines))


# -----------------------------------------------------------------------------
# The run directory: runs/<run>/ with config.json, metrics.jsonl, samples.jsonl, ckpt/

def add_run_args(parser, stage):
    g = parser.add_argument_group("run directory, checkpoints, health")
    g.add_argument("--run_name", default=None, help="outputs go to <runs_dir>/<run_name>/ "
                   f"(default: {stage}_<preset>_<time>)")
    g.add_argument("--runs_dir", default="runs", help="where runs live (default: %(default)s)")
    g.add_argument("--resume", nargs="?", const="latest", default=None, help=
                   "continue from the newest checkpoint of --run_name (or of the newest run of "
                   "this stage), or from the checkpoint directory given")
    g.add_argument("--ckpt_every", type=int, default=500, help="checkpoint every N >= 1 steps, and "
                   "at the last step (default: %(default)s)")
    g.add_argument("--keep", type=int, default=3, help="checkpoints kept, newest first; at least 1 "
                   "(default: %(default)s)")
    g.add_argument("--frozen_check_step", type=int, default=10, help="steps after the start at "
                   "which unchanged parameters are named (default: %(default)s)")
    g.add_argument("--health_every", type=int, default=50, help="log update/parameter RMS ratios "
                   "every N steps (default: %(default)s)")
    g.add_argument("--log_every", type=int, default=10, help="progress line every N steps "
                   "(default: %(default)s)")
    g.add_argument("--wandb", default=None, help="wandb project to log to (needs `pip install "
                   "wandb`)")
    g.add_argument("--status", default=None, metavar="RUN_DIR",
                   help="print a run's status and exit")
    g = parser.add_argument_group("distributed (under torchrun)")
    g.add_argument("--fsdp", default="auto", choices=["auto", "true", "false"], help=
                   "shard weights, gradients and optimizer state over the ranks with FSDP2; auto: "
                   "when they would not fit one device (default: %(default)s)")
    g.add_argument("--dist_timeout", type=float, default=600, help="seconds a collective waits for "
                   "the other ranks (a dead or hung rank) before the run stops; it must outlast "
                   "the slowest rank's first compile (default: %(default)s)")


def resolve_run(args, stage):
    """(run directory, checkpoint to resume or None); sets args.runs_dir and args.run_name."""
    if args.keep < 1:
        raise ValueError(f"--keep {args.keep}: keep at least 1 checkpoint (the newest is the one a "
                         "resume needs)")
    if args.resume not in (None, "latest"):
        path = Path(args.resume)
        if not (path / "meta.json").is_file() or checkpoint_step(path) is None:
            raise FileNotFoundError(f"--resume {path}: not a checkpoint (runs/<run>/ckpt/step_*/ "
                                    "with meta.json)")
        args.runs_dir, args.run_name = str(path.parent.parent.parent), path.parent.parent.name
        check_shared_dir(path.parent.parent)
        return path.parent.parent, path
    if args.resume and args.run_name is None:
        newest = newest_checkpoint(args.runs_dir, stage=stage)
        if newest is None:
            raise FileNotFoundError(f"--resume: no {stage} checkpoint in {args.runs_dir}/*/ckpt/ "
                                    "or */*/ckpt/")
        run = newest.parent.parent  # runs/<run>, or speedrun.sh's runs/<run>/<stage>
        args.runs_dir, args.run_name = str(run.parent), run.name
    args.run_name = args.run_name or f"{stage}_{args.preset}_{time.strftime('%Y%m%d_%H%M%S')}"
    run_dir = Path(args.runs_dir) / args.run_name
    # several nodes: every rank must see what rank 0 writes there
    check_shared_dir(run_dir)
    if not args.resume:
        return run_dir, None
    found = list_checkpoints(run_dir / "ckpt")
    if not found:
        raise FileNotFoundError(f"--resume: {run_dir}/ckpt has no checkpoint yet")
    return run_dir, found[-1]


# what a later stage inherits from its parent (meta.json "hparams")
INHERITED = ["tokenizer", "sequence_len", "micro_batch", "total_batch_tokens", "optimizer",
             "matrix_lr", "embedding_lr", "head_lr", "scalar_lr", "weight_decay", "grad_clip",
             "dtype", "compile"]


def record_run(args, stage, model_config, seq_len, micro, accum, world, total_steps,
               tokens_per_step, tokenizer, params, record):
    """(layout a resume must match, run for config.json, meta for each checkpoint: run, argv,
    the hparams a child inherits)."""
    layout = {"model_config": model_config, "world_size": world, "micro_batch": micro,
              "accum": accum}
    run = {"stage": stage, "run": args.run_name, **layout, "total_steps": total_steps,
           "tokens_per_step": tokens_per_step, "code": code_version(),
           "tokenizer": args.tokenizer,
           "tokenizer_sha256": tokenizer.fingerprint(), "params": params, **record}
    inherited = {**{name: getattr(args, name, None) for name in INHERITED}, "sequence_len": seq_len,
                 "micro_batch": micro, "total_batch_tokens": tokens_per_step}
    return layout, run, {**run, "argv": sys.argv, "hparams": inherited}


def announce(args, run_dir, run, lines, precision):
    run_dir.mkdir(parents=True, exist_ok=True)
    config = {**run, "args": vars(args), "hardware": distributed.WORLD, "argv": sys.argv,
              "versions": versions()}
    (run_dir / "config.json").write_text(json.dumps(config, indent=1, default=str))
    code = f"code: commit {run['code']['commit']}, uncommitted changes: {run['code']['dirty']}"
    print("\n".join([*lines, code, precision]))


def batch_line(micro, seq_len, world, accum):
    return (f"batch: tokens per step = micro_batch {micro} x sequence_len {seq_len} x world size "
            f"{world} x accumulation {accum} = {micro * seq_len * world * accum:,}")


# -----------------------------------------------------------------------------
# A chat stage's start from its parent checkpoint. Each meta.json records its stage,
# "hparams" and parent (path and model.pt's sha256).

def inherit(args, meta, parent):
    """Fill inherited flags left at None from the parent's hparams; returns (name, value,
    source) rows, but micro_batch's (parent_lines adds it)."""
    recorded = meta.get("hparams") or {}
    # checkpoints older than hparams: their run's config.json
    config_file = Path(parent).parent.parent / "config.json"
    older = {}
    if not recorded and config_file.is_file():
        older = json.loads(config_file.read_text()).get("args", {})
    table = []
    for name in (n for n in INHERITED if n != "micro_batch"):
        if getattr(args, name) is not None:
            table.append((name, getattr(args, name), "flag"))
            continue
        value = recorded.get(name, older.get(name))
        if value is None:
            raise ValueError(f"{parent}: its meta.json records no {name}; pass --{name}")
        setattr(args, name, value)
        where = "meta.json" if name in recorded else "its run config.json"
        table.append((name, value, f"parent ({where})"))
    if args.sequence_len > meta["model_config"]["sequence_len"]:
        raise ValueError(f"--sequence_len {args.sequence_len} exceeds the parent's "
                         f"{meta['model_config']['sequence_len']} (its rotary tables end there): "
                         f"pass at most that")
    return table


def weights_sha256(parent):
    digest = hashlib.sha256()
    with open(Path(parent) / "model.pt", "rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            digest.update(block)  # hashlib releases the GIL on a block this large
    return digest.hexdigest()


def parent_record(parent, meta, sha256):
    return {"path": str(parent), "stage": meta.get("stage"), "step": meta.get("step"),
            "sha256": sha256}


def warm_start(parent, parent_meta, model, optimizers, args, device):
    """The parent's optimizer state with this stage's hyperparameters: warm moments keep the
    first steps the size of the parent's last; a fresh AdamW's first update, sign(gradient),
    moves every embedding coordinate by about the lr. A state that does not fit stays fresh.
    Returns the line saying which."""
    if not args.warm_start:
        return "optimizer: fresh state (--warm_start false)"
    recorded, mine = parent_meta.get("optimizers"), optimizer_layout(optimizers)
    if recorded is None:
        return (f"optimizer: fresh state: {parent}/meta.json does not record its optimizers "
                f"(written by an older version of this code), so its state cannot be checked "
                f"against this stage's")
    if recorded != mine:
        return (f"optimizer: fresh state: the parent's optimizers {recorded} are not this stage's "
                f"{mine} (another --optimizer or --adam8bit, or another model)")
    try:
        load_state(parent, model, optimizers, device, keep=None)
    except (ValueError, KeyError, RuntimeError, FileNotFoundError) as error:
        for opt in optimizers:  # a partly loaded state is no state
            opt.state.clear()
        return (f"optimizer: fresh state: the parent's could not be loaded "
                f"({type(error).__name__}: {error})")
    tensors = sum(len(opt.state) for opt in optimizers)
    return (f"optimizer: warm start from {parent}'s state ({tensors} parameters' moments, step "
            f"{parent_meta['step']}), lrs reset to {args.lr_scale:g} x the parent's")


def load_parent(args, stage, parents, device):
    """The parent's (path, meta, model, tokenizer, inherit's table, a future of its
    weights_sha256); a tokenizer other than the parent's is refused."""
    parent, _ = pick_checkpoint(args, [(name,) for name in parents])
    # hashed while the stage starts: in line it takes a third of the start
    hashing = concurrent.futures.ThreadPoolExecutor(1)
    sha256 = hashing.submit(weights_sha256, parent)
    hashing.shutdown(wait=False)  # its thread ends with the hash
    model, meta = load_model(parent, device)
    model.train()
    inherited = inherit(args, meta, parent)
    tokenizer, _ = checkpoint_tokenizer(meta, parent, args.tokenizer)
    check_chat_tokenizer(tokenizer, args.tokenizer)
    args.preset = meta.get("run", stage)  # names the default run directory
    return parent, meta, model, tokenizer, inherited, sha256


def parent_lines(parent, meta, params, inherited, micro_batch):
    """The parent and the inherited table; micro_batch: plan_batch's (value, source)."""
    rows = list(inherited)
    rows.insert(INHERITED.index("micro_batch"), ("micro_batch", *micro_batch))
    table = "\n".join(f"  {name:<18} {value!s:<14} {where}" for name, value, where in rows)
    init = f"init: {parent} ({meta.get('stage')}, step {meta.get('step')}), params: {params}"
    return [init, "inherited:\n" + table]


def main(argv=None):
    parser = argparse.ArgumentParser(description="a sharded checkpoint's model.pt, or a "
                                     "checkpoint's lineage")
    parser.add_argument("command", choices=["consolidate", "lineage"], help="consolidate: write "
                        "CHECKPOINT/model.pt from its shards, in one process; lineage: its stage, "
                        "step and hparams, then its parent's, ...")
    parser.add_argument("checkpoint", nargs="?", help="a step_* directory or a run directory (its "
                        "newest)")
    args = parser.parse_args(argv)
    if args.checkpoint is None:
        parser.error(f"{args.command} needs a checkpoint: python checkpoint.py {args.command} "
                     "runs/<run>[/ckpt/step_N]")
    path = find_checkpoint(args.checkpoint)
    if args.command == "lineage":
        while path is not None and (Path(path) / "meta.json").is_file():
            meta = json.loads((Path(path) / "meta.json").read_text())
            print(f"{path}: {meta.get('stage')}, step {meta.get('step')}, "
                  f"hparams {meta.get('hparams')}")
            path = (meta.get("parent") or {}).get("path")
        return 0
    written = consolidate(path)
    count = sum(t.numel() for t in torch.load(written, weights_only=True).values())
    print(f"consolidate: wrote {written} ({count:,} parameters)")
    return 0


if __name__ == "__main__":
    sys.exit(run_main(main))
