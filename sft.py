"""Supervised fine-tuning: a midtrained (or pretrained) checkpoint learns to answer, the loss on
assistant content, tool calls and <|assistant_end|> only.

    python sft.py  # SmolTalk + MMLU auxiliary_train x3 + GSM8K x4 + ARC + identity, one pass
    python sft.py --source smoltalk:1 --source gsm8k:2 --source data/my_chats:3
        # DIR (or a dataset name):EPOCHS
    python sft.py --source my_chats.jsonl:2 --val_chat_dir held_out.jsonl
        # your own (docs/own-data.md)
    python sft.py --checkpoint runs/mid_demo --chat_dir DIR --epochs 3
        # LIMA-style: a few epochs over a small set
    torchrun --standalone --nproc_per_node=8 sft.py --chat_dir DIR --steps 1000
    python sft.py --run_name NAME --resume  # continue from the last checkpoint
    python sft.py --status runs/NAME

Writes runs/<run_name>/: config.json, metrics.jsonl, samples.jsonl (greedy answers at each
eval), ckpt/step_XXXXXX/ (meta.json names the parent), done.json.
"""
import argparse
import math
import random
import sys
from dataclasses import replace
from functools import partial
from pathlib import Path

import torch

import chat_stage
import checkpoint
import distributed
import optim
import train_loop
from dataset import chat_rows, check_chat_files, mixture_files, parse_chat_sources
from loader import (
    STAT_KEYS,
    PieceBuffer,
    assign_units,
    chat_loader,
    close_all,
    pack_batch,
    read_footers,
    unit_rows,
)
from model import flops_per_token, num_params

# nanochat's SFT epochs, plus ARC's training questions and identity
DEFAULT_SOURCES = ["smoltalk:1", "mmlu:3", "gsm8k:4", "arc-easy:1", "arc-challenge:1", "identity:2"]
# warm-started at 0.3 of the parent's lrs, warmdown over the second half: on the demo chain it
# forgot far less than a fresh state at full lrs, or nanochat's 0.8 (dev/LOG.md)
SFT_LR_SCALE, SFT_WARMDOWN = 0.3, 0.5
SFT_WHY = "measured on the demo world; nanochat's chat_sft uses 0.8"


def get_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("data")
    g.add_argument("--source", action="append", default=None, metavar="DIR:EPOCHS", help=
                   "a chat directory (or a `prepare.py chat` name, or a .jsonl file of "
                   "conversations in the OpenAI chat format) and how many times one pass of the "
                   "mixture goes over it, repeatable; files named test*/val* are held out "
                   "(default: "
                   f"{' '.join(DEFAULT_SOURCES)}, nanochat's epochs for SmolTalk, MMLU and GSM8K)")
    g.add_argument("--add_source", action="append", default=[], metavar="DIR:EPOCHS", help=
                   "a source added to the --source ones (or the defaults) (default: none)")
    g.add_argument("--chat_dir", default=None, help="one chat directory, once per pass: the same "
                   "as --source DIR:1 (default: the --source mixture)")
    g.add_argument("--seed", type=int, default=0, help="shuffles the conversations, anew every "
                   "epoch (default: %(default)s)")
    budgets = [("epochs", float, "passes over the mixture (default: 1, as nanochat)"),
               ("steps", int, "optimizer steps")]
    chat_stage.add_chat_stage_args(p, g, "sft", ["midtrain", "pretrain"], budgets, eval_every=100,
                                   lr_scale=SFT_LR_SCALE, warmdown_frac=SFT_WARMDOWN, why=SFT_WHY)
    args = train_loop.parse_stage_args(p, argv, ["epochs", "steps"], default=("epochs", 1.0))
    if args.chat_dir and args.source:
        p.error("give --chat_dir or --source, not both")
    try:
        args.sources = parse_chat_sources([f"{args.chat_dir}:1"] if args.chat_dir else
                                          (args.source or DEFAULT_SOURCES) + args.add_source)
    except ValueError as e:
        p.error(str(e))
    return p, args


SAMPLE_ROWS = 1024  # a file's first conversations, rendered to estimate an epoch
SAMPLE_PACKED = 4000  # of those, packed in the mixture's proportions: how full a row gets


