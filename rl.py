"""Reinforcement learning on answers that can be checked: an SFT checkpoint samples several replies to each question
with the calculator live, a reply whose checked answer is right gets reward 1 (else 0), and the model is updated on
policy, on the tokens it sampled only (nanochat's simplified GRPO: advantage = reward - the mean reward of the
question's replies, the loss normalized per sampled token, no KL penalty, no ratio clipping; the prompt and the
calculator's output carry no loss).

    python rl.py                        # the newest SFT checkpoint; GSM8K train, held out: GSM8K test
    python rl.py --checkpoint runs/speedrun/sft --demo runs/speedrun/demo --steps 60 --max_new_tokens 48
    torchrun --standalone --nproc_per_node=8 rl.py
    python rl.py --run_name NAME --resume                              # continue from the last checkpoint
    python rl.py --status runs/NAME

Tasks. The demo world (--demo; by default the parent's world when it was trained on one): its word problems
(problems/, GSM8K's shape); held out: chat_eval's demo-problems. Otherwise GSM8K's train split; held out: GSM8K's test
split. Either way a reply is right when the number after '####' is the answer (no '####' is wrong, nanochat's rule).
Writes runs/<run_name>/: config.json, metrics.jsonl (every step: mean reward, reply length, tokens sampled per
second; at each evaluation held-out pass@1 and pass@k), ckpt/step_XXXXXX/ (as every stage's), done.json.
"""
import argparse
import json
import math
import signal
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import numpy as np
import torch

import checkpoint
import common
import distributed
import runs
import train_loop
from calculator import ToolUse, reply_text
from dataset import CACHE_DIR
from decode import decode
from model import autocast_context
from tasks import demo_world, gsm8k_items, load_items, prompt_ids, reward

# every lr is this fraction of the SFT parent's (0.3 of pretraining's), decaying linearly to 0: 0.06 of pretraining's,
# about nanochat's RL start (0.05); on the demo's word problems 0.2 beat 0.05 (dev/LOG.md)
RL_LR_SCALE = 0.2
RL_WHY = "about nanochat's chat_rl start, 0.05 of the pretraining lrs; beat 0.05 on the demo's word problems"
# sampling on a CPU: one thread, as a small model's decode step is per-op overhead that more threads only make wait
CPU_ROLLOUT_THREADS = 1


def get_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("tasks")
    g.add_argument("--demo", default="auto", help="a demo world directory (python demo.py --out DIR) whose problems/ "
                   "are trained on and chat_eval/demo-problems.jsonl held out; auto = the parent's world when it "
                   "was trained on one, else GSM8K; none = GSM8K (default: %(default)s)")
    g.add_argument("--train_dir", default=str(CACHE_DIR / "chat" / "gsm8k"), help="GSM8K's train split (columns "
                   "question, answer), without a demo world (default: %(default)s, `python dataset.py download-chat "
                   "gsm8k`)")
    g.add_argument("--cache_dir", default=str(CACHE_DIR / "chat_eval"), help="chat_eval.py's task cache, where GSM8K's "
                   "test split is held out from (default: %(default)s)")
    g.add_argument("--seed", type=int, default=0, help="the order of the questions (a new one every epoch) and the "
                   "sampling, seeded per step and group of questions decoded together (default: %(default)s)")
    g = p.add_argument_group("rollouts")
    g.add_argument("--questions_per_step", type=int, default=16, help="questions per optimizer step over all ranks, "
                   "at least the world size (default: %(default)s, nanochat's)")
    g.add_argument("--samples", type=int, default=16, help="replies sampled per question: the group whose mean reward "
                   "is its baseline (default: %(default)s, nanochat's)")
    g.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (default: %(default)s)")
    g.add_argument("--top_k", type=int, default=50, help="sample among the k likeliest tokens, 0 = all (default: "
                   "%(default)s)")
    g.add_argument("--max_new_tokens", type=int, default=256, help="most tokens per reply, the calculator's output "
                   "included (default: %(default)s)")
    g.add_argument("--rollout_questions", type=int, default=16, help="questions whose replies are decoded together, "
                   "every reply a row of one batch (decode.py); fewer rows per forward use less memory (default: "
                   "%(default)s)")
    g = p.add_argument_group("budget: one of; given both, the last one is in force")
    train_loop.add_budget_args(g, [("epochs", float, "passes over the training questions (default: 1, as nanochat)"),
                                   ("steps", int, "optimizer steps")])
    g = p.add_argument_group("evaluation")
    g.add_argument("--eval_every", type=int, default=60, help="held-out pass@1 and pass@k every N steps, and before "
                   "the first and after the last; 0 = only those two (default: %(default)s)")
    g.add_argument("--eval_items", type=int, default=400, help="held-out questions, the first N in chat_eval.py's "
                   "order; -1 = all (default: %(default)s)")
    g.add_argument("--eval_samples", type=int, default=8, help="k: replies sampled per held-out question (default: "
                   "%(default)s)")
    runs.add_run_args(p, "rl")
    runs.add_init_args(p, ["sft"], lr_scale=RL_LR_SCALE, schedule="linear", warmdown_frac=0.2, why=RL_WHY)
    args = train_loop.parse_stage_args(p, argv, ["epochs", "steps"], default=("epochs", 1.0))
    if min(args.questions_per_step, args.samples, args.max_new_tokens, args.eval_samples, args.rollout_questions) < 1 \
            or args.temperature < 0:
        p.error("--questions_per_step, --samples, --max_new_tokens, --eval_samples and --rollout_questions must be "
                ">= 1, --temperature >= 0")
    return p, args


