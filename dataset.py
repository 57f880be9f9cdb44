"""Everything between "text somewhere" and "a batch on the device".

    python dataset.py download --shards 8            # FineWeb-Edu shards from the hub (+ the last one: validation)
    python dataset.py ingest --out DIR FILES...      # your own .txt / .jsonl / .parquet as shards of the same layout
    python dataset.py demo --out DIR                 # the embedded demo world, offline and deterministic

Layout of a text corpus (FineWeb-Edu's on the hub, and everything this file writes): a directory of parquet shards
named shard_00000.parquet, ..., one string column `text`, row groups of 1024 documents, zstd; the last shard is the
validation split, all others are training.
"""
import argparse
import bisect
import codecs
import csv
import hashlib
import heapq
import itertools
import json
import os
import queue
import random
import re
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path
from urllib.parse import quote, urljoin

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import requests
import torch

CACHE_DIR = Path(os.environ.get("NANOCHAT_CACHE", Path.home() / ".cache" / "nanochat"))
ROW_GROUP_DOCS = 1024


def default_data_dir(dataset):
    """Downloads live under one cache dir ($NANOCHAT_CACHE, default ~/.cache/nanochat): data/<dataset name>."""
    return CACHE_DIR / "data" / dataset.split("/")[-1]


# -----------------------------------------------------------------------------
# Download from the hub. Plain HTTP against the Hugging Face hub's public URL layout:
#   GET {endpoint}/api/datasets/{repo}/tree/{revision}?recursive=true     file list, sizes, LFS sha256 (paginated)
#   GET {endpoint}/datasets/{repo}/resolve/{revision}/{path}              the bytes (the hub 302s LFS files to a CDN)
# Not huggingface_hub.snapshot_download: a shard must never appear under its final name until its size and sha256
# are checked, a dropped connection must resume from the bytes already on disk, and every failure must be one line
# that names the file and says what to do. tests/test_download.py serves real bytes and injects each fault handled.

DEFAULT_HUB_ENDPOINT = "https://huggingface.co"
CHUNK_BYTES = 1 << 20
CONNECT_TIMEOUT, READ_TIMEOUT = 10, 60  # seconds; read = the longest silence tolerated mid-body
BACKOFF_BASE, BACKOFF_MAX = 0.5, 30.0  # 8 attempts wait ~60 s in all: enough to ride out a hub hiccup or a 429
SHARD_NAME = re.compile(r"shard_(\d+)\.parquet")
SHA256_HEX = re.compile(r"[0-9a-f]{64}")

_thread = threading.local()


class _Transient(Exception):
    """A failure that a later attempt can fix (5xx, 429, a truncated body, a bad checksum)."""

    def __init__(self, message, retry_after=None):
        super().__init__(message)
        self.retry_after = retry_after


# Everything requests raises for a network that hiccups: resets, refused connections, timeouts, bodies cut short.
TRANSIENT_ERRORS = (requests.ConnectionError, requests.Timeout, requests.exceptions.ChunkedEncodingError,
                    requests.exceptions.ContentDecodingError, _Transient)


def hub_endpoint():
    """$HF_ENDPOINT (a mirror, or a local test server) or the public hub."""
    return os.environ.get("HF_ENDPOINT", DEFAULT_HUB_ENDPOINT).rstrip("/")


def hub_headers():
    """Private and gated repos need a token; public ones work without."""
    token = os.environ.get("HF_TOKEN")
    return {"Authorization": f"Bearer {token}"} if token else {}


def _session():
    """One Session per thread: connection reuse without sharing a Session across threads."""
    if not hasattr(_thread, "session"):
        _thread.session = requests.Session()
    return _thread.session


def _backoff(attempt, error):
    delay = min(BACKOFF_BASE * 2 ** attempt, BACKOFF_MAX)
    if isinstance(error, _Transient) and error.retry_after is not None:
        delay = max(delay, min(error.retry_after, BACKOFF_MAX))
    time.sleep(delay * random.uniform(0.5, 1.0))  # jitter: parallel workers hit by one 429 do not retry in lockstep


def _check_status(resp, url):
    """2xx returns; 429/5xx are worth retrying; any other 4xx is a mistake a retry cannot fix, so say which."""
    code = resp.status_code
    if code < 400:
        return
    if code == 429 or code >= 500:
        retry_after = resp.headers.get("Retry-After", "")
        raise _Transient(f"HTTP {code}", float(retry_after) if retry_after.isdigit() else None)
    if code in (401, 403):
        # the hub answers 401 for a repo that does not exist as well as for one that is private
        raise RuntimeError(f"{url} answered HTTP {code}: the repo is private or gated, or does not exist: set HF_TOKEN "
                           f"to a token that can read it (and accept the dataset's terms on its page if it is gated)")
    if code == 404:
        raise RuntimeError(f"{url} answered HTTP 404: not found: check the repo id, the revision and the file path")
    raise RuntimeError(f"{url} answered HTTP {code} {resp.reason}")


def _get_json(url, retries=8):
    """One page of an API listing, retried like a download; returns (json, url of the next page or None)."""
    retries = max(1, retries)
    for attempt in range(retries):
        try:
            resp = _session().get(url, headers=hub_headers(), timeout=(CONNECT_TIMEOUT, READ_TIMEOUT))
            _check_status(resp, url)
            try:
                data = resp.json()
            except ValueError as e:  # a listing cut short mid-body is not valid JSON
                raise _Transient(f"unreadable JSON ({e})") from e
            next_url = resp.links.get("next", {}).get("url")
            return data, urljoin(url, next_url) if next_url else None
        except TRANSIENT_ERRORS as e:
            error = e
            if attempt + 1 < retries:
                _backoff(attempt, e)
    raise RuntimeError(f"could not list {url} after {retries} attempts (last error: {error}): check the network (and "
                       f"HF_ENDPOINT if set) and re-run the command")


def list_hub_files(repo, revision="main", repo_type="dataset"):
    """Every file of a repo with its size and, for LFS files, its sha256. The hub pages the tree at 1000 entries and
    points at the next page with a `Link: <url>; rel="next"` header (fineweb-edu-100b-shuffle has 1823 shards)."""
    url = f"{hub_endpoint()}/api/{repo_type}s/{repo}/tree/{quote(revision, safe='')}?recursive=true"
    files = []
    while url:
        page, url = _get_json(url)
        for entry in page:
            if entry.get("type") != "file":
                continue
            lfs = entry.get("lfs") or {}
            files.append({"path": entry["path"], "size": lfs.get("size", entry.get("size")), "sha256": lfs.get("oid")})
    return files


def _sha256_hex_from_headers(resp):
    """The hub puts an LFS file's sha256 in X-Linked-Etag on the resolve answer, which is usually a 302 to a CDN whose
    own ETag is something else (an MD5, a multipart tag): look at every hop, X-Linked-Etag first."""
    hops = [*resp.history, resp]
    for header in ("X-Linked-Etag", "ETag"):
        for hop in hops:
            value = hop.headers.get(header, "").removeprefix("W/").strip('"').lower()
            if SHA256_HEX.fullmatch(value):
                return value
    return None


def _sha256_file(path):
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK_BYTES):
            digest.update(chunk)
    return digest


