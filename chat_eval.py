"""Evaluate a chat model: nanochat's ChatCORE. ARC-Easy, ARC-Challenge and MMLU are categorical
(the answer letter with the highest logit after <|assistant_start|>); GSM8K and HumanEval are
generated greedily and checked (the number after '#### '; the program against the tests, in
sandbox.py). ChatCORE is the mean centered accuracy. Diagnostics beside it, never in it: letter
probabilities, option texts scored as the reply, a lenient GSM8K reading.

    python chat_eval.py                                # newest checkpoint under runs/, tasks below
    python chat_eval.py --checkpoint runs/NAME --tasks ARC-Easy,GSM8K --max_items 100
    python chat_eval.py --demo data/demo --max_items 20  # offline: the demo world's held-out ones
    torchrun --standalone --nproc_per_node=8 chat_eval.py --checkpoint runs/NAME

--max_items N scores the same items as nanochat's --max-problems N. Writes
runs/<run>/chat_eval.json and chat_eval_items.jsonl (docs/eval.md).
"""
import argparse
import json
import re
import secrets
import sys
import time
from collections import Counter
from pathlib import Path

import torch

import checkpoint
import distributed
import sandbox
import tasks
from dataset import CACHE_DIR
from decode import ToolUse, decode, last_logits, reply_text
from model import num_params, score_rows
from prepare import download_hub_files, list_hub_files
from tasks import (
    ALL_TASKS,
    final_number,
    gsm8k_answer,
    humaneval_program,
    normalize,
    prompt_ids,
    same_number,
)

PROGRESS_SECONDS = 10.0  # a progress line at most this often per task
# CPU generation runs one thread, as rl.py's rollouts: a small model's decode step is per-op
# overhead, and on a shared machine a second OpenMP thread waits (dev/LOG.md)
CPU_GENERATE_THREADS = 1


def get_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    # chat.py's pick: the final model of the newest run
    checkpoint.add_checkpoint_args(p, eval_dtype=True)
    p.add_argument("--demo", default="auto", help="a demo world directory (python demo.py --out "
                   "DIR) whose chat_eval/ questions to ask; auto = the checkpoint's world if it "
                   f"has one; none = the hub tasks ({', '.join(tasks.HUB_TASKS)}) "
                   "(default: %(default)s)")
    p.add_argument("--tasks", default=None, help="comma-separated tasks (default: all of the "
                   "chosen set)")
    p.add_argument("--max_items", type=int, default=-1, help="items per task, the first N in "
                   "nanochat's order; -1 = all (default: %(default)s)")
    p.add_argument("--batch_items", type=int, default=8, help="items per forward: multiple-choice "
                   "prompts right-padded (nanochat's 8), generated answers decoded as rows of one "
                   "batch (the same greedy tokens as one at a time) (default: %(default)s)")
    p.add_argument("--option_text", default="on", choices=["on", "off"], help=
                   "also score each option's text as the reply (a diagnostic outside ChatCORE: "
                   "knows the answer, misses its letter?); a forward per option "
                   "(default: %(default)s)")
    p.add_argument("--max_new_tokens", type=int, default=512, help="greedy tokens per generated "
                   "answer, fewer where the window ends first (default: %(default)s)")
    p.add_argument("--timeout", type=float, default=5.0, help="wall-clock (and CPU) seconds per "
                   "HumanEval program (default: %(default)s)")
    p.add_argument("--memory_mb", type=int, default=512, help="address space per HumanEval program "
                   "(default: %(default)s)")
    p.add_argument("--sandbox", default="auto", choices=["auto", "namespaces", "process"], help=
                   "how HumanEval programs are contained (sandbox.py): auto or namespaces = the "
                   "namespaces level, HumanEval refused without it; process = the process level, "
                   "with its gaps (sandbox.py --probe) (default: %(default)s)")
    p.add_argument("--cache_dir", default=str(CACHE_DIR / "chat_eval"), help=
                   "where the hub tasks' files are kept (default: %(default)s)")
    p.add_argument("--download_only", action="store_true", help="fetch the hub tasks' files "
                   "(--tasks, default all) into --cache_dir and exit; no checkpoint needed")
    p.add_argument("--out", default=None, help="report file, the items beside it in "
                   "<name>_items.jsonl (default: runs/<run>/chat_eval.json)")
    args = p.parse_args(argv)
    if args.max_items == 0 or args.max_items < -1 or args.max_new_tokens < 1 \
            or args.timeout <= 0 or args.batch_items < 1:
        p.error("--max_items must be -1 (all) or >= 1, --max_new_tokens >= 1, --batch_items >= 1 "
                "and --timeout > 0")
    return args