# -----------------------------------------------------------------------------
# Rewards to advantages, and the order of the questions

def advantages(rewards, samples):
    """Each reward minus the mean reward of its question's group of `samples` replies (consecutive)."""
    grouped = torch.tensor(rewards, dtype=torch.float64).view(-1, samples)
    return (grouped - grouped.mean(dim=1, keepdim=True)).view(-1).float()


def step_items(step, per_step, total, seed):
    """The indices of the step's questions in the training set: one stream of every question, shuffled anew each
    epoch, a pure function of the step (a resumed run takes the same questions)."""
    positions = range(step * per_step, (step + 1) * per_step)
    orders = {e: np.random.default_rng([seed, e]).permutation(total) for e in {p // total for p in positions}}
    return [int(orders[p // total][p % total]) for p in positions]


def sampling_seed(*keys):
    return hash(keys) % 2 ** 62  # a tuple of ints hashes the same in every process (no PYTHONHASHSEED for ints)


def eta_seconds(step, total_steps, eval_every, step_s, eval_s):
    """Seconds left after `step` steps: the steps left at step_s each, and the held-out evaluations left at eval_s
    each (one every eval_every steps before the last, and the final one)."""
    between = len(range((step // eval_every + 1) * eval_every, total_steps, eval_every)) if eval_every else 0
    return (total_steps - step) * step_s + (between + 1) * eval_s


# -----------------------------------------------------------------------------
# Rollouts

def sample_groups(model, tokenizer, prompts, n, max_new_tokens, temperature, top_k, seed, dtype):
    """n replies to each prompt, every reply a row of one batch (decode.py), sampling seeded by `seed`. Returns
    (replies, sampled), n rows per prompt in order: each row's tokens up to and with its <|assistant_end|>, and per
    token whether the model sampled it (True) or the calculator's output was fed (False)."""
    budgets = [min(max_new_tokens, model.config.sequence_len - len(p)) for p in prompts]
    stop = {tokenizer.special_id("<|assistant_end|>"), tokenizer.bos_id}
    tools = [ToolUse(tokenizer) for _ in range(n * len(prompts))]
    return decode(model, prompts, budgets, samples=n, temperature=temperature, top_k=top_k, seed=seed, dtype=dtype,
                  tools=tools, stop=stop)


def training_rows(prompt, replies, sampled, pad_id):
    """(inputs, targets) per reply: prompt + reply shifted by one, the target -1 (no loss) on the prompt and on every
    token the model did not sample."""
    rows = []
    for reply, own in zip(replies, sampled, strict=True):
        ids = prompt + reply
        targets = [-1] * (len(prompt) - 1) + [t if s else -1 for t, s in zip(reply, own, strict=True)]
        rows.append((ids[:-1] or [pad_id], targets or [-1]))
    return rows


def pad(rows, pad_id, device):
    width = max(len(inputs) for inputs, _ in rows)
    inputs = torch.tensor([x + [pad_id] * (width - len(x)) for x, _ in rows], dtype=torch.long, device=device)
    targets = torch.tensor([y + [-1] * (width - len(y)) for _, y in rows], dtype=torch.long, device=device)
    return inputs, targets


def policy_gradient(train_model, rows, weights, micro_batch, dtype, device, world):
    """Backward of the loss -sum(advantage x log p(token)) / (tokens sampled over all ranks), over the sampled tokens
    of every row, micro_batch rows per forward; DDP averages over ranks, so each rank scales by world / count.
    Returns (the summed loss, the sampled-token count), both over all ranks (the loss: their ratio)."""
    count = distributed.all_reduce(sum(sum(t != -1 for t in y) for _, y in rows))
    scale, loss_sum = world / max(count, 1.0), torch.zeros((), dtype=torch.float64, device=device)
    chunks = range(0, len(rows), micro_batch)
    for start in chunks:
        inputs, targets = pad(rows[start:start + micro_batch], 0, device)
        advantage = weights[start:start + micro_batch].to(device).view(-1, 1)
        sync = start == chunks[-1] or not hasattr(train_model, "no_sync")
        with train_model.no_sync() if not sync else nullcontext(), autocast_context(device.type, dtype):
            nll = train_model(inputs, targets, reduction="none")  # -log p, 0 where the target is -1
            loss = (nll.float() * advantage).sum()
            (loss * scale).backward()
        loss_sum += loss.detach().double()
    return distributed.all_reduce_tensor(loss_sum), count


@torch.no_grad()
def evaluate(model, tokenizer, items, args, rank, world, step, stopping=lambda: False):
    """Held-out pass@1 (the share of right replies, averaged over questions) and pass@k (the share of questions with
    a right reply among k = --eval_samples) at the training temperature, seeded by the questions' positions so that
    evaluations differ by the model only. None when stopping() said so between groups."""
    right = torch.zeros(len(items), dtype=torch.float64)  # each question's right replies
    mine, k = list(range(rank, len(items), world)), args.eval_samples
    for chunk in [mine[c:c + args.rollout_questions] for c in range(0, len(mine), args.rollout_questions)]:
        if stopping():
            return None
        prompts = [prompt_ids(tokenizer, items[i]["prompt"], model.config.sequence_len, 1)[0] for i in chunk]
        replies, _ = sample_groups(model, tokenizer, prompts, k, args.max_new_tokens, args.temperature, args.top_k,
                                   sampling_seed(args.seed, -1, chunk[0]), args.dtype)
        for j, i in enumerate(chunk):
            right[i] = sum(reward(items[i], reply_text(tokenizer, strip_end(r, tokenizer)))
                           for r in replies[j * k:(j + 1) * k])
    distributed.all_reduce_tensor(right)
    return {"step": step, "k": k, "items": len(items), "all": {"pass@1": (right / k).mean().item(),
                                                               f"pass@{k}": (right > 0).double().mean().item(),
                                                               "items": len(items)}}


def strip_end(reply, tokenizer):
    return reply[:-1] if reply and reply[-1] in (tokenizer.special_id("<|assistant_end|>"), tokenizer.bos_id) else reply


class Cursor:
    """RL's data position in a checkpoint (the other stages' loader state): the questions taken and this rank's
    sampled tokens. The questions and seeds are a function of the step, so this only records it."""

    def __init__(self, questions):
        self.state, self.questions = {"questions": 0, "stats": {"tokens": 0}}, questions

    @property
    def epoch(self):  # passes over the training questions completed (the shared loop's record counts from 1)
        return self.state["questions"] // self.questions

    def state_dict(self):
        return {"questions": self.state["questions"], "stats": dict(self.state["stats"])}

    def load_state_dict(self, state):
        self.state = {"questions": state["questions"], "stats": dict(state["stats"])}


def verdict(records):
    """The reward's change (first fifth of the steps against the last fifth) beside held-out pass@1's (first evaluation
    against the last), and what they say together: a reward that rose while held-out accuracy fell is said so."""
    steps, evals = [r for r in records if "reward" in r], [r["held_out"] for r in records if "held_out" in r]
    fifth = max(1, len(steps) // 5)
    before, after = (sum(r["reward"] for r in part) / len(part) for part in (steps[:fifth], steps[-fifth:]))
    held = (evals[0]["all"]["pass@1"], evals[-1]["all"]["pass@1"])
    rose, fell = after > before, held[1] < held[0]
    held_change = "fell" if fell else "rose" if held[1] > held[0] else "did not change"
    note = "the reward ROSE while held-out accuracy FELL: the model learned the training questions, not the task" \
        if rose and fell else f"the reward {'rose' if rose else 'did not rise'}, held-out accuracy {held_change}"
    return {"reward_first_fifth": before, "reward_last_fifth": after, "held_out_pass@1_first": held[0],
            "held_out_pass@1_last": held[1], "note": note}


def plan(args, start):
    """What runs.start_stage asks of RL: the training questions, the held-out ones and the total steps."""
    data_dir = (checkpoint.pretraining_run(start.parent, start.parent_meta) or [None])[0]
    world_dir = demo_world(args.demo, data_dir, "problems")
    train_items = gsm8k_items(world_dir / "problems" if world_dir else args.train_dir)
    held_out = distributed.fetch_everywhere(
        lambda: load_items("demo-problems" if world_dir else "GSM8K", args.cache_dir, world_dir, args.eval_items)[0],
        start.rank, start.world)
    if args.questions_per_step < start.world:
        raise ValueError(f"--questions_per_step {args.questions_per_step} is fewer than the {start.world} ranks: give "
                         f"each rank at least one question")
    total_steps = args.steps or math.ceil(args.epochs * len(train_items) / args.questions_per_step)
    tasks = f"the demo world {world_dir} (problems/ word problems; held out: demo-problems)" if world_dir \
        else f"GSM8K {args.train_dir} (held out: GSM8K test from {args.cache_dir})"
    rollouts = (f"rollouts: {args.questions_per_step} questions x {args.samples} replies per step over {start.world} "
                f"rank(s), temperature {args.temperature}, top_k {args.top_k}, at most {args.max_new_tokens} new "
                f"tokens, {args.rollout_questions} questions' replies decoded together; {start.micro_batch} rows per "
                f"training forward; compile off (the rows' lengths change every step)")
    lines = [f"tasks: {tasks}: {len(train_items):,} training questions, {len(held_out):,} held out", rollouts,
             args.budget_line, f"budget: {total_steps:,} steps" + (f" = {args.epochs:g} epochs" if args.epochs else "")]
    return {"total_steps": total_steps, "loaders": [Cursor(len(train_items))], "train_items": train_items, "held_out": held_out,
            "lines": lines, "record": {"data_dir": data_dir, "tasks": tasks, "train_questions": len(train_items),
                                       "held_out_questions": len(held_out)}}


def main(argv=None):
    _, args = get_args(argv)
    if args.status:
        return train_loop.print_status(Path(args.status))
    if args.fsdp == "true":
        raise ValueError("--fsdp true: rl.py does not shard the model (each rank samples replies of its own length, "
                         "which FSDP's per-layer gathers cannot follow); use a model that fits one device")
    s = runs.start_stage(args, "rl", ["sft"], plan, rollouts=True)
    rank, world, device, model, tokenizer, run_dir = s.rank, s.world, s.device, s.model, s.tokenizer, s.run_dir
    master, (cursor,), stop = rank == 0, s.loaders, train_loop.StopSignal()
    # dynamic=None: the replies' lengths vary, so torch marks the shapes dynamic after a first change
    train_model = train_loop.wrap_model(model, args, world, s.local_rank, device, dynamic=None)
    train_threads = torch.get_num_threads()
    rollout_threads = CPU_ROLLOUT_THREADS if device.type == "cpu" else train_threads
    # the ETA's two rates, steps and held-out evaluations: the shared loop's would count evaluations as steps
    eval_seconds, step_seconds = [], []

    def held_out_eval(step):  # None: a signal on some rank between groups of questions, seen by all at once
        t0 = time.perf_counter()
        torch.set_num_threads(rollout_threads)
        result = evaluate(model, tokenizer, s.held_out, args, rank, world, step, stop.requested)
        torch.set_num_threads(train_threads)
        if result is None:
            return None
        eval_seconds.append(time.perf_counter() - t0)
        if master:
            k, held = result["k"], result["all"]
            print(f"held out at step {step}: all pass@1 {held['pass@1']:.3f} pass@{k} {held[f'pass@{k}']:.3f} "
                  f"({held['items']} questions)", flush=True)
        return {"held_out": result}

    def rl_step(step):
        """The shared loop's step hook: the step's rollouts, rewards and policy gradient."""
        t0 = time.perf_counter()
        chosen = step_items(step, args.questions_per_step, len(s.train_items), args.seed)
        torch.set_num_threads(rollout_threads)
        rows, rewards, lengths, sampled_tokens = [], [], [], 0
        mine, n = list(range(rank, len(chosen), world)), args.samples
        for chunk in [mine[c:c + args.rollout_questions] for c in range(0, len(mine), args.rollout_questions)]:
            if stop.requested():  # a step's rollouts can take minutes: the step is dropped, the last finished one saved
                return f"during step {step + 1}'s rollouts"
            items = [s.train_items[chosen[position]] for position in chunk]
            prompts = [prompt_ids(tokenizer, item["prompt"], args.sequence_len, 1)[0] for item in items]
            all_replies, all_sampled = sample_groups(model, tokenizer, prompts, n, args.max_new_tokens,
                                                     args.temperature, args.top_k,
                                                     sampling_seed(args.seed, step, chunk[0]), args.dtype)
            for j, (item, prompt) in enumerate(zip(items, prompts, strict=True)):
                replies, sampled = all_replies[j * n:(j + 1) * n], all_sampled[j * n:(j + 1) * n]
                rewards += [reward(item, reply_text(tokenizer, strip_end(r, tokenizer))) for r in replies]
                lengths += [len(r) for r in replies]
                sampled_tokens += sum(map(sum, sampled))
                rows += training_rows(prompt, replies, sampled, tokenizer.bos_id)
        rollout = time.perf_counter() - t0
        torch.set_num_threads(train_threads)
        loss_sum, count = policy_gradient(train_model, rows, advantages(rewards, args.samples), s.micro_batch,
                                      args.dtype, device, world)
        sums = distributed.all_reduce_tensor(torch.tensor([sum(rewards), len(rewards), sum(lengths), sampled_tokens],
                                                          dtype=torch.float64)).tolist()
        rollout = distributed.all_reduce(rollout, torch.distributed.ReduceOp.MAX if world > 1 else None)
        cursor.state["questions"] = (step + 1) * args.questions_per_step
        cursor.state["stats"]["tokens"] += sampled_tokens
        step_seconds.append(time.perf_counter() - t0)  # the optimizer step after it is not in: small beside these
        return loss_sum, count, sums[3], {
            "reward": sums[0] / sums[1], "sampled_tokens": int(sums[3]), "reply_tokens": sums[2] / sums[1],
            "sampled_tok_per_s": sums[3] / rollout, "rollout_time": rollout, "mfu": "unknown"}

    def progress(record, total_steps):
        eta = eta_seconds(record["step"], total_steps, args.eval_every, sum(step_seconds) / len(step_seconds),
                          sum(eval_seconds) / len(eval_seconds) if eval_seconds else 0.0)
        return (f"step {record['step']}/{total_steps} reward {record['reward']:.3f} loss {record['loss']:+.5f} reply "
                f"{record['reply_tokens']:.1f} tokens, {record['sampled_tok_per_s']:,.0f} sampled tok/s, lr x"
                f"{record['lr_mult']:.3f} gnorm {record['grad_norm']:.3f} ETA {common.fmt_duration(eta)}")

    signum = train_loop.train(args, model, train_model, s.optimizers, s.loaders, run_dir=run_dir, start=s.step,
                              total_steps=s.total_steps, ckpt_meta=s.ckpt_meta, evaluate=held_out_eval,
                              flops_per_token=0, rank=rank, world=world, device=device, step_fn=rl_step, stop=stop,
                              evaluate_first=True, progress=progress)
    if signum is not None:
        return signum
    total_steps = s.total_steps
    final = held_out_eval(total_steps)
    if final is None:
        if master:
            print(f"stopped by signal in the final held-out evaluation; step {total_steps}'s checkpoint is on disk. "
                  f"Resume with: {checkpoint.resume_command(args)}", flush=True)
        return stop.signum or signal.SIGTERM
    if master:
        common.append_jsonl(run_dir / "metrics.jsonl", {"step": total_steps, "final": True, **final})
        records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        summary = verdict(records)
        (run_dir / "done.json").write_text(json.dumps({"step": total_steps, **summary, "held_out": final["held_out"]}))
        print(f"reward {summary['reward_first_fifth']:.3f} -> {summary['reward_last_fifth']:.3f} (first and last "
              f"fifth of the steps); held-out pass@1 {summary['held_out_pass@1_first']:.3f} -> "
              f"{summary['held_out_pass@1_last']:.3f}: {summary['note']}")
        print(f"done: {total_steps} steps, run dir {run_dir}")
    return None


if __name__ == "__main__":
    sys.exit(distributed.run_main(main))
