"""Reinforcement learning on checkable answers: an SFT checkpoint samples several replies per
question with the calculator live; a right answer gets reward 1, else 0. The update is on policy
(nanochat's simplified GRPO: advantage = reward - the group's mean, no KL penalty, no ratio
clipping), on the sampled tokens of the questions whose replies differ.

    python rl.py  # the newest SFT checkpoint; GSM8K train, held out: GSM8K test
    python rl.py --checkpoint runs/speedrun/sft --demo runs/speedrun/demo --steps 60 \\
        --max_new_tokens 48
    torchrun --standalone --nproc_per_node=8 rl.py
    python rl.py --run_name NAME --resume  # continue from the last checkpoint
    python rl.py --status runs/NAME

Tasks: the demo world's word problems (--demo; held out: demo-problems), else GSM8K train
(held out: GSM8K test). A reply is right when the number after '####' is the answer. Writes
runs/<run_name>/: config.json, metrics.jsonl (reward, reply length, held-out pass@1 and pass@k),
ckpt/step_XXXXXX/, done.json.
"""
import argparse
import gc
import json
import math
import signal
import sys
import time
from contextlib import contextmanager, nullcontext
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

import checkpoint
import distributed
import optim
import train_loop
from dataset import CACHE_DIR
from decode import ToolUse, decode, reply_text
from model import autocast_context, num_params
from tasks import demo_world, gsm8k_items, load_items, prompt_ids, reward

# x SFT's lrs (0.3 of pretraining's) = 0.06; untuned on GSM8K
RL_LR_SCALE = 0.2
RL_WHY = "near nanochat's chat_rl start; the demo plan passes 0.1"
# a small model's CPU decode step is per-op overhead: more threads only wait
CPU_ROLLOUT_THREADS = 1


def get_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("tasks")
    g.add_argument("--demo", default="auto", help="a demo world: its problems_rl/ trained on, "
                   "chat_eval/demo-problems.jsonl held out; auto = the parent's "
                   "world if it had one, else GSM8K; none = GSM8K (default: %(default)s)")
    g.add_argument("--train_dir", default=str(CACHE_DIR / "chat" / "gsm8k"), help=
                   "GSM8K's train split (columns question, answer), without a demo world (default: "
                   "%(default)s, `python prepare.py chat gsm8k`)")
    g.add_argument("--cache_dir", default=str(CACHE_DIR / "chat_eval"), help=
                   "chat_eval.py's task cache, where GSM8K's test split is held out from (default: "
                   "%(default)s, `python chat_eval.py --download_only --tasks GSM8K`)")
    g.add_argument("--seed", type=int, default=0, help="the questions' order (new every epoch) "
                   "and the sampling (default: %(default)s)")
    g = p.add_argument_group("rollouts")
    g.add_argument("--questions_per_step", type=int, default=16, help="questions per optimizer "
                   "step over all ranks, at least the world size (default: %(default)s, "
                   "nanochat's)")
    g.add_argument("--samples", type=int, default=16, help="replies sampled per question: the "
                   "group whose mean reward is its baseline (default: %(default)s, nanochat's)")
    g.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (default: "
                   "%(default)s)")
    g.add_argument("--top_k", type=int, default=50, help="sample among the k likeliest tokens, 0 = "
                   "all (default: %(default)s)")
    g.add_argument("--max_new_tokens", type=int, default=256, help="most tokens per reply, the "
                   "calculator's output included (default: %(default)s)")
    g.add_argument("--rollout_questions", type=int, default=16, help="questions whose replies are "
                   "decoded together, each reply a row of one batch; fewer use less memory "
                   "(default: %(default)s)")
    g = p.add_argument_group("budget: one of; given both, the last one is in force")
    train_loop.add_budget_args(g, [("epochs", float,
                                    "passes over the training questions (default: 1, as nanochat)"),
                                   ("steps", int, "optimizer steps")])
    g = p.add_argument_group("evaluation")
    g.add_argument("--eval_every", type=int, default=60, help="held-out pass@1 and pass@k every N "
                   "steps, and before the first and after the last; 0 = only those two (default: "
                   "%(default)s)")
    g.add_argument("--eval_items", type=int, default=400, help="held-out questions, the first N in "
                   "chat_eval.py's order; -1 = all (default: %(default)s)")
    g.add_argument("--eval_samples", type=int, default=8, help="k: replies sampled per held-out "
                   "question (default: %(default)s)")
    checkpoint.add_run_args(p, "rl")
    train_loop.add_init_args(p, ["sft"], lr_scale=RL_LR_SCALE, schedule="linear", warmdown_frac=0.2,
                             why=RL_WHY)
    args = train_loop.parse_stage_args(p, argv, ["epochs", "steps"], default=("epochs", 1.0))
    if min(args.questions_per_step, args.samples, args.max_new_tokens, args.eval_samples,
           args.rollout_questions) < 1 \
            or args.temperature < 0:
        p.error("--questions_per_step, --samples, --max_new_tokens, --eval_samples and "
                "--rollout_questions must be >= 1, --temperature >= 0")
    return p, args


