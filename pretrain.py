"""Pretraining: a GPT from model.py on a corpus from dataset.py, tokenized by tokenizer.py.

    python pretrain.py --data_dir data/demo/pretrain --steps 400                   # one process
    torchrun --standalone --nproc_per_node=8 pretrain.py --preset d20 --tokens_per_param 20
    python pretrain.py --run_name NAME --resume                                    # continue
    python pretrain.py --status runs/NAME                                          # its progress

Writes runs/<run_name>/: config.json, metrics.jsonl (every step), samples.jsonl (every eval),
ckpt/step_XXXXXX/, done.json (the final figures).
"""
import argparse
import json
import math
import os
import re
import sys
from contextlib import suppress
from dataclasses import asdict
from functools import partial
from pathlib import Path

import torch

import checkpoint
import distributed
import optim
import train_loop
from dataset import FINEWEB, default_data_dir, open_parquet, read_row_group, split_shards
from loader import close_all, text_loader, val_rows
from model import (
    add_model_args,
    autocast_context,
    budget_params,
    build_model,
    check_master_weights,
    config_from_args,
    flops_per_token,
    num_params,
    param_breakdown,
    parse_bool,
)
from tokenizer import Tokenizer

PROMPTS = ["The capital of", "Once upon a time,", "Two plus three is", ("The first day of the week "
            "is")]


def get_args(argv=None):
    cuda = torch.cuda.is_available()
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p, default_preset="d20" if cuda else "tiny")
    g = p.add_argument_group("data")
    g.add_argument("--data_dir", default=str(default_data_dir(FINEWEB)),
                   help="corpus directory (default: %(default)s)")
    g.add_argument("--tokenizer", default="runs/tokenizer", help="tokenizer directory (default: "
                   "%(default)s)")
    g.add_argument("--seed", type=int, default=0, help="init seed, the same on every rank "
                   "(default: %(default)s)")
    g.add_argument("--data_plan", action="store_true", help="print the training shards the budget "
                   "needs (by the tokens of --data_dir's first shard) and exit; needs "
                   "--total_batch_tokens (default: off)")
    train_loop.add_loader_threads_arg(g)
    g = p.add_argument_group("budget: one of; given several, the last one is in force")
    train_loop.add_budget_args(g, [("steps", int, "optimizer steps"),
                                   ("target_flops", float, ("total training FLOPs (model.py's "
                                     "FLOPs/token x tokens)")),
                                   ("tokens_per_param", float, ("tokens per parameter, "
                                                                 "value-embedding tables not "
                                                                 "counted (Chinchilla: 20)"))])
    g = p.add_argument_group("batch and precision")
    g.add_argument("--total_batch_tokens", type=int, default=None, help="tokens per optimizer step "
                   "over all ranks (default: micro_batch x sequence_len x world size, no "
                   "accumulation)")
    g.add_argument("--check_batch", type=int, default=0, metavar="N", help=
                   "check that --total_batch_tokens splits over N processes x --sequence_len (x "
                   "--micro_batch when given) and, without CUDA, that N CPU processes fit in "
                   "memory, and exit (default: off)")
    train_loop.add_micro_batch_arg(g)
    g.add_argument("--dtype", default=None, choices=["bfloat16", "float32"], help=
                   "compute dtype (autocast); weights stay fp32 (default: bfloat16 on a GPU that "
                   "supports it; on the CPU the faster of the two, measured once, fp32 where bf16 "
                   "is emulated)")
    g.add_argument("--compile", type=parse_bool, default=cuda, help="torch.compile the model "
                   "(default: %(default)s)")
    g = p.add_argument_group("evaluation")
    g.add_argument("--eval_every", type=int, default=250, help="validation bpb + samples every N "
                   "steps; 0 = only at the end (default: %(default)s)")
    g.add_argument("--bpb_tokens", type=int, default=2 ** 20, help="validation tokens per "
                   "evaluation: the split's first N, in BOS-led rows (default: %(default)s)")
    g.add_argument("--sample_prompt", action="append", default=None, help=
                   f"sample prompt, repeatable (default: {PROMPTS})")
    checkpoint.add_run_args(p, "pretrain")
    p.add_argument("--final_checkpoint", type=parse_bool, default=True, help=
                   "save a checkpoint at the last step; false: only the --ckpt_every ones (a "
                   "benchmark) (default: %(default)s)")
    optim.add_schedule_args(p)
    args = train_loop.parse_stage_args(p, argv, ["steps", "target_flops", "tokens_per_param"])
    if args.matrix_lr is None:
        args.matrix_lr = 0.02 if args.optimizer == "muon" else 0.003
    return p, args


