"""Corpora and conversation sets on disk (download.py fetches them): reading them, token counts
against a budget, your own text as a corpus, and training the tokenizer.

    python dataset.py ingest --out DIR PATHS...      # your own .txt/.md/.jsonl/.parquet, or folders
    python dataset.py tokenizer --data_dir DIR --vocab_size 65536   # -> runs/tokenizer/
    python dataset.py bytes_per_token --data_dir DIR                # the tokenizer on the val split

A text corpus (FineWeb-Edu's layout): parquet shards shard_00000.parquet, ..., one column
`text`, row groups of 1024 documents, zstd; the last shard is validation, the rest training.
"""
import argparse
import codecs
import itertools
import json
import logging
import math
import os
import random
import re
import sys
import time
from array import array
from pathlib import Path
from types import SimpleNamespace

import pyarrow as pa
import pyarrow.parquet as pq
import rustbpe

from tokenizer import SPECIAL_TOKENS, SPLIT_PATTERN, Tokenizer

CACHE_DIR = Path(os.environ.get("NANOCHAT_CACHE", Path.home() / ".cache" / "nanochat"))
ROW_GROUP_DOCS = 1024
FINEWEB = "karpathy/fineweb-edu-100b-shuffle"  # pretraining's corpus, download.py's default


def default_data_dir(dataset):
    return CACHE_DIR / "data" / dataset.split("/")[-1]


# Conversations: parquet with `messages`, `conversations` (LIMA), or a task's columns (MMLU,
# ARC, GSM8K). Files named test* or val* are validation.
CHAT_DATASETS = {  # name: (hub repo, the files to fetch)
    "smoltalk": ("HuggingFaceTB/smoltalk", r"data/all/(train|test)-\d+-of-\d+\.parquet"),
    "ultrachat": ("HuggingFaceH4/ultrachat_200k", r"data/(train|test)_sft-.+\.parquet"),
    # gated: accept its terms on the hub, set HF_TOKEN; its test.jsonl has no answers
    "lima": ("GAIR/lima", r"train\.jsonl"),
    # training splits only: their test splits are chat_eval.py's
    "mmlu": ("cais/mmlu", r"all/auxiliary_train-\d+-of-\d+\.parquet"),
    "arc-easy": ("allenai/ai2_arc", r"ARC-Easy/train-\d+-of-\d+\.parquet"),
    "arc-challenge": ("allenai/ai2_arc", r"ARC-Challenge/train-\d+-of-\d+\.parquet"),
    "gsm8k": ("openai/gsm8k", r"main/train-\d+-of-\d+\.parquet"),
    # no download: written from identity.json, the file you edit
    "identity": (None, None),
}
IDENTITY_FILE = Path(__file__).resolve().parent / "identity.json"


def load_identity(path=IDENTITY_FILE):
    """(the assistant's name, [(question, answer)]) from the identity file."""
    try:
        spec = json.loads(Path(path).read_text())
        name, pairs = spec["name"], [(q, a.format(name=spec["name"])) for q in spec["questions"]
                                     for a in spec["answers"]]
    except (OSError, ValueError, KeyError, TypeError, IndexError) as e:
        raise ValueError(f"{path} is not a usable identity file ({type(e).__name__}: {e}): it is "
                         "JSON with \"name\", \"questions\" and \"answers\" (each answer may say "
                         "{name})") from None
    if not isinstance(name, str) or not name or not pairs:
        raise ValueError(f"{path}: \"name\" must be a non-empty string and \"questions\", "
                         "\"answers\" non-empty lists")
    return name, pairs


def write_identity(out_dir, path=IDENTITY_FILE):
    """Every question with every answer, as out_dir/train.parquet."""
    _, pairs = load_identity(path)
    rows = [[{"role": "user", "content": q}, {"role": "assistant", "content": a}] for q, a in pairs]
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    schema = pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))
    write_parquet(out_dir / "train.parquet", {"messages": pa.array(rows, schema)})
    return out_dir


def chat_dir(spec):
    if spec in CHAT_DATASETS and not Path(spec).exists():
        return CACHE_DIR / "chat" / spec
    return Path(spec)


