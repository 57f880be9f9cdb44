"""Everything between "text somewhere" and "a batch on the device".

    python dataset.py download --shards 8            # FineWeb-Edu shards from the hub (+ the last one: validation)
    python dataset.py ingest --out DIR FILES...      # your own .txt / .jsonl / .parquet as shards of the same layout
    python dataset.py demo --out DIR                 # the embedded demo world, offline and deterministic

Layout of a text corpus (FineWeb-Edu's on the hub, and everything this file writes): a directory of parquet shards
named shard_00000.parquet, ..., one string column `text`, row groups of 1024 documents, zstd; the last shard is the
validation split, all others are training.
"""
import bisect
import codecs
import itertools
import json
import os
import queue
import random
import re
import threading
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

CACHE_DIR = Path(os.environ.get("NANOCHAT_CACHE", Path.home() / ".cache" / "nanochat"))
ROW_GROUP_DOCS = 1024


def default_data_dir(dataset):
    """Downloads live under one cache dir ($NANOCHAT_CACHE, default ~/.cache/nanochat): data/<dataset name>."""
    return CACHE_DIR / "data" / dataset.split("/")[-1]


# -----------------------------------------------------------------------------
# Shards on disk

def list_shards(data_dir):
    data_dir = Path(data_dir)
    if not data_dir.is_dir():
        raise FileNotFoundError(f"data directory {data_dir} does not exist: run `python dataset.py download --shards N"
                                f" --data-dir {data_dir}` or `python dataset.py demo --out {data_dir}`")
    shards = sorted(data_dir.glob("*.parquet"))
    if not shards:
        raise FileNotFoundError(f"no .parquet shards in {data_dir}: run `python dataset.py download --shards N "
                                f"--data-dir {data_dir}` or `python dataset.py ingest --out {data_dir} FILES...`")
    return shards


def split_shards(data_dir, split):
    """The last shard is the validation split; all the others are training."""
    shards = list_shards(data_dir)
    if split not in ("train", "val"):
        raise ValueError(f"split={split!r} is not allowed: choose train or val")
    if len(shards) < 2:
        raise ValueError(f"{data_dir} has {len(shards)} shard; a corpus needs at least two (training shards, then the "
                         f"validation shard last)")
    return shards[:-1] if split == "train" else shards[-1:]


def open_parquet(path, column="text"):
    """Open a shard, with an error that names the file and says how to get a good copy."""
    try:
        parquet = pq.ParquetFile(path)
    except (pa.ArrowInvalid, OSError) as e:
        raise ValueError(f"{path} is not a readable parquet file ({e}): delete it and fetch it again (`python "
                         f"dataset.py download` verifies every shard) or re-create it with `python dataset.py "
                         f"ingest`") from e
    if column is not None and column not in parquet.schema_arrow.names:
        raise ValueError(f"{path} has no column {column!r} (columns: {', '.join(parquet.schema_arrow.names)})")
    return parquet


def read_row_group(path, index, column="text"):
    try:
        return open_parquet(path, column).read_row_group(index, columns=[column]).column(column).to_pylist()
    except (pa.ArrowInvalid, OSError) as e:
        raise ValueError(f"{path}: row group {index} is unreadable ({e}): delete the file and fetch it again") from e


def iter_texts(data_dir, split, max_chars=None):
    """Documents of a split in order, empty ones skipped; stops once max_chars characters have been yielded."""
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
    """Shuffle documents with `seed` and write them in the corpus layout: training shards of `shard_docs` documents,
    then one validation shard (the last file) of val_fraction of the documents (at least one). Returns the paths."""
    texts = list(texts)
    if len(texts) < 2:
        raise ValueError(f"need at least 2 documents to make a training and a validation split, got {len(texts)}")
    random.Random(seed).shuffle(texts)
    n_val = max(1, round(len(texts) * val_fraction))
    train, val = texts[:-n_val], texts[-n_val:]
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    chunks = [train[i:i + shard_docs] for i in range(0, len(train), shard_docs)] + [val]
    paths = []
    for i, chunk in enumerate(chunks):
        path = out_dir / f"shard_{i:05d}.parquet"
        tmp = path.with_suffix(".parquet.tmp")
        pq.write_table(pa.table({"text": pa.array(chunk, pa.string())}), tmp, row_group_size=ROW_GROUP_DOCS,
                       compression="zstd")
        os.replace(tmp, path)  # a shard is visible under its name only once it is complete
        paths.append(path)
    return paths