# in a corpus directory: {tokenizer fingerprint: {shard name: [tokens, docs]}}
TOKEN_COUNTS = ".token_counts.json"


def shard_tokens(path, tokenizer):
    """(tokens, documents) of a shard as trained on (each document plus BOS), counted once per
    tokenizer."""
    path = Path(path)
    cache = path.parent / TOKEN_COUNTS
    key = tokenizer.fingerprint()
    try:
        counts = json.loads(cache.read_text())
    except (OSError, ValueError):
        counts = {}
    if path.name in counts.get(key, {}):
        return tuple(counts[key][path.name])
    tokens = docs = 0
    for index in range(open_parquet(path).num_row_groups):
        texts = [t for t in read_row_group(path, index) if t]
        tokens += sum(len(ids) + 1 for ids in tokenizer.encode_batch(texts,
                                                                     num_threads=os.cpu_count()))
        docs += len(texts)
    counts.setdefault(key, {})[path.name] = [tokens, docs]
    tmp = cache.with_name(cache.name + f".{os.getpid()}.tmp")
    try:
        tmp.write_text(json.dumps(counts))
        os.replace(tmp, cache)
    except OSError:  # a read-only corpus: counted again next time
        tmp.unlink(missing_ok=True)
    return tokens, docs


def corpus_budget(data_dir, tokenizer, budget_tokens):
    """A training split against a token budget: shards, docs, tokens (estimated from the first
    shard), epochs."""
    train = split_shards(data_dir, "train")
    tokens0, docs0 = shard_tokens(train[0], tokenizer)
    docs = sum(open_parquet(p).metadata.num_rows for p in train)
    per_doc = tokens0 / max(1, docs0)
    tokens = int(per_doc * docs)
    fineweb = Path(data_dir).resolve() == default_data_dir(FINEWEB).resolve()
    return {"shards": len(train), "docs": docs, "measured_shard": train[0].name, "fineweb": fineweb,
            "tokens_per_doc": per_doc,
            "tokens_per_shard": tokens0, "tokens": tokens, "epochs": budget_tokens / max(1, tokens)}


def budget_line(b, budget_tokens):
    """The data line: budget against corpus, and whether data repeats."""
    line = (f"data: budget {budget_tokens:,} tokens; corpus {b['shards']} training shards, "
            f"{b['docs']:,} documents x {b['tokens_per_doc']:,.0f} tokens (the mean of "
            f"{b['measured_shard']}, counted with this tokenizer) = ~{b['tokens']:,} tokens: "
            f"{b['epochs']:.2f} epochs")
    if b["epochs"] > 1:
        shards = math.ceil(budget_tokens / max(1, b["tokens_per_shard"])) + 1
        # only FineWeb-Edu's directory is prepare.py's to fill
        more = (f"more shards: `python prepare.py shards --shards N`; N ~ {shards}" if b["fineweb"]
                else "fewer --steps, or more text in the corpus")
        line += f". This run REPEATS data: {b['epochs']:.2f} passes over the corpus ({more})"
    return line