def render_mc(question, letters, choices):
    """nanochat's multiple-choice message: each choice then '=' and its letter, no space, so the
    prompt's letter is the same token as the answer's bare letter."""
    return (f"Multiple Choice question: {question}\n" + "".join(f"- {c}={x}\n" for x,
                                                                c in zip(letters, choices))
            + "\nRespond only with the letter of the correct answer.")


def calculator_parts(answer):
    """GSM8K's answer as assistant parts: each <<expr=result>> becomes a python call and its
    python_output."""
    parts = []
    for piece in re.split(r"(<<[^<>]*>>)", answer):
        if piece.startswith("<<") and piece.endswith(">>"):
            expr, _, result = piece[2:-2].rpartition("=")
            parts += [{"type": "python", "text": expr or result}] + \
                ([{"type": "python_output", "text": result}] if expr else [])
        elif piece:
            parts.append({"type": "text", "text": piece})
    return parts


def chat_format(path):
    """How a chat file's rows become conversations, by its columns."""
    names = set(open_parquet(path, column=None).schema_arrow.names)
    for fmt, needs in (("messages", {"messages"}), ("conversations", {"conversations"}),
                       ("arc", {"question", "choices", "answerKey"}), ("mmlu", {"question",
                                                                                "choices",
                                                                                "answer"}),
                       ("mmlu", {"train"}), ("gsm8k", {"question", "answer"})):
        if needs <= names:
            return fmt
    raise ValueError(f"{path} has neither a `messages` column (SmolTalk, UltraChat), a "
                     "`conversations` column (LIMA), nor a task's columns (MMLU, ARC: question, "
                     "choices, answer or answerKey; GSM8K: question, answer); columns: "
                     f"{', '.join(sorted(names))}")


def multiple_choice(row, answer="answer"):
    """(prompt, letters, answer letter, options) of an ARC or MMLU row; a ValueError where the
    answerKey is not a label."""
    arc = isinstance(row["choices"], dict)
    options = list(row["choices"]["text"] if arc else row["choices"])
    letters = list(row["choices"]["label"] if arc else MC_LETTERS[:len(options)])
    key = row["answerKey"] if arc else letters[row[answer]]
    if key not in letters:
        raise ValueError(f"answerKey {key!r} is not among the labels {letters}")
    return render_mc(row["question"], letters, options), letters, key, options


def task_messages(fmt, row):
    """A task row as a conversation, or why it cannot be one (a string)."""
    try:
        if fmt in ("mmlu", "arc"):
            # auxiliary_train nests its rows
            row = row["train"] if isinstance(row.get("train"), dict) else row
            user, _, assistant, _ = multiple_choice(row)
        else:
            user, assistant = row["question"], calculator_parts(row["answer"])
    except ValueError as e:
        return str(e)
    except (KeyError, TypeError, IndexError) as e:
        return f"not a {fmt} row ({type(e).__name__}: {e})"
    return [{"role": "user", "content": user}, {"role": "assistant", "content": assistant}]


MC_LETTERS = "ABCDEFGHIJ"


def conversation_messages(item):
    """Lists of {role, content}, or LIMA's lists of strings, user first, alternating."""
    if item and isinstance(item[0], str):
        return [{"role": "user" if i % 2 == 0 else "assistant", "content": text} for i,
                text in enumerate(item)]
    return item or []


def chat_rows(path, row_group, rows=None):
    """A row group as conversations, or why a row is not one; rows: only those indices, in
    order (a stream of W reads 1/W of a row group)."""
    if Path(path).suffix == ".jsonl":
        return conversation_lines(path).rows(row_group, rows)
    fmt = chat_format(path)
    items = read_row_group(path, row_group, fmt if fmt in ("messages", "conversations") else None)
    items = items if rows is None else [items[r] for r in rows]
    if fmt in ("messages", "conversations"):
        return [conversation_messages(item) for item in items]
    return [task_messages(fmt, row) for row in items]