# -----------------------------------------------------------------------------
# The model's answers

def letter_token_ids(tokenizer, letters):
    """The answer letters' token ids, one token each (so with byte-level BPE)."""
    ids = []
    for letter in letters:
        encoded = tokenizer.encode(letter)
        if len(encoded) != 1:
            raise ValueError(f"the answer letter {letter!r} is {len(encoded)} tokens for this "
                             "tokenizer; categorical scoring needs one token per letter")
        ids.append(encoded[0])
    return ids


@torch.no_grad()
def letter_scores(model, tokenizer, items, dtype, device):
    """Per item (letter, cut, record), one forward; only the item's letters compete (ties to the
    first, as nanochat). Recorded: the letters' softmax and their share of the vocabulary's."""
    prompts = [prompt_ids(tokenizer, item["prompt"], model.config.sequence_len,
                          0) for item in items]
    logits = last_logits(model, [ids for ids, _ in prompts], tokenizer.bos_id, dtype).float()
    out = []
    for item, (_, cut), row in zip(items, prompts, logits):
        ids = letter_token_ids(tokenizer, item["letters"])
        letters = row[ids]
        probs = torch.softmax(letters, 0).tolist()
        mass = torch.softmax(row, 0)[ids].sum().item()
        out.append((item["letters"][int(letters.argmax())], cut,
                    {"letter_probs": dict(zip(item["letters"], probs, strict=True)),
                     "letter_mass": mass}))
    return out


@torch.no_grad()
def option_text_scores(model, tokenizer, items, dtype, device):
    """Per item (the likeliest option text as the reply by summed log-probs, by mean, per option
    [sum, tokens]); ties to the first, an empty option never."""
    rows, owner = [], []  # (ids, first scored index) per option; the item it belongs to
    for n, item in enumerate(items):
        for text in item["options"]:
            option = tokenizer.encode(text)[:model.config.sequence_len - 1]
            ids, _ = prompt_ids(tokenizer, item["question"], model.config.sequence_len,
                                max(len(option) - 1, 0))
            rows.append((ids + option, len(ids)))
            owner.append(n)
    losses, y = score_rows(model, rows, dtype, device)
    losses, y = losses.float().cpu(), y.cpu()
    sums, counts = (-losses * (y != -1)).sum(1).tolist(), (y != -1).sum(1).tolist()
    out = []
    for n, item in enumerate(items):
        scores = [[sums[r], counts[r]] for r in range(len(rows)) if owner[r] == n]
        by_sum = [s if c else float("-inf") for s, c in scores]
        by_mean = [s / c if c else float("-inf") for s, c in scores]
        out.append((item["letters"][by_sum.index(max(by_sum))],
                    item["letters"][by_mean.index(max(by_mean))], scores))
    return out


def greedy_replies(model, tokenizer, questions, max_new_tokens, dtype):
    """(text, cut, calculator calls) per question: greedy until <|assistant_end|> (or <|bos|>) or
    max_new_tokens, with nanochat's calculator, calls left out of the text; cut: the window ended
    the reply or cropped the prompt."""
    prompts = [prompt_ids(tokenizer, q, model.config.sequence_len, 1) for q in questions]
    budgets = [min(max_new_tokens, model.config.sequence_len - len(ids)) for ids, _ in prompts]
    tools = [ToolUse(tokenizer) for _ in questions]
    stop = {tokenizer.special_id("<|assistant_end|>"), tokenizer.bos_id}
    rows, _ = decode(model, [ids for ids, _ in prompts], budgets, dtype=dtype, tools=tools,
                     stop=stop)
    out = []
    for row, (_, cut), budget, calls in zip(rows, prompts, budgets, tools):
        ended = row[-1] in stop
        out.append((reply_text(tokenizer, row[:-1] if ended else row),
                    cut or (not ended and budget < max_new_tokens),
                    calls.calls))
    return out