def estimate_epoch_batches(args, tokenizer, micro, seq_len, streams):
    """Batches in one pass of the mixture on the fullest stream, estimated (counting would render
    and pack every conversation before step 1): counts from the footers, lengths and skips from
    SAMPLE_ROWS per file, row fill from packing a sample. Returns (batches, the line saying how)."""
    files = mixture_files(args.sources)
    # only renders; bad .jsonl lines render as skipped
    renderer = chat_loader(None, "train", tokenizer, micro, seq_len, files=files[:1], threads=1,
                           skip_bad_rows=True)
    # path: (share kept, mean rendered tokens); the kept ones
    per_file, kept = {}, {}
    footers = read_footers(files)
    for path, footer in footers.items():
        rows, group = [], 0
        while len(rows) < SAMPLE_ROWS and group < footer.num_row_groups:
            rows += chat_rows(path, group)[:SAMPLE_ROWS - len(rows)]
            group += 1
        rendered = [renderer._render(m)[0] if not isinstance(m, str) else "malformed" for m in rows]
        kept[path] = [r for r in rendered if isinstance(r, tuple)]
        per_file[path] = (len(kept[path]) / max(1, len(rendered)),
                          sum(len(ids) for ids, _ in kept[path]) / max(1, len(kept[path])))
    # a sample in the mixture's proportions, fixed seed
    weights = [footers[path].num_rows * per_file[path][0] if kept[path] else 0 for path in files]
    rng = random.Random(0)
    sample = [rng.choice(kept[path]) for path in rng.choices(
            files, weights, k=SAMPLE_PACKED)] if any(weights) else []
    # per stream: rendered tokens kept in one pass
    tokens = [sum(len(unit_rows(unit, footers)) * math.prod(per_file[unit[0]])
                  for unit in assign_units(files, stream, streams,
                                           footers)) for stream in range(streams)]
    stats, buffer, rows, documents = dict.fromkeys(STAT_KEYS, 0), PieceBuffer([]), 0, iter(sample)
    while True:  # packed as in training: how full a row gets
        packed, _ = pack_batch(buffer, documents, 64, seq_len + 1, tokenizer.bos_id, crop=False,
                               buffer_docs=1000,
                               masked=True, stats=stats)
        if not len(packed):
            break
        rows += len(packed)
    fill = 1 - stats["padding"] / max(1, rows * (seq_len + 1))
    batches = max(1, math.ceil(max(tokens) / (fill * (seq_len + 1)) / micro))
    conversations = sum(footers[path].num_rows for path in files)
    return batches, (f"estimated: {conversations:,} conversations in the files' footers, about "
                     f"{sum(tokens) / max(1, conversations):,.0f} tokens each as rendered "
                     f"(measured on {sum(map(len, kept.values())):,}), rows {fill:.1%} full, the "
                     f"fullest of {streams} data streams")


def packing(loaders):
    """Over all ranks: positions trained, supervised and padding shares, skips by reason."""
    reasons = ["no_assistant", "malformed", "empty_content", "too_long", "empty"]
    keys = ["tokens", "supervised", "padding", "batches", *reasons]
    counts = torch.tensor([[loader.state["stats"].get(k, 0) for k in keys] for loader in loaders],
                          dtype=torch.float64)
    totals = distributed.all_reduce_tensor(counts.sum(0)).tolist()
    stats = dict(zip(keys, totals, strict=True))
    positions = stats["tokens"] or 1
    return {"tokens": int(stats["tokens"]), "supervised": stats["supervised"] / positions,
            "padding": stats["padding"] / positions, "skipped": {k: int(stats[k]) for k in reasons}}


