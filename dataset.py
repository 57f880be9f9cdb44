"""Corpora and conversation sets on disk, as the stages read them: text shards, and
conversations in every format the stages take (parquet sets, JSON lines). prepare.py fetches or
makes them; not a stage.

A text corpus (FineWeb-Edu's layout): parquet shards shard_00000.parquet, ..., one column
`text`, row groups of 1024 documents, zstd; the last shard is validation, the rest training.
"""
import json
import os
import re
from array import array
from pathlib import Path
from types import SimpleNamespace

import pyarrow as pa
import pyarrow.parquet as pq

CACHE_DIR = Path(os.environ.get("NANOCHAT_CACHE", Path.home() / ".cache" / "nanochat"))
ROW_GROUP_DOCS = 1024
FINEWEB = "karpathy/fineweb-edu-100b-shuffle"  # pretraining's corpus, prepare.py's default


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
def chat_dir(spec):
    if spec in CHAT_DATASETS and not Path(spec).exists():
        return CACHE_DIR / "chat" / spec
    return Path(spec)


def render_mc(question, letters, choices):
    """nanochat's multiple-choice message: each choice then '=' and its letter, no space: the
    same token as the answer's bare letter."""
    return (f"Multiple Choice question: {question}\n" + "".join(f"- {c}={x}\n" for x,
                                                                c in zip(letters, choices))
            + "\nRespond only with the letter of the correct answer.")


def calculator_parts(answer):
    """GSM8K's answer as assistant parts, each <<expr=result>> a python call and its output."""
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
    """A row group as conversations, or why a row is not one; rows: only those indices."""
    if Path(path).suffix == ".jsonl":
        return conversation_lines(path).rows(row_group, rows)
    fmt = chat_format(path)
    items = read_row_group(path, row_group, fmt if fmt in ("messages", "conversations") else None)
    items = items if rows is None else [items[r] for r in rows]
    if fmt in ("messages", "conversations"):
        return [conversation_messages(item) for item in items]
    return [task_messages(fmt, row) for row in items]


def chat_files(chat_dir, split):
    """A chat directory's train or val files (test*, val*), or [the file] given."""
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
                                "`python prepare.py chat NAME` (one of "
                                f"{', '.join(CHAT_DATASETS)}) or `python demo.py --out DIR`")
    return chosen


# Your own conversations: JSON lines in the OpenAI chat format, indexed to answer as a parquet
# footer does
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
    """A .jsonl conversation file indexed once (line offsets, bad lines), answering as a parquet
    footer, ROW_GROUP_DOCS lines a row group."""

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
    all-bad file); with skip_bad_rows, lines saying how many are skipped."""
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
    """--source DIR:EPOCHS as [(directory, epochs)]; DIR may be a dataset name or a .jsonl
    file."""
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
    """The training files of [(chat dir, epochs)], each once per epoch."""
    return [f for directory, epochs in sources for _ in range(epochs) for f in chat_files(directory,
                                                                                          "train")]


# -----------------------------------------------------------------------------
# Shards on disk

def list_shards(data_dir):
    data_dir = Path(data_dir)
    if not data_dir.is_dir():
        raise FileNotFoundError(f"data directory {data_dir} does not exist: run `python "
                                f"prepare.py shards --shards N --data_dir {data_dir}` or `python "
                                "demo.py --out DIR` (its DIR/pretrain)")
    shards = sorted(data_dir.glob("*.parquet"))
    if not shards:
        raise FileNotFoundError(f"no .parquet shards in {data_dir}: run `python prepare.py shards "
                                f"--shards N --data_dir {data_dir}` or `python prepare.py ingest "
                                f"--out {data_dir} FILES...`")
    return shards


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
                         "again (`python prepare.py shards` verifies every shard) or re-create it "
                         "with `python prepare.py ingest`") from e
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
