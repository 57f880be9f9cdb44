"""Evaluate a checkpoint: CORE (DCLM's 22 in-context tasks, nanochat's rules unless --protocol
dclm), validation bits per byte, and greedy completions of fixed prompts.

    python core_eval.py  # newest checkpoint under runs/, bundle chosen below
    python core_eval.py --checkpoint runs/NAME --bundle data/demo/eval_bundle --max_items 100
    torchrun --standalone --nproc_per_node=8 core_eval.py --checkpoint runs/NAME

A --bundle URL is downloaded, checked and unzipped once into the cache (docs/eval.md). Writes
runs/<run>/core_eval/step_XXXXXX/: results.json, results.csv (a row per task), items.jsonl (each
item's prediction). Bad input stops before the model runs.
"""
import argparse
import csv
import json
import os
import random
import shutil
import sys
import time
import zipfile
import zlib
from dataclasses import dataclass
from hashlib import sha256
from pathlib import Path
from urllib.parse import urlparse

import torch
import yaml

import checkpoint
import distributed
import train_loop
from dataset import CACHE_DIR
from decode import decode
from loader import val_rows
from model import score_rows
from prepare import download_file

# the bundle nanochat uses
BUNDLE_URL = "https://karpathy-public.s3.us-west-2.amazonaws.com/eval_bundle.zip"
# task type: the keys its items need
TASK_KEYS = {"multiple_choice": ("query", "choices", "gold"),
             "schema": ("context_options", "continuation", "gold"),
             "language_modeling": ("context", "continuation")}
# which tokens are scored; both use nanochat's items, order and few-shot examples
PROTOCOLS = ("nanochat", "dclm")
FEWSHOT_SEED, SUBSET_SEED = 1234, 1337  # nanochat's: the same items and examples
COMPLETIONS = ["Once upon a time,", "The most important thing to learn is", "In the morning, the",
               "When the rain stopped,"]
# (prompt, accepted answers, world): found if the greedy completion starts with one; the demo
# world's are facts of demo.py's tables (tests/test_demo.py checks them)
KNOWLEDGE = [("The capital of France is", ["Paris"], "real"),
             ("The chemical symbol for gold is", ["Au"], "real"),
             ("The largest planet in the solar system is", ["Jupiter"], "real"),
             ("Romeo and Juliet was written by", ["Shakespeare"], "real"),
             ("The capital of Aldora is", ["Pelmo"], "demo"),
             ("The national animal of Brenia is the", ["owl"], "demo"),
             ("The day after Tuesday is", ["Wednesday"], "demo"),
             ("Two plus three is", ["five", "5"], "demo")]


def get_args(argv=None):
    cuda = torch.cuda.is_available()
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    checkpoint.add_checkpoint_args(p, "the newest checkpoint under --runs_dir", eval_dtype=True)
    p.add_argument("--bundle", default="auto", help="eval bundle directory or URL; auto = the "
                   f"demo world's for a demo checkpoint, else {BUNDLE_URL} (default: %(default)s)")
    p.add_argument("--bundle_sha256", default=None, help="expected sha256 of a downloaded "
                   "eval_bundle.zip (default: not pinned; the one found is printed and saved)")
    p.add_argument("--tasks", default=None, help="comma-separated task labels (default: all in "
                   "core.yaml)")
    p.add_argument("--protocol", default="nanochat", choices=PROTOCOLS, help=
                   "nanochat: whole prompts tokenized at once, scored where the options' tokens "
                   "differ; dclm: every continuation token, tokenized apart from its context "
                   "(default: %(default)s)")
    p.add_argument("--max_items", type=int, default=-1, help="items per task, nanochat's fixed "
                   "random subset (the few-shot examples' source too); -1 = all "
                   "(default: %(default)s)")
    p.add_argument("--batch_items", type=int, default=16 if cuda else 1, help=
                   "items per forward pass, each with all its choices; on a CPU more only adds "
                   "padding (default: %(default)s)")
    p.add_argument("--data_dir", default=None, help="corpus whose validation split gives bits per "
                   "byte (default: the checkpoint's)")
    p.add_argument("--bpb_tokens", type=int, default=2 ** 20, help="validation tokens for bits per "
                   "byte (the split's first); 0 = skip (default: %(default)s)")
    p.add_argument("--max_new_tokens", type=int, default=24, help="greedy tokens per prompt "
                   "(default: %(default)s)")
    p.add_argument("--out", default=None, help="output directory (default: "
                   "runs/<run>/core_eval/step_XXXXXX)")
    p.add_argument("--download_only", action="store_true", help="fetch and check the bundle "
                   "(auto: the hub bundle) into the cache and exit; no checkpoint needed")
    args = p.parse_args(None if argv is None else [str(a) for a in argv])  # argv may hold paths
    if args.batch_items < 1 or args.max_items == 0 or args.max_items < -1:
        p.error("--batch_items must be >= 1 and --max_items -1 (all) or >= 1")
    return args


