"""Midtraining: a pretrained checkpoint keeps training on a token-share mixture of its pretraining
text and chat-template conversations, packed BOS-aligned (no padding), so it learns the template,
turns and when to stop, and keeps its knowledge.

    python midtrain.py --steps 2000
        # newest pretrain checkpoint; 30% its corpus, 70% conversations and tasks
    python midtrain.py --checkpoint runs/base --source text:data/demo/pretrain:0.3 \\
        --source chat:data/demo/conversations:0.7
    python midtrain.py --source text:data/mine:0.3 --source chat:my_chats.jsonl:0.7 \\
        --val_chat_dir held_out.jsonl
    torchrun --standalone --nproc_per_node=8 midtrain.py --tokens 500000000
    python midtrain.py --run_name NAME --resume  # continue from the last checkpoint
    python midtrain.py --status runs/NAME

Writes runs/<run_name>/: config.json, metrics.jsonl, samples.jsonl (greedy answers per eval),
ckpt/step_XXXXXX/ (meta.json names the parent), done.json (the realized mixture).
"""
import argparse
import math
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
from dataset import CACHE_DIR, chat_files, check_chat_files
from loader import STAT_KEYS, chat_loader, close_all, text_loader, to_device
from model import flops_per_token, num_params

# beside the parent's text (0.3): conversation, chat_eval.py's shapes, and identity
DEFAULT_CHAT_SHARES = [("smoltalk", 0.3), ("ultrachat", 0.1), ("mmlu", 0.15), ("gsm8k", 0.1),
                       ("arc-easy", 0.02), ("arc-challenge", 0.02), ("identity", 0.01)]
# the parent's full lrs, flat, then a linear warmdown over the last 20% (nanochat's): better on
# the demo world and forgot less on real text than a fresh state; half the lrs learned far less
# (dev/LOG.md)
MID_LR_SCALE, MID_WARMDOWN = 1.0, 0.2
MID_WHY = "measured on the demo world and on real text"


# -----------------------------------------------------------------------------
# The mixture: each row from the source furthest below its token share

def check_sources(sources):
    if not sources:
        raise ValueError("a mixture needs at least one source")
    for i, source in enumerate(sources):
        missing = {"name", "kind", "path", "share"} - set(source)
        if missing:
            raise ValueError(f"mixture source {i} ({source}) lacks {', '.join(sorted(missing))}: "
                             "each source is {'name', 'kind': 'text'|'chat', 'path', 'share'}")
        if source["kind"] not in ("text", "chat"):
            raise ValueError(f"mixture source {source['name']!r}: kind={source['kind']!r}: choose "
                             "text or chat")
    shares = {source["name"]: source["share"] for source in sources}
    if len(shares) < len(sources):
        raise ValueError("mixture sources need distinct names, got "
                         f"{[source['name'] for source in sources]}")
    if any(share < 0 for share in shares.values()) or abs(sum(shares.values()) - 1) > 1e-6:
        raise ValueError(f"mixture shares {shares} sum to {sum(shares.values()):.6g}: they must be "
                         "non-negative and sum to 1")


