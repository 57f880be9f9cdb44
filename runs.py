"""A run: its directory (runs/<run>/: flags, where it lives, what it resumes from,
config.json), its record (what it is, what its checkpoints' meta.json hold, what a child stage
inherits) and its first lines. Not a stage: `import runs`; one command line:

    python runs.py runs/<run>[/ckpt/step_N]     # a checkpoint's stage, step and hparams, then its parent's, ...
"""
import argparse
import json
import sys
import time
from pathlib import Path

import checkpoint
import common
import distributed
import optim

# -----------------------------------------------------------------------------
# The run directory: runs/<run>/ with config.json, metrics.jsonl, samples.jsonl, ckpt/step_XXXXXX/

def add_run_args(parser, stage):
    """Every training stage's flags for its run directory, checkpoints, health checks, ranks."""
    g = parser.add_argument_group("run directory, checkpoints, health")
    g.add_argument("--run_name", default=None, help="outputs go to <runs_dir>/<run_name>/ "
                   f"(default: {stage}_<preset>_<time>; not --run, which torchrun would take for "
                   "its own --run-path)")
    g.add_argument("--runs_dir", default="runs", help="where runs live (default: %(default)s)")
    g.add_argument("--resume", nargs="?", const="latest", default=None, help=
                   "continue from the newest checkpoint of --run_name (or of the newest run of "
                   "this "
                   "stage), or from the checkpoint directory given")
    g.add_argument("--ckpt_every", type=int, default=500, help="checkpoint every N >= 1 steps, and "
                   "at the last step (default: %(default)s)")
    g.add_argument("--keep", type=int, default=3, help="checkpoints kept, newest first; at least 1 "
                   "(default: %(default)s)")
    g.add_argument("--frozen_check_step", type=int, default=10, help="steps after the start at "
                   "which unchanged parameters are named (default: %(default)s)")
    g.add_argument("--health_every", type=int, default=50, help="log update/parameter RMS ratios "
                   "every N steps (default: %(default)s)")
    g.add_argument("--log_every", type=int, default=10, help="progress line every N steps "
                                                             "(default: "
                   "%(default)s)")
    g.add_argument("--wandb", default=None, help="wandb project to log to (needs `pip install "
                   "wandb`)")
    g.add_argument("--status", default=None, metavar="RUN_DIR",
                   help="print a run's status and exit")
    g = parser.add_argument_group("distributed (under torchrun)")
    g.add_argument("--fsdp", default="auto", choices=["auto", "true", "false"], help=
                   "shard weights, gradients and optimizer state over the ranks with FSDP2; auto: "
                   "when they would not fit one device by model.py's estimate (default: "
                   "%(default)s)")
    g.add_argument("--dist_timeout", type=float, default=600, help="seconds a collective may wait "
                   "for the other ranks before the run stops with an error (a dead or hung rank); "
                   "it must outlast the slowest rank's first compile (default: %(default)s)")


def resolve_run(args, stage):
    """(run directory, checkpoint to resume from or None) from --runs_dir, --run_name and --resume
    [PATH]; sets args.runs_dir and args.run_name to the run's, so the resume command and config.json
    name it."""
    if args.keep < 1:
        raise ValueError(f"--keep {args.keep}: keep at least 1 checkpoint (the newest is the one a "
                         "resume needs)")
    # a checkpoint path: <runs_dir>/<run_name>/ckpt/step_XXXXXX
    if args.resume not in (None, "latest"):
        path = Path(args.resume)
        if not (path / "meta.json").is_file() or checkpoint.checkpoint_step(path) is None:
            raise FileNotFoundError(f"--resume {path}: not a checkpoint (runs/<run>/ckpt/step_*/ "
                                    "with meta.json)")
        args.runs_dir, args.run_name = str(path.parent.parent.parent), path.parent.parent.name
        distributed.check_shared_dir(path.parent.parent)
        return path.parent.parent, path
    if args.resume and args.run_name is None:
        newest = checkpoint.newest_checkpoint(args.runs_dir, stage=stage)
        if newest is None:
            raise FileNotFoundError(f"--resume: no {stage} checkpoint in {args.runs_dir}/*/ckpt/ "
                                    "or "
                                    "*/*/ckpt/")
        run = newest.parent.parent  # runs/<run>, or speedrun.sh's runs/<run>/<stage>
        args.runs_dir, args.run_name = str(run.parent), run.name
    args.run_name = args.run_name or f"{stage}_{args.preset}_{time.strftime('%Y%m%d_%H%M%S')}"
    run_dir = Path(args.runs_dir) / args.run_name
    # several nodes: every rank must see what rank 0 writes there
    distributed.check_shared_dir(run_dir)
    if not args.resume:
        return run_dir, None
    found = checkpoint.list_checkpoints(run_dir / "ckpt")
    if not found:
        raise FileNotFoundError(f"--resume: {run_dir}/ckpt has no checkpoint yet")
    return run_dir, found[-1]