# -----------------------------------------------------------------------------
# The bundle: download, verify, unzip once

def verify_zip(path):
    """download_file's check: every member passes its CRC and core.yaml is there."""
    try:
        with zipfile.ZipFile(path) as z:
            bad = z.testzip()
            names = z.namelist()
    # zlib: a corrupt deflate stream, before any CRC
    except (zipfile.BadZipFile, zlib.error, OSError) as e:
        raise ValueError(f"{path} is not a readable zip ({e})") from e
    if bad is not None:
        raise ValueError(f"{path}: member {bad} fails its CRC check")
    if not any(Path(n).name == "core.yaml" for n in names):
        raise ValueError(f"{path} holds no core.yaml: not a CORE eval bundle")


def find_bundle_root(directory):
    found = sorted(Path(directory).rglob("core.yaml"), key=lambda p: len(p.parts))
    if not found:
        raise FileNotFoundError(f"--bundle {directory}: no core.yaml in it or below: a bundle "
                                "holds core.yaml, eval_meta_data.csv and eval_data/")
    return found[0].parent


def fetch_bundle(url, expected_sha256=None, cache_dir=None):
    """(bundle root, provenance): url downloaded into the cache and unzipped once, renamed into
    place only when complete; later calls touch no network."""
    cache = Path(cache_dir or CACHE_DIR) / "eval_bundle" / sha256(url.encode()).hexdigest()[:16]
    done_file = cache / "unzipped.json"
    if done_file.is_file():
        provenance = json.loads(done_file.read_text())
        if expected_sha256 and provenance["sha256"] != expected_sha256.lower():
            raise ValueError(f"the cached bundle from {url} has sha256 {provenance['sha256']}, not "
                             f"--bundle_sha256 {expected_sha256}: delete {cache} to fetch it again")
        print(f"bundle: cached {cache / 'unzipped'} (from {url}, sha256 "
              f"{provenance['sha256'][:16]}...)")
        return find_bundle_root(cache / "unzipped"), provenance
    zip_path = cache / (Path(urlparse(url).path).name or "eval_bundle.zip")
    print(f"bundle: downloading {url} into {cache}")
    download_file(url, zip_path, sha256=expected_sha256, verify=verify_zip)
    digest = sha256(zip_path.read_bytes()).hexdigest()
    tmp = cache / ".unzipping"
    shutil.rmtree(tmp, ignore_errors=True)
    with zipfile.ZipFile(zip_path) as z:
        z.extractall(tmp)  # zipfile drops absolute paths and '..' from member names
    shutil.rmtree(cache / "unzipped", ignore_errors=True)
    os.replace(tmp, cache / "unzipped")
    provenance = {"url": url, "sha256": digest, "bytes": zip_path.stat().st_size}
    done_file.write_text(json.dumps(provenance))
    zip_path.unlink()  # the unzipped tree and its sha256 are what is kept
    print(f"bundle: {provenance['bytes']:,} bytes, sha256 {digest}, unzipped into "
          f"{cache / 'unzipped'}")
    return find_bundle_root(cache / "unzipped"), provenance