def chat_files(chat_dir, split):
    """A chat directory's train or val files (test*, val*), or [the file] for either split when
    one file is given."""
    if Path(chat_dir).suffix in (".jsonl", ".parquet"):
        if not Path(chat_dir).is_file():
            raise FileNotFoundError(f"{chat_dir}: no such file (a conversation source is a "
                                    "directory of parquet files, a dataset name, or a .jsonl file: "
                                    "docs/own-data.md)")
        return [Path(chat_dir)]
    files = sorted(Path(chat_dir).glob("*.parquet"))
    val = [f for f in files if f.name.startswith(("test", "val"))]
    chosen = val if split == "val" else [f for f in files if f not in val]
    if not chosen:
        which = "*.parquet " + ("named" if split == "val" else "not named") + " test* or val*"
        raise FileNotFoundError(f"no {split} conversation files ({which}) in {chat_dir}: run "
                                "`python download.py chat NAME` (one of "
                                f"{', '.join(CHAT_DATASETS)}) or `python demo.py --out DIR`")
    return chosen


# Your own conversations: JSON lines in the OpenAI chat format (docs/own-data.md), indexed to
# answer as a parquet footer does
CHAT_ROLES = ("system", "user", "assistant")
LINE_FORMAT = ('each line is one conversation, {"messages": [{"role": "user", "content": "..."}, '
               '{"role": "assistant", "content": "..."}]}, roles system (first, optional), user '
               'and assistant in turn (docs/own-data.md)')
SKIP_BAD_ROWS_HELP = ("skip the bad lines of .jsonl conversation files (invalid JSON or UTF-8, no "
                      "messages, a wrong role, no assistant message), counted in a printed line, "
                      "instead of stopping at the first (default: off)")


def conversation_line(line):
    """One line's messages ({role, content} only), or what is wrong with it (a string)."""
    try:
        text = line.decode("utf-8").removeprefix("\ufeff").rstrip("\r\n")
    except UnicodeDecodeError as e:
        return (f"not UTF-8 (byte 0x{line[e.start]:02x} at byte {e.start + 1} of the line): save "
                "the file as UTF-8")
    try:
        record = json.loads(text)
    except json.JSONDecodeError as e:
        return f"not valid JSON ({e.msg} at column {e.colno})"
    if not isinstance(record, dict) or "messages" not in record:
        got = f"fields: {', '.join(map(str, record))}" if isinstance(
                record, dict) else type(record).__name__
        return f'no "messages" field ({got})'
    messages = record["messages"]
    if not isinstance(messages, list) or not messages:
        return '"messages" is not a non-empty list of messages'
    for i, m in enumerate(messages):
        missing = [key for key in ("role", "content") if not isinstance(m, dict) or key not in m]
        if missing:
            return f'message {i} has no {" or ".join(missing)} (each message is {{"role": ..., ' \
                   f'"content": ...}})'
        if m["role"] not in CHAT_ROLES:
            return f"message {i} has role {json.dumps(m['role'])}: use system, user or assistant"
        if not isinstance(m["content"], str):
            return f"message {i}'s content is {type(m['content']).__name__}, not a string"
        if m["role"] != "system" and not m["content"].strip():
            return f"message {i} ({m['role']}) has empty content"
    if not any(m["role"] == "assistant" for m in messages):
        return "no assistant message: nothing to train on"
    roles = [m["role"] for m in messages]
    start = 1 if roles[0] == "system" else 0
    for i, role in enumerate(roles[start:], start=start):
        expected = "user" if (i - start) % 2 == 0 else "assistant"
        if role != expected:
            return (f"message {i} is {role!r} where {expected!r} comes (roles alternate user, "
                    "assistant, ...)")
    return [{"role": m["role"], "content": m["content"]} for m in messages]