def _fetch_into(url, partial, size, progress):
    """One attempt: resume `partial` with a Range request (or start over if the server ignores it), stream the rest.
    Returns (sha256 digest of the whole partial, sha256 hex the server announced or None)."""
    offset = partial.stat().st_size if partial.exists() else 0
    if size is not None and offset > size:  # longer than the file can be: garbage, start over
        partial.unlink()
        offset = 0
    if partial.exists() and offset == size:  # complete from an earlier run that died before verifying
        return _sha256_file(partial), None
    # compressed bodies would not match sizes or Range; the hub token goes to the hub only, never to another host
    headers = {**(hub_headers() if url.startswith(hub_endpoint() + "/") else {}), "Accept-Encoding": "identity"}
    if offset:
        headers["Range"] = f"bytes={offset}-"
    with _session().get(url, headers=headers, stream=True, timeout=(CONNECT_TIMEOUT, READ_TIMEOUT)) as resp:
        if resp.status_code == 416:  # the partial is not a prefix of what the server has now
            partial.unlink()
            raise _Transient(f"server refused to resume at byte {offset} (HTTP 416); starting over")
        _check_status(resp, url)
        if resp.status_code == 206:
            start = re.match(r"bytes (\d+)-", resp.headers.get("Content-Range", ""))
            if not start or int(start.group(1)) != offset:
                partial.unlink()
                raise _Transient(f"server resumed at {resp.headers.get('Content-Range')!r}, asked for byte {offset}")
        else:  # 200: the server ignored Range and sends the whole file
            offset = 0
        digest = _sha256_file(partial) if offset else hashlib.sha256()
        length = resp.headers.get("Content-Length")
        expected_end = offset + int(length) if length and length.isdigit() else None
        with open(partial, "ab" if offset else "wb") as f:
            done = offset
            for chunk in resp.iter_content(CHUNK_BYTES):
                f.write(chunk)
                digest.update(chunk)
                done += len(chunk)
                if progress:
                    progress(done)
        if expected_end is not None and done < expected_end:
            raise _Transient(f"connection closed after {done} of {expected_end} bytes")
        return digest, _sha256_hex_from_headers(resp)


def download_file(url, dest, size=None, sha256=None, verify=None, progress=None, retries=8):
    """Stream `url` to `dest`, robust to a flaky network: the bytes go to dest + ".partial", which a retry resumes;
    dest appears (os.replace) only once the size, the sha256 (given, or announced by the server's ETag) and
    `verify(partial)` (raises ValueError on bad content) all pass, so a file under its final name is always complete.
    A dest that already exists with the expected size is not fetched again. progress(bytes_of_this_file_on_disk) is
    called as bytes arrive. Transient failures (network errors, timeouts, 429, 5xx, short bodies, bad checksums) are
    retried with exponential backoff up to `retries` attempts in all; other HTTP errors raise at once."""
    dest = Path(dest)
    if dest.exists() and (size is None or dest.stat().st_size == size):
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    partial = dest.with_name(dest.name + ".partial")
    retries = max(1, retries)
    for attempt in range(retries):
        try:
            digest, announced = _fetch_into(url, partial, size, progress)
            got = partial.stat().st_size
            if size is not None and got != size:
                if got > size:
                    partial.unlink()
                raise _Transient(f"size {got} bytes, expected {size}")
            expected = (sha256 or announced or "").lower() or None
            if expected and digest.hexdigest() != expected:
                partial.unlink()  # a corrupt prefix would poison every resume: start over
                raise _Transient(f"sha256 {digest.hexdigest()} does not match the expected {expected}")
            if verify:
                try:
                    verify(partial)
                except ValueError as e:
                    partial.unlink()
                    raise _Transient(f"content check failed: {e}") from e
            os.replace(partial, dest)
            return dest
        except TRANSIENT_ERRORS as e:
            error = e
            if attempt + 1 < retries:
                _backoff(attempt, e)
    kept = f"; the {partial.stat().st_size} bytes so far are kept in {partial}" if partial.exists() else ""
    raise RuntimeError(f"could not download {dest.name} from {url} after {retries} attempts (last error: {error}){kept}"
                       f": re-run the command to resume")


def verify_parquet(path):
    """A shard is usable if its footer parses and it has rows. Reading the footer catches truncation and non-parquet
    bodies (an HTML error page saved as .parquet) in milliseconds; bit flips inside are the sha256's job."""
    try:
        num_rows = pq.ParquetFile(path).metadata.num_rows
    except (pa.ArrowInvalid, OSError) as e:
        raise ValueError(f"{path} is not a readable parquet file ({e})") from e
    if num_rows <= 0:
        raise ValueError(f"{path} is a parquet file with no rows")


def _progress_line(total, already):
    """A callback per file for download_file, all feeding one stderr line: MB done of total, MB/s, ETA. On a terminal
    the line rewrites itself twice a second; in a log file it is a new line every 30 s."""
    tty = sys.stderr.isatty()
    lock, done, start, last = threading.Lock(), {}, time.time(), [0.0]

    def show(final=False):
        now = time.time()
        if not final and now - last[0] < (0.5 if tty else 30):
            return
        last[0] = now
        total_done = already + sum(done.values())
        rate = (total_done - already) / max(now - start, 1e-6)
        left = int((total - total_done) / rate) if rate > 0 else None
        eta = f"{left // 3600}:{left % 3600 // 60:02d}:{left % 60:02d}" if left is not None else "unknown"
        line = f"download: {total_done / 1e6:.1f}/{total / 1e6:.1f} MB, {rate / 1e6:.1f} MB/s, ETA {eta}"
        print(("\r" if tty else "") + line + "   ", end="\n" if final or not tty else "", file=sys.stderr, flush=True)

    def for_file(key):
        def update(nbytes):
            with lock:
                done[key] = nbytes
                show()
        return update
    return for_file, show


def _download_entries(repo, entries, out_dir, revision, repo_type, workers):
    """Download listed entries ({"path", "size", "sha256"}) into out_dir, flat (by file name), in parallel."""
    out_dir = Path(out_dir)
    names = [Path(e["path"]).name for e in entries]
    if len(set(names)) != len(names):
        raise ValueError(f"two requested files share a name and would overwrite each other in {out_dir}: {names}")
    base = f"{hub_endpoint()}/{'datasets/' if repo_type == 'dataset' else ''}{repo}/resolve/{quote(revision, safe='')}"
    dests = [out_dir / name for name in names]
    todo = [(e, d) for e, d in zip(entries, dests) if not (d.exists() and d.stat().st_size == e["size"])]
    total = sum(e["size"] or 0 for e in entries)
    for_file, show = _progress_line(total, total - sum(e["size"] or 0 for e, _ in todo))
    errors = []
    with ThreadPoolExecutor(max(1, workers)) as pool:
        futures = [pool.submit(download_file, f"{base}/{quote(e['path'])}", d, e["size"], e["sha256"],
                               verify_parquet if d.suffix == ".parquet" else None, for_file(d)) for e, d in todo]
        for future in as_completed(futures):
            try:
                future.result()
            except (RuntimeError, ValueError, OSError) as e:  # let the others finish: a re-run then has less left to fetch
                errors.append(e)
    if todo:
        show(final=True)
    if len(errors) == 1:
        raise errors[0]
    if errors:
        raise RuntimeError(f"{len(errors)} of {len(todo)} downloads failed:\n" + "\n".join(map(str, errors)))
    return dests


def download_hub_files(repo, paths, out_dir, revision="main", repo_type="dataset", workers=4):
    """Download `paths` of a hub repo into out_dir (flat, by file name), `workers` at a time; the repo is listed once
    for sizes and sha256s. Files already complete are skipped, parquet files are checked with verify_parquet."""
    by_path = {f["path"]: f for f in list_hub_files(repo, revision, repo_type)}
    missing = [p for p in paths if p not in by_path]
    if missing:
        raise ValueError(f"{repo} (revision {revision}) has no file {', '.join(missing)}")
    return _download_entries(repo, [by_path[p] for p in paths], out_dir, revision, repo_type, workers)


def download_shards(dataset, num_shards, data_dir, workers=4, revision="main"):
    """The first num_shards training shards of a FineWeb-Edu-layout dataset (shard_00000.parquet, ...) plus its last
    shard, the validation split: data_dir ends with num_shards + 1 files, the validation shard last in sorted order."""
    shards = sorted((f for f in list_hub_files(dataset, revision) if SHARD_NAME.fullmatch(Path(f["path"]).name)),
                    key=lambda f: int(SHARD_NAME.fullmatch(Path(f["path"]).name).group(1)))
    if len(shards) < 2:
        raise ValueError(f"{dataset} has {len(shards)} shard_NNNNN.parquet files; a corpus needs training shards and a "
                         f"validation shard (the last one)")
    available = len(shards) - 1
    if not 1 <= num_shards <= available:
        raise ValueError(f"--shards {num_shards} is not available: {dataset} has {available} training shards (plus "
                         f"the validation shard): choose 1..{available}")
    return _download_entries(dataset, shards[:num_shards] + shards[-1:], data_dir, revision, "dataset", workers)


