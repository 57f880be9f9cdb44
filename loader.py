"""Streaming loaders: (inputs, targets) batches on the device from a text corpus (text_loader)
or conversations (chat_loader), resumable bit-identically. Packing is pure functions;
PackedLoader adds threads and files. Not a stage; `python prepare.py rows` shows a batch's rows.
"""
import bisect
import contextlib
import heapq
import itertools
import math
import os
import queue
import random
import threading
from pathlib import Path

import numpy as np
import torch

from dataset import (
    chat_files,
    chat_footer,
    chat_rows,
    check_chat_files,
    read_row_group,
    split_shards,
)

STAT_KEYS = ("batches", "tokens", "supervised", "docs", "doc_tokens", "pieces", "cropped",
             "padding",
             "empty",
             "no_assistant", "too_long", "malformed", "empty_content")
# the first skipped conversations are printed (file, row, why); the rest only counted
REPORT_SKIPPED = 5


def read_footers(files):
    """{path: its parquet metadata or .jsonl index}, read once."""
    return {path: chat_footer(path) for path in files}


def unit_rows(unit, footers):
    """The rows of its row group that a unit holds, in file order."""
    path, row_group, first, step = unit
    return range(first, footers[path].row_group(row_group).num_rows, step)


def assign_units(files, rank, world_size, footers=None):
    """Rank `rank`'s units (path, row group, first doc, doc step), no document shared and no
    rank running out first: full row groups round robin in whole rounds, the rest dealt by
    document (repeated if fewer than ranks)."""
    footers = footers or read_footers(files)
    row_groups = [(path, i, footers[path].row_group(i).num_rows) for path in files
                  for i in range(footers[path].num_row_groups)]
    most = max((n for _, _, n in row_groups), default=0)
    full = [k for k, (_, _, n) in enumerate(row_groups) if n == most]
    whole = {k: j % world_size for j, k in enumerate(full[:len(full) // world_size * world_size])}
    documents = sum(n for k, (_, _, n) in enumerate(row_groups) if k not in whole)
    copies = -(-world_size // documents) if documents and not whole else 1
    units, start = [], 0  # start: the dealt index of the row group's first document
    for _ in range(copies):
        for k, (path, i, n) in enumerate(row_groups):
            if k in whole:
                units += [(path, i, 0, 1)] if whole[k] == rank else []
                continue
            first = (rank - start) % world_size
            if first < n:
                units.append((path, i, first, world_size))
            start += n
    return units


def trained_epoch(stats, pass_tokens):
    """The pass the tokens in rows are in (pass_tokens 0: unknown, so 0)."""
    return int(stats["tokens"] // pass_tokens) if pass_tokens else 0


def cut_into_pieces(ids, row_len, bos):
    """A long document as row-sized pieces, each after the first led by `bos` (a mask is cut
    the same way)."""
    rest = [np.concatenate([[bos], ids[s:s + row_len - 1]]).astype(ids.dtype)
            for s in range(row_len, len(ids), row_len - 1)]
    return [ids[:row_len], *rest]


def skipped(item):
    """None (an empty document) or the reason an item was skipped."""
    return item is None or isinstance(item, str)


class PieceBuffer:
    """Pieces (ids, mask, arrival) sorted by length: the largest that fits is a bisect; a heap
    of arrivals finds the oldest."""

    def __init__(self, pieces):
        self.lengths, self.pieces, self.live, self.oldest, self.tokens = [], [], {}, [], 0
        for ids, mask, arrival in pieces:
            self.add(ids, mask, arrival)

    def __len__(self):
        return len(self.pieces)

    def add(self, ids, mask, arrival):
        i = bisect.bisect_right(self.lengths, len(ids))
        self.lengths.insert(i, len(ids))
        self.pieces.insert(i, (ids, mask, arrival))
        self.live[arrival] = len(ids)
        heapq.heappush(self.oldest, arrival)
        self.tokens += len(ids)

    def take(self, i):
        self.lengths.pop(i)
        ids, mask, arrival = self.pieces.pop(i)
        del self.live[arrival]
        self.tokens -= len(ids)
        return ids, mask, arrival

    def take_oldest(self):
        while self.oldest[0] not in self.live:
            heapq.heappop(self.oldest)
        arrival = self.oldest[0]
        first = bisect.bisect_left(self.lengths, self.live[arrival])
        return self.take(next(i for i in range(first,
                                               len(self.pieces)) if self.pieces[i][2] == arrival))

    def take_largest(self, space):
        """The largest piece of at most `space` tokens, or None."""
        i = bisect.bisect_right(self.lengths, space) - 1
        return self.take(i) if i >= 0 else None


# -----------------------------------------------------------------------------
# Packing: pure functions, no threads or I/O. A document: ids (text), (ids, mask) (a
# conversation, mask 1 at targets), or skipped: None (empty) or its stats key.

_END = object()  # the documents have run out


def add_document(buffer, document, row_len, bos, stats):
    """Buffer one document (a skipped one is counted); a long one as pieces, tokens past the
    first counted as 'cropped'."""
    if skipped(document):
        stats[document or "empty"] += 1
        return
    ids, mask = document if isinstance(document, tuple) else (document, None)
    stats["docs"] += 1
    stats["doc_tokens"] += len(ids)
    pieces = [(ids, mask)]
    if len(ids) > row_len:
        stats["cropped"] += len(ids) - row_len
        id_pieces = cut_into_pieces(ids, row_len, bos)
        mask_pieces = [None] * len(id_pieces) if mask is None else cut_into_pieces(mask, row_len,
                                                                                   mask[0])
        pieces = list(zip(id_pieces, mask_pieces, strict=True))
    for piece, piece_mask in pieces:
        buffer.add(piece, piece_mask, stats["pieces"])
        stats["pieces"] += 1


def fill_row(buffer, row, row_mask, bos, crop, stats):
    """The oldest piece opens the row (pure best-fit starves short documents), then the largest
    that fits, repeatedly, then pad_or_crop() the rest."""
    pos, piece = 0, buffer.take_oldest()
    while piece is not None:
        ids, mask, _ = piece
        row[pos:pos + len(ids)] = ids
        if mask is not None:
            row_mask[pos:pos + len(ids)] = mask
        pos += len(ids)
        piece = buffer.take_largest(len(row) - pos)
    if pos < len(row):
        pad_or_crop(buffer, row, row_mask, pos, bos, crop, stats)


def pad_or_crop(buffer, row, row_mask, pos, bos, crop, stats):
    """No piece fits: "pad" pads (BOS, mask 0); "crop" fills with the smallest piece and puts
    its BOS-led remainder back under the same arrival."""
    space = len(row) - pos
    if not crop or not len(buffer):  # crop pads only once the data has ended
        row[pos:], row_mask[pos:] = bos, 0
        stats["padding"] += space
        return
    ids, mask, arrival = buffer.take(0)
    row[pos:] = ids[:space]
    if mask is not None:
        row_mask[pos:] = mask[:space]
    stats["cropped"] += len(ids) - space
    buffer.add(np.concatenate([[bos], ids[space:]]).astype(np.int32),
               None if mask is None else np.concatenate([mask[:1], mask[space:]]), arrival)


def pack_batch(buffer, documents, batch_size, row_len, bos, *, crop, buffer_docs, masked, stats):
    """(rows, masks or None): up to batch_size rows; fewer once the data has ended."""
    rows = np.empty((batch_size, row_len), dtype=np.int32)
    masks = np.ones((batch_size, row_len), dtype=np.int8) if masked else None
    filled = 0
    for b in range(batch_size):
        # fill to buffer_docs pieces; cropping also wants a row's worth of tokens to crop from
        while len(buffer) < buffer_docs or (crop and buffer.tokens < row_len):
            if (document := next(documents, _END)) is _END:
                break
            add_document(buffer, document, row_len, bos, stats)
        if not len(buffer):  # the data has ended: a short last batch
            break
        fill_row(buffer, rows[b], None if masks is None else masks[b], bos, crop, stats)
        filled += 1
    if filled:
        stats["batches"] += 1
        stats["tokens"] += filled * (row_len - 1)
        supervised = filled * (row_len - 1) if masks is None else int(masks[:filled, 1:].sum())
        stats["supervised"] += supervised
    return rows[:filled], None if masks is None else masks[:filled]


def inputs_and_targets(rows, masks):
    """int32 [inputs, targets], shape (2, rows, row_len - 1); targets -1 (ignored) where the
    mask is 0."""
    inputs, targets = rows[:, :-1], rows[:, 1:].copy()
    if masks is not None:
        targets[masks[:, 1:] == 0] = -1
    return np.stack([inputs, targets])


def to_device(batch, device):
    """int64 (inputs, targets) on `device`; int32 until here: half the bytes on the wire."""
    if device.type == "cuda":
        batch = batch.pin_memory().to(device, non_blocking=True)
    batch = batch.long()
    return batch[0], batch[1]


class Pipe:
    """A bounded queue with its start's stop event, so a thread outliving close()'s join still
    finds it stopped."""

    def __init__(self, maxsize, stop, name):
        self.queue, self.stop, self.name = queue.Queue(maxsize=maxsize), stop, name

    def put(self, item):
        """False if the pipeline was stopped first."""
        while not self.stop.is_set():
            with contextlib.suppress(queue.Full):
                self.queue.put(item, timeout=0.1)
                return True
        return False

    def get(self):
        while not self.stop.is_set():
            with contextlib.suppress(queue.Empty):
                return self.queue.get(timeout=0.1)
        raise RuntimeError(f"{self.name} loader was closed while waiting: next() starts it again "
                           "from its last state")


class PackedLoader:
    """(inputs, targets) batches (B, T) for one rank: pack="crop" packs without padding, "pad"
    pads whole conversations (SFT); supervise picks the targets (docs/data.md). state_dict():
    the position after the last batch. A reader thread tokenizes, a packer thread ships batches
    `prefetch` ahead. seed shuffles units by (seed, epoch), documents by (seed, epoch, unit).
    max_epochs None cycles forever."""

    def __init__(self, files, tokenizer, batch_size, seq_len, kind="text", rank=0, world_size=1,
                 device=
                 "cpu",
                 buffer_docs=1000, threads=None, prefetch=2, name="train", max_epochs=None,
                 pack=None,
                 supervise=None, seed=None, skip_bad_rows=False):
        if kind not in ("text", "chat"):
            raise ValueError(f"kind={kind!r} is not allowed: choose text or chat")
        pack = pack or ("crop" if kind == "text" else "pad")
        supervise = supervise or ("all" if kind == "text" else "assistant")
        if pack not in ("pad", "crop") or supervise not in ("all", "assistant") or \
                kind == "text" and (pack, supervise) != ("crop", "all"):
            raise ValueError(f"{name}: pack={pack!r}, supervise={supervise!r}: choose pack pad or "
                             "crop, supervise all or assistant (text: pack='crop' and "
                             "supervise='all', every token a target)")
        self.files, self.tokenizer, self.kind, self.name = [Path(f)
                                                            for f in files], tokenizer, kind, name
        self.pack, self.crop, self.supervise, self.seed = pack, pack == "crop", supervise, seed
        self.B, self.T, self.rank, self.world_size = batch_size, seq_len, rank, world_size
        self.device = torch.device(device)
        self.threads = threads or os.cpu_count()
        self.prefetch, self.max_epochs = prefetch, max_epochs
        # a bad .jsonl line stops here, before any batch (skipped: "malformed")
        if kind == "chat":
            check_chat_files(self.files, skip_bad_rows)
        self._footers = read_footers(self.files)
        self.units = assign_units(self.files, rank, world_size, self._footers)
        if not self.units:
            raise ValueError(f"{name}: rank {rank} of {world_size} has no data in "
                             f"{', '.join(map(str, self.files))}")
        # training buffers at most one pass, else a small set is read many times before a row
        pass_docs = sum(len(unit_rows(unit, self._footers)) for unit in self.units)
        self.buffer_docs = buffer_docs if max_epochs is not None else min(buffer_docs, max(
                1, pass_docs))
        # a training pass shorter than buffer_docs stays encoded after its first read:
        # {(unit, row): _read_unit's}; None: every pass reads
        self._encoded = {} if max_epochs is None and pass_docs < buffer_docs else None
        # epoch, unit, doc: where the reader goes on; pass_tokens: a pass's tokens, once known
        self.state = {"epoch": 0, "unit": 0, "doc": 0, "buffer": [],
                      "stats": dict.fromkeys(STAT_KEYS, 0),
                      "pass_tokens": 0}
        self._threads, self._batches = [], None
        self._reported = 0  # skipped conversations printed so far

    # --- state
    @property
    def epoch(self):
        """The pass the rows handed out are in (0: the first); state["epoch"] runs ahead."""
        return trained_epoch(self.state["stats"], self.state["pass_tokens"])

    def state_dict(self):
        buffer = self.state["buffer"]
        ids = np.concatenate([x for x, _, _ in buffer]) if buffer else np.zeros(0, np.int32)
        masks = np.concatenate([
                m for _, m, _ in buffer]) if buffer and self.kind == "chat" else np.zeros(0,
                                                                                          np.int8)
        return {"epoch": self.state["epoch"], "unit": self.state["unit"], "doc": self.state["doc"],
                "stats": dict(self.state["stats"]), "buffer_ids": torch.from_numpy(ids),
                "buffer_masks": torch.from_numpy(masks),
                "buffer_lengths": torch.tensor([len(x) for x, _, _ in buffer], dtype=torch.int64),
                "buffer_arrivals": torch.tensor([a for _, _, a in buffer], dtype=torch.int64),
                "rank": self.rank, "world_size": self.world_size, "seq_len": self.T,
                "kind": self.kind,
                "pack": self.pack, "supervise": self.supervise, "seed": self.seed,
                "pass_tokens": self.state["pass_tokens"]}

    def load_state_dict(self, sd):
        for key, mine in (("rank", self.rank), ("world_size", self.world_size), ("seq_len", self.T),
                          ("kind", self.kind), ("pack", self.pack), ("supervise", self.supervise),
                          ("seed", self.seed)):
            if sd[key] != mine:
                raise ValueError(f"{self.name} loader: state was saved with {key}={sd[key]}, this "
                                 f"loader has {key}={mine}; an exact resume needs the same {key}")
        if self._batches is not None:
            raise RuntimeError("load_state_dict() must come before the first batch: close() the "
                               "loader first")
        bounds = np.cumsum([0, *sd["buffer_lengths"].tolist()])
        ids, masks = sd["buffer_ids"].numpy(), sd["buffer_masks"].numpy()
        buffer = [(ids[a:b].copy(), masks[a:b].copy() if self.kind == "chat" else None, arrival)
                  for (a, b), arrival in zip(itertools.pairwise(bounds),
                                             sd["buffer_arrivals"].tolist(), strict=True)]
        self.state = {"epoch": sd["epoch"], "unit": sd["unit"], "doc": sd["doc"], "buffer": buffer,
                      "stats": dict(sd["stats"]), "pass_tokens": sd["pass_tokens"]}

    def log_line(self):
        s = self.state["stats"]
        line = (f"{self.name} loader rank {self.rank}/{self.world_size}: epoch "
                f"{self.state['epoch']}, {s['batches']:,} batches, {s['tokens']:,} tokens, "
                f"{s['docs']:,} docs, empty skipped {s['empty']:,}")
        cropped = f"{100 * s['cropped'] / s['doc_tokens']:.1f}%" if s["doc_tokens"] else "n/a"
        cropped = (f", cropped {cropped} of document tokens (moved to a later row as a BOS-led "
                   "piece; none discarded)")
        if self.kind == "text":
            return line + cropped
        slots = s["batches"] * self.B * (self.T + 1)
        padding = f"{100 * s['padding'] / slots:.1f}%" if slots else "n/a"
        supervised = f"{100 * s['supervised'] / s['tokens']:.1f}%" if s["tokens"] else "n/a"
        cropped = cropped if self.crop else ""
        return line + (f", supervised {supervised} of targets ({self.supervise}), padding "
                       f"{padding}{cropped}, skipped: no assistant turn {s['no_assistant']:,}, "
                       f"malformed {s['malformed']:,}, first exchange longer than a row "
                       f"{s['too_long']:,}, empty content {s['empty_content']:,}")

    # --- the pipeline
    def __iter__(self):
        return self

    def __next__(self):
        if self._batches is None:
            self._start()
        item = self._batches.get()
        if isinstance(item, BaseException):
            self.close()
            raise item
        batch, self.state = item
        return batch

    def stop(self):
        """Tell this start's threads to end without waiting (close() waits)."""
        if self._batches is not None:
            self._batches.stop.set()

    def close(self, timeout=10):
        """Stop the threads; the next batch starts new ones from self.state."""
        self.stop()
        for thread in self._threads:
            thread.join(timeout=timeout)
        self._threads, self._batches = [], None

    def _start(self):
        stop = threading.Event()  # this start's own (see Pipe)
        units, batches = Pipe(2, stop, self.name), Pipe(self.prefetch, stop, self.name)
        start = (self.state["epoch"], self.state["unit"], self.state["doc"])
        self._threads = [threading.Thread(target=self._guard, args=(batches, self._read, start,
                                                                    units), daemon=True),
                         threading.Thread(target=self._guard, args=(batches, self._pack, units,
                                                                    batches, self.state),
                                          daemon=True)]
        self._batches = batches
        for thread in self._threads:
            thread.start()

    def _guard(self, batches, fn, *args):
        try:
            fn(*args)
        except BaseException as e:  # noqa: BLE001 -- the consumer raises it: no silent death
            batches.put(e)

    def _read(self, start, out):
        """Reader thread: per unit in the epoch's order, (epoch, unit, first doc, [encoded doc
        or skip reason])."""
        epoch, first_unit, doc = start
        while epoch != self.max_epochs:
            order = list(range(len(self.units)))  # order[k]: the unit visited k-th this epoch
            if self.seed is not None:
                random.Random(f"{self.seed} {epoch}").shuffle(order)
            for unit in range(first_unit, len(self.units)):
                doc_order = None if self.seed is None else f"{self.seed} {epoch} {order[unit]}"
                if not out.put((epoch, unit, doc, self._encode(self.units[order[unit]], doc,
                                                               doc_order))):
                    return
                doc = 0
            epoch, first_unit = epoch + 1, 0
        out.put(None)  # the data has ended (max_epochs)

    def _encode(self, unit, skip, doc_order=None):
        """A unit's documents from `skip` on, in file order or shuffled by `doc_order`."""
        path, row_group, _, _ = unit
        rows = list(unit_rows(unit, self._footers))  # indices in the row group
        if doc_order is not None:
            random.Random(doc_order).shuffle(rows)
        rows = rows[skip:]
        if self._encoded is not None and all((unit, r) in self._encoded for r in rows):
            encoded = [self._encoded[unit, r] for r in rows]
        else:
            encoded = self._read_unit(path, row_group, rows)
            if self._encoded is not None:
                self._encoded.update(zip([(unit, r) for r in rows], encoded, strict=True))
        if self.kind == "text":
            return encoded
        out = []
        for r, (conversation, why) in zip(rows, encoded, strict=True):
            if why and self.rank == 0 and self._reported < REPORT_SKIPPED:
                self._reported += 1
                row = sum(self._footers[path].row_group(g).num_rows for g in range(row_group)) + r
                more = ""
                if self._reported == REPORT_SKIPPED:
                    more = (f" (only the first {REPORT_SKIPPED} are printed; log_line() counts "
                            "them all)")
                print(f"{self.name} loader: skipping {path} row {row}: {why}{more}")
            out.append(conversation)
        return out

    def _read_unit(self, path, row_group, rows):
        """Rows encoded: text as BOS-led ids (None: empty), a conversation as _render's."""
        if self.kind == "text":
            items = read_row_group(path, row_group, "text")
            texts = [items[r] for r in rows]
            encoded = iter(self.tokenizer.encode_batch([t for t in texts if t],
                                                       num_threads=self.threads))
            bos = self.tokenizer.bos_id
            return [np.array([bos, *next(encoded)], dtype=np.int32) if t else None for t in texts]
        return [("malformed", item) if isinstance(item, str) else self._render(item)
                for item in chat_rows(path, row_group, rows)]

    def _render(self, messages):
        """((ids, mask) or a stats key, why it is bad input or None). pack="pad" cuts after the
        last assistant turn that fits."""
        if not messages:
            return None, "no messages"
        try:
            ids, mask = self.tokenizer.render_conversation(
                    messages, max_tokens=None if self.crop else self.T + 1)
        except ValueError as e:  # unknown role, non-string content, roles out of order
            return "malformed", str(e)
        empty = [i for i, m in enumerate(messages) if m["role"] != "system"
                 and isinstance(m["content"], str) and not m["content"].strip()]
        if empty:
            role = messages[empty[0]]["role"]
            return "empty_content", f"message {empty[0]} ({role}) has empty content"
        if not any(m["role"] == "assistant" for m in messages):
            return "no_assistant", "no assistant turn"
        if not ids:
            return "too_long", None  # not bad input: a longer row would take it
        mask = np.ones(len(ids), np.int8) if self.supervise == "all" else np.array(mask, np.int8)
        return (np.array(ids, np.int32), mask), None

    # --- packing
    def _pack(self, units, batches, state):
        """Packer thread: ship each batch to the device with the state after it."""
        stats, buffer = dict(state["stats"]), PieceBuffer(state["buffer"])
        per_pass = [state["pass_tokens"]]  # set by _documents when a second pass starts
        # the next unread document, where a resume reads on; None once the data has ended
        position = [(state["epoch"], state["unit"], state["doc"])]
        documents = self._documents(units, position, len(buffer), stats, per_pass)
        # a row that can end in padding needs a mask
        masked = self.kind == "chat" or self.max_epochs is not None
        while len(buffer) or position[0] is not None:
            rows, masks = pack_batch(buffer, documents, self.B, self.T + 1, self.tokenizer.bos_id,
                                     crop=self.crop,
                                     buffer_docs=self.buffer_docs, masked=masked, stats=stats)
            if len(rows):
                trained = trained_epoch(stats, per_pass[0])
                new = trained > trained_epoch(state["stats"], state["pass_tokens"])
                # epochs 2-4, 10, 100, ...
                if new and self.rank == 0 and (trained < 4 or str(trained + 1).strip("0") == "1"):
                    later = "; later epochs: only 10, 100, ... are printed" if trained == 3 else ""
                    print(f"{self.name} loader, stream {self.rank} of {self.world_size}: epoch "
                          f"{trained + 1} starts (its data ran out: its rows repeat documents from "
                          f"here on{later})")
                epoch, unit, doc = position[0] or (self.max_epochs, 0, 0)
                state = {"epoch": epoch, "unit": unit, "doc": doc, "stats": dict(stats),
                         "buffer": list(buffer.pieces),
                         "pass_tokens": per_pass[0]}
                if not batches.put((to_device(torch.from_numpy(inputs_and_targets(rows, masks)),
                                              self.device), state)):
                    return
        batches.put(StopIteration())  # max_epochs done: __next__ raises it

    def _documents(self, units, position, buffered, stats, per_pass):
        """Documents from position[0] on, moved to the next unread before each is yielded. A
        pass with no usable document is an error."""
        epoch, usable = position[0][0], buffered
        while (got := units.get()) is not None:
            item_epoch, unit, doc, items = got
            if item_epoch != epoch:
                if not usable:
                    raise ValueError(f"{self.name} loader: a whole pass over {len(self.units)} row "
                                     f"groups found no usable document ({self.log_line()})")
                epoch, usable = item_epoch, 0
                per_pass[0] = stats["doc_tokens"] / item_epoch
            for read, item in enumerate(items, start=1):
                usable += not skipped(item)
                position[0] = (epoch, unit, doc + read)
                if read == len(items):
                    position[0] = (epoch + 1, 0, 0) if unit + 1 == len(self.units) else (
                            epoch, unit + 1, 0)
                yield item
        position[0] = None


def close_all(loaders, timeout=10):
    """Close loaders, every thread told first, so they end together, not poll after poll."""
    for loader in loaders:
        loader.stop()
    for loader in loaders:
        for source in getattr(loader, "loaders", [loader]):
            source.close(timeout)


def text_loader(data_dir, split, tokenizer, batch_size, seq_len, **kwargs):
    return PackedLoader(split_shards(data_dir, split), tokenizer, batch_size, seq_len, kind="text",
                        **{"name": split, **kwargs})


def chat_loader(chat_dir, split, tokenizer, batch_size, seq_len, *, files=None, **kwargs):
    """The conversation loader over a chat split, or `files`."""
    return PackedLoader(files or chat_files(chat_dir, split), tokenizer, batch_size, seq_len,
                        kind="chat", **{"name": f"chat {split}", **kwargs})


# -----------------------------------------------------------------------------

def val_rows(data_dir, tokenizer, max_tokens, seq_len):
    """Rows of seq_len + 1 tokens for max_tokens targets, packed as in training, the same in
    every process and stage."""
    n_rows = max(1, math.ceil(max_tokens / seq_len))
    loader = text_loader(data_dir, "val", tokenizer, min(n_rows, 64), seq_len, max_epochs=1, name=
                         "val")
    rows, have = [], 0
    try:
        for inputs, targets in loader:
            rows.append(torch.cat([inputs[:, :1], targets], dim=1))
            have += len(inputs)
            if have >= n_rows:
                break
    finally:
        loader.close()
    return torch.cat(rows)[:n_rows]