class ConversationLines:
    """A .jsonl conversation file indexed once (line offsets, bad lines). It answers as a parquet
    footer, ROW_GROUP_DOCS lines a row group, so the loader treats it as parquet."""

    def __init__(self, path):
        self.path, self.offsets, self.numbers, self.bad = Path(path), array("q"), array("q"), []
        offset = 0
        with open(path, "rb") as f:
            for number, line in enumerate(f, start=1):
                if line.strip():
                    self.offsets.append(offset)
                    self.numbers.append(number)
                    if isinstance(why := conversation_line(line), str):
                        self.bad.append((number, why))
                offset += len(line)
        self.num_rows = len(self.offsets)
        self.num_row_groups = -(-self.num_rows // ROW_GROUP_DOCS)

    def row_group(self, index):
        return SimpleNamespace(num_rows=min(ROW_GROUP_DOCS, self.num_rows - index * ROW_GROUP_DOCS))

    def rows(self, row_group, rows=None):
        """A row group's conversations (rows: those indices), a bad line as "line N: why"."""
        first = row_group * ROW_GROUP_DOCS
        out = []
        with open(self.path, "rb") as f:
            for r in range(self.row_group(row_group).num_rows) if rows is None else rows:
                f.seek(self.offsets[first + r])
                item = conversation_line(f.readline())
                out.append(f"line {self.numbers[first + r]}: {item}" if isinstance(item,
                                                                                   str) else item)
        return out


# (path, size, mtime): ConversationLines, so a stage's loaders index a file once
_INDEXED = {}


def conversation_lines(path):
    """A .jsonl file's ConversationLines, indexed again only if the file changed."""
    stat = os.stat(path)
    key = (str(Path(path).resolve()), stat.st_size, stat.st_mtime_ns)
    if key not in _INDEXED:
        if len(_INDEXED) >= 64:  # the tests meet many files
            _INDEXED.clear()
        _INDEXED[key] = ConversationLines(path)
    return _INDEXED[key]


def chat_footer(path):
    """A parquet footer, or a .jsonl file's ConversationLines."""
    return conversation_lines(path) if Path(path).suffix == ".jsonl" else open_parquet(
            path, column=None).metadata


def check_chat_files(files, skip_bad_rows=False):
    """A ValueError naming file, line and fix at a .jsonl file's first bad line (or an empty or
    all-bad file); with skip_bad_rows, lines saying how many are skipped instead."""
    lines = []
    for path in dict.fromkeys(Path(f) for f in files if Path(f).suffix == ".jsonl"):
        index = conversation_lines(path)
        if not index.num_rows:
            raise ValueError(f"{path}: the file is empty: {LINE_FORMAT}")
        if not index.bad:
            continue
        (number, why), count = index.bad[0], len(index.bad)
        if count == index.num_rows:
            raise ValueError(f"{path}, line {number}: {why}; every one of its {count:,} lines is "
                             f"bad: {LINE_FORMAT}")
        if not skip_bad_rows:
            more = ""
            if count > 1:
                more = f" ({count:,} bad lines of {index.num_rows:,}; this is the first)"
            raise ValueError(f"{path}, line {number}: {why}{more}: {LINE_FORMAT}; fix it, or pass "
                             "--skip_bad_rows to skip bad lines (they are counted)")
        shown = "; ".join(f"line {n}: {w}" for n,
                          w in index.bad[:3]) + ("; ..." if count > 3 else "")
        lines.append(f"--skip_bad_rows: skipping {count:,} bad line{'s' * (count > 1)} of "
                     f"{index.num_rows:,} in {path} ({shown})")
    return lines


def parse_chat_sources(specs):
    """--source DIR:EPOCHS as [(directory, epochs)]; DIR may be a CHAT_DATASETS name or a
    .jsonl file."""
    sources = []
    for spec in specs:
        path, _, epochs = spec.rpartition(":")
        if not path or not epochs.isdigit() or int(epochs) < 1:
            raise ValueError(f"--source {spec!r}: write DIR:EPOCHS (or FILE.jsonl:EPOCHS) with a "
                             "whole number of passes >= 1, e.g. --source gsm8k:4 or --source "
                             "data/demo/conversations:1")
        sources.append((str(chat_dir(path)), int(epochs)))
    return sources


def mixture_files(sources):
    """The training files of [(chat dir, epochs)], each once per epoch: one pass over the list
    is one pass of the mixture."""
    return [f for directory, epochs in sources for _ in range(epochs) for f in chat_files(directory,
                                                                                          "train")]


# -----------------------------------------------------------------------------
# Shards on disk

def list_shards(data_dir):
    data_dir = Path(data_dir)
    if not data_dir.is_dir():
        raise FileNotFoundError(f"data directory {data_dir} does not exist: run `python "
                                f"download.py shards --shards N --data_dir {data_dir}` or `python "
                                "demo.py --out DIR` (its DIR/pretrain)")
    shards = sorted(data_dir.glob("*.parquet"))
    if not shards:
        raise FileNotFoundError(f"no .parquet shards in {data_dir}: run `python download.py shards "
                                f"--shards N --data_dir {data_dir}` or `python dataset.py ingest "
                                f"--out {data_dir} FILES...`")
    return shards


# in a corpus directory: {tokenizer fingerprint: {shard name: [tokens, docs]}}
TOKEN_COUNTS = ".token_counts.json"


def shard_tokens(path, tokenizer):
    """(tokens, documents) of a shard as trained on: each document's tokens plus BOS. Counted
    once per tokenizer, kept in .token_counts.json."""
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
    """The plan's data line: budget against corpus; says so when data repeats."""
    line = (f"data: budget {budget_tokens:,} tokens; corpus {b['shards']} training shards, "
            f"{b['docs']:,} documents x {b['tokens_per_doc']:,.0f} tokens (the mean of "
            f"{b['measured_shard']}, counted with this tokenizer) = ~{b['tokens']:,} tokens: "
            f"{b['epochs']:.2f} epochs")
    if b["epochs"] > 1:
        shards = math.ceil(budget_tokens / max(1, b["tokens_per_shard"])) + 1
        # only FineWeb-Edu's directory is download.py's to fill
        more = (f"more shards: `python download.py shards --shards N`; N ~ {shards}" if b["fineweb"]
                else "fewer --steps, or more text in the corpus")
        line += f". This run REPEATS data: {b['epochs']:.2f} passes over the corpus ({more})"
    return line


def split_shards(data_dir, split):
    shards = list_shards(data_dir)
    if split not in ("train", "val"):
        raise ValueError(f"split={split!r} is not allowed: choose train or val")
    if len(shards) < 2:
        raise ValueError(f"{data_dir} has {len(shards)} shard; a corpus needs at least two "
                         "(training shards, then the validation shard last)")
    return shards[:-1] if split == "train" else shards[-1:]


def open_parquet(path, column="text"):
    try:
        parquet = pq.ParquetFile(path)
    except (pa.ArrowInvalid, OSError) as e:
        raise ValueError(f"{path} is not a readable parquet file ({e}): delete it and fetch it "
                         "again (`python download.py shards` verifies every shard) or re-create it "
                         "with `python dataset.py ingest`") from e
    if column is not None and column not in parquet.schema_arrow.names:
        raise ValueError(f"{path} has no column {column!r} (columns: "
                         f"{', '.join(parquet.schema_arrow.names)})")
    return parquet


def read_row_group(path, index, column="text"):
    """A row group's column, or with column=None its rows as dicts."""
    try:
        table = open_parquet(path, column).read_row_group(
                index, columns=None if column is None else [column])
        return table.to_pylist() if column is None else table.column(column).to_pylist()
    except (pa.ArrowInvalid, OSError) as e:
        raise ValueError(f"{path}: row group {index} is unreadable ({e}): delete the file and "
                         "fetch it again") from e


def iter_texts(data_dir, split, max_chars=None):
    """A split's non-empty documents in order, up to max_chars characters."""
    total = 0
    for path in split_shards(data_dir, split):
        for index in range(open_parquet(path).num_row_groups):
            for text in read_row_group(path, index):
                if not text:
                    continue
                yield text
                total += len(text)
                if max_chars is not None and total >= max_chars:
                    return


def write_text_shards(texts, out_dir, seed=0, shard_docs=8 * ROW_GROUP_DOCS, val_fraction=0.05):
    """Shuffle documents and write the corpus layout, the last shard val_fraction of them (at
    least one). Returns the paths."""
    texts = list(texts)
    if len(texts) < 2:
        raise ValueError("need at least 2 documents to make a training and a validation split, "
                         f"got {len(texts)}")
    random.Random(seed).shuffle(texts)
    n_val = max(1, round(len(texts) * val_fraction))
    train, val = texts[:-n_val], texts[-n_val:]
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    chunks = [train[i:i + shard_docs] for i in range(0, len(train), shard_docs)] + [val]
    return [write_parquet(out_dir / f"shard_{i:05d}.parquet", {"text": pa.array(chunk,
                                                                                pa.string())},
                          row_group_size=ROW_GROUP_DOCS) for i, chunk in enumerate(chunks)]


def write_parquet(path, columns, **kwargs):
    """zstd parquet, written to path + ".tmp" then renamed: visible only once complete."""
    tmp = path.with_name(path.name + ".tmp")
    pq.write_table(pa.table(columns), tmp, compression="zstd", **kwargs)
    os.replace(tmp, path)
    return path


# -----------------------------------------------------------------------------
# Ingest: your own text as a corpus

def decode_utf8(data):
    """(text, invalid sequences replaced with U+FFFD)."""
    replaced = 0

    def count(err):
        nonlocal replaced
        replaced += 1
        return "\ufffd", err.end
    # re-registered per call: the closure holds this call's counter
    codecs.register_error("dataset.count", count)
    return data.decode("utf-8", errors="dataset.count"), replaced


def read_documents(path, column="text", one_per_file=False):
    """(documents, invalid UTF-8 replaced) of a file. .txt, .md: split at blank lines (or
    one_per_file); .jsonl, .parquet: the `column` field."""
    path = Path(path)
    if path.suffix == ".parquet":
        parquet = open_parquet(path, column)
        return [t for i in range(parquet.num_row_groups) for t in read_row_group(path, i,
                                                                                 column)], 0
    if path.suffix not in (".txt", ".md", ".jsonl"):
        raise ValueError(f"{path}: unsupported file type {path.suffix!r}: use .txt, .md, .jsonl or "
                         ".parquet")
    text, replaced = decode_utf8(path.read_bytes())
    if not text.strip():
        raise ValueError(f"{path}: empty: it holds no text; leave it out of the corpus")
    if path.suffix in (".txt", ".md"):
        return ([text] if one_per_file else re.split(r"\n\s*\n", text)), replaced
    docs = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{number}: not valid JSON ({e.msg}); each line must be one "
                             f"JSON object with a {column!r} field") from e
        if not isinstance(record, dict) or column not in record or not isinstance(
                record[column], (str, type(None))):
            what = "no field" if isinstance(record,
                                            dict) and column not in record else "not a string field"
            raise ValueError(f"{path}:{number}: {what} {column!r}: each line must be one JSON "
                             f"object with a string {column!r} field (--column NAME reads another "
                             "field)")
        docs.append(record[column])
    return docs, replaced


