"""Midtraining: a pretrained checkpoint goes on training on a mixture, by token share, of its pretraining text and
conversations in the chat template, packed BOS-aligned as text is (no padding), so it learns the template, turns and
when to stop, and keeps its knowledge.

    python midtrain.py --steps 2000        # newest pretrain checkpoint; 30% its corpus, 70% conversations and tasks
    python midtrain.py --checkpoint runs/base --source text:data/demo/pretrain:0.3 --source chat:data/demo/conversations:0.7
    python midtrain.py --source text:data/mine:0.3 --source chat:my_chats.jsonl:0.7 --val_chat_dir held_out.jsonl
    torchrun --standalone --nproc_per_node=8 midtrain.py --tokens 500000000
    python midtrain.py --run_name NAME --resume                          # continue from the last checkpoint
    python midtrain.py --status runs/NAME

Writes runs/<run_name>/: config.json, metrics.jsonl (every step), samples.jsonl (greedy answers at every eval),
ckpt/step_XXXXXX/ (meta.json names the parent checkpoint and the sha256 of its weights), done.json (with the realized
mixture).
"""
import argparse
import math
import sys
from functools import partial
from pathlib import Path

import torch

import distributed
import runs
import train_loop
import validation
from dataset import CACHE_DIR, chat_files, check_chat_files
from loader import MixtureLoader

# beside the parent's text (0.3): conversation, the shapes chat_eval.py scores, and who the assistant is (identity)
DEFAULT_CHAT_SHARES = [("smoltalk", 0.3), ("ultrachat", 0.1), ("mmlu", 0.15), ("gsm8k", 0.1), ("arc-easy", 0.02),
                       ("arc-challenge", 0.02), ("identity", 0.01)]
# warm-started at the parent's full lrs, flat, then a linear warmdown over the last 20% (nanochat's): against a fresh
# state, better on the demo world and forgot less on real text; half the lrs learned far less there (dev/LOG.md)
MID_LR_SCALE, MID_WARMDOWN = 1.0, 0.2
MID_WHY = "measured on the demo world and on real text"


def get_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("data")
    g.add_argument("--source", action="append", default=None, metavar="KIND:PATH:SHARE", help="a data source and its "
                   "share of the tokens, repeatable; KIND is text (a corpus directory, its train split) or chat (a "
                   "directory of conversation or task parquet files, or a .jsonl file of conversations: "
                   "docs/own-data.md) (default: text:<the parent's data_dir>:0.3, "
                   + ", ".join(f"chat:{CACHE_DIR / 'chat' / name}:{share}" for name, share in DEFAULT_CHAT_SHARES)
                   + ")")
    g.add_argument("--add_source", action="append", default=[], metavar="KIND:PATH:SHARE", help="a source added to "
                   "the mixture above (the --source ones, or the defaults) at SHARE, every other share scaled by 1 - "
                   "SHARE: speedrun.sh --chat FILE adds chat:FILE:0.2 (default: none)")
    g.add_argument("--supervise", default="all", choices=["all", "assistant"], help="conversation tokens that carry "
                   "loss: all of them, as in pretraining, or the assistant's only (default: %(default)s, as nanochat "
                   "midtrains)")
    g.add_argument("--seed", type=int, default=0, help="shuffles each source's documents, anew every epoch (default: "
                   "%(default)s)")
    runs.add_chat_stage_args(p, g, "midtrain", ["pretrain"], [("steps", int, "optimizer steps"),
                                                              ("tokens", float, "tokens over all ranks")],
                             eval_every=250, lr_scale=MID_LR_SCALE, warmdown_frac=MID_WARMDOWN, why=MID_WHY)
    args = train_loop.parse_stage_args(p, argv, ["steps", "tokens"])
    return p, args