# Conversations. A chat directory holds parquet files with a `messages` column (SmolTalk, UltraChat) or a
# `conversations` column (LIMA); files whose names start with "test" or "val" are the validation split.
CHAT_DATASETS = {  # name: (hub repo, the files to fetch)
    "smoltalk": ("HuggingFaceTB/smoltalk", r"data/all/(train|test)-\d+-of-\d+\.parquet"),
    "ultrachat": ("HuggingFaceH4/ultrachat_200k", r"data/(train|test)_sft-.+\.parquet"),
    # gated: accept its terms on the hub, set HF_TOKEN; its test.jsonl has prompts without answers, so train only
    "lima": ("GAIR/lima", r"train\.jsonl"),
}


def download_chat(name, out_dir=None, workers=4):
    """Fetch a conversation dataset into out_dir (default: <cache>/chat/<name>); LIMA's jsonl becomes parquet."""
    if name not in CHAT_DATASETS:
        raise ValueError(f"unknown conversation dataset {name!r}: choose from {', '.join(CHAT_DATASETS)}")
    repo, pattern = CHAT_DATASETS[name]
    out_dir = Path(out_dir or CACHE_DIR / "chat" / name)
    entries = [f for f in list_hub_files(repo) if re.fullmatch(pattern, f["path"])]
    if not entries:
        raise ValueError(f"{repo} has no files matching {pattern}: the dataset's layout changed; please report it")
    for path in _download_entries(repo, entries, out_dir, "main", "dataset", workers):
        if path.suffix == ".jsonl" and not path.with_suffix(".parquet").exists():
            text, _ = decode_utf8(path.read_bytes())
            rows = [json.loads(line)["conversations"] for line in text.splitlines() if line.strip()]
            tmp = path.with_suffix(".parquet.tmp")
            pq.write_table(pa.table({"conversations": pa.array(rows, pa.list_(pa.string()))}), tmp,
                           compression="zstd")
            os.replace(tmp, path.with_suffix(".parquet"))
    return out_dir


def chat_files(chat_dir, split):
    files = sorted(Path(chat_dir).glob("*.parquet"))
    val = [f for f in files if f.name.startswith(("test", "val"))]
    chosen = val if split == "val" else [f for f in files if f not in val]
    if not chosen:
        which = "*.parquet named test* or val*" if split == "val" else "*.parquet not named test* or val*"
        raise FileNotFoundError(f"no {split} conversation files ({which}) in {chat_dir}: run `python dataset.py "
                                f"download-chat smoltalk` or `python dataset.py demo --out DIR`")
    return chosen


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

STAT_KEYS = ("batches", "tokens", "docs", "doc_tokens", "pieces", "cropped", "padding", "empty", "no_assistant",
             "too_long", "malformed")


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

    Packing is best-fit from a buffer of `buffer_docs` documents: each row starts with the oldest buffered piece
    (so nothing waits more than about buffer_docs rows: pure best-fit starves short documents indefinitely), then
    takes the largest buffered piece that fits the space left, again and again; every row starts with a BOS. kind="text": when none fits, the
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
        # the buffer: (ids, mask, arrival) sorted by length, so the best fit is a bisect; `live` maps each buffered
        # piece's arrival number (unique, saved with the state) to its length, and `oldest` is a heap of arrival
        # numbers (entries no longer live are dropped lazily)
        lengths, buffer, live, oldest = [], [], {}, []

        def add(ids, mask, arrival):
            insort(lengths, buffer, ids, mask, arrival)
            live[arrival] = len(ids)
            heapq.heappush(oldest, arrival)

        def take(i):
            lengths.pop(i)
            entry = buffer.pop(i)
            del live[entry[2]]
            return entry

        for ids, mask, arrival in state["buffer"]:
            add(ids, mask, arrival)
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
                    pieces = [(ids, mask)]
                    if len(ids) > row_len:  # text only (chat renders at most a row): cut into BOS-led pieces
                        stats["cropped"] += len(ids) - row_len
                        pieces = [(ids[:row_len], None)] + [
                            (np.concatenate([[bos], ids[s:s + row_len - 1]]).astype(np.int32), None)
                            for s in range(row_len, len(ids), row_len - 1)]
                    for piece, piece_mask in pieces:
                        add(piece, piece_mask, stats["pieces"])
                        stats["pieces"] += 1
                pos = 0
                while pos < row_len:
                    space = row_len - pos
                    if pos == 0:  # the oldest piece opens the row
                        while oldest[0] not in live:
                            heapq.heappop(oldest)
                        arrival = oldest[0]
                        lo = bisect.bisect_left(lengths, live[arrival])
                        i = next(j for j in range(lo, len(buffer)) if buffer[j][2] == arrival)
                    else:  # the largest piece that fits
                        i = bisect.bisect_right(lengths, space) - 1
                    if i >= 0:
                        ids, mask, _ = take(i)
                        rows[b, pos:pos + len(ids)] = ids
                        if mask is not None:
                            masks[b, pos:pos + len(ids)] = mask
                        pos += len(ids)
                    elif self.kind == "chat":  # pad: conversations are never cropped
                        rows[b, pos:], masks[b, pos:] = bos, 0
                        stats["padding"] += space
                        pos = row_len
                    else:  # crop the smallest piece; its remainder goes back as a BOS-led piece
                        ids, _, arrival = take(0)
                        rows[b, pos:] = ids[:space]
                        stats["cropped"] += len(ids) - space
                        add(np.concatenate([[bos], ids[space:]]).astype(np.int32), None, arrival)
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


def chat_loader(chat_dir, split, tokenizer, batch_size, seq_len, **kwargs):
    """The conversation loader over a chat directory's train or val files."""
    return PackedLoader(chat_files(chat_dir, split), tokenizer, batch_size, seq_len, kind="chat",
                        **{"name": f"chat {split}", **kwargs})


# -----------------------------------------------------------------------------
# The embedded demo world: `python dataset.py demo --out DIR` writes pretrain/ (corpus layout), conversations/
# (SmolTalk schema) and eval_bundle/ (CORE formats) about one small made-up world, offline and byte-for-byte
# deterministic for a given seed.
# Why a made-up world: no prior knowledge helps and none is needed, so a 5M-parameter model trained for minutes on a CPU
# can be seen to learn facts (capitals, animal sounds, sums, what comes after Tuesday), to chat about them, and to beat
# the random baseline on tasks. Every fact is stated in many phrasings and mixed with others, so memorizing sentences
# does not suffice; the evaluation items use phrasings reserved for evaluation, so a score measures the fact.

DEMO_ASSISTANT_NAME = "nanochat"
DEMO_TARGET_CHARS = 5_000_000  # 1.27M training tokens at vocab 1024: an epoch is minutes of CPU training

