"""A run: its directory (runs/<run>/: flags, where it lives, what it resumes from, config.json) and, for a stage after
pretraining, the parent it starts from and what it inherits: the flags (inherit), the optimizer state (warm_start),
midtrain.py's, sft.py's and rl.py's whole start in one function (start_stage), and midtrain.py's and sft.py's shared
flags (add_chat_stage_args) and training to the end (train_chat_stage). Not a stage: `import runs`.

    python runs.py runs/<run>[/ckpt/step_N]     # a checkpoint's stage, step and hparams, then its parent's, ...
"""
import argparse
import concurrent.futures
import hashlib
import json
import sys
import time
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import checkpoint
import common
import distributed
import optim
import train_loop
import validation
from dataset import SKIP_BAD_ROWS_HELP
from loader import close_all
from model import flops_per_token, num_params, parse_bool

# -----------------------------------------------------------------------------
# The run directory: runs/<run>/ with config.json, metrics.jsonl, samples.jsonl, ckpt/step_XXXXXX/

def add_run_args(parser, stage):
    """Every training stage's flags for its run directory, checkpoints, health checks, ranks."""
    g = parser.add_argument_group("run directory, checkpoints, health")
    g.add_argument("--run_name", default=None, help=f"outputs go to <runs_dir>/<run_name>/ (default: {stage}_<preset>_"
                   f"<time>; not --run, which torchrun would take for its own --run-path)")
    g.add_argument("--runs_dir", default="runs", help="where runs live (default: %(default)s)")
    g.add_argument("--resume", nargs="?", const="latest", default=None, help="continue from the newest checkpoint of "
                   "--run_name (or of the newest run of this stage), or from the checkpoint directory given")
    g.add_argument("--ckpt_every", type=int, default=500, help="checkpoint every N >= 1 steps, and at the last step "
                   "(default: %(default)s)")
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
                   "before the run stops with an error (a dead or hung rank); it must outlast the slowest rank's first "
                   "compile (default: %(default)s)")


def resolve_run(args, stage):
    """(run directory, checkpoint to resume from or None) from --runs_dir, --run_name and --resume [PATH]; sets
    args.runs_dir and args.run_name to the run's, so the resume command and config.json name it."""
    if args.keep < 1:
        raise ValueError(f"--keep {args.keep}: keep at least 1 checkpoint (the newest is the one a resume needs)")
    if args.resume not in (None, "latest"):  # a checkpoint path: <runs_dir>/<run_name>/ckpt/step_XXXXXX
        path = Path(args.resume)
        if not (path / "meta.json").is_file() or checkpoint.checkpoint_step(path) is None:
            raise FileNotFoundError(f"--resume {path}: not a checkpoint (runs/<run>/ckpt/step_*/ with meta.json)")
        args.runs_dir, args.run_name = str(path.parent.parent.parent), path.parent.parent.name
        distributed.check_shared_dir(path.parent.parent)
        return path.parent.parent, path
    if args.resume and args.run_name is None:
        newest = checkpoint.newest_checkpoint(args.runs_dir, stage=stage)
        if newest is None:
            raise FileNotFoundError(f"--resume: no {stage} checkpoint in {args.runs_dir}/*/ckpt/ or */*/ckpt/")
        run = newest.parent.parent  # runs/<run>, or speedrun.sh's runs/<run>/<stage>
        args.runs_dir, args.run_name = str(run.parent), run.name
    args.run_name = args.run_name or f"{stage}_{args.preset}_{time.strftime('%Y%m%d_%H%M%S')}"
    run_dir = Path(args.runs_dir) / args.run_name
    distributed.check_shared_dir(run_dir)  # several nodes: every rank must see what rank 0 writes there
    if not args.resume:
        return run_dir, None
    found = checkpoint.list_checkpoints(run_dir / "ckpt")
    if not found:
        raise FileNotFoundError(f"--resume: {run_dir}/ckpt has no checkpoint yet")
    return run_dir, found[-1]


def record_run(args, stage, model_config, seq_len, micro, accum, world, total_steps, tokens_per_step, tokenizer,
               params, record):
    """(layout, run, ckpt_meta), pretrain.py's and start_stage's: the layout a resume must match; what the run is, for
    config.json; that, its argv and what a child stage inherits (hparams), for every checkpoint's meta.json."""
    layout = {"model_config": model_config, "world_size": world, "micro_batch": micro, "accum": accum}
    run = {"stage": stage, "run": args.run_name, **layout, "total_steps": total_steps,
           "tokens_per_step": tokens_per_step, "code": common.code_version(), "tokenizer": args.tokenizer,
           "tokenizer_sha256": tokenizer.fingerprint(), "params": params, **record}
    inherited = {**{name: getattr(args, name, None) for name in INHERITED}, "sequence_len": seq_len,
                 "micro_batch": micro, "total_batch_tokens": tokens_per_step}
    return layout, run, {**run, "argv": sys.argv, "hparams": inherited}


