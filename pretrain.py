"""Pretraining: a GPT from model.py on a corpus from dataset.py, tokenized by tokenizer.py.

    python pretrain.py --data_dir data/demo/pretrain --steps 400                   # one process (CPU or one GPU)
    torchrun --standalone --nproc_per_node=8 pretrain.py --preset d20 --tokens_per_param 20
    python pretrain.py --run_name NAME --resume                                    # continue from the last checkpoint
    python pretrain.py --status runs/NAME                                          # a live or finished run

Writes runs/<run_name>/: config.json, metrics.jsonl (every step), samples.jsonl (every eval), ckpt/step_XXXXXX/.
"""
import argparse
import json
import math
import os
import signal
import sys
import time
from contextlib import nullcontext
from dataclasses import asdict
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import common as C
from dataset import default_data_dir, text_loader
from model import (
    add_model_args,
    autocast_context,
    build_model,
    check_master_weights,
    config_from_args,
    flops_per_token,
    generate,
    num_params,
    parse_args,
    parse_bool,
)
from tokenizer import Tokenizer

PROMPTS = ["The capital of", "Once upon a time,", "Two plus three is", "The first day of the week is"]


def get_args(argv=None):
    cuda = torch.cuda.is_available()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p, default_preset="d20" if cuda else "tiny")
    g = p.add_argument_group("run and data")
    g.add_argument("--run_name", default=None, help="outputs go to runs/<run_name>/ (default: pretrain_<preset>_<time>; not "
                   "--run, which torchrun would take for its own --run-path)")
    g.add_argument("--runs_dir", default="runs", help="where runs live (default: %(default)s)")
    g.add_argument("--data_dir", default=str(default_data_dir("karpathy/fineweb-edu-100b-shuffle")),
                   help="corpus directory (default: %(default)s)")
    g.add_argument("--tokenizer", default="runs/tokenizer", help="tokenizer directory (default: %(default)s)")
    g.add_argument("--seed", type=int, default=0, help="init seed, the same on every rank (default: %(default)s)")
    g = p.add_argument_group("budget: exactly one of")
    budget = g.add_mutually_exclusive_group()
    budget.add_argument("--steps", type=int, help="optimizer steps")
    budget.add_argument("--target_flops", type=float, help="total training FLOPs (model.py's FLOPs/token x tokens)")
    budget.add_argument("--tokens_per_param", type=float, help="tokens per parameter (Chinchilla: 20)")
    g = p.add_argument_group("batch and precision")
    g.add_argument("--total_batch_tokens", type=int, default=None, help="tokens per optimizer step over all ranks "
                   "(default: micro_batch x sequence_len x world size, no accumulation)")
    g.add_argument("--micro_batch", type=int, default=0, help="sequences per rank per forward; 0 = find the largest "
                   "that fits on CUDA (on CPU: the whole per-rank batch) (default: %(default)s)")
    g.add_argument("--dtype", default="bfloat16" if cuda else "float32", choices=["bfloat16", "float32"],
                   help="compute dtype; weights stay fp32 (default: %(default)s)")
    g.add_argument("--compile", type=parse_bool, default=cuda, help="torch.compile the model (default: %(default)s)")
    g = p.add_argument_group("evaluation, checkpoints, health")
    g.add_argument("--eval_every", type=int, default=250, help="validation bpb + samples every N steps; 0 = only at "
                   "the end (default: %(default)s)")
    g.add_argument("--eval_tokens", type=int, default=2 ** 20, help="validation tokens per evaluation: the split's "
                   "first N (default: %(default)s)")
    g.add_argument("--prompt", action="append", default=None, help=f"sample prompt, repeatable (default: {PROMPTS})")
    g.add_argument("--ckpt_every", type=int, default=500, help="checkpoint every N steps (default: %(default)s)")
    g.add_argument("--keep", type=int, default=3, help="checkpoints kept (default: %(default)s)")
    g.add_argument("--resume", nargs="?", const="latest", default=None, help="continue from the latest checkpoint of "
                   "--run_name (or of the newest run), or from the checkpoint directory given")
    g.add_argument("--frozen_check_step", type=int, default=10, help="steps after the start at which unchanged "
                   "parameters are named (default: %(default)s)")
    g.add_argument("--health_every", type=int, default=50, help="log update/parameter RMS ratios every N steps "
                   "(default: %(default)s)")
    g.add_argument("--log_every", type=int, default=10, help="progress line every N steps (default: %(default)s)")
    g.add_argument("--wandb", default=None, help="wandb project to log to (needs `pip install wandb`)")
    g.add_argument("--status", default=None, metavar="RUN_DIR", help="print a run's status and exit")
    g.add_argument("--inject_nan_step", type=int, default=-1, help="testing: poison the loss at this step (steps "
                   "count from 1, as logged)")
    g.add_argument("--kill_at_step", type=int, default=-1, help="testing: SIGKILL this run's process group after "
                   "this step (a machine dying mid-run)")
    g.add_argument("--signal_at_step", type=int, default=-1, help="testing: SIGTERM this process after this step")
    C.add_schedule_args(p)
    args = parse_args(p, argv)
    if args.status is None and sum(x is not None for x in (args.steps, args.target_flops, args.tokens_per_param)) != 1:
        p.error("give exactly one budget: --steps, --target_flops or --tokens_per_param")
    if args.matrix_lr is None:
        args.matrix_lr = 0.02 if args.optimizer == "muon" else 0.003
    return p, args