def parse_sources(specs, parent_data_dir, added=()):
    """--source KIND:PATH:SHARE values (and --add_source's, the others' shares scaled down to make room) as the
    mixture loader's source dicts."""
    if added:
        base, extra = parse_sources(specs, parent_data_dir), parse_sources(list(added), None)
        scale = 1 - sum(s["share"] for s in extra)
        return [{**s, "share": s["share"] * scale} for s in base] + extra
    specs = specs or [f"text:{parent_data_dir}:0.3"] + [f"chat:{CACHE_DIR / 'chat' / name}:{share}"
                                                         for name, share in DEFAULT_CHAT_SHARES]
    sources = []
    for spec in specs:
        kind, _, rest = spec.partition(":")
        path, _, share = rest.rpartition(":")
        try:
            share = float(share)
        except ValueError:
            share = -1.0
        if kind not in ("text", "chat") or not path or not 0 < share <= 1:
            raise ValueError(f"--source {spec!r}: write KIND:PATH:SHARE with KIND text or chat and 0 < SHARE <= 1, "
                             f"e.g. --source chat:data/demo/conversations:0.7")
        sources.append({"name": f"{kind}:{Path(path).name}", "kind": kind, "path": path, "share": share})
    return sources


def realized_mixture(loaders, sources):
    """Tokens and documents per source over every loader of every rank, and the share of the tokens each got."""
    counts = torch.tensor([[loader.mixture()[s["name"]][key] for key in ("tokens", "docs")] for loader in loaders
                           for s in sources], dtype=torch.float64).view(len(loaders), len(sources), 2).sum(0)
    counts = distributed.all_reduce_tensor(counts).tolist()
    total = sum(tokens for tokens, _ in counts) or 1
    return {s["name"]: {"tokens": int(tokens), "docs": int(docs), "share": tokens / total, "target": s["share"]}
            for s, (tokens, docs) in zip(sources, counts, strict=True)}


def evaluate(args, start, batches, step):
    figures = validation.chat_validation(args, start, batches, step)
    mixture = realized_mixture(start.loaders, start.sources)
    if start.rank == 0:
        print(f"mixture at step {step}: " + ", ".join(f"{name} {m['share']:.1%} of {m['tokens']:,} tokens (target "
                                                       f"{m['target']:.0%}), {m['docs']:,} documents"
                                                       for name, m in mixture.items()))
    return {**figures, "mixture": mixture}


def plan(args, start):
    """What runs.start_stage asks of midtraining: its sources, total steps and loaders."""
    sources = parse_sources(args.source, start.parent_meta.get("data_dir"), args.add_source)
    # a .jsonl chat source's bad lines: an error now, before any step (or, --skip_bad_rows, a line saying how many)
    skipped = check_chat_files([f for s in sources if s["kind"] == "chat" for f in chat_files(s["path"], "train")],
                               args.skip_bad_rows)
    val_chat_dir = validation.held_out_dir(args.val_chat_dir, next((s["path"] for s in sources if s["kind"] == "chat"),
                                                                   None))
    total_steps = args.steps or math.ceil(args.tokens / start.tokens_per_step)
    loaders = [MixtureLoader(sources, start.tokenizer, start.micro_batch, start.seq_len, device=start.device,
                             rank=start.rank * start.accum + j, world_size=start.world * start.accum, seed=args.seed,
                             supervise=args.supervise, threads=train_loop.loader_threads(args, start.device),
                             skip_bad_rows=args.skip_bad_rows)
               for j in range(start.accum)]
    data_dir = next((s["path"] for s in sources if s["kind"] == "text"), start.parent_meta.get("data_dir"))
    lines = ["mixture (share of tokens): " + ", ".join(f"{s['name']} {s['share']:.0%} ({s['path']})" for s in sources)
             + f"; loss on {args.supervise} conversation tokens", *skipped, args.budget_line,
             f"budget: {total_steps:,} steps, {total_steps * start.tokens_per_step:,} tokens"]
    return {"total_steps": total_steps, "loaders": loaders, "sources": sources, "val_chat_dir": val_chat_dir,
            "lines": lines, "record": {"sources": sources, "supervise": args.supervise, "data_dir": data_dir}}


def main(argv=None):
    _, args = get_args(argv)
    if args.status:
        return train_loop.print_status(Path(args.status))
    s = runs.start_stage(args, "midtrain", ["pretrain"], plan)
    evaluator = partial(evaluate, args, s, validation.chat_val_batches(s.val_chat_dir, s.tokenizer, s.seq_len,
                                                                       args.eval_rows, args.skip_bad_rows))
    return runs.train_chat_stage(args, s, evaluator, lambda final: ({}, [
        "mixture realized: " + ", ".join(f"{name} {m['tokens']:,} tokens ({m['share']:.1%}, target {m['target']:.0%}), "
                                         f"{m['docs']:,} documents" for name, m in final["mixture"].items())]))


if __name__ == "__main__":
    sys.exit(distributed.run_main(main))