# what a stage after pretraining inherits from its parent checkpoint, recorded in every
# checkpoint's meta.json ("hparams"; chat_stage.inherit)
INHERITED = ["tokenizer", "sequence_len", "micro_batch", "total_batch_tokens", "optimizer",
             "matrix_lr",
             "embedding_lr", "head_lr", "scalar_lr", "weight_decay", "grad_clip", "dtype",
             "compile"]


def record_run(args, stage, model_config, seq_len, micro, accum, world, total_steps,
               tokens_per_step, tokenizer,
               params, record):
    """(layout, run, ckpt_meta), every training stage's: the layout a resume must match; what the
    run is, for config.json; that, its argv and what a child stage inherits (hparams), for every
    checkpoint's meta.json."""
    layout = {"model_config": model_config, "world_size": world, "micro_batch": micro,
              "accum": accum}
    run = {"stage": stage, "run": args.run_name, **layout, "total_steps": total_steps,
           "tokens_per_step": tokens_per_step, "code": common.code_version(),
           "tokenizer": args.tokenizer,
           "tokenizer_sha256": tokenizer.fingerprint(), "params": params, **record}
    inherited = {**{name: getattr(args, name, None) for name in INHERITED}, "sequence_len": seq_len,
                 "micro_batch": micro, "total_batch_tokens": tokens_per_step}
    return layout, run, {**run, "argv": sys.argv, "hparams": inherited}


def announce(args, run_dir, run, lines, optimizers, device):
    """Rank 0's start of a run: config.json (rewritten by a resume with its own command line), then
    `lines`, the code's commit and the precision."""
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.json").write_text(json.dumps({**run, "args": vars(args),
                                                     "hardware": distributed.WORLD,
                                                     "argv": sys.argv,
                                                     "versions": common.versions()}, indent=1,
                                                    default=str))
    print("\n".join([*lines, (f"code: commit {run['code']['commit']}, uncommitted changes: "
                      f"{run['code']['dirty']}"),
                     optim.precision_line(args, device, optimizers,
                                          run["model_config"]["n_embd"])]))


def batch_line(micro, seq_len, world, accum):
    return (f"batch: tokens per step = micro_batch {micro} x sequence_len {seq_len} x world size "
            f"{world} x accumulation {accum} = {micro * seq_len * world * accum:,}")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoint", help="a checkpoint (runs/<run>/ckpt/step_*) or a run directory "
                   "(its newest)")
    path = checkpoint.find_checkpoint(p.parse_args(argv).checkpoint)
    # to pretraining, or a parent moved or deleted
    while path is not None and (Path(path) / "meta.json").is_file():
        meta = json.loads((Path(path) / "meta.json").read_text())
        print(f"{path}: {meta.get('stage')}, step {meta.get('step')}, hparams {meta.get('hparams')}")
        path = (meta.get("parent") or {}).get("path")


if __name__ == "__main__":
    sys.exit(distributed.run_main(main))