def data_plan(args, config, tokenizer):
    """--data_plan: shards, steps and checkpoint bytes for a budget, to <runs_dir>/data_plan.json
    (speedrun.sh's and the gpu plan's)."""
    if not args.total_batch_tokens:
        raise ValueError("--data_plan needs --total_batch_tokens (the tokens per step the run will "
                         "use)")
    steps = plan_steps(args, config, args.total_batch_tokens)
    print(args.budget_line)
    budget = steps * args.total_batch_tokens
    first = split_shards(args.data_dir, "train")[0]
    per_shard, docs = shard_tokens(first, tokenizer)
    # one spare: the other shards' documents vary a little in length
    shards = math.ceil(budget / per_shard) + 1
    print(f"data plan: budget {steps:,} steps x {args.total_batch_tokens:,} tokens = {budget:,} "
          f"tokens; {per_shard:,} tokens in {first.name} ({docs:,} documents, counted with this "
          "tokenizer)")
    epochs = None
    # your own corpus (prepare.py ingest): all here
    if (ingested := Path(args.data_dir, "ingest.json")).is_file():
        record = json.loads(ingested.read_text())
        train_docs = record["documents"] - record["val_documents"]
        epochs = budget / (per_shard * train_docs / docs)
        print(f"data plan: your corpus: about {per_shard * train_docs / docs:,.0f} training tokens "
              f"({train_docs:,} documents), so the budget is {epochs:.2f} epochs of it" + (
                  ": pretraining repeats its documents (it says so at each pass); fewer steps: "
                  "PRETRAIN_ARGS=--steps N" if epochs > 1 else ""))
    out = Path(args.runs_dir) / "data_plan.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    # what the gpu plan's disk check counts checkpoints by
    out.write_text(json.dumps({"shards": shards, "budget_tokens": budget,
                               "first_shard_tokens": per_shard,
                               "steps": steps, "tokens_per_step": args.total_batch_tokens,
                               "step_cap": args.steps,
                               "ckpt_every": args.ckpt_every, "keep": args.keep,
                               "params": num_params(config),
                               "checkpoint_bytes": checkpoint_bytes(config, args.optimizer),
                               "data_dir": str(Path(args.data_dir).resolve()),
                               "runs_dir": str(Path(args.runs_dir).resolve()), "epochs": epochs}))
    print(f"data plan: {shards} training shards ({out})")


def checkpoint_bytes(config, optimizer):
    """Bytes of one checkpoint: fp32 weights (4 a parameter), AdamW's moments (8); for the block
    matrices with Muon, its momentum (4)."""
    counts = param_breakdown(config)
    matrices = counts["attention"] + counts["mlp"]
    return 4 * counts["total"] + 8 * (counts["total"] - matrices) + (4 if optimizer == "muon"
                                                                     else 8) * matrices


def plan_steps(args, config, tokens_per_step):
    if args.steps is not None:
        return args.steps
    if args.target_flops is not None:
        return math.ceil(args.target_flops / (flops_per_token(config) * tokens_per_step))
    return math.ceil(args.tokens_per_param * budget_params(config) / tokens_per_step)


# -----------------------------------------------------------------------------
# --check_batch: checked before any process starts

def check_batch_divides(total, seq_len, world, micro=0):
    """The line saying what a step is, else a ValueError naming process counts and totals that
    work."""
    used = train_loop.nearest_batch(total, seq_len, world, micro)
    if used not in (None, total):
        return train_loop.batch_line(total, used, seq_len, world, micro)
    sequences = total // (seq_len * world)
    if used and micro:
        return (f"batch: {total:,} tokens a step = micro-batch {micro} x sequence {seq_len:,} x "
                f"{train_loop.processes(world)} x {sequences // micro} accumulation steps")
    if used:
        return (f"batch: {total:,} tokens a step = {sequences} sequences x sequence {seq_len:,} x "
                f"{train_loop.processes(world)} (a process's {sequences}: micro-batch x "
                "accumulation steps, the micro-batch chosen when pretraining starts)")
    unit = (micro or 1) * seq_len * world
    micro_x = f"micro_batch {micro} x " if micro else ""
    what = f"{micro_x}sequence_len {seq_len} x {train_loop.processes(world)} = {unit:,}"
    counts = [str(n) for n in range(1, world) if total % ((micro or 1) * seq_len * n) == 0]
    lo, hi = total // unit * unit, (total // unit + 1) * unit
    fixes = [f"--gpus {', '.join(counts[:-1])} or {counts[-1]}" if len(counts) > 1 else "--gpus "
             f"{counts[0]}"] \
        if counts else []
    fixes.append(f"PRETRAIN_ARGS=\"--total_batch_tokens {lo or hi}\"" + (f" (or {hi})" if lo
                                                                         else "")
                 + f" with {world} processes")
    raise ValueError(f"--total_batch_tokens {total:,} is not a multiple of "
                     f"{what}{'' if micro else ': no micro-batch fits'}, so pretraining would fail "
                     f"at its start. Use {', or '.join(fixes)}")


def available_memory():
    with suppress(OSError, StopIteration):
        lines = Path("/proc/meminfo").read_text().splitlines()
        return next(int(line.split()[1]) * 1024 for line in lines
                    if line.startswith("MemAvailable:"))
    return train_loop.machine_memory()