def announce(args, run_dir, run, lines, optimizers, device):
    """Rank 0's start of a run: config.json (rewritten by a resume with its own command line), then `lines`, the
    code's commit and the precision."""
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.json").write_text(json.dumps({**run, "args": vars(args), "hardware": distributed.WORLD,
                                                     "argv": sys.argv, "versions": common.versions()}, indent=1,
                                                    default=str))
    print("\n".join([*lines, f"code: commit {run['code']['commit']}, uncommitted changes: {run['code']['dirty']}",
                     optim.precision_line(args, device, optimizers, run["model_config"]["n_embd"])]))


def batch_line(micro, seq_len, world, accum):
    return (f"batch: tokens per step = micro_batch {micro} x sequence_len {seq_len} x world size {world} x "
            f"accumulation {accum} = {micro * seq_len * world * accum:,}")


# -----------------------------------------------------------------------------
# Stages after pretraining: the parent checkpoint they start from, and what they inherit from it. Every checkpoint's
# meta records its stage, its hyperparameters ("hparams") and its parent (path and the sha256 of its model.pt).

INHERITED = ["tokenizer", "sequence_len", "micro_batch", "total_batch_tokens", "optimizer", "matrix_lr",
             "embedding_lr", "head_lr", "scalar_lr", "weight_decay", "grad_clip", "dtype", "compile"]


def add_init_args(parser, parents, lr_scale, schedule, warmdown_frac, why):
    """A stage's start from a checkpoint of one of `parents` (in that order): --checkpoint, the warm start and the
    schedule (`why`: where the stage's defaults come from), and the inherited flags (None: the parent's value)."""
    optim.add_schedule_args(parser)
    g = parser.add_argument_group("warm start: the parent's optimizer state and this stage's lrs")
    g.add_argument("--warm_start", type=parse_bool, default=True, help="continue from the parent checkpoint's "
                   "optimizer state (AdamW moments, Muon momentum) with the lrs reset to this stage's; a state that "
                   "does not fit this stage's optimizers is reported and replaced by a fresh one; false: fresh "
                   "(default: %(default)s)")
    g.add_argument("--lr_scale", type=float, default=lr_scale, help="every lr is this fraction of the parent's (its "
                   f"base lrs at this stage's batch; {why}) (default: %(default)s)")
    parser.set_defaults(schedule=schedule, warmdown_frac=warmdown_frac)
    g = parser.add_argument_group("start: the parent checkpoint and what is inherited from it")
    g.add_argument("--checkpoint", default=None, help=f"checkpoint to start from: a step_* directory or a run directory "
                   f"(default: the newest {' checkpoint, else the newest '.join(parents)} checkpoint under --runs_dir)")
    g.add_argument("--tokenizer", default=None, help="tokenizer directory (default: the parent's)")
    g.add_argument("--sequence_len", type=int, default=None, help="row length, at most the parent's (default: the "
                   "parent's)")
    train_loop.add_micro_batch_arg(g)
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


def inherit(args, meta, parent):
    """Fill every inherited flag left at None from the parent's recorded hparams; returns the table of (name, value,
    where it came from) (--micro_batch: train_loop.plan_batch's, added by start_stage)."""
    recorded = meta.get("hparams") or {}
    config_file = Path(parent).parent.parent / "config.json"  # checkpoints from before hparams were recorded
    older = json.loads(config_file.read_text()).get("args", {}) if not recorded and config_file.is_file() else {}
    table = []
    for name in (n for n in INHERITED if n != "micro_batch"):
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