# -----------------------------------------------------------------------------
# Ingest: your own text as a corpus

def decode_utf8(data):
    """Decode bytes as UTF-8, replacing each invalid sequence with U+FFFD; returns (text, number replaced)."""
    replaced = 0

    def count(err):
        nonlocal replaced
        replaced += 1
        return "\ufffd", err.end
    codecs.register_error("dataset.count", count)  # re-registered per call: the closure holds this call's counter
    return data.decode("utf-8", errors="dataset.count"), replaced


def read_documents(path, column="text", one_per_file=False):
    """Documents of one input file and the number of invalid UTF-8 sequences replaced in it.
    .txt: documents separated by blank lines (or the whole file, one_per_file); .jsonl: the `column` field of each
    line; .parquet: the `column` column."""
    path = Path(path)
    if path.suffix == ".parquet":
        parquet = open_parquet(path, column)
        return [t for i in range(parquet.num_row_groups) for t in read_row_group(path, i, column)], 0
    if path.suffix not in (".txt", ".jsonl"):
        raise ValueError(f"{path}: unsupported file type {path.suffix!r}: use .txt, .jsonl or .parquet")
    text, replaced = decode_utf8(path.read_bytes())
    if path.suffix == ".txt":
        return ([text] if one_per_file else re.split(r"\n\s*\n", text)), replaced
    docs = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{number}: not valid JSON ({e.msg}); each line must be one JSON object with a "
                             f"{column!r} field") from e
        if not isinstance(record, dict) or not isinstance(record.get(column), (str, type(None))):
            raise TypeError(f"{path}:{number}: expected a JSON object with a string field {column!r}")
        docs.append(record.get(column))
    return docs, replaced


def ingest(files, out_dir, seed=0, column="text", one_per_file=False, val_fraction=0.05):
    """Turn .txt/.jsonl/.parquet files into a corpus (shuffled with `seed`, last shard = validation)."""
    if not files:
        raise ValueError("no input files given")
    docs, empty, replaced = [], 0, 0
    for path in files:
        if not Path(path).is_file():
            raise FileNotFoundError(f"{path}: no such file")
        file_docs, file_replaced = read_documents(path, column, one_per_file)
        replaced += file_replaced
        for doc in file_docs:
            doc = (doc or "").strip()
            if doc:
                docs.append(doc)
            else:
                empty += 1
    paths = write_text_shards(docs, out_dir, seed=seed, val_fraction=val_fraction)
    print(f"ingest: {len(files)} files -> {len(docs):,} documents ({sum(map(len, docs)):,} characters) in "
          f"{len(paths)} shards under {out_dir} (last = validation); empty documents skipped: {empty:,}; invalid "
          f"UTF-8 sequences replaced with U+FFFD: {replaced:,}")
    return {"documents": len(docs), "empty": empty, "replaced": replaced, "shards": paths}


# -----------------------------------------------------------------------------
# The streaming loader

STAT_KEYS = ("batches", "tokens", "docs", "doc_tokens", "cropped", "padding", "empty", "no_assistant", "too_long",
             "malformed")


def assign_units(files, rank, world_size):
    """What rank `rank` of `world_size` reads: row groups rank, rank+W, ... of the files in order, so ranks never share
    a document. A split with fewer row groups than ranks (a small validation shard) is dealt by document instead:
    rank r takes documents r, r+W, ... of every row group. A unit is (path, row group, first doc, doc step)."""
    row_groups = [(path, i) for path in files for i in range(open_parquet(path, column=None).num_row_groups)]
    if len(row_groups) >= world_size:
        return [(path, i, 0, 1) for path, i in row_groups[rank::world_size]]
    return [(path, i, rank, world_size) for path, i in row_groups]


def chat_column(path):
    names = open_parquet(path, column=None).schema_arrow.names
    for column in ("messages", "conversations"):
        if column in names:
            return column
    raise ValueError(f"{path} has neither a `messages` column (SmolTalk, UltraChat) nor a `conversations` column "
                     f"(LIMA); columns: {', '.join(names)}")


def conversation_messages(item):
    """SmolTalk/UltraChat rows are lists of {role, content}; LIMA rows are lists of strings, user first, alternating."""
    if item and isinstance(item[0], str):
        return [{"role": "user" if i % 2 == 0 else "assistant", "content": text} for i, text in enumerate(item)]
    return item or []