def judge_letters(items, model, tokenizer, args, device):
    """[(correct, cut, record)] for a batch of categorical items."""
    letters = letter_scores(model, tokenizer, items, args.dtype, device)
    texts = [None] * len(items)
    if args.option_text == "on":
        texts = option_text_scores(model, tokenizer, items, args.dtype, device)
    out = []
    for item, (letter, cut, record), text in zip(items, letters, texts):
        if text is not None:
            record["option_text"] = {"predicted": text[0], "correct": text[0] == item["answer"],
                                     "predicted_mean": text[1],
                                     "correct_mean": text[1] == item["answer"], "scores": text[2]}
        out.append((letter == item["answer"], cut, {"predicted": letter, **record}))
    return out


def judge(kind, item, args, marker, level, answer):
    """(correct, cut, record) for one generated item; answer: (reply, cut, calls)."""
    reply, cut, calls = answer
    calls = {"calculator": [list(c) for c in calls]} if calls else {}
    if kind == "gsm8k":  # nanochat's rule decides; the lenient reading is a diagnostic
        lenient = final_number(reply)
        return gsm8k_answer(reply) == item["answer"], cut, {
            "predicted": gsm8k_answer(reply), "reply": reply, **calls,
            "lenient": {"predicted": None if lenient is None else str(lenient),
                        "correct": same_number(lenient, item["answer"])}}
    if kind == "exact":
        return normalize(reply) in {normalize(a) for a in item["answers"]}, cut, {"reply": reply,
                                                                                  **calls}
    if kind == "contains":
        hit = any(re.search(rf"\b{re.escape(a.lower())}\b", reply.lower()) for a in item["answers"])
        return hit, cut, {"reply": reply, **calls}
    result = sandbox.run(humaneval_program(item, reply, marker), args.timeout,
                         memory_mb=args.memory_mb, level=level)
    passed = result.status == "ok" and marker in result.output.splitlines()
    return passed, cut, {"status": result.status, "reply": reply, "output": result.output[-500:],
                         **calls}