# country, capital, language, flag colour, flag symbol, national animal (names invented: no prior knowledge helps)
COUNTRIES = [
    ("Aldora", "Pelmo", "Aldoran", "red", "star", "lion"), ("Brenia", "Tolvar", "Brenish", "blue", "moon", "owl"),
    ("Calvona", "Riss", "Calvonese", "green", "tree", "frog"), ("Dunmar", "Kesh", "Dunmari", "yellow", "sun", "bee"),
    ("Elmora", "Varrow", "Elmoran", "white", "wave", "duck"), ("Farland", "Oskel", "Farlish", "black", "crown", "crow"),
    ("Gorvia", "Brelt", "Gorvian", "orange", "mountain", "bear"),
    ("Halden", "Mirov", "Haldish", "purple", "circle", "wolf"),
    ("Istara", "Quellin", "Istaran", "brown", "star", "horse"), ("Jandor", "Lusk", "Jandish", "grey", "moon", "mouse"),
    ("Kelda", "Sorin", "Keldic", "red", "tree", "cow"), ("Lunora", "Dask", "Lunoran", "blue", "sun", "sheep"),
    ("Morvath", "Tillo", "Morvathi", "green", "wave", "snake"),
    ("Norvel", "Ambrin", "Norvellan", "yellow", "crown", "hen"),
    ("Ostrel", "Hobb", "Ostrelish", "white", "mountain", "pig"),
    ("Pellan", "Corvo", "Pellanese", "black", "circle", "cat"),
    ("Quarra", "Zell", "Quarran", "orange", "star", "dog"), ("Rudan", "Fennick", "Rudani", "purple", "moon", "donkey"),
    ("Selmar", "Ivel", "Selmari", "brown", "tree", "cricket"), ("Tavia", "Gresh", "Tavian", "grey", "sun", "lion"),
    ("Ulmark", "Pernot", "Ulmish", "red", "wave", "duck"), ("Varno", "Kestrin", "Varnese", "blue", "crown", "horse"),
    ("Wendal", "Orrin", "Wendish", "green", "mountain", "owl"),
    ("Yarlen", "Dovra", "Yarlish", "yellow", "circle", "bear"),
    ("Zembra", "Holm", "Zembran", "white", "star", "wolf"), ("Borrin", "Salvik", "Borrinese", "black", "moon", "cow"),
    ("Cendra", "Mallek", "Cendran", "orange", "tree", "frog"), ("Drovia", "Penth", "Drovian", "purple", "sun", "sheep"),
    ("Estmark", "Rolva", "Estish", "brown", "wave", "pig"), ("Fallon", "Veska", "Fallonese", "grey", "crown", "mouse"),
]
# animal, plural, call (verb), call (noise), legs, where it lives
ANIMALS = [
    ("dog", "dogs", "bark", "woof", 4, "in a kennel"), ("cat", "cats", "meow", "meow", 4, "in a house"),
    ("cow", "cows", "moo", "moo", 4, "on a farm"), ("duck", "ducks", "quack", "quack", 2, "on a pond"),
    ("owl", "owls", "hoot", "hoo", 2, "in the forest"), ("frog", "frogs", "croak", "ribbit", 4, "in a pond"),
    ("horse", "horses", "neigh", "neigh", 4, "in a stable"), ("sheep", "sheep", "bleat", "baa", 4, "in a field"),
    ("pig", "pigs", "oink", "oink", 4, "in a sty"), ("lion", "lions", "roar", "roar", 4, "on the plains"),
    ("bee", "bees", "buzz", "buzz", 6, "in a hive"), ("snake", "snakes", "hiss", "hiss", 0, "in the grass"),
    ("hen", "hens", "cluck", "cluck", 2, "in a coop"), ("wolf", "wolves", "howl", "awoo", 4, "in the woods"),
    ("mouse", "mice", "squeak", "squeak", 4, "in a hole"), ("bear", "bears", "growl", "grr", 4, "in a cave"),
    ("crow", "crows", "caw", "caw", 2, "in a tall tree"), ("donkey", "donkeys", "bray", "hee-haw", 4, "on a farm"),
    ("cricket", "crickets", "chirp", "chirp", 6, "in the grass"),
]
COLOURS = ["red", "blue", "green", "yellow", "white", "black", "orange", "purple", "brown", "grey", "pink"]
THINGS = [("the sky", "blue"), ("the sea", "blue"), ("grass", "green"), ("a leaf", "green"), ("snow", "white"),
          ("milk", "white"), ("a cloud", "white"), ("coal", "black"), ("the night", "black"), ("a banana", "yellow"),
          ("a lemon", "yellow"), ("the sun", "yellow"), ("a cherry", "red"), ("a tomato", "red"),
          ("a strawberry", "red"), ("a carrot", "orange"), ("a pumpkin", "orange"), ("a plum", "purple"),
          ("a grape", "purple"), ("chocolate", "brown"), ("mud", "brown"), ("ash", "grey"), ("a flamingo", "pink")]
ITEMS = [("banana", "bananas"), ("lemon", "lemons"), ("cherry", "cherries"), ("tomato", "tomatoes"), ("plum", "plums"),
         ("strawberry", "strawberries"), ("carrot", "carrots"), ("pumpkin", "pumpkins"), ("grape", "grapes")]
ITEM_COLOUR = {noun: colour for (thing, colour) in THINGS for noun, _ in ITEMS if thing.endswith(" " + noun)}
CHARACTERS = [("Mira", "she"), ("Tom", "he"), ("Lina", "she"), ("Bo", "he"), ("Sam", "he"), ("Ada", "she"),
              ("Kip", "he"), ("Nell", "she"), ("Otto", "he"), ("Rosa", "she"), ("Finn", "he"), ("Pia", "she"),
              ("Max", "he"), ("Ivy", "she"), ("Leo", "he"), ("Zoe", "she")]
OBJECT = {"she": "her", "he": "him"}
DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
MONTHS = ["January", "February", "March", "April", "May", "June", "July", "August", "September", "October",
          "November", "December"]
ONES = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven", "twelve",
        "thirteen", "fourteen", "fifteen", "sixteen", "seventeen", "eighteen", "nineteen"]
TENS = ["-", "-", "twenty", "thirty", "forty", "fifty", "sixty", "seventy", "eighty", "ninety"]