def insort(lengths, buffer, ids, mask, arrival):
    i = bisect.bisect_right(lengths, len(ids))
    lengths.insert(i, len(ids))
    buffer.insert(i, (ids, mask, arrival))


class PackedLoader:
    """(inputs, targets) batches of shape (B, T) for one rank, packed without padding (kind="text") or from whole
    conversations padded at the end of a row (kind="chat"). Iterate it; state_dict() is the exact position after the
    last batch handed out, buffered documents included, and a loader given it by load_state_dict() continues with
    bit-identical batches.

    Pipeline: a reader thread reads this rank's row groups in order and tokenizes them (tiktoken's batch encoder runs
    on `threads` threads outside the GIL); a packer thread fills rows of T+1 tokens and copies each batch to the
    device (pinned memory, non_blocking) `prefetch` batches ahead of the training step. Every batch travels with the
    state after it, so the state never runs ahead of what the consumer has seen.

    Packing is best-fit from a buffer of `buffer_docs` documents: each row starts with the oldest buffered document
    (so no document waits more than buffer_docs rows: pure best-fit starves short ones indefinitely), then takes the
    largest buffered document that fits the space left, again and again; every row starts with a BOS. kind="text": when none fits, the
    smallest document is cropped to fill the row and its remainder goes back to the buffer as a new BOS-led piece
    (documents longer than a row are cut into row-sized BOS-led pieces on arrival); nothing is discarded, and the
    tokens moved to a later row (cut off from their document's beginning) are counted as 'cropped'. kind="chat":
    when none fits the row is padded (inputs BOS, targets -1); conversations are never cropped; targets are -1 on
    every token that is not assistant content or <|assistant_end|>."""

    def __init__(self, files, tokenizer, batch_size, seq_len, kind="text", rank=0, world_size=1, device="cpu",
                 buffer_docs=1000, threads=None, prefetch=2, name="train"):
        if kind not in ("text", "chat"):
            raise ValueError(f"kind={kind!r} is not allowed: choose text or chat")
        self.files, self.tokenizer, self.kind, self.name = [Path(f) for f in files], tokenizer, kind, name
        self.B, self.T, self.rank, self.world_size = batch_size, seq_len, rank, world_size
        self.device, self.buffer_docs = torch.device(device), buffer_docs
        self.threads, self.prefetch = threads or os.cpu_count(), prefetch
        self.units = assign_units(self.files, rank, world_size)
        if not self.units:
            raise ValueError(f"{name}: rank {rank} of {world_size} has no data in {', '.join(map(str, self.files))}")
        self.state = {"epoch": 0, "unit": 0, "doc": 0, "buffer": [], "stats": dict.fromkeys(STAT_KEYS, 0)}
        self._stop, self._threads, self._batches = threading.Event(), [], None

    # --- state ---------------------------------------------------------------------------------------------------
    def state_dict(self):
        buffer = self.state["buffer"]
        ids = np.concatenate([x for x, _, _ in buffer]) if buffer else np.zeros(0, np.int32)
        masks = np.concatenate([m for _, m, _ in buffer]) if buffer and self.kind == "chat" else np.zeros(0, np.int8)
        return {"epoch": self.state["epoch"], "unit": self.state["unit"], "doc": self.state["doc"],
                "stats": dict(self.state["stats"]), "buffer_ids": torch.from_numpy(ids),
                "buffer_masks": torch.from_numpy(masks),
                "buffer_lengths": torch.tensor([len(x) for x, _, _ in buffer], dtype=torch.int64),
                "buffer_arrivals": torch.tensor([a for _, _, a in buffer], dtype=torch.int64),
                "rank": self.rank, "world_size": self.world_size, "seq_len": self.T, "kind": self.kind}

    def load_state_dict(self, sd):
        for key, mine in (("rank", self.rank), ("world_size", self.world_size), ("seq_len", self.T),
                          ("kind", self.kind)):
            if sd[key] != mine:
                raise ValueError(f"{self.name} loader: state was saved with {key}={sd[key]}, this loader has {key}="
                                 f"{mine}; an exact resume needs the same {key}")
        if self._batches is not None:
            raise RuntimeError("load_state_dict() must come before the first batch")
        bounds = np.cumsum([0, *sd["buffer_lengths"].tolist()])
        ids, masks = sd["buffer_ids"].numpy(), sd["buffer_masks"].numpy()
        buffer = [(ids[a:b].copy(), masks[a:b].copy() if self.kind == "chat" else None, arrival)
                  for (a, b), arrival in zip(itertools.pairwise(bounds), sd["buffer_arrivals"].tolist(), strict=True)]
        self.state = {"epoch": sd["epoch"], "unit": sd["unit"], "doc": sd["doc"], "buffer": buffer,
                      "stats": dict(sd["stats"])}

    def log_line(self):
        s = self.state["stats"]
        line = (f"{self.name} loader rank {self.rank}/{self.world_size}: epoch {self.state['epoch']}, "
                f"{s['batches']:,} batches, {s['tokens']:,} tokens, {s['docs']:,} docs, empty skipped {s['empty']:,}")
        if self.kind == "text":
            cropped = f"{100 * s['cropped'] / s['doc_tokens']:.1f}%" if s["doc_tokens"] else "n/a"
            return line + f", cropped {cropped} of document tokens (moved to a later row as a BOS-led piece; " \
                          f"none discarded)"
        padding = f"{100 * s['padding'] / (s['batches'] * self.B * (self.T + 1)):.1f}%" if s["batches"] else "n/a"
        return line + (f", padding {padding}, skipped: no assistant turn {s['no_assistant']:,}, malformed "
                       f"{s['malformed']:,}, first exchange longer than a row {s['too_long']:,}")

    # --- the pipeline --------------------------------------------------------------------------------------------
    def __iter__(self):
        return self

    def __next__(self):
        if self._batches is None:
            self._start()
        item = self._get(self._batches)
        if isinstance(item, BaseException):
            self.close()
            raise item
        batch, self.state = item
        return batch

    def close(self):
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=10)
        self._stop, self._threads, self._batches = threading.Event(), [], None

    def _start(self):
        units, self._batches = queue.Queue(maxsize=2), queue.Queue(maxsize=self.prefetch)
        start = (self.state["epoch"], self.state["unit"], self.state["doc"])
        self._threads = [threading.Thread(target=self._guard, args=(self._read, start, units), daemon=True),
                         threading.Thread(target=self._guard, args=(self._pack, units, self.state), daemon=True)]
        for thread in self._threads:
            thread.start()

    def _guard(self, fn, *args):
        try:
            fn(*args)
        except BaseException as e:  # noqa: BLE001 -- handed to the consumer, who raises it, instead of dying silently
            self._put(self._batches, e)

    def _put(self, q, item):
        while not self._stop.is_set():
            try:
                q.put(item, timeout=0.1)
                return True
            except queue.Full:
                pass
        return False

    def _get(self, q):
        while not self._stop.is_set():
            try:
                return q.get(timeout=0.1)
            except queue.Empty:
                pass
        raise RuntimeError(f"{self.name} loader was closed")

    def _read(self, start, out):
        """Reader thread: per row group, (epoch, unit, first doc index, [encoded doc, or None/reason if skipped])."""
        epoch, unit, doc = start
        while self._put(out, (epoch, unit, doc, self._encode(self.units[unit], doc))):
            unit, doc = unit + 1, 0
            if unit == len(self.units):
                epoch, unit = epoch + 1, 0

    def _encode(self, unit, skip):
        path, row_group, first, step = unit
        items = read_row_group(path, row_group, "text" if self.kind == "text" else chat_column(path))
        items = items[first::step][skip:]
        if self.kind == "text":
            encoded = iter(self.tokenizer.encode_batch([t for t in items if t], num_threads=self.threads))
            bos = self.tokenizer.bos_id
            return [np.array([bos, *next(encoded)], dtype=np.int32) if t else None for t in items]
        from tokenizer import render_conversation  # here, not at the top: tokenizer.py imports this file
        out = []
        for item in items:
            messages = conversation_messages(item)
            if not messages:
                out.append(None)
            elif not any(m.get("role") == "assistant" for m in messages):
                out.append("no_assistant")
            else:
                try:
                    ids, mask = render_conversation(self.tokenizer, messages, max_tokens=self.T + 1)
                except ValueError:
                    out.append("malformed")
                    continue
                out.append((np.array(ids, np.int32), np.array(mask, np.int8)) if ids else "too_long")
        return out

    def _pack(self, units, state):
        """Packer thread: fill rows from the best-fit buffer, ship each batch to the device with the state after it."""
        epoch, unit, doc = state["epoch"], state["unit"], state["doc"]
        stats, row_len, bos = dict(state["stats"]), self.T + 1, self.tokenizer.bos_id
        lengths, buffer = [], []  # sorted by length, so the best fit is a bisect
        for ids, mask, arrival in state["buffer"]:
            insort(lengths, buffer, ids, mask, arrival)
        pending, pending_at, docs_this_epoch = [], 0, len(buffer)
        while not self._stop.is_set():
            rows = np.empty((self.B, row_len), dtype=np.int32)
            masks = np.ones((self.B, row_len), dtype=np.int8) if self.kind == "chat" else None
            for b in range(self.B):
                while len(buffer) < self.buffer_docs:  # top the buffer up, in document order
                    while pending_at == len(pending):
                        item_epoch, unit, doc, pending = self._get(units)
                        pending_at = 0
                        if item_epoch != epoch:
                            if docs_this_epoch == 0:
                                raise ValueError(f"{self.name} loader: a whole pass over {len(self.units)} row groups "
                                                 f"found no usable document ({self.log_line()})")
                            if self.rank == 0:
                                print(f"{self.name} loader: epoch {item_epoch} starts (the data ran out, starting over)")
                            epoch, docs_this_epoch = item_epoch, 0
                    item = pending[pending_at]
                    pending_at, doc = pending_at + 1, doc + 1
                    if item is None or isinstance(item, str):
                        stats[item or "empty"] += 1
                        continue
                    ids, mask = item if self.kind == "chat" else (item, None)
                    stats["docs"], stats["doc_tokens"], docs_this_epoch = stats["docs"] + 1, \
                        stats["doc_tokens"] + len(ids), docs_this_epoch + 1
                    if len(ids) > row_len:  # text only (chat renders at most a row): cut into BOS-led pieces
                        stats["cropped"] += len(ids) - row_len
                        insort(lengths, buffer, ids[:row_len], None, stats["docs"])
                        for s in range(row_len, len(ids), row_len - 1):
                            insort(lengths, buffer, np.concatenate([[bos], ids[s:s + row_len - 1]]).astype(np.int32),
                                   None, stats["docs"])
                    else:
                        insort(lengths, buffer, ids, mask, stats["docs"])
                pos = 0
                while pos < row_len:
                    space = row_len - pos
                    if pos == 0:  # the oldest document opens the row (min: the first of equals, deterministic)
                        i = min(range(len(buffer)), key=lambda j: buffer[j][2])
                    else:  # the largest document that fits
                        i = bisect.bisect_right(lengths, space) - 1
                    if i >= 0:
                        lengths.pop(i)
                        ids, mask, _ = buffer.pop(i)
                        rows[b, pos:pos + len(ids)] = ids
                        if mask is not None:
                            masks[b, pos:pos + len(ids)] = mask
                        pos += len(ids)
                    elif self.kind == "chat":  # pad: conversations are never cropped
                        rows[b, pos:], masks[b, pos:] = bos, 0
                        stats["padding"] += space
                        pos = row_len
                    else:  # crop the smallest document; its remainder goes back as a BOS-led piece
                        lengths.pop(0)
                        ids, _, arrival = buffer.pop(0)
                        rows[b, pos:] = ids[:space]
                        stats["cropped"] += len(ids) - space
                        insort(lengths, buffer, np.concatenate([[bos], ids[space:]]).astype(np.int32), None, arrival)
                        pos = row_len
            stats["batches"], stats["tokens"] = stats["batches"] + 1, stats["tokens"] + self.B * self.T
            after = (epoch, unit, doc)
            if pending_at == len(pending):  # the next document is the first of the next row group
                after = (epoch + 1, 0, 0) if unit + 1 == len(self.units) else (epoch, unit + 1, 0)
            snapshot = {"epoch": after[0], "unit": after[1], "doc": after[2], "stats": dict(stats),
                        "buffer": list(buffer)}
            if not self._put(self._batches, (self._to_device(rows, masks), snapshot)):
                return

    def _to_device(self, rows, masks):
        inputs, targets = rows[:, :-1], rows[:, 1:].copy()
        if masks is not None:
            targets[masks[:, 1:] == 0] = -1
        batch = torch.from_numpy(np.stack([inputs, targets]))  # int32 on the wire, half the bytes of int64
        if self.device.type == "cuda":
            batch = batch.pin_memory().to(self.device, non_blocking=True)
        batch = batch.long()
        return batch[0], batch[1]


def text_loader(data_dir, split, tokenizer, batch_size, seq_len, **kwargs):
    """The pretraining loader over a corpus directory's train or val split."""
    return PackedLoader(split_shards(data_dir, split), tokenizer, batch_size, seq_len, kind="text",
                        **{"name": split, **kwargs})