class MixtureLoader:
    """Batches from sources [{"name", "kind": "text"|"chat", "path", "share"}] at token
    shares."""

    def __init__(self, sources, tokenizer, batch_size, seq_len, *, rank=0, world_size=1, device=
                 "cpu", seed=0,
                 supervise="assistant", prefetch=2, name="mixture", **kwargs):
        check_sources(sources)
        self.names, self.targets = [s["name"] for s in sources], [float(s["share"])
                                                                  for s in sources]
        self.B, self.T, self.rank, self.world_size = batch_size, seq_len, rank, world_size
        self.device, self.name, self.batches = torch.device(device), name, 0
        # each source keeps a batch's worth of rows ready (its batches are one row)
        common = {"rank": rank, "world_size": world_size, "seed": seed,
                  "prefetch": prefetch * batch_size, **kwargs}
        make = {"text": text_loader, "chat": partial(chat_loader, pack="crop", supervise=supervise)}
        self.loaders = [make[s["kind"]](s["path"], "train", tokenizer, 1, seq_len, name=s["name"],
                                        **common)
                        for s in sources]

    def __iter__(self):
        return self

    def __next__(self):
        tokens = [loader.state["stats"]["tokens"] for loader in self.loaders]
        rows = []
        for _ in range(self.B):
            # with this row: the first goes to the largest share, not the first listed
            total = sum(tokens) + self.T
            i = max(range(len(tokens)), key=lambda k: self.targets[k] * total - tokens[k])
            rows.append(next(self.loaders[i]))
            tokens[i] = self.loaders[i].state["stats"]["tokens"]
        self.batches += 1
        return to_device(torch.stack([torch.cat([x for x, _ in rows]), torch.cat([
                y for _, y in rows])]), self.device)

    def stop(self):
        for loader in self.loaders:
            loader.stop()

    def close(self, timeout=10):
        close_all([self], timeout)

    @property
    def state(self):
        """The sources' counters summed, shaped like a PackedLoader's state["stats"]."""
        stats = {key: sum(loader.state["stats"][key] for loader in self.loaders)
                 for key in STAT_KEYS}
        return {"stats": {**stats, "batches": self.batches}}

    @property
    def epoch(self):
        """The furthest pass any source is in (0: the first)."""
        return max(loader.epoch for loader in self.loaders)

    def state_dict(self):
        return {"kind": "mixture", "names": list(self.names), "shares": list(self.targets),
                "batches": self.batches,
                "sources": [loader.state_dict() for loader in self.loaders]}

    def load_state_dict(self, sd):
        mine = list(zip(self.names, self.targets))
        saved = list(zip(sd["names"], sd["shares"])) if sd.get("kind") == "mixture" else None
        if saved != mine:
            by = f"the mixture {dict(saved)}" if saved else f"a {sd.get('kind')} loader"
            raise ValueError(f"{self.name} loader: state was saved by {by}, this loader has "
                             f"{dict(mine)}; an exact resume needs the same sources and shares, in "
                             "the same order")
        for loader, state in zip(self.loaders, sd["sources"], strict=True):
            loader.load_state_dict(state)
        self.batches = sd["batches"]

    def mixture(self):
        """{name: {"tokens", "docs", "share" (realized), "target"}}."""
        total = max(1, sum(loader.state["stats"]["tokens"] for loader in self.loaders))
        return {name: {"tokens": loader.state["stats"]["tokens"],
                       "docs": loader.state["stats"]["docs"],
                       "share": loader.state["stats"]["tokens"] / total, "target": target}
                for name, target, loader in zip(self.names, self.targets, self.loaders)}

    def log_line(self):
        parts = []
        for (name, m), loader in zip(self.mixture().items(), self.loaders):
            s = loader.state["stats"]
            supervised = f", supervised {100 * s['supervised'] / s['tokens']:.1f}%" \
                if loader.kind == "chat" and s["tokens"] else ""
            parts.append(f"{name}: {m['tokens']:,} tokens, {m['docs']:,} docs{supervised}, share "
                         f"{100 * m['share']:.1f}% (target {100 * m['target']:.1f}%)")
        head = f"{self.name} loader rank {self.rank}/{self.world_size}: {self.batches:,} batches"
        return "; ".join([head, *parts])


# -----------------------------------------------------------------------------

def get_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("data")
    g.add_argument("--source", action="append", default=None, metavar="KIND:PATH:SHARE", help=
                   "a data source and its share of the tokens, repeatable; KIND is text (a corpus "
                   "directory) or chat (a directory of conversation or task parquet files, or a "
                   ".jsonl file of conversations) (default: "
                   "text:<the parent's data_dir>:0.3, "
                   + ", ".join(f"chat:{CACHE_DIR / 'chat' / name}:{share}" for name,
                               share in DEFAULT_CHAT_SHARES)
                   + ")")
    g.add_argument("--add_source", action="append", default=[], metavar="KIND:PATH:SHARE", help=
                   "a source added to the mixture (the --source ones, or the defaults) at SHARE, "
                   "every other share scaled by 1 - SHARE (default: none)")
    g.add_argument("--supervise", default="all", choices=["all", "assistant"], help=
                   "conversation tokens that carry loss: all of them, as in pretraining, or the "
                   "assistant's only (default: %(default)s, as nanochat midtrains)")
    g.add_argument("--seed", type=int, default=0, help="shuffles each source's documents, anew "
                   "every epoch (default: %(default)s)")
    budgets = [("steps", int, "optimizer steps"), ("tokens", float, "tokens over all ranks")]
    chat_stage.add_chat_stage_args(p, g, "midtrain", ["pretrain"], budgets, eval_every=250,
                                   lr_scale=MID_LR_SCALE, warmdown_frac=MID_WARMDOWN, why=MID_WHY)
    args = train_loop.parse_stage_args(p, argv, ["steps", "tokens"])
    return p, args


def parse_sources(specs, parent_data_dir, added=()):
    """--source values (and --add_source's, scaling the others down) as source dicts."""
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
            raise ValueError(f"--source {spec!r}: write KIND:PATH:SHARE with KIND text or chat and "
                             "0 < SHARE <= 1, e.g. --source chat:data/demo/conversations:0.7")
        sources.append({"name": f"{kind}:{Path(path).name}", "kind": kind, "path": path,
                        "share": share})
    return sources


def realized_mixture(loaders, sources, step, rank):
    """Tokens and documents per source over all loaders and ranks, with shares; rank 0 prints."""
    counts = torch.tensor([[loader.mixture()[s["name"]][key] for key in (
            "tokens", "docs")] for loader in loaders
                           for s in sources], dtype=torch.float64).view(len(loaders), len(sources),
                                                                        2).sum(0)
    counts = distributed.all_reduce_tensor(counts).tolist()
    total = sum(tokens for tokens, _ in counts) or 1
    mixture = {s["name"]: {"tokens": int(tokens), "docs": int(docs), "share": tokens / total,
                           "target": s["share"]}
               for s, (tokens, docs) in zip(sources, counts, strict=True)}
    if rank == 0:
        print(f"mixture at step {step}: " + ", ".join(
            f"{name} {m['share']:.1%} of {m['tokens']:,} tokens (target {m['target']:.0%}), "
            f"{m['docs']:,} documents" for name, m in mixture.items()))
    return mixture