def main(argv=None):
    _, args = get_args(argv)
    if args.status:
        return train_loop.print_status(Path(args.status))
    # before the model loads
    val_chat_dir = chat_stage.held_out_dir(args.val_chat_dir, args.sources[0][0])
    rank, local_rank, world, device = distributed.setup_distributed(args.dist_timeout)
    parent, parent_meta, model, tokenizer, inherited, sha256 = checkpoint.load_parent(
        args, "sft", ["midtrain", "pretrain"], device)
    sharding = train_loop.shard_model(model, args, world, device)
    seq_len = args.sequence_len
    # the rows' length; the model keeps the parent's rotary tables
    config = replace(model.config, sequence_len=seq_len)
    run_dir, resume_from = checkpoint.resolve_run(args, "sft")
    micro, accum, source = train_loop.plan_batch(args, config, world, model, device, resume_from,
                                                 parent_meta)
    tokens_per_step = micro * seq_len * world * accum
    optimizers = optim.build_optimizers(model, args, config.n_embd, tokens_per_step, device,
                                        lr_scale=args.lr_scale)

    files = mixture_files(args.sources)
    # bad .jsonl lines: an error now, before any step (--skip_bad_rows: counted)
    skipped = check_chat_files(files, args.skip_bad_rows)
    epoch_batches, estimate = None, None
    if args.epochs:
        epoch_batches, estimate = estimate_epoch_batches(args, tokenizer, micro, seq_len,
                                                         world * accum)
    total_steps = args.steps or math.ceil(args.epochs * epoch_batches)
    # one loader per micro-step, virtual rank rank * accum + j
    loaders = [chat_loader(None, "train", tokenizer, micro, seq_len, files=files,
                           rank=rank * accum + j, world_size=world * accum, device=device,
                           seed=args.seed, threads=train_loop.loader_threads(args, device),
                           skip_bad_rows=args.skip_bad_rows)
               for j in range(accum)]
    record = {"chat_dir": str(args.sources[0][0]),
              "sources": [{"path": str(path), "epochs": epochs} for path, epochs in args.sources],
              "parent": checkpoint.parent_record(parent, parent_meta, sha256.result())}
    layout, run, ckpt_meta = checkpoint.record_run(
        args, "sft", parent_meta["model_config"], seq_len, micro, accum, world, total_steps,
        tokens_per_step, tokenizer, num_params(config), record)
    if rank == 0:
        passes = ", ".join(f"{path} x{epochs}" for path, epochs in args.sources)
        in_epochs = (f" = {args.epochs:g} epochs of about {epoch_batches:,} batches ({estimate}); "
                     f"the loader says when each epoch ends" if args.epochs else "")
        precision = optim.precision_line(args, device, optimizers, run["model_config"]["n_embd"])
        checkpoint.announce(args, run_dir, run, [
            *checkpoint.parent_lines(parent, parent_meta, run["params"], inherited,
                                     (micro, source)),
            sharding, checkpoint.batch_line(micro, seq_len, world, accum),
            f"mixture (passes per epoch): {passes}; tokens per step count the padding", *skipped,
            args.budget_line, f"budget: {total_steps:,} steps{in_epochs}"], precision)
    if resume_from:
        step = checkpoint.resume(resume_from, run_dir, model, optimizers, loaders, layout, rank,
                                 device)
    else:
        step, line = 0, checkpoint.warm_start(parent, parent_meta, model, optimizers, args, device)
        if rank == 0:
            print(line)

    batches = chat_stage.chat_val_batches(val_chat_dir, tokenizer, seq_len, args.eval_rows,
                                          args.skip_bad_rows)
    evaluate = partial(chat_stage.chat_validation, model, tokenizer, batches, args, rank, world,
                       device, run_dir)
    train_model = train_loop.wrap_model(model, args, world, local_rank, device)
    signum = train_loop.train(args, model, train_model, optimizers, loaders, run_dir=run_dir,
                              start=step, total_steps=total_steps, ckpt_meta=ckpt_meta,
                              evaluate=evaluate, flops_per_token=flops_per_token(config),
                              rank=rank, world=world, device=device)
    if signum is None:
        figures = evaluate(total_steps)  # once: a second call reruns the validation
        rows = packing(loaders)  # on every rank: it gathers
        kept = chat_stage.forgetting(model, tokenizer, parent, parent_meta, args, rank, world,
                                     device)
        if rank == 0:
            line = (f"rows: {rows['tokens']:,} token positions, {rows['supervised']:.1%} "
                    f"supervised, {rows['padding']:.1%} padding; conversations skipped: "
                    f"{rows['skipped']}")
            chat_stage.finish(run_dir, total_steps, figures, kept, {"rows": rows}, [line])
    close_all(loaders)
    return signum

if __name__ == "__main__":
    sys.exit(distributed.run_main(main))