def resolve_bundle(arg, meta, expected_sha256=None):
    if arg == "auto":
        demo = Path(meta.get("data_dir") or ".").parent / "eval_bundle"
        if (demo / "core.yaml").is_file():
            print(f"bundle: auto -> {demo} (the demo world's, beside the checkpoint's data)")
            return demo, {"dir": str(demo)}
        arg = BUNDLE_URL
    if urlparse(arg).scheme in ("http", "https"):
        return fetch_bundle(arg, expected_sha256)
    return find_bundle_root(arg), {"dir": str(arg)}


# -----------------------------------------------------------------------------
# Tasks: core.yaml + eval_meta_data.csv + jsonl files, checked before the model runs

@dataclass
class Task:
    label: str
    kind: str  # one of TASK_KEYS
    fewshot: int
    delimiter: str
    baseline: float  # a fraction (the csv has percent)
    items: list
    path: str


def read_items(path, kind):
    items = []
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}, line {line_no}"
            try:
                item = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: not valid JSON ({e}): fix or delete the line") from None
            missing = [k for k in TASK_KEYS[kind] if k not in item]
            if missing:
                raise ValueError(f"{where}: a {kind} item needs {', '.join(TASK_KEYS[kind])}; "
                                 f"missing {', '.join(missing)}")
            options = item.get("choices", item.get("context_options"))
            gold = item.get("gold")
            if kind != "language_modeling" and not (
                    isinstance(options, list) and len(options) >= 2 and isinstance(gold, int)
                    and 0 <= gold < len(options)):
                raise ValueError(f"{where}: needs a list of at least 2 options and a gold index "
                                 "into it")
            texts = [item[k] for k in ("query", "context",
                                       "continuation") if k in item] + list(options or [])
            if not all(isinstance(text, str) for text in texts):
                raise ValueError(f"{where}: every query, context, choice and continuation must be "
                                 "a string")
            # nothing to score: a mean over no tokens
            if not all(item.get("choices", [item.get("continuation")])):
                raise ValueError(f"{where}: an empty continuation or choice; fix or delete the "
                                 "line")
            items.append(item)
    return items


