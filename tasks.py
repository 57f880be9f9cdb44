"""The chat tasks' loading, rendering and scoring (ARC, MMLU, GSM8K, HumanEval, the demo
world's) for chat_eval.py and rl.py. Not a stage.

    python tasks.py GSM8K --max_items 2  # a task's first items in nanochat's order, as scored
    python tasks.py demo-answer --demo data/demo
"""
import argparse
import json
import re
import sys
from decimal import Decimal, InvalidOperation
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq

from dataset import CACHE_DIR, chat_files, multiple_choice
from distributed import run_main

# task: (hub repo, test files, kind, random baseline). Kinds: categorical (a letter's logit), gsm8k
# (the number after '#### '), humaneval (passes the tests), exact (normalized answer).
HUB_TASKS = {"ARC-Easy": ("allenai/ai2_arc", r"ARC-Easy/test-\d+-of-\d+\.parquet", "categorical",
                          0.25),
             "ARC-Challenge": ("allenai/ai2_arc", r"ARC-Challenge/test-\d+-of-\d+\.parquet",
                               "categorical", 0.25),
             "MMLU": ("cais/mmlu", r"all/test-\d+-of-\d+\.parquet", "categorical", 0.25),
             "GSM8K": ("openai/gsm8k", r"main/test-\d+-of-\d+\.parquet", "gsm8k", 0.0),
             "HumanEval": ("openai/openai_humaneval", r"openai_humaneval/test-\d+-of-\d+\.parquet",
                           "humaneval", 0.0)}
DEMO_TASKS = {"demo-choice": (None, None, "categorical", 0.25), "demo-answer": (None, None, "exact",
                                                                                0.0),
              "demo-problems": (None, None, "gsm8k", 0.0)}
# Only by name (--tasks), not in ChatCORE: untemplated questions, right when the reply contains
# the answer
DEMO_EXTRA = {"demo-words": (None, None, "contains", None)}
ALL_TASKS = HUB_TASKS | DEMO_TASKS | DEMO_EXTRA
# nanochat's order: datasets' shuffle(seed=42) is np.random.default_rng(42).permutation(n)
SHUFFLE_SEED = 42


# -----------------------------------------------------------------------------
# Loading a task's items in nanochat's order; the prompt

def hub_files(task, cache_dir):
    """The task's test files, as chat_eval.py downloaded them."""
    out_dir = Path(cache_dir) / task
    done = out_dir / "files.json"
    names = json.loads(done.read_text()) if done.is_file() else []
    if not names or not all((out_dir / name).is_file() for name in names):
        raise FileNotFoundError(f"{task}'s test files are not in {out_dir}: download them with "
                                f"`python chat_eval.py --download_only --tasks {task} "
                                f"--cache_dir {cache_dir}`")
    return [out_dir / name for name in names]


def read_rows(task, cache_dir, demo_dir):
    """[(where, row)] of the task's data, in file order."""
    if demo_dir is not None:
        path = Path(demo_dir) / "chat_eval" / f"{task}.jsonl"
        if not path.is_file():
            raise FileNotFoundError(f"{path} does not exist: write the demo world again (python "
                                    f"demo.py --out {demo_dir}), which writes chat_eval/")
        lines = path.read_text().splitlines()
        try:
            return [(f"{path}, line {i + 1}", json.loads(line))
                    for i, line in enumerate(lines) if line.strip()]
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: a line is not valid JSON ({e}): write the demo world "
                             "again") from None
    return [(f"{f}, row {i}", row) for f in hub_files(task, cache_dir)
            for i, row in enumerate(pq.read_table(f).to_pylist())]


def make_item(task, row, where):
    """An item from a hub (or demo.py) row. Fields by kind: categorical {prompt, letters,
    answer, options, question}, gsm8k {prompt, answer}, humaneval {prompt, test, entry_point,
    id}, exact and contains {prompt, answers}."""
    try:
        if task.startswith("ARC") or task in ("MMLU", "demo-choice"):
            prompt, letters, answer, options = multiple_choice(
                    row, "gold" if task == "demo-choice" else "answer")
            return {"prompt": prompt, "letters": letters, "answer": answer, "options": options,
                    "question": row["question"]}
        if task in ("GSM8K", "demo-problems"):
            answer = gsm8k_answer(row["answer"])
            if answer is None:
                raise KeyError("no '#### <number>' in its answer")
            return {"prompt": row["question"], "answer": answer}
        if task == "HumanEval":
            return {"prompt": row["prompt"], "test": row["test"], "entry_point": row["entry_point"],
                    "id": row["task_id"]}
        return {"prompt": row["question"], "answers": list(row["answers"])}
    except (KeyError, TypeError, IndexError, ValueError) as e:
        raise ValueError(f"{where}: not in {task}'s layout ({type(e).__name__}: {e}): the file is "
                         "damaged or its layout changed; delete it (a hub file is fetched again, "
                         "the demo world's written again by demo.py), or report the "
                         "change") from None


def load_items(task, cache_dir, demo_dir, max_items):
    """(items, row count): the first max_items rows in nanochat's order."""
    rows = read_rows(task, cache_dir, demo_dir)
    order = np.random.default_rng(SHUFFLE_SEED).permutation(len(rows)).tolist()
    order = order[:max_items] if max_items > 0 else order
    return [{**make_item(task, rows[i][1], rows[i][0]), "row": i} for i in order], len(rows)