def cpu_processes_fit(config, args, nproc, capacity):
    """(fits in capacity bytes, a rank's peak, how) for nproc CPU processes."""
    estimate = train_loop.step_estimate(config, args, args.micro_batch or 1, "cpu")
    whole = train_loop.rank_memory(config, estimate, nproc, False, "cpu")
    sharded = nproc > 1 and (args.fsdp == "true" or
                             (args.fsdp == "auto" and whole > capacity / nproc))
    peak = train_loop.rank_memory(config, estimate, nproc, True, "cpu") if sharded else whole
    how = "FSDP2" if sharded else "DDP" if nproc > 1 else "one process"
    # a tenth spare: the estimate's error against measured peaks
    return nproc * peak * 1.1 <= capacity, peak, how


def check_cpu_memory(args, nproc):
    """The line saying what each CPU process will hold, or a ValueError naming a fit."""
    def config_for(preset):
        return config_from_args(argparse.Namespace(**{**vars(args), "preset": preset}))
    config = config_for(args.preset)
    capacity = available_memory()  # read once: every plan below is weighed against it
    fits, peak, how = cpu_processes_fit(config, args, nproc, capacity)
    fmt_bytes = distributed.fmt_bytes
    said = (f"{train_loop.processes(nproc)} on this CPU x about {fmt_bytes(peak)} each at its peak "
            f"({how}, micro-batch {args.micro_batch or 1}) = {fmt_bytes(nproc * peak)}, of "
            f"{fmt_bytes(capacity)} available now")
    if fits:
        return f"memory: {said}"
    fixes = []
    depth = int(args.preset[1:]) if re.fullmatch(r"d\d+", args.preset) else 0
    smaller = next((d for d in range(depth - 1, 0, -1)
                    if cpu_processes_fit(config_for(f"d{d}"), args, nproc, capacity)[0]), None)
    if smaller:
        fixes.append(f"--depth {smaller}")
    fewer = next((n for n in range(nproc - 1, 0, -1)
                  if cpu_processes_fit(config, args, n, capacity)[0]), None)
    if fewer:
        fixes.append(f"--gpus {fewer}")
    fix = " or ".join(fixes) if fixes else "a machine with more memory"
    raise ValueError(f"{said}: they would not fit with a tenth to spare, and the out-of-memory "
                     f"killer would end a rank. Rehearse with {fix}")