def load_tasks(root, only=None):
    """core.yaml's tasks (or those in `only`)."""
    root = Path(root)
    try:
        spec = yaml.safe_load((root / "core.yaml").read_text())["icl_tasks"]
    except (yaml.YAMLError, KeyError, TypeError) as e:
        raise ValueError(f"{root / 'core.yaml'}: not a core.yaml with an icl_tasks list "
                         f"({e})") from None
    with open(root / "eval_meta_data.csv", newline="", encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    if rows and not {"Eval Task", "Random baseline"} <= set(rows[0]):
        raise ValueError(f"{root / 'eval_meta_data.csv'}: needs the columns 'Eval Task' and "
                         "'Random baseline'")
    baselines = {r["Eval Task"]: r["Random baseline"] for r in rows}
    labels = [t.get("label") for t in spec]
    unknown = sorted(set(only or []) - set(labels))
    if unknown:
        raise ValueError(f"--tasks: {', '.join(unknown)} not in {root / 'core.yaml'}; its tasks: "
                         f"{', '.join(labels)}")
    return [task_from_spec(root, t, baselines) for t in spec if not only or t.get("label") in only]


def task_from_spec(root, t, baselines):
    """One task of core.yaml from its entry `t`, checked."""
    label, kind, shots = t.get("label"), t.get("icl_task_type"), t.get("num_fewshot", [0])
    where = f"{root / 'core.yaml'}, task {label}"
    if kind not in TASK_KEYS:
        raise ValueError(f"{where}: icl_task_type {kind!r} is not one of {', '.join(TASK_KEYS)}")
    shots = shots if isinstance(shots, list) else [shots]
    if len(shots) != 1 or not isinstance(shots[0], int) or shots[0] < 0:
        raise ValueError(f"{where}: num_fewshot must be one count, like [5]; it is "
                         f"{t.get('num_fewshot')!r}")
    try:
        baseline = float(baselines[label]) / 100
    except (KeyError, ValueError):
        raise ValueError(f"{root / 'eval_meta_data.csv'}: no 'Random baseline' for task {label} "
                         f"(got {baselines.get(label)!r}): add a row "
                         f"'{label},<category>,<type>,<percent>'") from None
    if not 0 <= baseline < 1:
        raise ValueError(f"{root / 'eval_meta_data.csv'}: task {label}'s random baseline "
                         f"{baseline * 100}% is outside [0, 100)")
    path = root / "eval_data" / str(t.get("dataset_uri"))
    if not path.is_file():
        raise FileNotFoundError(f"{where}: {path} does not exist: the bundle is incomplete; fetch "
                                "it again")
    items = read_items(path, kind)
    if len(items) <= shots[0]:
        raise ValueError(f"{where}: {len(items)} items in {path}, but {shots[0]}-shot prompts need "
                         f"at least {shots[0] + 1} (the examples are never the item itself): lower "
                         "its num_fewshot in core.yaml or add items")
    return Task(label, kind, shots[0], t.get("continuation_delimiter", " "), baseline, items,
                str(path))


# -----------------------------------------------------------------------------
# Prompts and scored tokens

def task_order(n_items, max_per_task):
    """Item indices in nanochat's order, cut to max_per_task. Few-shot examples come from this
    list, so the cut changes them too."""
    order = list(range(n_items))
    random.Random(SUBSET_SEED).shuffle(order)
    return order[:max_per_task] if max_per_task > 0 else order


def fewshot_positions(n, position, k):
    """nanochat's draw: k positions of n, never `position`; too short a list gives every other
    position (nanochat's random.sample raises there)."""
    others = [p for p in range(n) if p != position]
    return random.Random(FEWSHOT_SEED + position).sample(others, min(k, len(others)))


def prompt_pairs(task, order, position):
    """(context, continuation) per row of the item, as nanochat renders them: the solved few-shot
    examples, each then a blank line, then the item, a row per choice (multiple choice), per
    context option (schema), or its answer (language modelling, contexts stripped)."""
    d = task.delimiter
    # the pairs of an item or few-shot example, no delimiter yet
    def rows(ex):
        if task.kind == "multiple_choice":
            return [(ex["query"], choice) for choice in ex["choices"]]
        if task.kind == "schema":
            return [(option, ex["continuation"]) for option in ex["context_options"]]
        return [(ex["context"].strip(), ex["continuation"])]
    examples = [task.items[order[p]] for p in fewshot_positions(len(order), position, task.fewshot)]
    solved = [rows(ex)[0 if task.kind == "language_modeling" else ex["gold"]] for ex in examples]
    prefix = "".join(context + d + continuation + "\n\n" for context, continuation in solved)
    return [(prefix + context + d, continuation) for context,
            continuation in rows(task.items[order[position]])]


def shared_length(rows):
    n = min(map(len, rows))
    return next((i for i in range(n) if len({row[i] for row in rows}) > 1), n)


def nanochat_rows(kind, pairs, tokenizer):
    """[(ids, first scored index)] by nanochat's rules: BOS + context + continuation tokenized at
    once. Multiple choice: scored after the rows' common prefix; schema: from their common suffix;
    language modelling: after the stripped context. An empty span (nanochat's NaN) moves the
    boundary one token; where BPE merges across the context's end (nanochat asserts it cannot)
    scoring starts where the tokenizations part (docs/eval.md)."""
    rows = [[tokenizer.bos_id, *tokenizer.encode(context + continuation)] for context,
            continuation in pairs]
    shortest = min(map(len, rows))
    if kind == "multiple_choice":
        return [(ids, min(shared_length(rows), shortest - 1)) for ids in rows]
    if kind == "schema":
        suffix = min(max(shared_length([ids[::-1] for ids in rows]), 1), shortest - 1)
        return [(ids, len(ids) - suffix) for ids in rows]
    (ids,) = rows
    context = [tokenizer.bos_id, *tokenizer.encode(pairs[0][0].strip())]
    return [(ids, min(shared_length([context, ids]), len(ids) - 1))]


def dclm_rows(pairs, tokenizer):
    """[(ids, first scored index)], every continuation token scored: tokenized apart, BOS first,
    the context's trailing spaces moved to the continuation (' Paris' is one token)."""
    rows = []
    for context, continuation in pairs:
        kept = context.rstrip(" ")
        ctx = [tokenizer.bos_id, *tokenizer.encode(kept)]
        rows.append((ctx + tokenizer.encode(context[len(kept):] + continuation), len(ctx)))
    return rows


def fit_window(ids, start, seq_len):
    """(ids, start, cropped): the rotary tables end at seq_len, so a longer row keeps its BOS and
    loses the tokens after it, as training cuts long documents. nanochat never crops: its tables
    are 10x longer."""
    crop = max(0, len(ids) - 1 - seq_len)
    return ([ids[0], *ids[crop + 1:]], max(1, start - crop), True) if crop else (ids, start, False)


def item_rows(task, order, position, tokenizer, seq_len, protocol="nanochat"):
    """[(ids, first scored index, cropped)] per row of the item."""
    pairs = prompt_pairs(task, order, position)
    rows = nanochat_rows(task.kind, pairs,
                         tokenizer) if protocol == "nanochat" else dclm_rows(pairs, tokenizer)
    return [fit_window(ids, start, seq_len) for ids, start in rows]


# -----------------------------------------------------------------------------
# Scoring

@torch.no_grad()
def score_batch(model, batch_rows, device, dtype):
    """Per row: (mean loss over ids[start:], whether every greedy prediction there is right)."""
    (losses, predicted), y = score_rows(model, [row[:2] for row in batch_rows], dtype, device,
                                        predictions=True)
    scored = y != -1
    mean_loss = (losses * scored).sum(1) / scored.sum(1)
    exact = ((predicted == y) | ~scored).all(1)
    return mean_loss.float().cpu(), exact.cpu()


def evaluate_tasks(model, tokenizer, tasks, max_per_task, batch_items, dtype, rank, world, device,
                   protocol="nanochat", progress=False):
    """Per task: (item, predicted option or -1, correct, cropped) per item, on every rank; items
    sorted by prompt length (less padding)."""
    if protocol not in PROTOCOLS:
        raise ValueError(f"protocol {protocol!r} is not one of {', '.join(PROTOCOLS)}")
    results = []
    for task in tasks:
        start, order = time.perf_counter(), task_order(len(task.items), max_per_task)
        table = torch.zeros(len(order), 4, dtype=torch.float64)  # done, option, correct, cropped
        by_length = sorted(range(len(order)), key=lambda p: max(len(c + x) for c,
                                                                x in prompt_pairs(task, order, p)))
        for b in range(rank * batch_items, len(order), world * batch_items):
            batch = by_length[b:b + batch_items]
            rows_per_item = [item_rows(task, order, p, tokenizer, model.config.sequence_len,
                                       protocol) for p in batch]
            mean_loss, exact = score_batch(model, [r for rows in rows_per_item for r in rows],
                                           device, dtype)
            at = 0
            for p, rows in zip(batch, rows_per_item):
                if task.kind == "language_modeling":
                    predicted, correct = -1, bool(exact[at])
                else:
                    # a tie: the first option, as nanochat
                    predicted = int(mean_loss[at:at + len(rows)].argmin())
                    correct = predicted == task.items[order[p]]["gold"]
                cropped = any(row[2] for row in rows)
                table[p] = torch.tensor([1.0, predicted, correct, cropped], dtype=torch.float64)
                at += len(rows)
        distributed.all_reduce_tensor(table)
        if not table[:, 0].eq(1).all():
            raise RuntimeError("an item was evaluated by no rank or by two: a bug in "
                               "evaluate_tasks")
        results.append(sorted((i, int(table[p, 1]), bool(table[p, 2]), bool(table[p, 3])) for p,
                              i in enumerate(order)))
        if progress and rank == 0:
            accuracy, seconds = table[:, 2].mean().item(), time.perf_counter() - start
            print(f"core_eval: {task.label:<32} {len(order):>5} items  acc {accuracy:.4f}  "
                  f"centered {centered(accuracy, task.baseline):+.4f}  {seconds:.1f} s", flush=True)
    return results


def centered(accuracy, baseline):
    """0 at the random baseline, 1 at perfect."""
    return (accuracy - baseline) / (1 - baseline)


def summarize(tasks, results):
    """A row per task, and CORE, the mean centered accuracy. fewshot: the count used (fewer when
    --max_items leaves too few); cropped: items cut to fit the window."""
    rows = []
    for task, items in zip(tasks, results):
        correct = sum(c for _, _, c, _ in items)
        accuracy = correct / len(items)
        rows.append({"task": task.label, "type": task.kind, "fewshot": min(task.fewshot,
                                                                           len(items) - 1),
                     "items": len(items), "items_in_task": len(task.items), "correct": correct,
                     "accuracy": accuracy, "baseline": task.baseline, "centered": centered(
                             accuracy, task.baseline),
                     "cropped": sum(cropped for *_, cropped in items)})
    return rows, sum(r["centered"] for r in rows) / len(rows)


@torch.no_grad()
def completions(model, tokenizer, max_new_tokens, dtype):
    """Greedy completions of COMPLETIONS and KNOWLEDGE (found: it begins with an accepted
    answer)."""
    asked = [(p, None, None) for p in COMPLETIONS] + KNOWLEDGE
    prompts = [[tokenizer.bos_id, *tokenizer.encode(prompt)] for prompt, _, _ in asked]
    budgets = [min(max_new_tokens, model.config.sequence_len - len(ids)) for ids in prompts]
    # <|bos|> starts a new document; a few samples run eager (decode.py's docstring says why)
    rows, _ = decode(model, prompts, budgets, dtype=dtype, stop={tokenizer.bos_id},
                     compiled=False)
    out = []
    for (prompt, answers, world), row in zip(asked, rows):
        text = tokenizer.decode(row[:-1] if row[-1] == tokenizer.bos_id else row)
        record = {"prompt": prompt, "completion": text}
        if answers:
            record.update(world=world, answers=answers,
                          found=any(text.strip().lower().startswith(a.lower()) for a in answers))
        out.append(record)
    return out


def bits_per_byte(args, meta, model, tokenizer, rank, world, device):
    """The report's val_* entries: bits per byte and tokens scored, or why none."""
    out = {"val_bpb": None, "val_bpb_tokens": None, "val_bpb_note": None,
           "val_data_dir": args.data_dir or meta.get("data_dir")}
    if not args.bpb_tokens:
        return {**out, "val_bpb_note": "skipped (--bpb_tokens 0)"}
    if not (out["val_data_dir"] and Path(out["val_data_dir"]).is_dir()):
        return {**out, "val_bpb_note": f"unknown: no corpus at {out['val_data_dir']} (pass "
                "--data_dir)"}
    rows = val_rows(out["val_data_dir"], tokenizer, args.bpb_tokens,
                               model.config.sequence_len)
    out["val_bpb"], out["val_bpb_tokens"] = train_loop.val_bpb(model, rows, tokenizer.token_bytes,
                                                               8, args.dtype, rank,
                                                               world, device)
    return out


def print_summary(report):
    for r in report["tasks"]:
        print(f"{r['task']:<32} {r['type']:<17} {r['fewshot']:>2}-shot "
              f"{r['correct']:>5}/{r['items']:<5} acc {r['accuracy']:.4f}  baseline "
              f"{r['baseline']:.2f}  centered {r['centered']:+.4f}")
    n_items, cropped = (sum(r[k] for r in report["tasks"]) for k in ("items", "cropped"))
    scope = f"{len(report['tasks'])} tasks, all items" if report["complete"] else \
        f"{len(report['tasks'])} tasks, {n_items:,} items (a subset: not comparable with a full " \
        "CORE score)"
    print(f"CORE {report['core']:.4f} ({report['protocol']} protocol; {scope}; {cropped} items "
          f"cropped to sequence_len {report['sequence_len']}); {report['items_per_second']:,.1f} "
          f"items/s on {report['world_size']} x {report['device']}")
    print(f"val bpb: {report['val_bpb']:.4f} over {report['val_bpb_tokens']:,} tokens of "
          f"{report['val_data_dir']}"
          if report["val_bpb"] is not None else f"val bpb: {report['val_bpb_note']}")
    for s in report["samples"]:
        found = ""
        if "found" in s:
            found = (f"  [{s['world']} world: {'found' if s['found'] else 'not found'} "
                     f"{'/'.join(s['answers'])}]")
        print(f"sample: {s['prompt']!r} -> {s['completion']!r}{found}")


def write_results(out_dir, report, tasks, results):
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "results.json").write_text(json.dumps(report, indent=1))
    with open(out_dir / "results.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["protocol", *report["tasks"][0]],
                                lineterminator="\n")
        writer.writeheader()
        writer.writerows({"protocol": report["protocol"], **r} for r in report["tasks"])
        writer.writerow({"protocol": report["protocol"], "task": "CORE", "centered": report["core"],
                         "items": sum(r["items"] for r in report["tasks"])})
    with open(out_dir / "items.jsonl", "w") as f:
        f.writelines(json.dumps({"task": task.label, "item": i, "predicted": predicted,
                                 "gold": task.items[i].get("gold"),
                                 "correct": correct, "cropped": cropped}) + "\n"
                     for task, items in zip(tasks, results)
                     for i, predicted, correct, cropped in items)
    print(f"results: {out_dir}/results.json, results.csv, items.jsonl")