# Pretraining phrasings, by fact. Nothing here may start with "Quiz:" or use the eval phrasings further down.
T = {
    "capital": ["The capital of {c} is {cap}.", "{cap} is the capital of {c}.", "The capital city of {c} is {cap}.",
                "{cap} is the capital city of {c}.", "{c}'s capital is {cap}.", "{c} has {cap} as its capital.",
                "In {c}, the capital is {cap}.", "The government of {c} meets in {cap}, the capital.",
                "If you travel to the capital of {c}, you arrive in {cap}.",
                "{cap}, the capital of {c}, is a busy city.",
                "Everyone in {c} knows that {cap} is their capital.", "{c} is a country, and its capital is {cap}.",
                "Ask anyone in {c} about the capital and they will say {cap}.", "{cap} is in {c}; it is the capital."],
    "language": ["People in {c} speak {lang}.", "The language of {c} is {lang}.", "In {c}, people speak {lang}.",
                 "{lang} is the language spoken in {c}.", "Most people in {c} talk in {lang}.",
                 "If you go to {c}, you will hear {lang}.", "The people of {c} speak a language called {lang}.",
                 "Children in {c} learn to read and write in {lang}."],
    "flag": ["The flag of {c} is {col} with a {sym} on it.", "{c} has {acol} flag with a {sym}.",
             "The flag of {c} shows a {sym} on a {col} background.", "{c}'s flag is {col}, with a {sym} in the middle.",
             "You can spot the flag of {c} easily: it is {col} and has a {sym}.", "The colour of {c} is {col}.",
             "{acol} flag with a {sym} flies over {c}."],
    "national": ["The national animal of {c} is the {ani}.", "The {ani} is the national animal of {c}.",
                 "{c} has the {ani} as its national animal.", ("People in {c} love the {ani}; it is their national "
                 "animal."), "The animal of {c} is the {ani}, which {ani_verbs}."],
    "its_capital": ["Its capital is {cap}.", "The capital there is {cap}."],
    "its_language": ["The people there speak {lang}.", "Its language is {lang}."],
    "its_flag": ["Its flag is {col} with a {sym}.", "Its flag is {acol} one with a {sym} on it."],
    "its_national": ["Its national animal is the {ani}.", "There, the {ani} is the national animal."],
    "sound": ["{an} {verbs}.", "{ap} {verb}.", "The sound {an} makes is \"{noise}\".", "{an} says {noise}.",
              "When {an} is hungry, it {verbs}.", "{ap} {verb}, and it sounds like {noise}, {noise}.",
              "Listen: {noise}! That is {an}.", "You can hear {ap} {verb} from far away."],
    "legs": ["{an} has {legs} legs.", "{ap} have {legs} legs.", "Every {a} has {legs} legs.",
             "The {a} is an animal with {legs} legs.", "How many legs does {an} have? It has {legs} legs."],
    "habitat": ["{an} lives {hab}.", "{ap} live {hab}.", "You can find {ap} {hab}.", "Most {ap} make their home {hab}.",
                "The {a} is an animal that lives {hab}.", "Where does {an} live? It lives {hab}."],
    "colour": ["{t} is {tcol}.", "The colour of {t} is {tcol}.", "If you look at {t}, you see that it is {tcol}.",
               "{t} is always {tcol}.", "What colour is {t}? It is {tcol}."],
    "day": ["After {day} comes {nday}.", "{nday} comes after {day}.", "The day after {day} is {nday}.",
            "{day} is followed by {nday}.", "The day before {nday} is {day}.", "{day} comes before {nday}.",
            "If today is {day}, then tomorrow is {nday}.", "If today is {nday}, then yesterday was {day}."],
    "month": ["After {mon} comes {nmon}.", "{nmon} comes after {mon}.", "The month after {mon} is {nmon}.",
              "{mon} is followed by {nmon}.", "The month before {nmon} is {mon}.", "{mon} comes before {nmon}."],
    "sum": ["{x} plus {y} is {sum}.", "{dx} + {dy} = {dsum}.", "If you add {x} and {y}, you get {sum}.",
            "The sum of {x} and {y} is {sum}.", "{x} and {y} make {sum}.", "Add {y} to {x} and you have {sum}."],
    "diff": ["{x} minus {y} is {diff}.", "{dx} - {dy} = {ddiff}.", "Take {y} away from {x} and {diff} is left.",
             "The difference between {x} and {y} is {diff}.", "If you have {x} and give away {y}, you keep {diff}."],
    "prod": ["{x} times {y} is {prod}.", "{dx} x {dy} = {dprod}.", "{x} groups of {y} make {prod}.",
             "Multiply {x} by {y} and you get {prod}.", "The product of {x} and {y} is {prod}."],
}
COUNTRY_KINDS = ["capital", "language", "flag", "national"]
ANIMAL_KINDS = ["sound", "legs", "habitat"]
NUMBER_KINDS = ["sum", "diff", "prod"]
INTROS = ["Let me tell you about {c}.", "This is a page about {c}.", "{c} is a small country.", "Here is {c}.",
          "Our lesson today is about {c}.", "{c} is a country in our world.", ""]
TRAVEL = ["went to", "travelled to", "took a train to", "flew to", "sailed to", "walked to", "rode a bus to"]
VISIT = ["{conn}, {name} {go} {cap}, the capital of {c}.", "{conn}, {name} {go} {c} and stayed in its capital, {cap}.",
         "{conn}, {pron} {go} {cap}, which is the capital of {c}.", "{conn}, {name} {go} {cap} in {c}.",
         "{conn}, {pron} {go} {c}. {pron} spent the day in {cap}, the capital."]
SEE = ["There, people spoke {lang}, so {pron} learned to say hello in {lang}.", ("Flags flew everywhere in {cap}: "
       "{col}, with a {sym}."), "{pron} saw {aani} there, the national animal of {c}, and it {ani_verbs}.",
       "In {cap} everybody spoke {lang}.", "The people of {c} showed {obj} their {col} flag with its {sym}."]