@torch.no_grad()
def greedy_completion(model, ids, new_tokens, dtype, device):
    """Greedy tokens, the whole row again each step: for a few short samples cheaper than a KV
    cache."""
    row = torch.tensor([ids], device=device)
    for _ in range(new_tokens):
        with autocast_context(device.type, dtype):
            logits = model(row, last_only=True)
        row = torch.cat([row, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return row[0, len(ids):].tolist()


@torch.no_grad()
def evaluate(model, tokenizer, args, rank, world, device, run_dir, val_rows, step):
    """Validation bits per byte and greedy samples; prints and returns the metrics fields."""
    bpb, _ = train_loop.val_bpb(model, val_rows, tokenizer.token_bytes, 8, args.dtype, rank, world,
                                device)
    if rank == 0 or distributed.is_sharded(model):  # a sharded model is gathered by every rank
        samples = []
        for prompt in args.sample_prompt or PROMPTS:
            ids = [tokenizer.bos_id, *tokenizer.encode(prompt)]
            new_tokens = min(32, model.config.sequence_len - len(ids))
            completion = greedy_completion(model, ids, new_tokens, args.dtype, device)
            samples.append({"step": step, "prompt": prompt,
                            "completion": tokenizer.decode(completion)})
    if rank == 0:
        distributed.append_jsonl(run_dir / "samples.jsonl", *samples)
        print(f"eval step {step}: val bpb {bpb:.4f}; " + " | ".join(f"{s['prompt']!r} -> "
                                                                    f"{s['completion']!r}"
                                                                   for s in samples))
    return {"val_bpb": bpb}


def main(argv=None):
    parser, args = get_args(argv)
    if args.status:
        return train_loop.print_status(Path(args.status))
    if args.check_batch:
        config = config_from_args(args)
        print(check_batch_divides(args.total_batch_tokens
                                             or config.sequence_len * args.check_batch,
                                             config.sequence_len, args.check_batch,
                                             args.micro_batch))
        if not torch.cuda.is_available():  # the processes are CPU processes sharing its memory
            print(check_cpu_memory(args, args.check_batch))
        return None
    rank, local_rank, world, device = distributed.setup_distributed(args.dist_timeout)
    master = rank == 0
    tokenizer = Tokenizer.load(args.tokenizer)
    if args.vocab_size not in (None, tokenizer.vocab_size):
        parser.error(f"--vocab_size {args.vocab_size} differs from the tokenizer's "
                     f"{tokenizer.vocab_size}")
    args.vocab_size = tokenizer.vocab_size
    try:
        config = config_from_args(args)
    except ValueError as e:
        parser.error(str(e))
    if args.data_plan:
        return data_plan(args, config, tokenizer)
    args.dtype = args.dtype or distributed.matmul_dtype(device, config.n_embd)
    torch.manual_seed(args.seed)
    model = build_model(config, device)
    check_master_weights(model)
    sharding = train_loop.shard_model(model, args, world, device)
    run_dir, resume_from = checkpoint.resolve_run(args, "pretrain")
    micro, accum, _ = train_loop.plan_batch(args, config, world, model, device, resume_from)
    seq_len, params, fpt = config.sequence_len, num_params(config), flops_per_token(config)
    counted = budget_params(config)  # what --tokens_per_param counts
    tokens_per_step = micro * seq_len * world * accum
    total_steps = plan_steps(args, config, tokens_per_step)
    optimizers = optim.build_optimizers(model, args, config.n_embd, tokens_per_step, device)
    # one loader per micro-step, virtual rank rank * accum + j: the same rows at any split
    loaders = [text_loader(args.data_dir, "train", tokenizer, micro, seq_len, rank=rank * accum + j,
                           world_size=world * accum, device=device,
                           threads=train_loop.loader_threads(args, device))
               for j in range(accum)]
    # does the corpus hold the budget? (rank 0 counts)
    budget = total_steps * tokens_per_step
    data = corpus_budget(args.data_dir, tokenizer, budget) if master else None
    layout, run, ckpt_meta = checkpoint.record_run(args, "pretrain", asdict(config), seq_len, micro,
                                             accum, world,
                                             total_steps, tokens_per_step, tokenizer, params,
                                             {"data": data, "data_dir": args.data_dir})
    if master:
        precision = optim.precision_line(args, device, optimizers, run["model_config"]["n_embd"])
        checkpoint.announce(args, run_dir, run, [
            f"model: {args.preset}, params: {params}; FLOPs/token {fpt:.4e}", sharding,
            checkpoint.batch_line(micro, seq_len, world, accum), args.budget_line,
            (f"budget: {total_steps:,} steps, {budget:,} tokens, "
             f"{fpt * total_steps * tokens_per_step:.3e} FLOPs, "
             f"{total_steps * tokens_per_step / counted:.2f} tokens per parameter (value-embedding "
             "tables not counted)"), budget_line(data, budget)],
            precision)
    start = (checkpoint.resume(resume_from, run_dir, model, optimizers, loaders, layout, rank,
                               device) if resume_from
             else 0)

    train_model = train_loop.wrap_model(model, args, world, local_rank, device)
    rows = val_rows(args.data_dir, tokenizer, args.bpb_tokens, seq_len)
    evaluator = partial(evaluate, model, tokenizer, args, rank, world, device, run_dir, rows)
    signum = train_loop.train(args, model, train_model, optimizers, loaders, run_dir=run_dir,
                              start=start,
                              total_steps=total_steps, ckpt_meta=ckpt_meta, evaluate=evaluator,
                              flops_per_token=fpt, rank=rank, world=world, device=device)
    if signum is None:
        bpb = evaluator(total_steps)["val_bpb"]
        if master:
            distributed.append_jsonl(run_dir / "metrics.jsonl", {"step": total_steps,
                                                            "final_val_bpb": bpb})
            (run_dir / "done.json").write_text(json.dumps({"step": total_steps, "val_bpb": bpb}))
            print(f"done: {total_steps} steps, val bpb {bpb:.4f}, run dir {run_dir}")
    close_all(loaders)
    return signum


if __name__ == "__main__":
    sys.exit(distributed.run_main(main))