def main(argv=None):
    _, args = get_args(argv)
    if args.status:
        return train_loop.print_status(Path(args.status))
    rank, local_rank, world, device = distributed.setup_distributed(args.dist_timeout)
    parent, parent_meta, model, tokenizer, inherited, sha256 = checkpoint.load_parent(
        args, "midtrain", ["pretrain"], device)
    sharding = train_loop.shard_model(model, args, world, device)
    seq_len = args.sequence_len
    # the rows' length; the model keeps the parent's rotary tables
    config = replace(model.config, sequence_len=seq_len)
    run_dir, resume_from = checkpoint.resolve_run(args, "midtrain")
    micro, accum, source = train_loop.plan_batch(args, config, world, model, device, resume_from,
                                                 parent_meta)
    tokens_per_step = micro * seq_len * world * accum
    optimizers = optim.build_optimizers(model, args, config.n_embd, tokens_per_step, device,
                                        lr_scale=args.lr_scale)

    sources = parse_sources(args.source, parent_meta.get("data_dir"), args.add_source)
    # a .jsonl chat source's bad lines: an error now, before any step (--skip_bad_rows: counted)
    chats = [s["path"] for s in sources if s["kind"] == "chat"]
    skipped = check_chat_files([f for path in chats for f in chat_files(path, "train")],
                               args.skip_bad_rows)
    val_chat_dir = chat_stage.held_out_dir(args.val_chat_dir, chats[0] if chats else None)
    total_steps = args.steps or math.ceil(args.tokens / tokens_per_step)
    # one loader per accumulation micro-step, as virtual rank rank * accum + j
    loaders = [MixtureLoader(sources, tokenizer, micro, seq_len, device=device,
                             rank=rank * accum + j, world_size=world * accum, seed=args.seed,
                             supervise=args.supervise, skip_bad_rows=args.skip_bad_rows,
                             threads=train_loop.loader_threads(args, device))
               for j in range(accum)]
    texts = [s["path"] for s in sources if s["kind"] == "text"]
    record = {"sources": sources, "supervise": args.supervise,
              "data_dir": texts[0] if texts else parent_meta.get("data_dir"),
              "parent": checkpoint.parent_record(parent, parent_meta, sha256.result())}
    layout, run, ckpt_meta = checkpoint.record_run(
        args, "midtrain", parent_meta["model_config"], seq_len, micro, accum, world, total_steps,
        tokens_per_step, tokenizer, num_params(config), record)
    if rank == 0:
        mixture = ", ".join(f"{s['name']} {s['share']:.0%} ({s['path']})" for s in sources)
        precision = optim.precision_line(args, device, optimizers, run["model_config"]["n_embd"])
        checkpoint.announce(args, run_dir, run, [
            *checkpoint.parent_lines(parent, parent_meta, run["params"], inherited,
                                     (micro, source)),
            sharding, checkpoint.batch_line(micro, seq_len, world, accum),
            f"mixture (share of tokens): {mixture}; loss on {args.supervise} conversation tokens",
            *skipped, args.budget_line,
            f"budget: {total_steps:,} steps, {total_steps * tokens_per_step:,} tokens"], precision)
    if resume_from:
        step = checkpoint.resume(resume_from, run_dir, model, optimizers, loaders, layout, rank,
                                 device)
    else:
        step, line = 0, checkpoint.warm_start(parent, parent_meta, model, optimizers, args, device)
        if rank == 0:
            print(line)

    batches = chat_stage.chat_val_batches(val_chat_dir, tokenizer, seq_len, args.eval_rows,
                                          args.skip_bad_rows)

    def evaluate(step):  # on every rank: it gathers
        figures = chat_stage.chat_validation(model, tokenizer, batches, args, rank, world, device,
                                             run_dir, step)
        return {**figures, "mixture": realized_mixture(loaders, sources, step, rank)}
    train_model = train_loop.wrap_model(model, args, world, local_rank, device)
    signum = train_loop.train(args, model, train_model, optimizers, loaders, run_dir=run_dir,
                              start=step, total_steps=total_steps, ckpt_meta=ckpt_meta,
                              evaluate=evaluate, flops_per_token=flops_per_token(config),
                              rank=rank, world=world, device=device)
    if signum is None:
        figures = evaluate(total_steps)  # once: each call reruns the validation
        kept = chat_stage.forgetting(model, tokenizer, parent, parent_meta, args, rank, world,
                                     device)
        if rank == 0:
            realized = ", ".join(f"{name} {m['tokens']:,} tokens ({m['share']:.1%}, target "
                                 f"{m['target']:.0%}), {m['docs']:,} documents"
                                 for name, m in figures["mixture"].items())
            chat_stage.finish(run_dir, total_steps, figures, kept, {},
                              [f"mixture realized: {realized}"])
    close_all(loaders)
    return signum


if __name__ == "__main__":
    sys.exit(distributed.run_main(main))