# -----------------------------------------------------------------------------
# Rewards to advantages, and the order of the questions

def advantages(rewards, samples):
    """Each reward minus its group's mean (`samples` consecutive replies)."""
    grouped = torch.tensor(rewards, dtype=torch.float64).view(-1, samples)
    return (grouped - grouped.mean(dim=1, keepdim=True)).view(-1).float()


def teaching_rows(rows, weights):
    """The rows whose advantage is not 0 and their weights (DAPO's dynamic sampling, without
    resampling); with none, one row at 0, so that the backward syncs."""
    keep = [i for i, weight in enumerate(weights.tolist()) if weight != 0] or [0]
    return [rows[i] for i in keep], weights[keep]


def step_items(step, per_step, total, seed):
    """The step's question indices, reshuffled each epoch: a function of the step, so a resume
    takes the same questions."""
    positions = range(step * per_step, (step + 1) * per_step)
    orders = {e: np.random.default_rng([
            seed, e]).permutation(total) for e in {p // total for p in positions}}
    return [int(orders[p // total][p % total]) for p in positions]


def sampling_seed(*keys):
    # a tuple of ints hashes the same in every process (no PYTHONHASHSEED for ints)
    return hash(keys) % 2 ** 62


def eta_seconds(step, total_steps, eval_every, step_s, eval_s):
    """Seconds left after `step`: the steps and held-out evaluations still to run."""
    between = len(range((step // eval_every + 1) * eval_every, total_steps,
                        eval_every)) if eval_every else 0
    return (total_steps - step) * step_s + (between + 1) * eval_s


# -----------------------------------------------------------------------------
# Rollouts

def sample_groups(model, tokenizer, prompts, n, max_new_tokens, temperature, top_k, seed, dtype):
    """n replies per prompt, all rows of one batch: (replies, sampled) as decode() returns."""
    budgets = [min(max_new_tokens, model.config.sequence_len - len(p)) for p in prompts]
    stop = {tokenizer.special_id("<|assistant_end|>"), tokenizer.bos_id}
    tools = [ToolUse(tokenizer) for _ in range(n * len(prompts))]
    return decode(model, prompts, budgets, samples=n, temperature=temperature, top_k=top_k,
                  seed=seed, dtype=dtype,
                  tools=tools, stop=stop)


def training_rows(prompt, replies, sampled, pad_id):
    """(inputs, targets) per reply; target -1 (no loss) on the prompt and unsampled tokens."""
    rows = []
    for reply, own in zip(replies, sampled, strict=True):
        ids = prompt + reply
        targets = [-1] * (len(prompt) - 1) + [t if s else -1 for t, s in zip(reply, own,
                                                                             strict=True)]
        rows.append((ids[:-1] or [pad_id], targets or [-1]))
    return rows


def pad(rows, pad_id, device):
    width = max(len(inputs) for inputs, _ in rows)
    inputs = torch.tensor([x + [pad_id] * (width - len(x)) for x, _ in rows], dtype=torch.long,
                          device=device)
    targets = torch.tensor([y + [-1] * (width - len(y)) for _, y in rows], dtype=torch.long,
                           device=device)
    return inputs, targets


def policy_gradient(train_model, rows, weights, micro_batch, dtype, device, world):
    """Backward of -sum(advantage x log p) / (sampled tokens over all ranks); DDP averages over
    ranks, so each scales by world / count. Returns (summed loss, count) over all ranks."""
    count = distributed.all_reduce(sum(sum(t != -1 for t in y) for _, y in rows))
    scale, loss_sum = world / max(count, 1.0), torch.zeros((), dtype=torch.float64, device=device)
    chunks = range(0, len(rows), micro_batch)
    for start in chunks:
        inputs, targets = pad(rows[start:start + micro_batch], 0, device)
        advantage = weights[start:start + micro_batch].to(device).view(-1, 1)
        sync = start == chunks[-1] or not hasattr(train_model, "no_sync")
        with train_model.no_sync() if not sync else nullcontext(), autocast_context(device.type,
                                                                                    dtype):
            nll = train_model(inputs, targets, reduction="none")  # -log p, 0 where the target is -1
            loss = (nll.float() * advantage).sum()
            (loss * scale).backward()
        loss_sum += loss.detach().double()
    return distributed.all_reduce_tensor(loss_sum), count


@torch.no_grad()
def evaluate(model, tokenizer, items, args, rank, world, step, stopping=lambda: False):
    """Held-out pass@1 and pass@k (k = --eval_samples), seeded by question position so evaluations
    differ by the model only. None when stopping()."""
    right = torch.zeros(len(items), dtype=torch.float64)  # each question's right replies
    mine, k = list(range(rank, len(items), world)), args.eval_samples
    for chunk in [mine[c:c + args.rollout_questions] for c in range(0, len(mine),
                                                                    args.rollout_questions)]:
        if stopping():
            return None
        prompts = [prompt_ids(tokenizer, items[i]["prompt"], model.config.sequence_len,
                              1)[0] for i in chunk]
        replies, _ = sample_groups(model, tokenizer, prompts, k, args.max_new_tokens,
                                   args.temperature, args.top_k,
                                   sampling_seed(args.seed, -1, chunk[0]), args.dtype)
        for j, i in enumerate(chunk):
            right[i] = sum(reward(items[i], reply_text(tokenizer, strip_end(r, tokenizer)))
                           for r in replies[j * k:(j + 1) * k])
    distributed.all_reduce_tensor(right)
    held = {"pass@1": (right / k).mean().item(), f"pass@{k}": (right > 0).double().mean().item(),
            "items": len(items)}
    if rank == 0:
        print(f"held out at step {step}: all pass@1 {held['pass@1']:.3f} pass@{k} "
              f"{held[f'pass@{k}']:.3f} ({held['items']} questions)", flush=True)
    return {"step": step, "k": k, "items": len(items), "all": held}


def strip_end(reply, tokenizer):
    return reply[:-1] if reply and reply[-1] in (tokenizer.special_id("<|assistant_end|>"),
                                                 tokenizer.bos_id) else reply


class Cursor:
    """RL's data position in a checkpoint: questions and seeds follow from the step, so only
    counts."""

    def __init__(self):
        self.state = {"questions": 0, "stats": {"tokens": 0}}

    def state_dict(self):
        return {"questions": self.state["questions"], "stats": dict(self.state["stats"])}

    def load_state_dict(self, state):
        self.state = {"questions": state["questions"], "stats": dict(state["stats"])}


def verdict(records):
    """Reward (first vs last fifth of steps) beside held-out pass@1 (first vs last evaluation);
    flags a reward that rose while held-out accuracy fell beyond its noise."""
    steps, evals = [r for r in records if "reward" in r], [r["held_out"] for r in records
                                                           if "held_out" in r]
    fifth = max(1, len(steps) // 5)
    before, after = (sum(r["reward"] for r in part) / len(part) for part in (steps[:fifth],
                                                                             steps[-fifth:]))
    held = (evals[0]["all"]["pass@1"], evals[-1]["all"]["pass@1"])
    questions = evals[-1]["all"]["items"]
    # two standard errors (pass@1's variance is at most p(1 - p) / questions): a smaller change
    # may come from which questions were drawn
    noise = 2 * math.sqrt(sum(p * (1 - p) for p in held) / questions)
    rose, fell = after > before, held[1] < held[0] - noise
    held_change = "fell" if fell else "rose" if held[1] > held[0] + noise else (
        f"did not change beyond its noise ({noise:.3f} over {questions} questions)")
    note = (f"the reward {'rose' if rose else 'did not rise'}, held-out accuracy {held_change}")
    if rose and fell:
        note = ("the reward ROSE while held-out accuracy FELL: the model learned the training "
                "questions, not the task")
    return {"reward_first_fifth": before, "reward_last_fifth": after,
            "held_out_pass@1_first": held[0],
            "held_out_pass@1_last": held[1], "note": note}


@contextmanager
def sampling_threads(device):
    train_threads = torch.get_num_threads()
    torch.set_num_threads(CPU_ROLLOUT_THREADS if device.type == "cpu" else train_threads)
    try:
        yield
    finally:
        torch.set_num_threads(train_threads)


def rl_step(args, model, train_model, optimizers, cursor, tokenizer, items, step, total_steps,
            micro_batch, rank, world, device, run_dir, stopping):
    """Rollouts of this rank's questions, rewards, policy gradient, optimizer step. Returns the
    step's record, or None when stopping() during the rollouts."""
    t0 = time.perf_counter()
    chosen = step_items(step, args.questions_per_step, len(items), args.seed)
    rows, rewards, lengths, tokens = [], [], [], 0
    mine, n, group = list(range(rank, len(chosen), world)), args.samples, args.rollout_questions
    with sampling_threads(device):
        for chunk in [mine[c:c + group] for c in range(0, len(mine), group)]:
            if stopping():
                return None
            questions = [items[chosen[position]] for position in chunk]
            prompts = [prompt_ids(tokenizer, item["prompt"], args.sequence_len, 1)[0]
                       for item in questions]
            all_replies, all_sampled = sample_groups(
                model, tokenizer, prompts, n, args.max_new_tokens, args.temperature, args.top_k,
                sampling_seed(args.seed, step, chunk[0]), args.dtype)
            for j, (item, prompt) in enumerate(zip(questions, prompts, strict=True)):
                replies, sampled = all_replies[j * n:(j + 1) * n], all_sampled[j * n:(j + 1) * n]
                rewards += [reward(item, reply_text(tokenizer, strip_end(r, tokenizer)))
                            for r in replies]
                lengths += [len(r) for r in replies]
                tokens += sum(map(sum, sampled))
                rows += training_rows(prompt, replies, sampled, tokenizer.bos_id)
    rollout = time.perf_counter() - t0
    weights = advantages(rewards, n)
    taught = int((weights.view(-1, n) != 0).any(dim=1).sum())  # questions whose replies differ
    rows, weights = teaching_rows(rows, weights)
    loss_sum, count = policy_gradient(train_model, rows, weights, micro_batch, args.dtype, device,
                                      world)
    sums = distributed.all_reduce_tensor(torch.tensor([sum(rewards), len(rewards), sum(lengths),
                                                       tokens, taught], dtype=torch.float64))
    sums = sums.tolist()
    teaching = sums[4] / args.questions_per_step
    # Muon and Adam normalize the step's size: scaled by the share of questions that taught
    lr_mult, wd = optim.apply_schedule(optimizers, step, total_steps, args, scale=teaching)
    rollout = distributed.all_reduce(rollout, torch.distributed.ReduceOp.MAX)
    cursor.state["questions"] = (step + 1) * args.questions_per_step
    cursor.state["stats"]["tokens"] += tokens
    loss, count, grad_norm = train_loop.optimizer_step(model, optimizers, args, loss_sum, count,
                                                       world, device, step + 1, run_dir)
    dt = time.perf_counter() - t0
    return {"step": step + 1, "loss": loss, "targets": int(count),
            "lr_mult": lr_mult, "teaching": teaching,
            "weight_decay": wd,
            "lr": {g["name"]: g["lr"] for opt in optimizers for g in opt.param_groups},
            "grad_norm": grad_norm,
            "tokens": int(distributed.all_reduce(cursor.state["stats"]["tokens"])),
            "tok_per_s": sums[3] / dt, "data_wait": 0.0,
            "epoch": cursor.state["questions"] // len(items) + 1, "mfu": "unknown", "step_time": dt,
            **train_loop.cuda_memory(device), "reward": sums[0] / sums[1],
            "sampled_tokens": int(sums[3]), "reply_tokens": sums[2] / sums[1],
            "sampled_tok_per_s": sums[3] / rollout, "rollout_time": rollout}


@train_loop.frozen_heap
def train(args, model, train_model, optimizers, cursor, tokenizer, items, held_out, stop, *,
          micro_batch, run_dir, start, total_steps, ckpt_meta, rank, world, device):
    """rl_step to total_steps with train_loop's logging, health checks, signals, checkpoints, and
    held-out evaluations. Returns None when done, else the stopping signal."""
    log = train_loop.Log(args, run_dir, start, total_steps, rank == 0)
    saver = train_loop.Saver(args, run_dir, model, optimizers, [cursor], ckpt_meta, rank, start,
                             log, stop)
    # no frozen-parameter check: a step changes nothing when every reply scores alike
    health = train_loop.Health(model, optimizers, args, start, rank == 0, frozen_check=False)
    step_seconds, eval_seconds = [], []  # for the ETA
    distributed.keep_progress(run_dir, "rl")
    distributed.mark_progress(start, "starting")

    def held_out_eval(step):  # None: a signal arrived
        t0 = time.perf_counter()
        with sampling_threads(device):
            result = evaluate(model, tokenizer, held_out, args, rank, world, step, stop.requested)
        eval_seconds.append(time.perf_counter() - t0)
        return None if result is None else {"held_out": result}

    if start == 0:
        first = held_out_eval(0)
        if first is None:
            return saver.stopped(0, "in the evaluation before step 1")
        log.write({"step": 0, **first})
    gc.collect()  # then keep start-up's survivors out of later collections
    gc.freeze()
    for step in range(start, total_steps):
        distributed.mark_progress(step + 1, "forward/backward")
        record = rl_step(args, model, train_model, optimizers, cursor, tokenizer, items, step,
                         total_steps, micro_batch, rank, world, device, run_dir, stop.requested)
        if record is None:  # rollouts take minutes: drop the step, keep the last save
            return saver.stopped(step, f"during step {step + 1}'s rollouts")
        health.check(record)
        step_seconds.append(record["step_time"])
        last_step = step + 1 == total_steps
        if args.eval_every and (step + 1) % args.eval_every == 0 and not last_step:
            distributed.mark_progress(step + 1, "evaluation")
            evaluated = held_out_eval(step + 1)
            if evaluated is None:
                log.write(record)
                return saver.stopped(step + 1, f"in the evaluation after step {step + 1}")
            record.update(evaluated)
        log.step(record, progress_line(record, total_steps, args.eval_every, step_seconds,
                                       eval_seconds))
        if stop.requested():
            return saver.stopped(step + 1, f"at step {step + 1}")
        if (step + 1) % args.ckpt_every == 0 or last_step:
            saver.save(step + 1, last_step)
    distributed.mark_progress(total_steps, "trained: final evaluation")
    return None


def progress_line(record, total_steps, eval_every, step_seconds, eval_seconds):
    eval_s = sum(eval_seconds) / len(eval_seconds) if eval_seconds else 0.0
    eta = eta_seconds(record["step"], total_steps, eval_every,
                      sum(step_seconds) / len(step_seconds), eval_s)
    return (f"step {record['step']}/{total_steps} reward {record['reward']:.3f} loss "
            f"{record['loss']:+.5f} reply {record['reply_tokens']:.1f} tokens, "
            f"{record['sampled_tok_per_s']:,.0f} sampled tok/s, lr x{record['lr_mult']:.3f} gnorm "
            f"{record['grad_norm']:.3f} ETA {distributed.fmt_duration(eta)}")


def load_tasks(args, parent, parent_meta, rank, world):
    """(train items, held-out items, pretraining data dir, description): the demo world's, else
    GSM8K's."""
    data_dir = (checkpoint.pretraining_run(parent, parent_meta) or [None])[0]
    world_dir = demo_world(args.demo, data_dir, "problems_rl")
    train_items = gsm8k_items(world_dir / "problems_rl" if world_dir else args.train_dir)
    name = "demo-problems" if world_dir else "GSM8K"
    held_out = distributed.fetch_everywhere(
        lambda: load_items(name, args.cache_dir, world_dir, args.eval_items)[0], rank, world)
    tasks = f"GSM8K {args.train_dir} (held out: GSM8K test from {args.cache_dir})"
    if world_dir:
        tasks = f"the demo world {world_dir} (problems_rl/ word problems; held out: demo-problems)"
    return train_items, held_out, data_dir, tasks


def finish(run_dir, total_steps, final):
    """Final held-out figures to metrics.jsonl, done.json with the verdict."""
    metrics = run_dir / "metrics.jsonl"
    distributed.append_jsonl(metrics, {"step": total_steps, "final": True, "held_out": final})
    summary = verdict([json.loads(line) for line in metrics.read_text().splitlines()])
    (run_dir / "done.json").write_text(json.dumps({"step": total_steps, **summary,
                                                   "held_out": final}))
    print(f"reward {summary['reward_first_fifth']:.3f} -> {summary['reward_last_fifth']:.3f} "
          f"(first and last fifth of the steps); held-out pass@1 "
          f"{summary['held_out_pass@1_first']:.3f} -> {summary['held_out_pass@1_last']:.3f}: "
          f"{summary['note']}")
    print(f"done: {total_steps} steps, run dir {run_dir}")


def main(argv=None):
    _, args = get_args(argv)
    if args.status:
        return train_loop.print_status(Path(args.status))
    if args.fsdp == "true":
        raise ValueError("--fsdp true: rl.py does not shard the model (each rank samples replies "
                         "of its own length, which FSDP's per-layer gathers cannot follow); use a "
                         "model that fits one device")
    rank, local_rank, world, device = distributed.setup_distributed(args.dist_timeout)
    parent, parent_meta, model, tokenizer, inherited, sha256 = checkpoint.load_parent(
        args, "rl", ["sft"], device)
    args.compile = False
    off = (False, "off in rl.py: the rows change length every step")
    inherited = [(name, *off) if name == "compile" else (name, value, where)
                 for name, value, where in inherited]
    # the rows' length; the model keeps the parent's rotary tables
    config = replace(model.config, sequence_len=args.sequence_len)
    run_dir, resume_from = checkpoint.resolve_run(args, "rl")
    # a step's batch is its replies: no accumulation; --total_batch_tokens only scales the lrs
    micro, _, source = train_loop.plan_batch(args, config, world, model, device, resume_from,
                                             parent_meta, accumulate=False)
    optimizers = optim.build_optimizers(model, args, config.n_embd, args.total_batch_tokens, device,
                                        lr_scale=args.lr_scale)

    train_items, held_out, data_dir, tasks = load_tasks(args, parent, parent_meta, rank, world)
    if args.questions_per_step < world:
        raise ValueError(f"--questions_per_step {args.questions_per_step} is fewer than the "
                         f"{world} ranks: give each rank at least one question")
    total_steps = args.steps or math.ceil(args.epochs * len(train_items) / args.questions_per_step)
    record = {"data_dir": data_dir, "tasks": tasks, "train_questions": len(train_items),
              "held_out_questions": len(held_out),
              "parent": checkpoint.parent_record(parent, parent_meta, sha256.result())}
    layout, run, ckpt_meta = checkpoint.record_run(
        args, "rl", parent_meta["model_config"], args.sequence_len, micro, 1, world, total_steps,
        args.total_batch_tokens, tokenizer, num_params(config), record)
    if rank == 0:
        rollouts = (f"rollouts: {args.questions_per_step} questions x {args.samples} replies per "
                    f"step over {world} rank(s), temperature {args.temperature}, top_k "
                    f"{args.top_k}, at most {args.max_new_tokens} new tokens, "
                    f"{args.rollout_questions} questions' replies decoded together; {micro} rows "
                    f"per training forward; compile off (the rows' lengths change every step)")
        in_epochs = f" = {args.epochs:g} epochs" if args.epochs else ""
        precision = optim.precision_line(args, device, optimizers, run["model_config"]["n_embd"])
        checkpoint.announce(args, run_dir, run, [
            *checkpoint.parent_lines(parent, parent_meta, run["params"], inherited,
                                     (micro, source)),
            f"tasks: {tasks}: {len(train_items):,} training questions, {len(held_out):,} held out",
            rollouts, args.budget_line, f"budget: {total_steps:,} steps{in_epochs}"],
            precision)
    cursor = Cursor()
    if resume_from:
        step = checkpoint.resume(resume_from, run_dir, model, optimizers, [cursor], layout, rank,
                                 device)
    else:
        step, line = 0, checkpoint.warm_start(parent, parent_meta, model, optimizers, args, device)
        if rank == 0:
            print(line)

    stop = train_loop.StopSignal()
    train_model = train_loop.wrap_model(model, args, world, local_rank, device)
    signum = train(args, model, train_model, optimizers, cursor, tokenizer, train_items, held_out,
                   stop, micro_batch=micro, run_dir=run_dir, start=step, total_steps=total_steps,
                   ckpt_meta=ckpt_meta, rank=rank, world=world, device=device)
    if signum is not None:
        return signum
    with sampling_threads(device):
        final = evaluate(model, tokenizer, held_out, args, rank, world, total_steps, stop.requested)
    if final is None:
        if rank == 0:
            print(f"stopped by signal in the final held-out evaluation; step {total_steps}'s "
                  f"checkpoint is on disk. Resume with: {checkpoint.resume_command(args)}",
                  flush=True)
        return stop.signum or signal.SIGTERM
    if rank == 0:
        finish(run_dir, total_steps, final)
    return None

if __name__ == "__main__":
    sys.exit(distributed.run_main(main))