def find_micro_batch(try_step, candidates):
    """The largest candidate for which try_step(micro_batch) does not run out of CUDA memory."""
    for micro in sorted(candidates, reverse=True):
        try:
            try_step(micro)
            return micro
        except torch.OutOfMemoryError:
            torch.cuda.empty_cache()
    raise SystemExit(f"even micro_batch={min(candidates)} runs out of memory: lower --sequence_len, use "
                     f"--activation_checkpointing true, or a smaller model")


def plan_batch(args, config, world, model, device):
    """(micro_batch, accumulation steps) for --total_batch_tokens; the error names the nearest valid values."""
    T = config.sequence_len
    total = args.total_batch_tokens
    if args.micro_batch == 0:
        per_rank = (total // (T * world)) if total else 8
        candidates = [m for m in range(1, max(1, per_rank) + 1) if per_rank % m == 0]
        if device.type == "cuda":
            def try_step(micro):
                idx = torch.randint(0, config.vocab_size, (micro, T), device=device)
                with autocast_context("cuda", args.dtype):
                    model(idx, idx).backward()
                model.zero_grad(set_to_none=True)
            micro = find_micro_batch(try_step, candidates)
            micro = int(C.all_reduce(micro, dist.ReduceOp.MIN if dist.is_initialized() else None))
            print(f"batch: micro_batch {micro} is the largest that fits on every rank (probed)")
        else:
            micro = max(candidates)
    else:
        micro = args.micro_batch
    step_unit = micro * T * world
    total = total or step_unit
    if total % step_unit:
        lo, hi = total // step_unit * step_unit, (total // step_unit + 1) * step_unit
        raise SystemExit(f"--total_batch_tokens {total} is not a multiple of micro_batch {micro} x sequence_len {T} x "
                         f"world size {world} = {step_unit}: nearest valid values are {lo or hi} and {hi}")
    return micro, total // step_unit


def plan_steps(args, config, tokens_per_step):
    if args.steps is not None:
        return args.steps
    if args.target_flops is not None:
        return math.ceil(args.target_flops / (flops_per_token(config) * tokens_per_step))
    return math.ceil(args.tokens_per_param * num_params(config) / tokens_per_step)


@torch.no_grad()
def evaluate(model, tokenizer, args, config, rank, world, device, step, run_dir, val_stream):
    """Validation bits per byte (common.val_bpb: the first --eval_tokens of the split, the same figure core_eval.py
    reports) and greedy samples."""
    bpb, _ = C.val_bpb(model, val_stream, tokenizer.token_bytes, config.sequence_len, 8, args.dtype, rank, world,
                       device)
    samples = []
    model.eval()
    if rank == 0:
        for prompt in args.prompt or PROMPTS:
            ids = [tokenizer.bos_id, *tokenizer.encode(prompt)]
            out = list(generate(model, ids, min(32, config.sequence_len - len(ids)), temperature=0, dtype=args.dtype))
            samples.append({"step": step, "prompt": prompt, "completion": tokenizer.decode(out)})
        with open(run_dir / "samples.jsonl", "a") as f:
            f.writelines(json.dumps(s) + "\n" for s in samples)
    model.train()
    return bpb, samples


def newest_run(runs_dir):
    newest = C.newest_checkpoint(runs_dir, stage="pretrain")
    if newest is None:
        raise SystemExit(f"--resume: no pretraining checkpoint under {runs_dir}/*/ckpt/")
    return newest.parent.parent.name


def main(argv=None):
    parser, args = get_args(argv)
    if args.status:
        return print_status(Path(args.status))
    rank, local_rank, world, device = C.setup_distributed()
    master = rank == 0
    tokenizer = Tokenizer.load(args.tokenizer)
    if args.vocab_size not in (None, tokenizer.vocab_size):
        parser.error(f"--vocab_size {args.vocab_size} differs from the tokenizer's {tokenizer.vocab_size}")
    args.vocab_size = tokenizer.vocab_size
    try:
        config = config_from_args(args)
    except ValueError as e:
        parser.error(str(e))
    torch.manual_seed(args.seed)
    model = build_model(config, device)
    check_master_weights(model)
    micro, accum = plan_batch(args, config, world, model, device)
    T, P = config.sequence_len, num_params(config)
    tokens_per_step = micro * T * world * accum
    total_steps = plan_steps(args, config, tokens_per_step)

    if args.resume not in (None, "latest"):  # a checkpoint path: runs_dir/run_name/ckpt/step_XXXXXX
        args.runs_dir, args.run_name = str(Path(args.resume).parent.parent.parent), Path(args.resume).parent.parent.name
    elif args.resume and args.run_name is None:
        args.run_name = newest_run(args.runs_dir)
    args.run_name = args.run_name or f"pretrain_{args.preset}_{time.strftime('%Y%m%d_%H%M%S')}"
    run_dir = Path(args.runs_dir) / args.run_name
    optimizers = C.build_optimizers(model, args, config.n_embd, tokens_per_step, device)
    # one loader per accumulation micro-step, as virtual rank rank*accum + j of world*accum: the rows of a global
    # batch are the same however it is split into processes and micro-steps
    loaders = [text_loader(args.data_dir, "train", tokenizer, micro, T, rank=rank * accum + j,
                           world_size=world * accum, device=device) for j in range(accum)]
    start = 0
    if args.resume:
        found = C.list_checkpoints(run_dir / "ckpt")
        if args.resume == "latest" and not found:
            raise SystemExit(f"--resume: {run_dir}/ckpt has no checkpoint yet")
        path = found[-1] if args.resume == "latest" else Path(args.resume)
        ckpt = C.load_checkpoint(path, rank, device)
        meta = ckpt["meta"]
        for key, mine in (("model_config", asdict(config)), ("world_size", world), ("micro_batch", micro),
                          ("accum", accum)):
            if meta[key] != mine:
                raise SystemExit(f"--resume {path}: its {key} is {meta[key]}, this run's is {mine}: resume with the "
                                 f"same settings (the command is in {run_dir}/config.json)")
        model.load_state_dict(ckpt["model"])
        for opt, state in zip(optimizers, ckpt["optimizers"], strict=True):
            opt.load_state_dict(state)
        for loader, state in zip(loaders, ckpt["rank"]["loader"], strict=True):
            loader.load_state_dict(state)
        C.set_rng_state(ckpt["rank"]["rng"])
        start = meta["step"]
        if master:
            C.truncate_metrics(run_dir / "metrics.jsonl", start)
            print(f"resume: from {path} at step {start}")
    if master:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.json").write_text(json.dumps({"stage": "pretrain", "argv": sys.argv, "args": vars(args),
                                                         "model_config": asdict(config), "world_size": world,
                                                         "micro_batch": micro, "accum": accum,
                                                         "total_steps": total_steps, "versions": C.versions()},
                                                        indent=1))
        print(f"model: {args.preset}, params: {P}; FLOPs/token {flops_per_token(config):.4e}")
        print(f"batch: tokens per step = micro_batch {micro} x sequence_len {T} x world size {world} x accumulation "
              f"{accum} = {tokens_per_step:,}")
        print(f"budget: {total_steps:,} steps, {total_steps * tokens_per_step:,} tokens, "
              f"{flops_per_token(config) * total_steps * tokens_per_step:.3e} FLOPs, "
              f"{total_steps * tokens_per_step / P:.2f} tokens per parameter")

    train_model = DDP(model, device_ids=[local_rank] if device.type == "cuda" else None) if world > 1 else model
    if args.compile:
        train_model = torch.compile(train_model)  # after DDP, not before (seed 004)
    metrics = C.Metrics(run_dir / "metrics.jsonl", master)
    wandb = None
    if args.wandb and master:
        try:
            import wandb
        except ImportError:
            raise SystemExit("--wandb needs `pip install wandb`") from None
        wandb.init(project=args.wandb, name=args.run_name, config=vars(args))
    peak = C.peak_flops(C.device_name(device), args.dtype)
    fpt = flops_per_token(config)
    stop = C.StopSignal()
    val_stream = C.val_tokens(args.data_dir, tokenizer, args.eval_tokens)
    initial, mem_history, warned, run_start = C.param_samples(model), [], set(), C.now()
    ckpt_meta = {"stage": "pretrain", "run": args.run_name, "model_config": asdict(config), "world_size": world,
                 "micro_batch": micro, "accum": accum, "total_steps": total_steps, "argv": sys.argv,
                 "tokenizer": args.tokenizer, "tokenizer_sha256": tokenizer.fingerprint(), "data_dir": args.data_dir}

    def checkpoint(step):
        if not all(torch.isfinite(p).all() for p in model.parameters()):  # never write a NaN checkpoint
            raise SystemExit(f"step {step}: parameters are not finite; not writing a checkpoint")
        return C.save_checkpoint(run_dir / "ckpt", step, model, optimizers, [ld.state_dict() for ld in loaders],
                                 ckpt_meta, rank, args.keep)

    for step in range(start, total_steps):
        t0 = C.now()
        lr_mult, wd = C.apply_schedule(optimizers, step, total_steps, args)
        loss_sum = torch.zeros((), device=device)
        for j, loader in enumerate(loaders):
            x, y = next(loader)
            sync_now = j == accum - 1 or world == 1
            with (train_model.no_sync() if not sync_now and hasattr(train_model, "no_sync") else nullcontext()), \
                    autocast_context(device.type, args.dtype):
                loss = train_model(x, y) / accum
                if step + 1 == args.inject_nan_step:
                    loss = loss * float("nan")
                loss.backward()
            loss_sum += loss.detach()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip or float("inf"))
        loss_value = C.all_reduce(loss_sum.item()) / world
        if not (math.isfinite(loss_value) and math.isfinite(grad_norm.item())):
            last = C.list_checkpoints(run_dir / "ckpt")
            raise SystemExit(f"step {step + 1}: loss {loss_value} / grad norm {grad_norm.item()} is not finite: run "
                             f"stopped before the optimizer step; last good checkpoint: "
                             f"{last[-1] if last else 'none'} (resume with --resume, perhaps a lower lr)")
        health = step % args.health_every == 0
        before = C.samples_by_id(optimizers) if health else None
        for opt in optimizers:
            opt.step()
        model.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize()
        dt = C.now() - t0
        tokens_seen = int(C.all_reduce(sum(ld.state["stats"]["tokens"] for ld in loaders)))
        record = {"step": step + 1, "loss": loss_value, "lr_mult": lr_mult, "weight_decay": wd,
                  "lr": {g["name"]: g["lr"] for opt in optimizers for g in opt.param_groups},
                  "grad_norm": grad_norm.item(), "tokens": tokens_seen, "tok_per_s": tokens_per_step / dt,
                  "mfu": tokens_per_step * fpt / dt / (peak * world) if peak else "unknown", "step_time": dt,
                  "cuda_mem_alloc": torch.cuda.memory_allocated(device) if device.type == "cuda" else None,
                  "cuda_mem_reserved": torch.cuda.memory_reserved(device) if device.type == "cuda" else None}
        if health:
            record["update_rms_ratio"] = C.update_ratios(optimizers, before)
        if device.type == "cuda":
            mem_history.append(record["cuda_mem_alloc"])
            if C.memory_growing(mem_history) and "memory" not in warned:
                warned.add("memory")
                record["warning"] = "CUDA memory allocated grew every step for the last 50 steps: a leak?"
        if step + 1 == start + args.frozen_check_step:
            frozen = C.frozen_parameters(model, initial)
            if frozen:
                record["warning"] = f"parameters unchanged after {args.frozen_check_step} steps: {', '.join(frozen)}"
        if master and "warning" in record:
            print(f"WARNING step {step + 1}: {record['warning']}")
        last_step = step + 1 == total_steps
        if args.eval_every and (step + 1) % args.eval_every == 0 and not last_step:
            record["val_bpb"], samples = evaluate(model, tokenizer, args, config, rank, world, device, step + 1,
                                                  run_dir, val_stream)
            if master:
                print(f"eval step {step + 1}: val bpb {record['val_bpb']:.4f}; " + " | ".join(
                    f"{s['prompt']!r} -> {s['completion']!r}" for s in samples))
        metrics.log(record)
        if wandb:
            wandb.log({k: v for k, v in record.items() if isinstance(v, (int, float))}, step=step + 1)
        if master and ((step + 1) % args.log_every == 0 or last_step or step == start):
            elapsed = C.now() - run_start
            eta = elapsed / (step + 1 - start) * (total_steps - step - 1)
            mfu = f"{100 * record['mfu']:.1f}%" if peak else "unknown"
            print(f"step {step + 1}/{total_steps} loss {loss_value:.4f} lr x{lr_mult:.3f} gnorm {grad_norm.item():.3f} "
                  f"{record['tok_per_s']:,.0f} tok/s MFU {mfu} tokens {tokens_seen:,} ETA {C.fmt_duration(eta)}",
                  flush=True)
        if step + 1 == args.kill_at_step and master:
            os.killpg(os.getpgid(0), signal.SIGKILL)
        if step + 1 == args.signal_at_step:
            os.kill(os.getpid(), signal.SIGTERM)
        if stop.requested():
            path = checkpoint(step + 1)
            if master:
                again = [a for a in sys.argv if a != "--resume"] + \
                    ([] if "--run_name" in sys.argv else ["--run_name", args.run_name]) + ["--resume"]
                print(f"stopped by signal at step {step + 1}; checkpoint {path}. Resume with: python {' '.join(again)}")
            C.teardown_distributed()
            sys.exit(128 + (stop.signum or signal.SIGTERM))  # non-zero: a script chaining stages must not go on
        if (step + 1) % args.ckpt_every == 0 or last_step:
            checkpoint(step + 1)  # the final checkpoint comes before the final evaluation (nanochat #446)
    bpb, _ = evaluate(model, tokenizer, args, config, rank, world, device, total_steps, run_dir, val_stream)
    if master:
        metrics.log({"step": total_steps, "final_val_bpb": bpb})
        (run_dir / "done.json").write_text(json.dumps({"step": total_steps, "val_bpb": bpb}))
        print(f"done: {total_steps} steps, val bpb {bpb:.4f}, run dir {run_dir}")
    for loader in loaders:
        loader.close()
    C.teardown_distributed()