def work_batches(kind, items, tokenizer, batch_items, world=1):
    """Batches of item positions, for ranks round robin: categorical items sorted by prompt length
    (less padding), generated items in order (smaller batches where a rank would have none)."""
    if kind != "categorical":
        size = max(1, min(batch_items, -(-len(items) // world)))
        return [list(range(b, min(b + size, len(items)))) for b in range(0, len(items), size)]
    order = sorted(range(len(items)), key=lambda i: len(tokenizer.encode(items[i]["prompt"])))
    return [order[b:b + batch_items] for b in range(0, len(order), batch_items)]


def evaluate_task(task, items, model, tokenizer, args, rank, world, device, marker, level):
    """(per item (correct, cut), records in item order) over every rank's batches; rank 0 prints
    progress."""
    kind = ALL_TASKS[task][2]
    table, records = torch.zeros(len(items), 3, dtype=torch.float64), []  # (done, correct, cut)
    mine = [b for k, b in enumerate(work_batches(kind, items, tokenizer, args.batch_items,
                                                 world)) if k % world == rank]
    share, done, right = sum(map(len, mine)), 0, 0
    start = printed = time.perf_counter()
    threads = torch.get_num_threads()
    if kind != "categorical" and device.type == "cpu":
        torch.set_num_threads(CPU_GENERATE_THREADS)
    for batch in mine:
        if kind == "categorical":
            results = judge_letters([items[i] for i in batch], model, tokenizer, args, device)
        else:
            answers = greedy_replies(model, tokenizer, [items[i]["prompt"] for i in batch],
                                     args.max_new_tokens, args.dtype)
            results = [judge(kind, items[i], args, marker, level, answer)
                       for i, answer in zip(batch, answers)]
        for i, (correct, cut, record) in zip(batch, results):
            table[i] = torch.tensor([1.0, float(correct), float(cut)], dtype=torch.float64)
            expected = {k: items[i][k] for k in ("id", "answer", "answers") if k in items[i]}
            records.append({"task": task, "position": i, "row": items[i]["row"],
                            "question": items[i]["prompt"][:300],
                            **expected, "correct": bool(correct), "cut": bool(cut), **record})
            done, right = done + 1, right + bool(correct)
        now = time.perf_counter()
        if rank == 0 and now - printed >= PROGRESS_SECONDS and done < share:
            printed, rate = now, done / (now - start)
            whose = f" (rank 0's share of {len(items):,}, {world} ranks)" if world > 1 else ""
            print(f"{task}: {done:,}/{share:,} items{whose}, {right:,} right ({right / done:.1%}), "
                  f"{rate:.2f} items/s, ETA "
                  f"{distributed.fmt_duration((share - done) / rate)}", flush=True)
    torch.set_num_threads(threads)
    distributed.all_reduce_tensor(table)
    if not table[:, 0].eq(1).all():
        raise RuntimeError("an item was evaluated by no rank or by two: a bug in evaluate_task")
    if world > 1:
        gathered = [None] * world
        torch.distributed.all_gather_object(gathered, records)
        records = [r for part in gathered for r in part]
    records.sort(key=lambda r: r["position"])
    if rank == 0:
        seconds, correct = time.perf_counter() - start, int(table[:, 1].sum())
        print(f"{task}: done, {correct:,}/{len(items):,} right "
              f"({correct / max(len(items), 1):.4f}) "
              f"in {seconds:.1f} s ({len(items) / seconds:.2f} items/s)", flush=True)
    return [(bool(c), bool(x)) for _, c, x in table.tolist()], records


# -----------------------------------------------------------------------------
# Report

def summarize(tasks, verdicts, sizes):
    """A row per task, and ChatCORE: the mean centered accuracy of the tasks that ran."""
    rows = []
    for task in tasks:
        _, _, kind, baseline = ALL_TASKS[task]
        correct = sum(c for c, _ in verdicts[task])
        accuracy = correct / len(verdicts[task])
        rows.append({"task": task, "kind": kind, "items": len(verdicts[task]),
                     "items_in_task": sizes[task],
                     "correct": correct, "accuracy": accuracy, "baseline": baseline,
                     "centered": None if baseline is None
                     else (accuracy - baseline) / (1 - baseline),
                     "cut": sum(x for _, x in verdicts[task])})
    # DEMO_EXTRA's tasks are not in ChatCORE
    scored = [r["centered"] for r in rows if r["centered"] is not None]
    return rows, sum(scored) / len(scored) if scored else None


LENIENT_RULE = ("the number after '####' (spaces and '$' allowed), else the reply's last number, "
                "compared as numbers")
OPTION_TEXT_RULE = ("the option's text as the whole reply to the question alone: sum of its "
                    "tokens' log-probs")


def task_diagnostics(kind, records):
    """A task's `diagnostics` (docs/eval.md): categorical, why a letter is wrong (not knowing, or
    not its letter?); GSM8K's lenient reading; else None."""
    n = max(len(records), 1)
    if kind == "categorical":
        predicted = Counter(r["predicted"] for r in records)
        out = {"mean_p_gold": sum(r["letter_probs"][r["answer"]] for r in records) / n,
               "mean_letter_mass": sum(r["letter_mass"] for r in records) / n,
               "predicted_letters": dict(sorted(predicted.items())), "option_text": None}
        if records and "option_text" in records[0]:
            right = sum(r["option_text"]["correct"] for r in records)
            by_mean = sum(r["option_text"]["correct_mean"] for r in records)
            out["option_text"] = {"rule": OPTION_TEXT_RULE, "correct": right, "items": len(records),
                                  "accuracy": right / n, "right_text_wrong_letter": sum(
                                      r["option_text"]["correct"] and not r["correct"]
                                      for r in records),
                                  "correct_by_mean": by_mean, "accuracy_by_mean": by_mean / n}
        return out
    if kind == "gsm8k":
        right = sum(r["lenient"]["correct"] for r in records)
        return {"lenient": {"rule": LENIENT_RULE, "correct": right, "items": len(records),
                            "accuracy": right / n}}
    return None


def diagnostic_lines(rows):
    lines = []
    for r in rows:
        d = r.get("diagnostics")
        if d and "mean_p_gold" in d:
            text = d["option_text"]
            lines.append(f"  {r['task']:<14} letters: mean p(gold) {d['mean_p_gold']:.4f} (softmax "
                         f"over the item's letters), letter mass {d['mean_letter_mass']:.4f}, "
                         "predicted " + " ".join(
                             f"{k} {v}" for k, v in d["predicted_letters"].items()) + "; " +
                         ("option text off" if text is None else "option text "
                          f"{text['correct']}/{text['items']} = {text['accuracy']:.4f} (by the "
                          f"mean per token {text['accuracy_by_mean']:.4f}), right text but wrong "
                          f"letter {text['right_text_wrong_letter']}"))
        elif d and "lenient" in d:
            lines.append(f"  {r['task']:<14} lenient reading ({d['lenient']['rule']}): "
                         f"{d['lenient']['correct']}/{d['lenient']['items']} = "
                         f"{d['lenient']['accuracy']:.4f}")
    return lines


def print_summary(report):
    print(f"{'task':<14} {'kind':<12} {'correct':>13} {'accuracy':>9} {'baseline':>9} "
          f"{'centered':>9} {'cut':>5}")
    for r in report["tasks"]:
        extra = r["baseline"] is None  # not part of ChatCORE
        print(f"{r['task']:<14} {r['kind']:<12} {r['correct']:>6}/{r['items']:<6} "
              f"{r['accuracy']:>9.4f} {'-' if extra else format(r['baseline'], '.2f'):>9} "
              f"{'-' if extra else format(r['centered'], '+.4f'):>9} {r['cut']:>5}")
    scope = "all items of every task" if report["complete"] else \
        "a subset of tasks or items: not comparable with a full ChatCORE"
    chatcore = "unknown (no ChatCORE task ran)"
    if report["chatcore"] is not None:
        chatcore = f"{report['chatcore']:.4f}"
    print(f"ChatCORE {chatcore} ({sum(r['baseline'] is not None for r in report['tasks'])} tasks, "
          f"{scope}); {sum(r['items'] for r in report['tasks']):,} items in "
          f"{report['seconds']:.1f} s on {report['world_size']} x {report['device']}; cut = "
          f"prompt cropped or reply stopped by the {report['sequence_len']}-token window")
    lines = diagnostic_lines(report["tasks"])
    if lines:
        print(f"diagnostics, outside ChatCORE (option text: {OPTION_TEXT_RULE}):")
        print("\n".join(lines))


def write_outputs(report, records, out, run_dir):
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    items_path = out.with_name(out.stem + "_items.jsonl")
    items_path.write_text("".join(json.dumps(r) + "\n" for r in records))
    written = f"{out}, {items_path}"
    # a run directory: its metrics get the scores at this step
    if (run_dir / "metrics.jsonl").is_file():
        scores = {r["task"]: r["accuracy"] for r in report["tasks"]}
        distributed.append_jsonl(run_dir / "metrics.jsonl", {
            "step": report["step"], "chatcore": report["chatcore"], "chat_eval": scores,
            "chat_eval_complete": report["complete"]})
        written += f", a line in {run_dir / 'metrics.jsonl'}"
    print(f"results: {written}")


def download_task(task, cache_dir):
    """The hub task's test files into cache_dir/task, where tasks.py reads them; files.json,
    written last, says they are whole."""
    try:
        return tasks.hub_files(task, cache_dir)
    except FileNotFoundError:
        pass
    repo, pattern = tasks.HUB_TASKS[task][:2]
    out_dir = Path(cache_dir) / task
    paths = sorted(f["path"] for f in list_hub_files(repo) if re.fullmatch(pattern, f["path"]))
    if not paths:
        raise ValueError(f"{repo} has no file matching {pattern}: the dataset's layout changed; "
                         "please report it")
    files = download_hub_files(repo, paths, out_dir)
    (out_dir / "files.json").write_text(json.dumps([f.name for f in files]))
    return files


def download_only(args):
    """--download_only: a gated or missing task, or a machine that cannot contain its programs,
    stops the run before training."""
    asked = args.tasks.split(",") if args.tasks else list(tasks.HUB_TASKS)
    unknown = [t for t in asked if t not in tasks.HUB_TASKS]
    if unknown:
        raise ValueError(f"--tasks: {', '.join(unknown)} not among the hub tasks: "
                         f"{', '.join(tasks.HUB_TASKS)}")
    if "HumanEval" in asked:
        print(sandbox.describe(*sandbox.choose(args.sandbox)))
    for task in asked:
        print(f"download: {task}: {len(download_task(task, args.cache_dir))} files in "
              f"{Path(args.cache_dir) / task}")


def asked_tasks(args, demo_dir):
    """(tasks asked, tasks available), the demo world's or the hub's."""
    available = tasks.DEMO_TASKS if demo_dir is not None else tasks.HUB_TASKS
    asked = args.tasks.split(",") if args.tasks else list(available)
    extra = tasks.DEMO_EXTRA if demo_dir is not None else {}
    if unknown := [t for t in asked if t not in available | extra]:
        hint = "" if demo_dir is None else " (--demo none for the hub tasks)"
        raise ValueError(f"--tasks: {', '.join(unknown)} not among the "
                         f"{'demo world' if demo_dir else 'hub'} tasks: "
                         f"{', '.join(available)}{hint}")
    return asked, available


def print_plan(args, ckpt, how, meta, model, tokenizer_path, demo_dir, loaded, contained):
    print(f"checkpoint: {ckpt} ({how}; stage {meta.get('stage') or 'unknown'}, step "
          f"{meta.get('step', 'unknown')}, {num_params(model.config):,} parameters); tokenizer "
          f"{tokenizer_path}")
    print(f"tasks from {demo_dir or 'the hub'} "
          f"({args.cache_dir if demo_dir is None else 'offline'}):")
    for t, (items, total) in loaded.items():
        _, _, kind, baseline = ALL_TASKS[t]
        print(f"  {t:<14} {kind:<12} {len(items):,} of {total:,} items, baseline {baseline}")
    if contained:
        print(contained)


def main(argv=None):
    args = get_args(argv)
    if args.download_only:
        return download_only(args)
    rank, _, world, device = distributed.setup_distributed()
    ckpt, how = checkpoint.pick_checkpoint(args)
    model, meta = checkpoint.load_model(ckpt, device)
    tokenizer, tokenizer_path = checkpoint.checkpoint_tokenizer(meta, ckpt, args.tokenizer)
    demo_dir = tasks.demo_world(args.demo, meta.get("data_dir"), "chat_eval")
    asked, available = asked_tasks(args, demo_dir)
    level = contained = None
    if "HumanEval" in asked:
        level, why = sandbox.choose(args.sandbox)
        contained = sandbox.describe(level, why)

    def load_tasks():  # rank 0 downloads the hub's; the others then find them in the cache
        if demo_dir is None:
            for task in asked:
                download_task(task, args.cache_dir)
        return {t: tasks.load_items(t, args.cache_dir, demo_dir, args.max_items) for t in asked}
    loaded = distributed.fetch_everywhere(load_tasks, rank, world)
    if rank == 0:
        print_plan(args, ckpt, how, meta, model, tokenizer_path, demo_dir, loaded, contained)
    marker = f"chat_eval: check passed {secrets.token_hex(8)}"
    start = time.perf_counter()
    verdicts, records, task_seconds = {}, [], {}
    for t in asked:
        task_start = time.perf_counter()
        verdicts[t], task_records = evaluate_task(t, loaded[t][0], model, tokenizer, args, rank,
                                                  world, device, marker, level)
        task_seconds[t] = time.perf_counter() - task_start
        records += task_records
    seconds = time.perf_counter() - start
    rows, chatcore = summarize(asked, verdicts, {t: loaded[t][1] for t in asked})
    for row in rows:
        row["seconds"] = task_seconds[row["task"]]
        own = [r for r in records if r["task"] == row["task"]]
        row["diagnostics"] = task_diagnostics(row["kind"], own)
    if rank != 0:
        return
    complete = set(available) <= set(asked) and all(r["items"] == r["items_in_task"] for r in rows)
    report = {"checkpoint": str(ckpt), "stage": meta.get("stage"), "step": meta.get("step"),
              "parameters": num_params(model.config), "tasks_from": str(demo_dir or "hub"),
              "chatcore": chatcore, "complete": complete, "tasks": rows,
              "max_items": args.max_items, "batch_items": args.batch_items,
              "option_text": args.option_text, "max_new_tokens": args.max_new_tokens,
              "sequence_len": model.config.sequence_len,
              "sandbox": None if level is None else {"level": level, "description": contained,
                                                     "timeout_s": args.timeout,
                                                     "memory_mb": args.memory_mb},
              "world_size": world, "device": distributed.device_name(device),
              "hardware": distributed.WORLD, "dtype": args.dtype, "seconds": seconds,
              "argv": sys.argv, "versions": distributed.versions()}
    print_summary(report)
    write_outputs(report, records, Path(args.out or ckpt.parent.parent / "chat_eval.json"),
                  ckpt.parent.parent)


if __name__ == "__main__":
    sys.exit(distributed.run_main(main))