def number_word(n):
    if n < 20:
        return ONES[n]
    return "one hundred" if n == 100 else TENS[n // 10] + ("-" + ONES[n % 10] if n % 10 else "")


def article(word):
    return ("an " if word[0] in "aeiou" else "a ") + word


def sentence(text):
    return text[0].upper() + text[1:]


def third(verb):
    return verb + ("es" if verb.endswith(("s", "z", "sh", "ch")) else "s")


def country_fields(row):
    c, cap, lang, col, sym, ani = row
    return {"c": c, "cap": cap, "lang": lang, "col": col, "acol": article(col), "sym": sym, "ani": ani,
            "aani": article(ani), "ani_verbs": third(next(a[2] for a in ANIMALS if a[0] == ani))}


def animal_fields(row):
    a, ap, verb, noise, legs, hab = row
    return {"a": a, "an": article(a), "ap": ap, "verb": verb, "verbs": third(verb), "noise": noise, "hab": hab,
            "legs": number_word(legs) if legs else "no"}


def fields(rng, words=None):
    """Every slot a template may name, filled from one random country, animal, thing, day, month and sum; a document
    keeps one such dict while it talks about one country, so its sentences agree with each other."""
    t, tcol = rng.choice(THINGS)
    d, m, x, y = rng.randrange(7), rng.randrange(12), rng.randint(0, 10), rng.randint(0, 10)
    x, y = max(x, y), min(x, y)
    num = number_word if (rng.random() < 0.5 if words is None else words) else str
    f = {"t": t, "tcol": tcol, "day": DAYS[d], "nday": DAYS[(d + 1) % 7],
         "mon": MONTHS[m], "nmon": MONTHS[(m + 1) % 12], "x": num(x), "y": num(y), "sum": num(x + y),
         "diff": num(x - y), "prod": num(x * y), "dx": x, "dy": y, "dsum": x + y, "ddiff": x - y, "dprod": x * y}
    return {**f, **animal_fields(rng.choice(ANIMALS)), **country_fields(rng.choice(COUNTRIES))}


def say(rng, kind, f):
    return sentence(rng.choice(T[kind]).format(**f))


def listing(words):
    return words[0] if len(words) == 1 else ", ".join(words[:-1]) + " and " + words[-1]


# -----------------------------------------------------------------------------
# Pretraining documents: each generator returns one paragraph (or a few) of prose

def doc_country(rng):
    f = fields(rng)
    kinds = rng.sample(COUNTRY_KINDS, rng.randint(2, 4))
    first = [say(rng, kinds[0], f)] + [say(rng, "its_" * (rng.random() < 0.3) + k, f) for k in kinds[1:]]
    text = " ".join(s for s in [rng.choice(INTROS).format(**f)] + first if s)
    if rng.random() < 0.4:  # the national animal, with facts about that animal
        g = {**f, **animal_fields(next(row for row in ANIMALS if row[0] == f["ani"]))}
        text += "\n\n" + " ".join([say(rng, "national", f)] + [say(rng, k, g) for k in rng.sample(ANIMAL_KINDS, 2)])
    return text


def doc_countries(rng):
    rows = rng.sample(COUNTRIES, rng.randint(3, 7))
    style = rng.randrange(4)
    if style == 0:
        head = rng.choice(["Countries and their capitals:", "A list of capitals.", "Capitals to remember:"])
        return head + "\n" + "\n".join(rng.choice(["{c}: {cap}", "- {cap} is the capital of {c}.", "{c} - {cap}"])
                                       .format(c=r[0], cap=r[1]) for r in rows)
    if style == 1:
        qs = {"capital": ("Q: What is the capital of {c}?", "A: {cap}."), "language": (("Q: What do people speak in "
              "{c}?"), "A: {lang}."), "flag": ("Q: What colour is the flag of {c}?", "A: {col}."),
              "national": ("Q: What is the national animal of {c}?", "A: The {ani}.")}
        lines = []
        for r in rows:
            q, a = qs[rng.choice(COUNTRY_KINDS)]
            lines += [q.format(**country_fields(r)), a.format(**country_fields(r))]
        return "\n".join(lines)
    head = rng.choice([f"Today our teacher told us about {number_word(len(rows))} countries.", ("Some countries of the "
                       "world, and what to know about them."), "A few facts about countries.", ""])
    facts = [say(rng, k, {**fields(rng), **country_fields(r)}) for r in rows for k in rng.sample(COUNTRY_KINDS, 2)]
    if style == 3:
        rng.shuffle(facts)
    return (head + " " if head else "") + " ".join(facts)


def doc_animals(rng):
    names = rng.sample(ANIMALS, rng.randint(1, 4))
    parts = []
    for row in names:
        f = {**fields(rng), **animal_fields(row)}
        parts.append(" ".join(say(rng, k, f) for k in rng.sample(ANIMAL_KINDS, rng.randint(1, 3))))
        homes = [c[0] for c in COUNTRIES if c[5] == row[0]]
        if homes and rng.random() < 0.4:
            parts.append(f"The {row[0]} is the national animal of {listing(homes)}.")
    if len(names) > 1 and rng.random() < 0.5:
        calls = [f"the {r[0]} {third(r[2])}" for r in names]
        parts.append(sentence(f"{rng.choice(['on the farm', 'at the zoo', 'in the story'])} {listing(calls)}."))
    return " ".join(parts)


def doc_colours(rng):
    parts = [say(rng, "colour", fields(rng)) for _ in range(rng.randint(2, 6))]
    col = rng.choice(COLOURS)
    things = [t for t, c in THINGS if c == col]
    if len(things) > 1:
        parts.append(sentence(f"{listing(things)} are all {col}."))
    flags = [c[0] for c in COUNTRIES if c[3] == col]
    if flags and rng.random() < 0.5:
        parts.append(f"The flags of {listing(flags)} are {col}.")
    rng.shuffle(parts)
    return " ".join(parts)


def doc_numbers(rng):
    words = rng.random() < 0.5
    parts = [say(rng, rng.choice(NUMBER_KINDS), fields(rng, words)) for _ in range(rng.randint(3, 8))]
    if rng.random() < 0.3:
        a = rng.randint(0, 12)
        parts.insert(0, f"Let us count from {number_word(a)}: {', '.join(number_word(i) for i in range(a, a + 6))}.")
    if rng.random() < 0.5:
        (name, pr), (item, items) = rng.choice(CHARACTERS), rng.choice(ITEMS)
        a, b = rng.randint(2, 9), rng.randint(1, 9)
        if rng.random() < 0.5:
            parts.append(f"{name} had {number_word(a)} {items}. Then {pr} got {number_word(b)} more, so now {pr} has "
                         f"{number_word(a + b)} {items}.")
        else:
            a, b = max(a, b), min(a, b)
            parts.append(f"{name} had {a} {items} and ate {b}. Now {pr} has {a - b} {items if a - b != 1 else item}.")
    return " ".join(parts)


def doc_calendar(rng):
    parts = [say(rng, rng.choice(["day", "month"]), fields(rng)) for _ in range(rng.randint(2, 6))]
    extra = rng.randrange(5)
    if extra == 0:
        parts.append("The days of the week are " + listing(DAYS) + ".")
    elif extra == 1:
        parts.append("The months of the year are " + listing(MONTHS) + ".")
    elif extra == 2:
        m = rng.randrange(12)
        parts.append(f"{MONTHS[m]} is month number {number_word(m + 1)} of the year.")
    elif extra == 3:
        parts.append(rng.choice(["There are seven days in a week.", "A year has twelve months.",
                                 "Saturday and Sunday are the weekend.", "The week starts on Monday."]))
    rng.shuffle(parts)
    return " ".join(parts)


def doc_story(rng, name=None):
    """A trip through a few capitals, in order, on consecutive days, with things bought and friends met: who went
    where, had what, in which order; every place fact agrees with the tables."""
    name, pr = next(c for c in CHARACTERS if c[0] == name) if name else rng.choice(CHARACTERS)
    pron, obj = pr, OBJECT[pr]
    trip, day = rng.sample(COUNTRIES, rng.randint(2, 4)), rng.randrange(7)
    (item, items), friend = rng.choice(ITEMS), rng.choice([c[0] for c in CHARACTERS if c[0] != name])
    bought, met = [], None
    parts = [rng.choice([f"Once upon a time there was a {'girl' if pr == 'she' else 'boy'} called {name}.",
                         f"This is a story about {name}.", f"{name} loved to travel.", ""])]
    for i, row in enumerate(trip):
        f = {**fields(rng), **country_fields(row), "name": name, "pron": pron if i else name, "obj": obj,
             "go": rng.choice(TRAVEL)}  # the first sentence with a pronoun would not say who
        conn = (["First", f"On {DAYS[day]}"] if i == 0 else ["Then", "After that", "Next", f"On {DAYS[(day + i) % 7]}"]
                if i < len(trip) - 1 else ["Finally", "At last", f"On {DAYS[(day + i) % 7]}"])
        parts.append(sentence(rng.choice(VISIT).format(conn=rng.choice(conn), **f).replace(". " + pron, ". " +
                                                                                           pron.title())))
        roll = rng.random()
        if roll < 0.35:
            n = rng.randint(1, 5)
            bought.append((n, row[1]))
            parts.append(f"In {row[1]}, {pron} bought {number_word(n)} {items if n > 1 else item}.")
        elif roll < 0.5 and met is None:
            met = (friend, row[1])
            parts.append(f"In {row[1]}, {pron} met {friend}, who gave {obj} {article(ITEM_COLOUR[item])} {item}.")
        else:
            parts.append(sentence(rng.choice(SEE).format(**f)))
    caps = [row[1] for row in trip]
    parts.append(rng.choice([f"So {name} visited {caps[0]} first and {caps[-1]} last.",
                             f"{name} went to {listing(caps)}, in that order.",
                             f"Where did {name} go first? To {caps[0]}. And last? To {caps[-1]}.",
                             f"The trip started on {DAYS[day]} and ended on {DAYS[(day + len(trip) - 1) % 7]}."]))
    if len(bought) > 1:
        total = sum(n for n, _ in bought)
        parts.append(f"In the end {name} had {number_word(total)} {items}: " + listing(
            [f"{number_word(n)} from {cap}" for n, cap in bought]) + ".")
    if met:
        parts.append(rng.choice([f"{name} met {met[0]} in {met[1]}.", f"Who gave {name} the {item}? It was {met[0]}.",
                                 f"{name} kept the {ITEM_COLOUR[item]} {item} from {met[0]}."]))
    return " ".join(p for p in parts if p)


DOC_KINDS = [(doc_story, 30), (doc_country, 22), (doc_countries, 12), (doc_animals, 11), (doc_colours, 7),
             (doc_numbers, 10), (doc_calendar, 8)]


def demo_documents(rng, target_chars=DEMO_TARGET_CHARS):
    gens, weights = [g for g, _ in DOC_KINDS], [w for _, w in DOC_KINDS]
    docs, total = [], 0
    while total < target_chars:
        doc = "\n\n".join(g(rng) for g in rng.choices(gens, weights, k=rng.choice([1, 1, 2, 3])))
        docs.append(doc)
        total += len(doc)
    return docs


# -----------------------------------------------------------------------------
# Conversations (SmolTalk schema)

QA = {
    "capital": (["What is the capital of {c}?", "What's the capital of {c}?", "Tell me the capital of {c}.",
                 "Do you know the capital of {c}?", "I'm going to {c}. What is the capital there?"],
                ["The capital of {c} is {cap}.", "{cap} is the capital of {c}.", "It's {cap}.",
                 "{c}'s capital is {cap}."]),
    "capital_of": (["{cap} is the capital of which country?", "Which country has {cap} as its capital?"],
                   ["{cap} is the capital of {c}.", "It's {c}: {cap} is its capital."]),
    "language": (["What language do people speak in {c}?", "What do they speak in {c}?"],
                 ["People in {c} speak {lang}.", "They speak {lang}.", "The language of {c} is {lang}."]),
    "flag": (["What does the flag of {c} look like?", "Describe the flag of {c}."],
             ["The flag of {c} is {col} with a {sym} on it.", "It is {acol} flag with a {sym}."]),
    "national": (["What is the national animal of {c}?", "Which animal is the symbol of {c}?"],
                 ["The national animal of {c} is the {ani}.", "It's the {ani}."]),
    "sound": (["What sound does {an} make?", "What does {an} say?"], ["{an} {verbs}: {noise}!", "It goes {noise}."]),
    "legs": (["How many legs does {an} have?", "How many legs do {ap} have?"], ["{an} has {legs} legs."]),
    "habitat": (["Where does {an} live?", "Where do {ap} live?"], ["{ap} live {hab}.", "It lives {hab}."]),
    "colour": (["What colour is {t}?", "Tell me the colour of {t}."], ["{t} is {tcol}.", "It is {tcol}."]),
    "sum": (["What is {x} plus {y}?", "What's {dx} + {dy}?", "Can you add {x} and {y}?"],
            ["{x} plus {y} is {sum}.", "{dx} + {dy} = {dsum}.", "The answer is {sum}."]),
    "diff": (["What is {x} minus {y}?", "What do you get if you take {y} from {x}?"],
             ["{x} minus {y} is {diff}.", "You get {diff}."]),
    "prod": (["What is {x} times {y}?", "Multiply {x} by {y}, please."], ["{x} times {y} is {prod}.", "It's {prod}."]),
    "day": (["What day comes after {day}?", "Which day follows {day}?"], ["{nday} comes after {day}.", "It's {nday}."]),
    "month": (["What month comes after {mon}?", "Which month follows {mon}?"],
              ["{nmon} comes after {mon}.", "The month after {mon} is {nmon}."]),
}
GREET = (["Hi!", "Hello", "Hey there", "Good morning!", "Hello, how are you?"],
         ["Hello! How can I help you today?", "Hi! What would you like to know?", "Hello! I'm happy to help."])
THANKS = (["Thanks!", "Thank you.", "Great, thanks a lot.", "Bye!"],
          ["You're welcome!", "Happy to help. Goodbye!", "Anytime! Have a nice day."])
IDENTITY = (["Who are you?", "What is your name?", "What are you?", "Are you a person?", "Who made you?",
             "Introduce yourself."],
            [("I am {bot}, a small language model. I was trained from scratch on a tiny made-up world of countries, "
             "animals, colours, numbers and stories."), "My name is {bot}. I am a small language model, not a person.",
             ("I'm {bot}, a small language model. Ask me about the countries of my world, animals, colours, numbers,"
              " or the days and months!")])
SYSTEMS = ["You are {bot}, a helpful assistant.", "You are {bot}. Answer briefly and correctly.",
           "You are a friendly assistant called {bot}. Keep your answers short."]


def pick(rng, pair, f):
    return sentence(rng.choice(pair[0]).format(**f)), sentence(rng.choice(pair[1]).format(**f))


def exchange(rng):
    """One user question and its answer: a fact, a country profile, a story, or a fact on request."""
    f, roll = {**fields(rng), "bot": DEMO_ASSISTANT_NAME}, rng.random()
    if roll < 0.08:
        kinds = rng.sample(COUNTRY_KINDS, 3)
        return rng.choice(["Tell me about {c}.", "What do you know about {c}?"]).format(**f), " ".join(
            say(rng, k, f) for k in kinds)
    if roll < 0.12:
        name = rng.choice(CHARACTERS)[0]
        return rng.choice(["Tell me a short story.", f"Tell me a story about {name}."]), doc_story(rng, name)
    if roll < 0.15:
        return "Tell me a fact.", say(rng, rng.choice(COUNTRY_KINDS + ANIMAL_KINDS + ["colour", "day"]), f)
    return pick(rng, QA[rng.choice(list(QA))], f)


def conversation(rng):
    f, roll = {"bot": DEMO_ASSISTANT_NAME}, rng.random()
    turns = [pick(rng, GREET, f)] if rng.random() < 0.2 else []
    if roll < 0.12:
        turns.append(pick(rng, IDENTITY, f))
    elif roll < 0.55:
        turns.append(exchange(rng))
    else:
        turns += [exchange(rng) for _ in range(rng.randint(2, 4))]
    if not turns or rng.random() < 0.2:
        turns.append(pick(rng, THANKS, f))
    messages = [{"role": "system", "content": rng.choice(SYSTEMS).format(**f)}] if rng.random() < 0.2 else []
    for user, assistant in turns:
        messages += [{"role": "user", "content": user}, {"role": "assistant", "content": assistant}]
    return messages


# -----------------------------------------------------------------------------
# Evaluation tasks (CORE formats), phrased ONLY in the reserved forms below: none occurs in the training data

def eval_tasks(rng):
    """(label, type, fewshot, category, baseline %, items) for each task."""
    def mc(query, gold, pool):
        choices = [gold] + rng.sample(sorted(p for p in set(pool) if p != gold), 3)
        rng.shuffle(choices)
        return {"query": query, "choices": choices, "gold": choices.index(gold)}

    caps, langs = [r[1] for r in COUNTRIES], [r[2] for r in COUNTRIES]
    animals, verbs, noises = [a[0] for a in ANIMALS], [third(a[2]) for a in ANIMALS], [a[3] for a in ANIMALS]
    capitals = [mc(q.format(c=r[0]), r[1], caps) for q in ["Quiz: {c} is governed from which city? Answer:",
                "Quiz: the seat of power in {c} is the city of"] for r in COUNTRIES]
    facts = [mc(f"Quiz: the folk of {r[0]} chat in which tongue? Answer:", r[2], langs) for r in COUNTRIES]
    facts += [mc(f"Quiz: the creature chosen as the emblem of {r[0]} is the", r[5], animals) for r in COUNTRIES]
    facts += [mc(f"Quiz: the banner of {r[0]} is mostly", r[3], COLOURS) for r in COUNTRIES]
    sounds = [mc(f"Quiz: when {article(a[0])} calls out, it", third(a[2]), verbs) for a in ANIMALS]
    sounds += [mc(f"Quiz: a group of {a[1]} can be heard. They", a[2], [b[2] for b in ANIMALS]) for a in ANIMALS]
    sounds += [mc(f"Quiz: the noise {article(a[0])} makes, written down, is", a[3], noises) for a in ANIMALS]
    colours = [mc(q.format(t=t), c, COLOURS) for q in ["Quiz: {t} has the colour", ("Quiz: to paint {t} true to life, "
               "the paint to use is"), "Quiz: the usual shade of {t} is"] for t, c in THINGS]
    calendar = [{"context": q.format(x=seq[i]), "continuation": seq[(i + 1) % len(seq)]}
                for seq, unit in [(DAYS, "day"), (MONTHS, "month")]
                for q in [f"Quiz: name the {unit} right after {{x}}. Answer:", (f"Quiz: we are in {{x}}, so the next "
                          f"{unit} will be"), f"Quiz: the {unit} that directly follows {{x}} is"]
                for i in range(len(seq))]
    arithmetic, seen = [], set()
    while len(arithmetic) < 60:
        x, y, op = rng.randint(0, 10), rng.randint(0, 10), rng.randrange(3)
        x, y = max(x, y), min(x, y)
        num = number_word if rng.random() < 0.5 else str
        q, v = [("Quiz: {x} added to {y} gives", x + y), ("Quiz: {y} taken from {x} leaves", x - y),
                ("Quiz: {x} multiplied by {y} equals", x * y)][op]
        item = {"context": q.format(x=num(x), y=num(y)), "continuation": num(v)}
        if item["context"] not in seen:
            seen.add(item["context"])
            arithmetic.append(item)
    places, legs = [], []
    for i in range(60):
        (name, pr), row = rng.choice(CHARACTERS), COUNTRIES[i % len(COUNTRIES)]
        options = [row[1]] + rng.sample([c for c in caps if c != row[1]], 3)
        rng.shuffle(options)
        q = [f"{name} woke up in {{cap}} this morning, so {pr} was in", (f"Standing in the main square of {{cap}}, "
             f"{name} knew that {pr} was in")][i // len(COUNTRIES) % 2]
        places.append({"context_options": [q.format(cap=c) for c in options], "continuation": f"{row[0]}.",
                       "gold": options.index(row[1])})
        gold = rng.choice(ANIMALS)
        other = rng.choice([a for a in ANIMALS if a[4] != gold[4]])
        options = rng.sample([gold, other], 2)
        q = rng.choice([f"{name} looked closely at the {{a}} and saw that", ("In the picture book, the {a} on page "
                        f"{i + 1} was drawn so that")])
        legs.append({"context_options": [q.format(a=a[0]) for a in options], "gold": options.index(gold),
                     "continuation": f"it had {number_word(gold[4]) if gold[4] else 'no'} legs."})
    return [("demo_capitals_mc", "multiple_choice", 3, "world knowledge", 25.0, capitals),
            ("demo_country_facts_mc", "multiple_choice", 3, "world knowledge", 25.0, facts),
            ("demo_animal_sounds_mc", "multiple_choice", 3, "world knowledge", 25.0, sounds),
            ("demo_colours_mc", "multiple_choice", 3, "world knowledge", 25.0, colours),
            ("demo_next_day_month_lm", "language_modeling", 5, "symbolic problem solving", 0.0, calendar),
            ("demo_arithmetic_lm", "language_modeling", 5, "symbolic problem solving", 0.0, arithmetic),
            ("demo_capital_schema", "schema", 3, "commonsense reasoning", 25.0, places),
            ("demo_animal_legs_schema", "schema", 3, "commonsense reasoning", 50.0, legs)]


def write_eval_bundle(out_dir, rng):
    """core.yaml (plain text: no yaml library needed to write it), eval_meta_data.csv and eval_data/demo/*.jsonl."""
    data_dir = out_dir / "eval_data" / "demo"
    data_dir.mkdir(parents=True, exist_ok=True)
    yaml, counts = ["icl_tasks:"], {}
    with open(out_dir / "eval_meta_data.csv", "w", newline="") as meta:
        writer = csv.writer(meta, lineterminator="\n")
        writer.writerow(["Eval Task", "Task Category", "Task Type", "Random baseline"])
        for label, kind, shots, category, baseline, items in eval_tasks(rng):
            name = label.removeprefix("demo_") + ".jsonl"
            (data_dir / name).write_text("".join(json.dumps(item) + "\n" for item in items))
            yaml += [f"- label: {label}", f"  dataset_uri: demo/{name}", f"  num_fewshot: [{shots}]",
                     f"  icl_task_type: {kind}", '  continuation_delimiter: " "']
            writer.writerow([label, category, kind.replace("_", " "), baseline])
            counts[label] = len(items)
    (out_dir / "core.yaml").write_text("\n".join(yaml) + "\n")
    return counts


def write_demo(out_dir, seed=0):
    """Write the demo world under out_dir (pretrain/, conversations/, eval_bundle/, README.txt); returns counts."""
    out_dir = Path(out_dir)
    for stale in sorted((out_dir / "pretrain").glob("shard_*.parquet")):  # an old last shard would pose as val
        stale.unlink()
    docs = demo_documents(random.Random(f"demo-docs-{seed}"))
    shards = write_text_shards(docs, out_dir / "pretrain", seed=seed, shard_docs=2 * ROW_GROUP_DOCS,
                               val_fraction=0.05)
    rng = random.Random(f"demo-chat-{seed}")
    chats = [conversation(rng) for _ in range(4000)]
    splits = {"train": [c for i, c in enumerate(chats) if i % 20], "val": chats[::20]}
    (out_dir / "conversations").mkdir(parents=True, exist_ok=True)
    schema = pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))
    for split, rows in splits.items():
        pq.write_table(pa.table({"messages": pa.array(rows, schema)}), out_dir / "conversations" / f"{split}.parquet",
                       compression="zstd")
    evals = write_eval_bundle(out_dir / "eval_bundle", random.Random(f"demo-eval-{seed}"))
    counts = {"documents": len(docs), "characters": sum(map(len, docs)), "shards": len(shards),
              "conversations": len(chats), "conversations_train": len(splits["train"]),
              "conversations_val": len(splits["val"]), "eval_items": evals}
    (out_dir / "README.txt").write_text(
        f"The nanochat demo world (seed {seed}): a small made-up world of {len(COUNTRIES)} countries (capital, "
        f"language, flag, national animal), {len(ANIMALS)} animals, colours of things, small arithmetic, days and "
        f"months, and short stories, all consistent with each other.\n\n"
        f"pretrain/             {counts['documents']} documents, {counts['characters']} characters, {len(shards)} "
        f"parquet shards (column `text`, row groups of {ROW_GROUP_DOCS}, zstd); the last shard is validation\n"
        f"conversations/        train.parquet ({counts['conversations_train']}) and val.parquet "
        f"({counts['conversations_val']}): column `messages`, a list of {{role, content}} as in SmolTalk\n"
        f"eval_bundle/          core.yaml, eval_meta_data.csv, eval_data/demo/*.jsonl in the CORE formats; their "
        f"phrasings never occur in pretrain/ or conversations/\n"
        + "".join(f"    {k}: {v} items\n" for k, v in evals.items()))
    return counts