def weights_sha256(parent):
    """sha256 of a checkpoint's model.pt (what a child's checkpoints record of its parent's weights)."""
    digest = hashlib.sha256()
    with open(Path(parent) / "model.pt", "rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            digest.update(block)  # hashlib lets go of the GIL over a block this large
    return digest.hexdigest()


def parent_record(parent, meta, sha256):
    """The parent as a child's checkpoints record it: path, stage, step, and its weights' sha256 (weights_sha256's)."""
    return {"path": str(parent), "stage": meta.get("stage"), "step": meta.get("step"), "sha256": sha256}


def warm_start(parent, parent_meta, model, optimizers, args, device):
    """The parent checkpoint's optimizer state with this stage's hyperparameters put back: warm moments keep the
    first steps the size of the parent's last ones, where a fresh AdamW moves every embedding coordinate by about the
    lr (its first update is sign(gradient)). A state that does not fit stays fresh. Returns the line saying which."""
    if not args.warm_start:
        return "optimizer: fresh state (--warm_start false)"
    recorded, mine = parent_meta.get("optimizers"), checkpoint.optimizer_layout(optimizers)
    if recorded is None:
        return (f"optimizer: fresh state: {parent}/meta.json does not record its optimizers (written by an older "
                f"version of this code), so its state cannot be checked against this stage's")
    if recorded != mine:
        return (f"optimizer: fresh state: the parent's optimizers {recorded} are not this stage's {mine} (another "
                f"--optimizer or --adam8bit, or another model)")
    try:
        checkpoint.load_state(parent, model, optimizers, device, keep=None)  # this stage's hyperparameters
    except (ValueError, KeyError, RuntimeError, FileNotFoundError) as error:
        for opt in optimizers:  # a partly loaded state is no state
            opt.state.clear()
        return f"optimizer: fresh state: the parent's could not be loaded ({type(error).__name__}: {error})"
    tensors = sum(len(opt.state) for opt in optimizers)
    return (f"optimizer: warm start from {parent}'s state ({tensors} parameters' moments, step {parent_meta['step']}),"
            f" lrs reset to {args.lr_scale:g} x the parent's")


def start_stage(args, stage, parents, plan, rollouts=False):
    """midtrain.py's, sft.py's and rl.py's start up to the first step, as a namespace: the parent and what it passes
    on, the run directory, batch, optimizers, and step (the resumed checkpoint's, else 0 after warm_start).
    plan(args, start) adds what only the stage knows: total_steps, loaders, record, lines (printed), and more.
    rollouts (rl.py): replies of their own lengths: no sharding, compile or accumulation; --total_batch_tokens only
    scales the lrs."""
    rank, local_rank, world, device = distributed.setup_distributed(args.dist_timeout)
    parent, _ = checkpoint.pick_checkpoint(args, [(name,) for name in parents])  # in that order of preference
    # the parent's weights hashed while the stage loads them and builds the rest: in line, a third of its start
    hashing = concurrent.futures.ThreadPoolExecutor(1)
    sha256 = hashing.submit(weights_sha256, parent)
    hashing.shutdown(wait=False)  # its thread ends with the hash
    model, parent_meta = checkpoint.load_model(parent, device)
    model.train()
    inherited = inherit(args, parent_meta, parent)
    if rollouts:  # every step's rows have other lengths: a compiled model would recompile at each
        args.compile = False
        inherited = [(n, False, "off in rl.py: the rows change length every step") if n == "compile" else (n, v, w)
                     for n, v, w in inherited]
    tokenizer, _ = checkpoint.checkpoint_tokenizer(parent_meta, parent, args.tokenizer)  # the parent's, or refused
    checkpoint.check_chat_tokenizer(tokenizer, args.tokenizer)
    sharding = None if rollouts else distributed.shard_model(model, args, world, device)
    args.preset = parent_meta.get("run", stage)  # names the default run directory
    config = replace(model.config, sequence_len=args.sequence_len)  # the rows; the model keeps the parent's tables
    run_dir, resume_from = resolve_run(args, stage)
    micro, accum, source = train_loop.plan_batch(args, config, world, model, device, resume_from, parent_meta,
                                                 accumulate=not rollouts)
    inherited.insert(INHERITED.index("micro_batch"), ("micro_batch", micro, source))
    tokens_per_step = args.total_batch_tokens if rollouts else micro * config.sequence_len * world * accum
    optimizers = optim.build_optimizers(model, args, config.n_embd, tokens_per_step, device, lr_scale=args.lr_scale)
    start = SimpleNamespace(rank=rank, local_rank=local_rank, world=world, device=device, parent=parent,
                            parent_meta=parent_meta, model=model, tokenizer=tokenizer, config=config, run_dir=run_dir,
                            micro_batch=micro, accum=accum, seq_len=config.sequence_len,
                            tokens_per_step=tokens_per_step, optimizers=optimizers)
    vars(start).update(plan(args, start))
    layout, start.run, start.ckpt_meta = record_run(
        args, stage, parent_meta["model_config"], config.sequence_len, micro, accum, world, start.total_steps,
        tokens_per_step, tokenizer, num_params(config), {**start.record, "parent": parent_record(parent, parent_meta, sha256.result())})
    if rank == 0:
        batch = [] if rollouts else [sharding, batch_line(micro, config.sequence_len, world, accum)]
        table = "\n".join(f"  {name:<18} {value!s:<14} {where}" for name, value, where in inherited)
        init = f"init: {parent} ({parent_meta.get('stage')}, step {parent_meta.get('step')})"
        announce(args, run_dir, start.run, [f"{init}, params: {start.run['params']}", "inherited:\n" + table, *batch,
                                            *start.lines], optimizers, device)
    if resume_from:
        start.step = checkpoint.resume(resume_from, run_dir, model, optimizers, start.loaders, layout, rank, device)
        return start
    line, start.step = warm_start(parent, parent_meta, model, optimizers, args, device), 0
    if rank == 0:
        print(line)
    return start


def add_chat_stage_args(parser, data, stage, parents, budgets, eval_every, lr_scale, warmdown_frac, why):
    """midtrain.py's and sft.py's shared flags, after the stage's own data flags in its group `data`."""
    data.add_argument("--val_chat_dir", default=None, help="held-out conversations for the validation loss: a "
                      "directory (its test*/val* files) or a .jsonl file (default: the first chat source's test*/val* "
                      "files; a .jsonl source has none: give one)")
    data.add_argument("--skip_bad_rows", action="store_true", help=SKIP_BAD_ROWS_HELP)
    train_loop.add_loader_threads_arg(data)
    train_loop.add_budget_args(parser.add_argument_group("budget: one of; given both, the last one is in force"),
                               budgets)
    g = parser.add_argument_group("evaluation")
    g.add_argument("--eval_every", type=int, default=eval_every, help="validation loss + greedy answers every N "
                   "steps; 0 = only at the end (default: %(default)s)")
    g.add_argument("--eval_rows", type=int, default=256, help="validation rows of held-out conversations, packed as "
                   "in training (default: %(default)s)")
    g.add_argument("--sample_prompt", action="append", default=None, help=f"question answered greedily at every eval, "
                   f"repeatable (default: {validation.CHAT_QUESTIONS})")
    add_run_args(parser, stage)
    validation.add_forgetting_args(parser)
    add_init_args(parser, parents, lr_scale=lr_scale, schedule="wsd", warmdown_frac=warmdown_frac, why=why)


def train_chat_stage(args, s, evaluator, summarize):
    """midtrain.py's and sft.py's training from `s` (start_stage's) and, unless a signal stopped it (its number is
    returned), the final evaluation (evaluator(step): val_loss and figures), forgetting, and summarize(figures): the
    stage's own (a dict for done.json, lines printed), on every rank as it may gather."""
    train_model = train_loop.wrap_model(s.model, args, s.world, s.local_rank, s.device)
    signum = train_loop.train(args, s.model, train_model, s.optimizers, s.loaders, run_dir=s.run_dir, start=s.step,
                              total_steps=s.total_steps, ckpt_meta=s.ckpt_meta, evaluate=evaluator,
                              flops_per_token=flops_per_token(s.config), rank=s.rank, world=s.world, device=s.device)
    if signum is None:
        figures = evaluator(s.total_steps)  # once: a second call would run the whole validation again
        loss = figures.pop("val_loss")
        done, lines = summarize(figures)
        kept = validation.forgetting(s.model, s.tokenizer, s.parent, s.parent_meta, args, s.rank, s.world, s.device)
        if s.rank == 0:
            common.append_jsonl(s.run_dir / "metrics.jsonl", {"step": s.total_steps, "final_val_loss": loss, **figures,
                                                              "pretrain_val_bpb": kept["val_bpb"]})
            (s.run_dir / "done.json").write_text(json.dumps({"step": s.total_steps, "val_loss": loss, **figures,
                                                             **done, "pretrain_val_bpb": kept}))
            print("\n".join([validation.forgetting_line(kept), *lines,
                             f"done: {s.total_steps} steps, val loss {loss:.4f}, run dir {s.run_dir}"]))
    close_all(s.loaders)
    return signum


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoint", help="a checkpoint (runs/<run>/ckpt/step_*) or a run directory (its newest)")
    path = checkpoint.find_checkpoint(p.parse_args(argv).checkpoint)
    while path is not None and (Path(path) / "meta.json").is_file():  # to pretraining, or a parent moved or deleted
        meta = json.loads((Path(path) / "meta.json").read_text())
        print(f"{path}: {meta.get('stage')}, step {meta.get('step')}, hparams {meta.get('hparams')}")
        path = (meta.get("parent") or {}).get("path")


if __name__ == "__main__":
    sys.exit(distributed.run_main(main))