INGEST_SUFFIXES = (".txt", ".md", ".jsonl", ".parquet")


def input_files(paths):
    """Each file given, and each directory's INGEST_SUFFIXES files, recursively, sorted."""
    files = []
    for path in map(Path, paths):
        if path.is_dir():
            found = sorted(p for p in path.rglob("*") if p.is_file()
                           and p.suffix in INGEST_SUFFIXES)
            if not found:
                raise FileNotFoundError(f"{path}: no {', '.join(INGEST_SUFFIXES)} files in it")
            files += found
        elif path.is_file():
            files.append(path)
        else:
            raise FileNotFoundError(f"{path}: no such file or directory")
    return files


def ingest(paths, out_dir, seed=0, column="text", one_per_file=False, val_fraction=0.05):
    """Files or directories into a corpus; <out_dir>/ingest.json, written last, says it is
    whole."""
    if not paths:
        raise ValueError("no input files given")
    files = input_files(paths)
    docs, empty, replaced = [], 0, 0
    for path in files:
        file_docs, file_replaced = read_documents(path, column, one_per_file)
        stripped = [(doc or "").strip() for doc in file_docs]
        docs += [doc for doc in stripped if doc]
        empty += stripped.count("")
        replaced += file_replaced
    Path(out_dir, "ingest.json").unlink(missing_ok=True)
    paths = write_text_shards(docs, out_dir, seed=seed, val_fraction=val_fraction)
    for stale in set(Path(out_dir).glob("shard_*.parquet")) - set(paths):
        stale.unlink()
    summary = {"inputs": [str(p) for p in files], "documents": len(docs), "characters": sum(map(
            len, docs)),
               "val_documents": pq.ParquetFile(paths[-1]).metadata.num_rows, "empty": empty,
               "replaced": replaced,
               "shards": len(paths)}
    Path(out_dir, "ingest.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(f"ingest: {len(files)} files -> {len(docs):,} documents ({summary['characters']:,} "
          f"characters) in {len(paths)} shards under {out_dir} (last = validation: "
          f"{summary['val_documents']:,} documents); empty documents skipped: {empty:,}; invalid "
          f"UTF-8 sequences replaced with U+FFFD: {replaced:,}")
    return {**summary, "shards": paths}


# -----------------------------------------------------------------------------
# The tokenizer, trained on a training split (rustbpe), measured on the validation split

# pyo3_log caches the level at rustbpe's first message: INFO here, printed only where
# train_tokenizer(progress=True) adds a handler
RUSTBPE_LOG = logging.getLogger("rustbpe")
RUSTBPE_LOG.setLevel(logging.INFO)
RUSTBPE_LOG.propagate = False


def rustbpe_printer(start, every_percent=10):
    """A handler printing rustbpe's messages with seconds since start: every set-up step, and
    merge progress every every_percent."""
    handler = logging.StreamHandler(sys.stdout)

    def keep(record):
        message = record.getMessage()
        percent = re.match(r"Progress: (\d+)%", message)
        if percent and int(percent.group(1)) % every_percent:
            return False
        seconds = time.perf_counter() - start
        record.msg, record.args = f"tokenizer: {seconds:.1f} s, rustbpe: {message}", ()
        return True
    handler.addFilter(keep)
    return handler


def train_tokenizer(texts, vocab_size, progress=False):
    """BPE: exactly vocab_size ids including SPECIAL_TOKENS. progress: print rustbpe's log."""
    n_merged = vocab_size - len(SPECIAL_TOKENS)
    if n_merged < 256:
        raise ValueError(f"vocab_size={vocab_size} is too small: byte-level BPE needs 256 byte "
                         f"tokens + {len(SPECIAL_TOKENS)} special tokens, so at least "
                         f"{256 + len(SPECIAL_TOKENS)}")
    bpe = rustbpe.Tokenizer()
    printer = rustbpe_printer(time.perf_counter()) if progress else None
    if printer:
        RUSTBPE_LOG.addHandler(printer)
    try:
        bpe.train_from_iterator(iter(texts), n_merged, pattern=SPLIT_PATTERN)
    finally:
        if printer:
            RUSTBPE_LOG.removeHandler(printer)
    ranks = dict(bpe.get_mergeable_ranks())
    # rustbpe stops early, silently, when no pair of tokens is left to merge
    if len(ranks) != n_merged:
        raise ValueError(f"the training text only allows {len(ranks) - 256} merges, "
                         f"vocab_size={vocab_size} needs {n_merged - 256}: use more text or a "
                         "smaller --vocab_size")
    return Tokenizer(ranks, SPLIT_PATTERN)


def counting(texts, stats, every_s=None):
    """Yield texts, counting documents, characters and bytes; print the rate every every_s."""
    start = printed = time.perf_counter()
    for text in texts:
        stats["docs"] += 1
        stats["chars"] += len(text)
        stats["bytes"] += len(text.encode("utf-8"))
        now = time.perf_counter()
        if every_s is not None and now - printed >= every_s:
            printed = now
            print(f"tokenizer: {now - start:.1f} s, read {stats['docs']:,} documents, "
                  f"{stats['bytes'] / 1e6:,.1f} MB "
                  f"({stats['bytes'] / 1e6 / max(now - start, 1e-9):.1f} MB/s)", flush=True)
        yield text


def text_stats(tokenizer, texts, batch_docs=1024):
    """(documents, UTF-8 bytes, tokens), encoded in parallel batches."""
    docs = n_bytes = n_tokens = 0
    texts = iter(texts)
    while batch := list(itertools.islice(texts, batch_docs)):
        docs += len(batch)
        n_bytes += sum(len(text.encode("utf-8")) for text in batch)
        n_tokens += sum(len(ids) for ids in tokenizer.encode_batch(batch))
    return docs, n_bytes, n_tokens


def bytes_per_token(tokenizer, texts):
    """UTF-8 bytes per token: higher compresses better."""
    _, n_bytes, n_tokens = text_stats(tokenizer, texts)
    if n_tokens == 0:
        raise ValueError("no tokens: bytes/token needs at least one non-empty text")
    return n_bytes / n_tokens


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    p = commands.add_parser("ingest", help="your own .txt/.md/.jsonl/.parquet files as a corpus")
    p.add_argument("files", nargs="+", help=".txt, .md (documents split on blank lines), .jsonl, "
                   ".parquet, or a directory of them")
    p.add_argument("--out", required=True, help="output corpus directory")
    p.add_argument("--column", default="text", help="jsonl field / parquet column (default: "
                   "%(default)s)")
    p.add_argument("--one_per_file", action="store_true", help="each .txt/.md file is one document "
                   "(default: split on blank lines)")
    p.add_argument("--seed", type=int, default=0, help="shuffle seed (default: %(default)s)")
    p.add_argument("--val_fraction", type=float, default=0.05, help="share of documents in the "
                   "validation shard (default: %(default)s)")
    train = commands.add_parser("tokenizer", help="train a tokenizer on a corpus's training split")
    train.add_argument("--data_dir", required=True, help="corpus directory of parquet shards")
    train.add_argument("--vocab_size", type=int, default=65536,
                       help="final vocabulary size, special tokens included (default: %(default)s)")
    train.add_argument("--max_chars", type=int, default=2_000_000_000,
                       help="stop reading the training split after this many characters (default: "
                       "%(default)s)")
    train.add_argument("--out", default="runs/tokenizer", help="directory to save tokenizer.json "
                       "in (default: %(default)s)")
    measure = commands.add_parser("bytes_per_token", help="a tokenizer's bytes per token on a "
                                  "corpus's validation split")
    measure.add_argument("--data_dir", required=True, help="corpus directory of parquet shards")
    measure.add_argument("--tokenizer", default="runs/tokenizer", help="directory of "
                         "tokenizer.json (default: %(default)s)")
    args = parser.parse_args(argv)
    try:
        if args.command == "ingest":
            ingest(args.files, args.out, seed=args.seed, column=args.column,
                   one_per_file=args.one_per_file, val_fraction=args.val_fraction)
        elif args.command == "tokenizer":
            stats = {"docs": 0, "chars": 0, "bytes": 0}
            start = time.perf_counter()
            texts = counting(iter_texts(args.data_dir, "train", args.max_chars), stats, every_s=10)
            tokenizer = train_tokenizer(texts, args.vocab_size, progress=True)
            seconds = time.perf_counter() - start
            print(f"training text: {stats['docs']:,} documents, {stats['chars']:,} characters, "
                  f"{stats['bytes']:,} UTF-8 bytes (train split of {args.data_dir})")
            print(f"trained in {seconds:.2f} s ({stats['bytes'] / 1e6 / seconds:.1f} MB/s)")
            print(f"vocab size: {tokenizer.vocab_size} (256 bytes + "
                  f"{len(tokenizer.mergeable_ranks) - 256} merges + {len(SPECIAL_TOKENS)} special "
                  "tokens)")
            print(f"saved to {tokenizer.save(args.out)}")
        else:
            tokenizer = Tokenizer.load(args.tokenizer)
            docs, n_bytes, n_tokens = text_stats(tokenizer, iter_texts(args.data_dir, "val"))
            if n_tokens == 0:
                raise ValueError(f"the validation split of {args.data_dir} has no text")
            print(f"val split of {args.data_dir}: {docs:,} documents, {n_bytes:,} bytes, "
                  f"{n_tokens:,} tokens")
            print(f"bytes/token: {n_bytes / n_tokens:.6f} (tokenizer {args.tokenizer}, vocab size "
                  f"{tokenizer.vocab_size})")
    # a runtime error: 1 (argparse gives a bad flag 2)
    except (ValueError, TypeError, FileNotFoundError, RuntimeError) as e:
        parser.exit(1, f"dataset.py {args.command}: error: {e}\n")


if __name__ == "__main__":
    main()