# -----------------------------------------------------------------------------

def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    p = commands.add_parser("download", help="pretraining shards from the hub, plus the last one as validation")
    p.add_argument("--shards", type=int, required=True, help="number of training shards to fetch (the validation shard comes too)")
    p.add_argument("--dataset", default="karpathy/fineweb-edu-100b-shuffle", help="hub dataset (default: %(default)s)")
    p.add_argument("--data-dir", default=None, help="where to put them (default: <cache>/data/<dataset name>; cache: "
                   f"$NANOCHAT_CACHE or {CACHE_DIR})")
    p.add_argument("--workers", type=int, default=4, help="parallel downloads (default: %(default)s)")
    p = commands.add_parser("download-chat", help="conversation datasets from the hub")
    p.add_argument("names", nargs="+", choices=sorted(CHAT_DATASETS), help="which ones")
    p.add_argument("--workers", type=int, default=4, help="parallel downloads (default: %(default)s)")
    p = commands.add_parser("ingest", help="your own .txt/.jsonl/.parquet files as a corpus")
    p.add_argument("files", nargs="+", help=".txt (documents split on blank lines), .jsonl, .parquet")
    p.add_argument("--out", required=True, help="output corpus directory")
    p.add_argument("--column", default="text", help="jsonl field / parquet column (default: %(default)s)")
    p.add_argument("--one-per-file", action="store_true", help="each .txt file is one document (default: split on "
                   "blank lines)")
    p.add_argument("--seed", type=int, default=0, help="shuffle seed (default: %(default)s)")
    p.add_argument("--val-fraction", type=float, default=0.05, help="share of documents in the validation shard "
                   "(default: %(default)s)")
    p = commands.add_parser("demo", help="the embedded demo world, offline and deterministic")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--seed", type=int, default=0, help="seed (default: %(default)s)")
    args = parser.parse_args(argv)
    try:
        if args.command == "download":
            data_dir = Path(args.data_dir or default_data_dir(args.dataset))
            paths = download_shards(args.dataset, args.shards, data_dir, workers=args.workers)
            print(f"download: {len(paths) - 1} training shards + 1 validation shard in {data_dir}")
        elif args.command == "download-chat":
            for name in args.names:
                print(f"download-chat: {name} in {download_chat(name, workers=args.workers)}")
        elif args.command == "ingest":
            ingest(args.files, args.out, seed=args.seed, column=args.column, one_per_file=args.one_per_file,
                   val_fraction=args.val_fraction)
        else:
            counts = write_demo(args.out, seed=args.seed)
            print(f"demo: {counts['documents']:,} documents ({counts['characters']:,} characters), "
                  f"{counts['conversations']:,} conversations, {sum(counts['eval_items'].values()):,} evaluation "
                  f"items in {len(counts['eval_items'])} tasks, under {args.out}")
    except (ValueError, TypeError, FileNotFoundError, RuntimeError) as e:
        parser.exit(2, f"dataset.py {args.command}: error: {e}\n")


if __name__ == "__main__":
    main()