def print_status(run_dir):
    """What a run has done so far, from its files: works while it runs and after it ends."""
    if not (run_dir / "metrics.jsonl").is_file():
        raise SystemExit(f"{run_dir} has no metrics.jsonl: not a run directory (runs/<run>/)")
    config = json.loads((run_dir / "config.json").read_text())
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "loss" in r]
    total = config["total_steps"]
    last = steps[-1]
    print(f"run {run_dir}: {'finished' if (run_dir / 'done.json').is_file() else 'not finished'}; step "
          f"{last['step']}/{total}, tokens {last['tokens']:,}")
    window = max(1, len(steps) // 5)
    trend = [sum(r["loss"] for r in steps[i:i + window]) / len(steps[i:i + window])
             for i in range(0, len(steps), window)]
    print("loss trend (means of fifths): " + " -> ".join(f"{v:.3f}" for v in trend))
    recent = steps[-20:]
    rate = sum(r["tok_per_s"] for r in recent) / len(recent)
    tokens_left = (total - last["step"]) * config["micro_batch"] * config["model_config"]["sequence_len"] * \
        config["world_size"] * config["accum"]
    print(f"speed {rate:,.0f} tok/s, MFU {last['mfu']}; ETA {C.fmt_duration(tokens_left / rate if rate else None)}")
    vals = [r for r in records if "val_bpb" in r or "final_val_bpb" in r]
    print(f"last validation: {vals[-1] if vals else 'none yet'}")
    warnings = [f"step {r['step']}: {r['warning']}" for r in records if "warning" in r]
    print("health warnings: " + ("; ".join(warnings) if warnings else "none"))
    samples_path = run_dir / "samples.jsonl"
    if samples_path.is_file():
        samples = [json.loads(line) for line in samples_path.read_text().splitlines()]
        for s in [s for s in samples if s["step"] == samples[-1]["step"]]:
            print(f"sample step {s['step']}: {s['prompt']!r} -> {s['completion']!r}")
    ckpts = C.list_checkpoints(run_dir / "ckpt")
    print(f"checkpoints: {', '.join(c.name for c in ckpts) if ckpts else 'none'}")


if __name__ == "__main__":
    main()