def prompt_ids(tokenizer, question, seq_len, room):
    """(ids, cut): the question as a user message, then <|assistant_start|>; past seq_len - room,
    tokens after the BOS are dropped."""
    ids = tokenizer.render_for_completion([{"role": "user", "content": question}])
    keep = seq_len - room
    return (ids, False) if len(ids) <= keep else ([ids[0], *ids[len(ids) - keep + 1:]], True)


# -----------------------------------------------------------------------------
# GSM8K: nanochat's rule and a lenient diagnostic reading; rl.py's questions

NUMBER = r"-?\d[\d,]*(?:\.\d+)?"
GSM_RE = re.compile(r"#### (\-?[0-9\.\,]+)")  # nanochat's tasks/gsm8k.py, character for character


def gsm8k_answer(text):
    """nanochat's extract_answer: the number after the first '#### ' as a string, commas dropped;
    None without the marker. ChatCORE compares strings: '18.00' is not '18'."""
    match = GSM_RE.search(text)
    return match.group(1).strip().replace(",", "") if match else None


def final_number(text, marker_only=False):
    """Lenient, outside ChatCORE: a Decimal after the first '####' ('$' and spaces allowed),
    else (not marker_only) the last number; 18.00 is 18."""
    found = re.findall(r"####\s*\$?\s*(" + NUMBER + ")",
                       text)[:1] or ([] if marker_only else re.findall(NUMBER, text))
    # NUMBER without commas: always a valid Decimal
    return Decimal(found[-1].replace(",", "")) if found else None


def same_number(lenient, answer):
    try:
        return lenient is not None and lenient == Decimal(answer)
    except InvalidOperation:
        return False


def gsm8k_items(train_dir):
    """rl.py's items from GSM8K-shaped training files."""
    return [make_item("GSM8K", row, f"{path}, row {i}") for path in chat_files(train_dir, "train")
            for i, row in enumerate(pq.read_table(path).to_pylist())]


def reward(item, reply):
    """rl.py's reward: 1.0 when the number after '####' equals the answer, else 0.0."""
    number = final_number(reply, marker_only=True)
    return float(number is not None and number == Decimal(item["answer"]))


# -----------------------------------------------------------------------------
# HumanEval (chat_eval.py runs the program in sandbox.py)

def humaneval_program(item, reply, marker):
    """nanochat's program: the prompt's imports, the reply's code (first ``` block, else all;
    without the entry point's def it continues the prompt), the tests, check(entry_point). The
    marker, printed last, proves check() returned: an early exit(0) passes nothing."""
    blocks = re.findall(r"```(?:python)?\s*\n(.*?)\n```", reply, re.DOTALL)
    code = (blocks[0] if blocks else reply).lstrip("\n").rstrip()
    if not re.search(rf"^\s*def\s+{re.escape(item['entry_point'])}\s*\(", code, re.MULTILINE):
        code = item["prompt"] + code
    imports = []
    for line in item["prompt"].splitlines():
        if line.strip().startswith(("import ", "from ")):
            imports.append(line.strip())
        elif line.strip() and not line.strip().startswith("#"):
            break
    return "\n\n".join(["\n".join(imports), code, item["test"], f"check({item['entry_point']})",
                        f"print({marker!r})"]) + "\n"


# -----------------------------------------------------------------------------
# The demo world: short answers compared normalized

def demo_world(arg, data_dir, part):
    """The demo world --demo names, or None: none; auto = the pretraining data's world if it has
    `part`; or DIR, which must have it."""
    if arg == "none":
        return None
    if arg == "auto":
        world = Path(data_dir).parent if data_dir else None
        return world if world is not None and (world / part).is_dir() else None
    if not (Path(arg) / part).is_dir():
        raise FileNotFoundError(f"--demo {arg}: no {part}/ in it: write the demo world there with "
                                f"`python demo.py --out {arg}`")
    return Path(arg)


def normalize(text):
    """Lower case, no punctuation or leading article, spaces collapsed."""
    words = re.sub(r"[^\w\s-]", " ", text.lower()).split()
    return " ".join(words[1:] if words[:1] in (["the"], ["a"], ["an"]) else words)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("task", choices=list(ALL_TASKS), help="the task whose first items to print")
    p.add_argument("--demo", default=None, help="the demo world, for its tasks; the hub's are "
                   "read from chat_eval.py's cache (default: none)")
    p.add_argument("--max_items", type=int, default=3, help="items, the first in nanochat's order "
                   "(default: %(default)s)")
    args = p.parse_args(argv)
    if (args.demo is None) == (args.task in DEMO_TASKS | DEMO_EXTRA):
        p.error("--demo DIR is what the demo tasks are read from, and only they")
    items, rows = load_items(args.task, CACHE_DIR / "chat_eval", args.demo, args.max_items)
    print(f"{args.task}: {rows:,} items; the first {len(items)}:\n" + "\n".join(json.dumps(item)
                                                                                for item in items))


if __name__ == "__main__":
    sys.exit(run_main(main))