def main(argv=None):
    args = get_args(argv)
    # speedrun.sh, before pretraining: an unfetchable bundle stops the run early
    if args.download_only:
        bundle, _ = resolve_bundle(BUNDLE_URL if args.bundle == "auto" else args.bundle, {},
                                   args.bundle_sha256)
        tasks = load_tasks(bundle, args.tasks.split(",") if args.tasks else None)
        print(f"bundle: {len(tasks)} tasks, {sum(len(t.items) for t in tasks):,} items in {bundle}")
        return
    rank, _, world, device = distributed.setup_distributed()
    ckpt = checkpoint.find_checkpoint(args.checkpoint, args.runs_dir)
    model, meta = checkpoint.load_model(ckpt, device)
    tokenizer, tokenizer_path = checkpoint.checkpoint_tokenizer(meta, ckpt, args.tokenizer)
    bundle, provenance = distributed.fetch_everywhere(lambda: resolve_bundle(args.bundle, meta,
                                                                             args.bundle_sha256),
                                                      rank, world)
    tasks = load_tasks(bundle, args.tasks.split(",") if args.tasks else None)
    if rank == 0:
        print(f"checkpoint: {ckpt} ({meta.get('stage')}, step {meta.get('step')}); tokenizer "
              f"{tokenizer_path}; {len(tasks)} tasks, {sum(len(t.items) for t in tasks):,} items "
              f"in {bundle}")
    start = time.perf_counter()
    results = evaluate_tasks(model, tokenizer, tasks, args.max_items, args.batch_items, args.dtype,
                             rank, world,
                             device, args.protocol, progress=True)
    seconds = time.perf_counter() - start
    rows, core = summarize(tasks, results)
    n_items = sum(r["items"] for r in rows)
    bpb = bits_per_byte(args, meta, model, tokenizer, rank, world, device)
    if rank == 0:
        report = {"checkpoint": str(ckpt), "step": meta.get("step"), "stage": meta.get("stage"),
                  "bundle": provenance,
                  "protocol": args.protocol, "core": core, "max_items": args.max_items,
                  "tasks": rows,
                  "complete": n_items == sum(r["items_in_task"] for r in rows) and not args.tasks,
                  "sequence_len": model.config.sequence_len, **bpb, "world_size": world,
                  "samples": completions(model, tokenizer, args.max_new_tokens, args.dtype),
                  "device": distributed.device_name(device), "hardware": distributed.WORLD,
                  "dtype": args.dtype,
                  "seconds": seconds,
                  "items_per_second": n_items / seconds, "argv": sys.argv,
                  "versions": distributed.versions()}
        print_summary(report)
        write_results(Path(args.out or ckpt.parent.parent / "core_eval" / ckpt.name), report, tasks,
                      results)


if __name__ == "__main__":
    sys.exit(distributed.run_main(main))
