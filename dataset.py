"""Everything between "text somewhere" and "a batch on the device".

    python dataset.py download --shards 8            # FineWeb-Edu shards from the hub (+ the last one: validation)
    python dataset.py ingest --out DIR FILES...      # your own .txt / .jsonl / .parquet as shards of the same layout

Layout of a text corpus (FineWeb-Edu's on the hub, and everything this file writes): a directory of parquet shards
named shard_00000.parquet, ..., one string column `text`, row groups of 1024 documents, zstd; the last shard is the
validation split, all others are training.
"""
import argparse
import bisect
import codecs
import hashlib
import heapq
import itertools
import json
import math
import os
import queue
import random
import re
import shutil
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
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
# Download from the hub, through huggingface_hub (imported in the functions that use it: ~0.35 s of CPU that every
# stage importing this file would pay for nothing): HfApi.list_repo_tree lists a repo (it follows the tree API's pages)
# with each file's size and sha256 (LFS files) or git blob id (files kept in git); hf_hub_download fetches a file:
# through hf_xet where the hub keeps it in Xet storage, else over plain HTTP, which it resumes with Range within the
# call after a timeout or a body cut short (from the last whole chunk written, 10 MB), retrying 429s. Both read
# HF_TOKEN and take the endpoint from hub_endpoint(); the token goes to the hub, never to the CDN it redirects to.
# On top of it this file keeps the promises huggingface_hub does not make, each shown by a test in
# tests/test_download.py:
#   - a file appears under its final name only after its size, its hash from the listing and, for parquet, its footer
#     check out; hf_hub_download checks none of them (test_a_flipped_byte_is_caught_by_the_listed_sha256_...);
#   - a failed check, a 500, a reset mid-body are fetched again with backoff; hf_hub_download gives up on those
#     (test_every_fault_is_survived_and_every_shard_ends_byte_identical);
#   - every failure is one line that names the file and says what to do
#     (test_a_shard_failing_every_check_never_appears_and_the_error_says_what_to_do).

DEFAULT_HUB_ENDPOINT = "https://huggingface.co"
RETRIES = 8  # attempts per file; with the backoff below they wait ~60 s in all: enough to ride out a hub hiccup
BACKOFF_BASE, BACKOFF_MAX = 0.5, 30.0
SHARD_NAME = re.compile(r"shard_(\d+)\.parquet")


class _Transient(Exception):
    """A downloaded file failed a check (size, hash, content); a fresh download can fix it."""


class _GaveUp(Exception):
    """Every attempt failed; the message is the last error's first line."""


def hub_endpoint():
    """$HF_ENDPOINT (a mirror, or a local test server) or the public hub, read per call: huggingface_hub reads it once,
    at import, so it is passed to it explicitly."""
    return os.environ.get("HF_ENDPOINT", DEFAULT_HUB_ENDPOINT).rstrip("/")


def _status(error):
    response = getattr(error, "response", None)
    return response.status_code if response is not None else None


def _first_line(error):
    return (str(error).strip().splitlines() or [type(error).__name__])[0]


def _transient(error):
    """Worth another attempt: network errors, 408/429/5xx answers (left over after huggingface_hub's own retries),
    bodies short of their size, failed checks. Any other HTTP answer (401, 404, ...) is a mistake to report."""
    from huggingface_hub.utils import HfHubHTTPError, httpx
    if isinstance(error, HfHubHTTPError):
        code = _status(error)
        return code is None or code in (408, 429) or code >= 500
    return isinstance(error, (httpx.HTTPError, OSError, _Transient))


def _retrying(attempt, retries):
    """attempt() until it returns, at most `retries` times, with exponential backoff between tries; raises _GaveUp
    after the last, and at once what a retry cannot fix."""
    retries = max(1, retries)
    for i in range(retries):
        try:
            return attempt()
        except Exception as e:
            if not _transient(e):
                raise
            if i + 1 == retries:
                raise _GaveUp(_first_line(e)) from e
        # jitter: parallel workers hit by one 429 do not retry in lockstep
        time.sleep(min(BACKOFF_BASE * 2 ** i, BACKOFF_MAX) * random.uniform(0.5, 1.0))


def _hash_file(path, digest):
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def _check(path, size=None, sha256=None, git_sha1=None, verify=None):
    """Raise _Transient, deleting path (a bad prefix would poison every resume), unless path has the expected size,
    sha256, git blob id (the sha1 of b"blob <size>\\0" + content: what the hub lists for a file kept in git) and passes
    verify(path), which raises ValueError on bad content."""
    got, problem = path.stat().st_size, None
    if size is not None and got != size:
        problem = f"size {got} bytes, expected {size}"
    elif sha256 and (digest := _hash_file(path, hashlib.sha256())) != sha256.lower():
        problem = f"sha256 {digest} does not match the expected {sha256}"
    elif git_sha1 and (digest := _hash_file(path, hashlib.sha1(b"blob %d\0" % got, usedforsecurity=False))) != git_sha1:
        problem = f"git blob id {digest} does not match the expected {git_sha1}"
    elif verify:
        try:
            verify(path)
        except ValueError as e:
            problem = f"content check failed: {e}"
    if problem:
        path.unlink()
        raise _Transient(problem)


class _Bar:
    """The part of tqdm's interface that huggingface_hub calls on a tqdm_class: silent."""

    def __init__(self, initial=0, **kwargs):
        self.n = initial

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def update(self, n=1):
        self.n += n

    def update_transfer(self, n):  # hf_xet's network bytes: update() counts the bytes written, that is enough
        pass

    def set_postfix_str(self, *args, **kwargs):
        pass

    set_transfer_postfix_str = refresh = close = set_postfix_str


def download_file(url, dest, size=None, sha256=None, verify=None, retries=RETRIES):
    """Stream a plain URL (the eval bundle: not a hub repo, so not hf_hub_download, and no token) to dest. The bytes
    go to dest + ".partial", which huggingface_hub's http_get resumes with Range within an attempt, and which later
    attempts and later runs resume too (test_retries_run_out_with_an_error_that_keeps_the_partial_for_the_next_run).
    dest appears (os.replace) only once the size, the sha256 and verify(partial) (raises ValueError on bad content)
    pass; a dest that exists with the expected size is not fetched again."""
    from huggingface_hub.file_download import http_get
    from huggingface_hub.utils import HfHubHTTPError
    dest = Path(dest)
    if dest.exists() and (size is None or dest.stat().st_size == size):
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    partial = dest.with_name(dest.name + ".partial")

    def attempt():
        offset = partial.stat().st_size if partial.exists() else 0
        try:
            with open(partial, "ab") as f:
                http_get(url, f, resume_size=offset, expected_size=size, tqdm_class=_Bar)
        except HfHubHTTPError as e:
            if _status(e) != 416:
                raise
            partial.unlink()  # the partial is not a prefix of what the server has now: start over
            raise _Transient(f"server refused to resume at byte {offset} (HTTP 416)") from e
        _check(partial, size, sha256, verify=verify)
        os.replace(partial, dest)
        return dest
    try:
        return _retrying(attempt, retries)
    except HfHubHTTPError as e:
        raise RuntimeError(f"{url} answered HTTP {_status(e)}: check the URL") from None
    except _GaveUp as e:
        kept = f"; the {partial.stat().st_size} bytes so far are kept in {partial}" if partial.exists() else ""
        raise RuntimeError(f"could not download {dest.name} from {url} after {max(1, retries)} attempts (last error: "
                           f"{e}){kept}: re-run the command to resume") from None


def _hub_failure(what, error):
    """The one line for a hub answer a retry cannot fix."""
    from huggingface_hub.utils import RepositoryNotFoundError
    code = _status(error)
    if code in (401, 403) or isinstance(error, RepositoryNotFoundError):
        # the hub answers 401 for a repo that does not exist as well as for one that is private
        return RuntimeError(f"{what}: HTTP {code}: the repo is private or gated, or does not exist: set HF_TOKEN to a "
                            f"token that can read it (and accept the dataset's terms on its page if it is gated)")
    if code == 404:
        return RuntimeError(f"{what}: HTTP 404: not found: check the repo id, the revision and the file path")
    return RuntimeError(f"{what}: {_first_line(error)}")


def list_hub_files(repo, revision="main", repo_type="dataset"):
    """Every file of a repo: {"path", "size", "sha256" (LFS files), "git_sha1" (files kept in git)}."""
    from huggingface_hub import HfApi, RepoFile
    from huggingface_hub.utils import HfHubHTTPError, httpx
    api = HfApi(endpoint=hub_endpoint())
    try:
        entries = list(api.list_repo_tree(repo, recursive=True, revision=revision, repo_type=repo_type))
    except HfHubHTTPError as e:
        if _transient(e):  # huggingface_hub retried 429/5xx five times already
            raise RuntimeError(f"could not list {repo} at {hub_endpoint()} ({_first_line(e)}): re-run the command "
                               f"later") from None
        raise _hub_failure(f"listing {repo} (revision {revision})", e) from None
    except httpx.HTTPError as e:
        raise RuntimeError(f"could not list {repo} at {hub_endpoint()} ({_first_line(e)}): check the network (and "
                           f"HF_ENDPOINT if set) and re-run the command") from None
    return [{"path": e.path, "size": e.size, "sha256": e.lfs.sha256 if e.lfs else None,
             "git_sha1": None if e.lfs else e.blob_id} for e in entries if isinstance(e, RepoFile)]


def _fetch_hub_file(repo, entry, dest, staging, revision, repo_type, bar):
    """One listed file: hf_hub_download into the staging dir, checked against the listing, then renamed to dest."""
    from huggingface_hub import hf_hub_download
    from huggingface_hub.utils import HfHubHTTPError
    def attempt():
        path = Path(hf_hub_download(repo, entry["path"], repo_type=repo_type, revision=revision, local_dir=staging,
                                    endpoint=hub_endpoint(), tqdm_class=bar))
        verify = verify_parquet if dest.suffix == ".parquet" else None
        _check(path, entry["size"], entry["sha256"], entry["git_sha1"], verify)
        os.replace(path, dest)
        return dest
    try:
        return _retrying(attempt, RETRIES)
    except HfHubHTTPError as e:
        raise _hub_failure(f"{repo}: {entry['path']}", e) from None
    except _GaveUp as e:
        raise RuntimeError(f"could not download {entry['path']} from {repo} after {RETRIES} attempts (last error: {e}):"
                           f" check the network (and HF_ENDPOINT if set) and re-run the command; complete files are "
                           f"kept") from None


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
    """A tqdm_class per file for hf_hub_download, all feeding one stderr line: MB done of total, MB/s, ETA. On a
    terminal the line rewrites itself twice a second; in a log file it is a new line every 30 s."""
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
        class FileBar(_Bar):  # a new one per attempt, starting from the bytes it resumes from: done[key] is on disk
            def update(self, n=1):
                super().update(n)
                with lock:
                    done[key] = self.n
                    show()
        return FileBar
    return for_file, show


def _download_entries(repo, entries, out_dir, revision, repo_type, workers):
    """Download listed entries into out_dir, flat (by file name), in parallel. hf_hub_download writes into a staging
    dir inside out_dir (same disk: the rename is atomic), which is removed at the end."""
    out_dir = Path(out_dir)
    names = [Path(e["path"]).name for e in entries]
    if len(set(names)) != len(names):
        raise ValueError(f"two requested files share a name and would overwrite each other in {out_dir}: {names}")
    dests = [out_dir / name for name in names]
    todo = [(e, d) for e, d in zip(entries, dests) if not (d.exists() and d.stat().st_size == e["size"])]
    total = sum(e["size"] or 0 for e in entries)
    for_file, show = _progress_line(total, total - sum(e["size"] or 0 for e, _ in todo))
    out_dir.mkdir(parents=True, exist_ok=True)
    staging, errors = out_dir / ".hub_download", []
    with ThreadPoolExecutor(max(1, workers)) as pool:
        futures = [pool.submit(_fetch_hub_file, repo, e, d, staging, revision, repo_type, for_file(d)) for e, d in todo]
        for future in as_completed(futures):
            try:
                future.result()
            except (RuntimeError, ValueError, OSError) as e:  # let the others finish: a re-run then has less to fetch
                errors.append(e)
    shutil.rmtree(staging, ignore_errors=True)  # nothing to resume in it: hf_hub_download deletes what it cut short
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


LISTING = ".hub_listing.json"  # in a download directory: the repo's listing (sizes, hashes) its files were checked with


def _saved_listing(out_dir, repo, revision):
    """The listing saved by an earlier download into out_dir of this repo and revision, or None."""
    try:
        saved = json.loads((Path(out_dir) / LISTING).read_text())
    except (OSError, ValueError):
        return None
    return saved["files"] if (saved.get("repo"), saved.get("revision")) == (repo, revision) else None


def _complete_on_disk(entries, out_dir, workers=4):
    """True when every entry is in out_dir (flat, by file name) with its listed size and sha256 or git blob id: a rerun
    then needs no hub. Hashing is what makes it safe: ~20 GB of shards take tens of seconds, a hub outage hours."""
    def ok(e):
        path = Path(out_dir) / Path(e["path"]).name
        if not path.is_file() or path.stat().st_size != e["size"] or not (e["sha256"] or e["git_sha1"]):
            return False
        if e["sha256"]:
            return _hash_file(path, hashlib.sha256()) == e["sha256"].lower()
        return _hash_file(path, hashlib.sha1(b"blob %d\0" % e["size"], usedforsecurity=False)) == e["git_sha1"]
    with ThreadPoolExecutor(max(1, workers)) as pool:
        return all(pool.map(ok, entries))


def _listing(repo, revision, out_dir, select, workers=4):
    """(entries chosen by select(listing), from_disk). The listing saved at the last download is tried first: when
    every chosen file is on disk and matches its stored hashes, no hub call is made (a resume during a hub outage, or
    offline). Otherwise the hub is listed and its listing saved in out_dir for the next run."""
    saved = _saved_listing(out_dir, repo, revision)
    if saved is not None:
        try:
            chosen = select(saved)
        except ValueError:
            chosen = None  # the saved listing cannot answer this request (more shards than it had): ask the hub
        if chosen and _complete_on_disk(chosen, out_dir, workers):
            return chosen, True
    files = list_hub_files(repo, revision)
    chosen = select(files)
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    tmp = Path(out_dir) / (LISTING + ".tmp")
    tmp.write_text(json.dumps({"repo": repo, "revision": revision, "files": files}))
    os.replace(tmp, Path(out_dir) / LISTING)
    return chosen, False


def download_shards(dataset, num_shards, data_dir, workers=4, revision="main"):
    """The first num_shards training shards of a FineWeb-Edu-layout dataset (shard_00000.parquet, ...) plus its last
    shard, the validation split: data_dir ends with num_shards + 1 files, the validation shard last in sorted order.
    A rerun whose files are all on disk and match the hashes listed at download time makes no hub call."""
    def select(files):
        return _select_shards(dataset, files, num_shards)
    chosen, from_disk = _listing(dataset, revision, data_dir, select, workers)
    if from_disk:
        return [Path(data_dir) / Path(e["path"]).name for e in chosen]
    return _download_entries(dataset, chosen, data_dir, revision, "dataset", workers)


def _select_shards(dataset, files, num_shards):
    shards = sorted((f for f in files if SHARD_NAME.fullmatch(Path(f["path"]).name)),
                    key=lambda f: int(SHARD_NAME.fullmatch(Path(f["path"]).name).group(1)))
    if len(shards) < 2:
        raise ValueError(f"{dataset} has {len(shards)} shard_NNNNN.parquet files; a corpus needs training shards and a "
                         f"validation shard (the last one)")
    available = len(shards) - 1
    if not 1 <= num_shards <= available:
        raise ValueError(f"--shards {num_shards} is not available: {dataset} has {available} training shards (plus "
                         f"the validation shard): choose 1..{available}")
    return shards[:num_shards] + shards[-1:]


# Conversations. A chat directory holds parquet files with a `messages` column (SmolTalk, UltraChat), a
# `conversations` column (LIMA), or a task's columns, rendered into a conversation as they are read (chat_rows):
# multiple choice answered with a letter (MMLU, ARC) and grade-school math with calculator calls (GSM8K). Files
# whose names start with "test" or "val" are the validation split.
CHAT_DATASETS = {  # name: (hub repo, the files to fetch)
    "smoltalk": ("HuggingFaceTB/smoltalk", r"data/all/(train|test)-\d+-of-\d+\.parquet"),
    "ultrachat": ("HuggingFaceH4/ultrachat_200k", r"data/(train|test)_sft-.+\.parquet"),
    # gated: accept its terms on the hub, set HF_TOKEN; its test.jsonl has prompts without answers, so train only
    "lima": ("GAIR/lima", r"train\.jsonl"),
    # training splits only: their test splits are chat_eval.py's
    "mmlu": ("cais/mmlu", r"all/auxiliary_train-\d+-of-\d+\.parquet"),
    "arc-easy": ("allenai/ai2_arc", r"ARC-Easy/train-\d+-of-\d+\.parquet"),
    "arc-challenge": ("allenai/ai2_arc", r"ARC-Challenge/train-\d+-of-\d+\.parquet"),
    "gsm8k": ("openai/gsm8k", r"main/train-\d+-of-\d+\.parquet"),
    "identity": (None, None),  # no download: written from identity.json (IDENTITY_FILE), the file you edit
}
IDENTITY_FILE = Path(__file__).resolve().parent / "identity.json"


def load_identity(path=IDENTITY_FILE):
    """(name, [(question, answer)]) from the identity file: the assistant's name and what it says about itself."""
    try:
        spec = json.loads(Path(path).read_text())
        name, pairs = spec["name"], [(q, a.format(name=spec["name"])) for q in spec["questions"]
                                     for a in spec["answers"]]
    except (OSError, ValueError, KeyError, TypeError, IndexError) as e:
        raise ValueError(f"{path} is not a usable identity file ({type(e).__name__}: {e}): it is JSON with \"name\", "
                         f"\"questions\" and \"answers\" (each answer may say {{name}})") from None
    if not isinstance(name, str) or not name or not pairs:
        raise ValueError(f"{path}: \"name\" must be a non-empty string and \"questions\", \"answers\" non-empty lists")
    return name, pairs


def write_identity(out_dir, path=IDENTITY_FILE):
    """Every question of the identity file with every answer, as a conversation set: out_dir/train.parquet."""
    _, pairs = load_identity(path)
    rows = [[{"role": "user", "content": q}, {"role": "assistant", "content": a}] for q, a in pairs]
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    schema = pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))
    tmp = out_dir / "train.parquet.tmp"
    pq.write_table(pa.table({"messages": pa.array(rows, schema)}), tmp, compression="zstd")
    os.replace(tmp, out_dir / "train.parquet")
    return out_dir


def download_chat(name, out_dir=None, workers=4, check_only=False):
    """Fetch a conversation dataset into out_dir (default: <cache>/chat/<name>); LIMA's jsonl becomes parquet.
    check_only: only list it (the error a gated or missing dataset gets, in seconds), or find it complete on disk.
    "identity" is written from the identity file instead (no network; a broken file fails the check too)."""
    if name not in CHAT_DATASETS:
        raise ValueError(f"unknown conversation dataset {name!r}: choose from {', '.join(CHAT_DATASETS)}")
    repo, pattern = CHAT_DATASETS[name]
    out_dir = Path(out_dir or CACHE_DIR / "chat" / name)
    if repo is None:
        return write_identity(out_dir)

    def select(files):
        entries = [f for f in files if re.fullmatch(pattern, f["path"])]
        if not entries:
            raise ValueError(f"{repo} has no files matching {pattern}: the dataset's layout changed; please report it")
        return entries
    entries, from_disk = _listing(repo, "main", out_dir, select, workers)
    if check_only:
        return out_dir
    paths = [out_dir / Path(e["path"]).name for e in entries] if from_disk else \
        _download_entries(repo, entries, out_dir, "main", "dataset", workers)
    for path in paths:
        if path.suffix == ".jsonl" and not path.with_suffix(".parquet").exists():
            text, _ = decode_utf8(path.read_bytes())
            rows = [json.loads(line)["conversations"] for line in text.splitlines() if line.strip()]
            tmp = path.with_suffix(".parquet.tmp")
            pq.write_table(pa.table({"conversations": pa.array(rows, pa.list_(pa.string()))}), tmp,
                           compression="zstd")
            os.replace(tmp, path.with_suffix(".parquet"))
    return out_dir


def chat_dir(spec):
    """A chat source's directory: a path, or a CHAT_DATASETS name for its place in the cache."""
    return CACHE_DIR / "chat" / spec if spec in CHAT_DATASETS and not Path(spec).exists() else Path(spec)


def render_mc(question, letters, choices):
    """nanochat's multiple-choice message: each choice followed by '=' and its letter, with no space between, so the
    letter in the prompt is the same token as the bare letter the answer is."""
    return (f"Multiple Choice question: {question}\n" + "".join(f"- {c}={x}\n" for x, c in zip(letters, choices))
            + "\nRespond only with the letter of the correct answer.")


def calculator_parts(answer):
    """GSM8K's answer text as assistant parts: each <<expr=result>> annotation becomes a tool call (python) and its
    result (python_output), the text between them text parts."""
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
    """How a chat file's rows become conversations: its column(s) decide."""
    names = set(open_parquet(path, column=None).schema_arrow.names)
    for fmt, needs in (("messages", {"messages"}), ("conversations", {"conversations"}),
                       ("arc", {"question", "choices", "answerKey"}), ("mmlu", {"question", "choices", "answer"}),
                       ("mmlu", {"train"}), ("gsm8k", {"question", "answer"})):
        if needs <= names:
            return fmt
    raise ValueError(f"{path} has neither a `messages` column (SmolTalk, UltraChat), a `conversations` column (LIMA), "
                     f"nor a task's columns (MMLU, ARC: question, choices, answer or answerKey; GSM8K: question, "
                     f"answer); columns: {', '.join(sorted(names))}")


def task_messages(fmt, row):
    """A task row (chat_format's mmlu, arc, gsm8k) as a conversation, or why it cannot be one (a string)."""
    try:
        if fmt == "mmlu":
            row = row["train"] if isinstance(row.get("train"), dict) else row  # auxiliary_train nests its rows
            letters = MC_LETTERS[:len(row["choices"])]
            user, assistant = render_mc(row["question"], letters, row["choices"]), letters[row["answer"]]
        elif fmt == "arc":
            letters, answer = list(row["choices"]["label"]), row["answerKey"]
            if answer not in letters:
                return f"answerKey {answer!r} is not among the labels {letters}"
            user, assistant = render_mc(row["question"], letters, row["choices"]["text"]), answer
        else:
            user, assistant = row["question"], calculator_parts(row["answer"])
    except (KeyError, TypeError, IndexError) as e:
        return f"not a {fmt} row ({type(e).__name__}: {e})"
    return [{"role": "user", "content": user}, {"role": "assistant", "content": assistant}]


MC_LETTERS = "ABCDEFGHIJ"


def chat_rows(path, row_group):
    """A row group of a chat file as conversations (lists of messages), or for a row that cannot be one, why."""
    fmt = chat_format(path)
    if fmt in ("messages", "conversations"):
        return [conversation_messages(item) for item in read_row_group(path, row_group, fmt)]
    try:
        rows = open_parquet(path, column=None).read_row_group(row_group).to_pylist()
    except (pa.ArrowInvalid, OSError) as e:
        raise ValueError(f"{path}: row group {row_group} is unreadable ({e}): delete the file and fetch it again") from e
    return [task_messages(fmt, row) for row in rows]


def chat_files(chat_dir, split):
    files = sorted(Path(chat_dir).glob("*.parquet"))
    val = [f for f in files if f.name.startswith(("test", "val"))]
    chosen = val if split == "val" else [f for f in files if f not in val]
    if not chosen:
        which = "*.parquet named test* or val*" if split == "val" else "*.parquet not named test* or val*"
        raise FileNotFoundError(f"no {split} conversation files ({which}) in {chat_dir}: run `python dataset.py "
                                f"download-chat NAME` (one of {', '.join(CHAT_DATASETS)}) or `python demo.py --out "
                                f"DIR`")
    return chosen


def parse_chat_sources(specs):
    """--source DIR:EPOCHS values as [(directory, epochs)]; DIR may be a CHAT_DATASETS name (its cache directory)."""
    sources = []
    for spec in specs:
        path, _, epochs = spec.rpartition(":")
        if not path or not epochs.isdigit() or int(epochs) < 1:
            raise ValueError(f"--source {spec!r}: write DIR:EPOCHS with a whole number of passes >= 1, e.g. "
                             f"--source gsm8k:4 or --source data/demo/conversations:1")
        sources.append((str(chat_dir(path)), int(epochs)))
    return sources


def mixture_files(sources):
    """The training files of [(chat dir, epochs)], each listed once per epoch: one pass over the list is one pass
    of the mixture, every source its number of times, their row groups shuffled together by the loader's seed."""
    return [f for directory, epochs in sources for _ in range(epochs) for f in chat_files(directory, "train")]


# -----------------------------------------------------------------------------
# Shards on disk

def list_shards(data_dir):
    data_dir = Path(data_dir)
    if not data_dir.is_dir():
        raise FileNotFoundError(f"data directory {data_dir} does not exist: run `python dataset.py download --shards N"
                                f" --data_dir {data_dir}` or `python demo.py --out DIR` (its DIR/pretrain)")
    shards = sorted(data_dir.glob("*.parquet"))
    if not shards:
        raise FileNotFoundError(f"no .parquet shards in {data_dir}: run `python dataset.py download --shards N "
                                f"--data_dir {data_dir}` or `python dataset.py ingest --out {data_dir} FILES...`")
    return shards


TOKEN_COUNTS = ".token_counts.json"  # in a corpus directory: {tokenizer fingerprint: {shard name: [tokens, docs]}}


def shard_tokens(path, tokenizer, threads=None):
    """(tokens, documents) of one shard as the pretraining loader trains on them: each non-empty document's tokens
    plus its BOS. Counted once per (shard, tokenizer) and kept in the corpus directory's .token_counts.json."""
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
        tokens += sum(len(ids) + 1 for ids in tokenizer.encode_batch(texts, num_threads=threads or os.cpu_count()))
        docs += len(texts)
    counts.setdefault(key, {})[path.name] = [tokens, docs]
    tmp = cache.with_name(cache.name + f".{os.getpid()}.tmp")
    try:
        tmp.write_text(json.dumps(counts))
        os.replace(tmp, cache)
    except OSError:  # a read-only corpus: counted again next time, nothing else lost
        tmp.unlink(missing_ok=True)
    return tokens, docs


def corpus_budget(data_dir, tokenizer, budget_tokens):
    """How the training split of a corpus compares with a token budget: {"shards", "docs", "measured_shard",
    "tokens_per_doc", "tokens" (estimated: the first shard's tokens per document x every training shard's documents,
    from the parquet footers), "epochs" (budget / tokens)}. The first shard is counted with the tokenizer; the others
    are assumed to hold documents of the same mean length (FineWeb's shards are one shuffled stream cut in pieces)."""
    train = split_shards(data_dir, "train")
    tokens0, docs0 = shard_tokens(train[0], tokenizer)
    docs = sum(open_parquet(p).metadata.num_rows for p in train)
    per_doc = tokens0 / max(1, docs0)
    tokens = int(per_doc * docs)
    return {"shards": len(train), "docs": docs, "measured_shard": train[0].name, "tokens_per_doc": per_doc,
            "tokens_per_shard": tokens0, "tokens": tokens, "epochs": budget_tokens / max(1, tokens)}


def budget_line(b, budget_tokens):
    """The plan's data line: what the budget needs against what the corpus holds; says so when data repeats."""
    line = (f"data: budget {budget_tokens:,} tokens; corpus {b['shards']} training shards, {b['docs']:,} documents x "
            f"{b['tokens_per_doc']:,.0f} tokens (the mean of {b['measured_shard']}, counted with this tokenizer) = "
            f"~{b['tokens']:,} tokens: {b['epochs']:.2f} epochs")
    if b["epochs"] > 1:
        line += (f". This run REPEATS data: {b['epochs']:.2f} passes over the corpus (more shards: `python dataset.py "
                 f"download --shards N`; N ~ {math.ceil(budget_tokens / max(1, b['tokens_per_shard'])) + 1})")
    return line


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

STAT_KEYS = ("batches", "tokens", "supervised", "docs", "doc_tokens", "pieces", "cropped", "padding", "empty",
             "no_assistant", "too_long", "malformed", "empty_content")
REPORT_SKIPPED = 5  # the first few conversations skipped as bad input are printed (file, row, why); the rest counted


def assign_units(files, rank, world_size):
    """What rank `rank` of `world_size` reads: row groups rank, rank+W, ... of the files in order, so ranks never share
    a document. A split with fewer row groups than ranks (a small validation shard) is dealt by document instead:
    rank r takes documents r, r+W, ... of every row group. A unit is (path, row group, first doc, doc step)."""
    row_groups = [(path, i) for path in files for i in range(open_parquet(path, column=None).num_row_groups)]
    if len(row_groups) >= world_size:
        return [(path, i, 0, 1) for path, i in row_groups[rank::world_size]]
    return [(path, i, rank, world_size) for path, i in row_groups]


def conversation_messages(item):
    """SmolTalk/UltraChat rows are lists of {role, content}; LIMA rows are lists of strings, user first, alternating."""
    if item and isinstance(item[0], str):
        return [{"role": "user" if i % 2 == 0 else "assistant", "content": text} for i, text in enumerate(item)]
    return item or []


def cut_into_pieces(ids, row_len, bos):
    """A document longer than a row as row-sized pieces, each after the first led by a BOS of its own. Cutting its
    loss mask the same way, with the mask's value for BOS as `bos`, keeps each piece's mask aligned with its ids."""
    rest = [np.concatenate([[bos], ids[s:s + row_len - 1]]).astype(ids.dtype)
            for s in range(row_len, len(ids), row_len - 1)]
    return [ids[:row_len], *rest]


def skipped(item):
    """An item the reader could not use: None (an empty document) or the reason it was skipped."""
    return item is None or isinstance(item, str)


class PieceBuffer:
    """The packer's buffer: pieces (ids, mask, arrival number) sorted by length, so the largest piece that fits a
    space is a bisect. `live` maps each buffered piece's arrival number (unique, saved with the state) to its length
    and `oldest` is a heap of arrival numbers, so the oldest piece is found without a scan (entries no longer live
    are dropped lazily). `tokens` is the number of tokens buffered."""

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
        first = bisect.bisect_left(self.lengths, self.live[arrival])  # among the pieces of its length
        return self.take(next(i for i in range(first, len(self.pieces)) if self.pieces[i][2] == arrival))

    def take_largest(self, space):
        """The largest piece of at most `space` tokens, or None if none is that short."""
        i = bisect.bisect_right(self.lengths, space) - 1
        return self.take(i) if i >= 0 else None


class Pipe:
    """A bounded queue between the threads of one started pipeline, with that pipeline's stop event: put() and get()
    give up once it is set. Each start makes its own event and close() only ever sets it, so a thread that outlives
    close()'s join still finds its pipeline stopped and exits."""

    def __init__(self, maxsize, stop, name):
        self.queue, self.stop, self.name = queue.Queue(maxsize=maxsize), stop, name

    def put(self, item):
        """Hand `item` on; False if the pipeline was stopped first."""
        while not self.stop.is_set():
            try:
                self.queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                pass
        return False

    def get(self):
        while not self.stop.is_set():
            try:
                return self.queue.get(timeout=0.1)
            except queue.Empty:
                pass
        raise RuntimeError(f"{self.name} loader was closed while waiting: next() starts it again from its last state")


class PackedLoader:
    """(inputs, targets) batches of shape (B, T) for one rank, packed without padding (pack="crop": text, and
    conversations in midtraining) or from whole conversations padded at the end of a row (pack="pad": SFT). Iterate
    it; state_dict() is the exact position after the last batch handed out, buffered documents included, and a loader
    given it by load_state_dict() continues with bit-identical batches.

    Pipeline: a reader thread reads this rank's row groups and tokenizes them (tiktoken's batch encoder runs on
    `threads` threads outside the GIL); a packer thread fills rows of T+1 tokens and copies each batch to the
    device (pinned memory, non_blocking) `prefetch` batches ahead of the training step. Every batch travels with the
    state after it, so the state never runs ahead of what the consumer has seen.

    Order: seed=None reads the row groups ("units") and their documents in file order every epoch (pretraining).
    seed=N visits the units in an order shuffled from (N, epoch) and the documents of each unit in an order shuffled
    from (N, epoch, unit), so small sets are seen in a new order every epoch; the state's (epoch, unit, doc) are then
    positions in those orders, so a resume mid-epoch is still exact.

    Packing is best-fit from a buffer of about `buffer_docs` pieces (_top_up, _add_document); every row starts with a
    BOS and with the oldest buffered piece (_fill_row). pack="crop" rows have no padding: documents longer than a row
    are cut into BOS-led pieces and a piece that does not fit is cropped, its remainder kept for a later row; a
    conversation's loss mask is cut along with it. pack="pad" rows hold whole conversations (rendered to at most a
    row, cut after an assistant turn) and are padded, so every row has a supervised target. Conversation targets are
    -1 on padding and, with supervise="assistant", on every token that is not assistant content or <|assistant_end|>;
    supervise="all" trains on every real token, as text does.

    max_epochs=None cycles over the data forever (training); max_epochs=N stops after N passes (validation): the
    buffer empties into the last rows, whose unfilled end is padded (inputs BOS, targets -1), the last batch may
    have fewer rows, and then iteration stops."""

    def __init__(self, files, tokenizer, batch_size, seq_len, kind="text", rank=0, world_size=1, device="cpu",
                 buffer_docs=1000, threads=None, prefetch=2, name="train", max_epochs=None, pack=None,
                 supervise=None, seed=None):
        if kind not in ("text", "chat"):
            raise ValueError(f"kind={kind!r} is not allowed: choose text or chat")
        pack = pack or ("crop" if kind == "text" else "pad")
        supervise = supervise or ("all" if kind == "text" else "assistant")
        if pack not in ("pad", "crop") or supervise not in ("all", "assistant"):
            raise ValueError(f"{name}: pack={pack!r}, supervise={supervise!r}: choose pack pad or crop, supervise all or "
                             f"assistant")
        if kind == "text" and (pack, supervise) != ("crop", "all"):
            raise ValueError(f"{name}: text is packed with pack='crop' and supervise='all' (every token is a target), "
                             f"got pack={pack!r}, supervise={supervise!r}")
        self.files, self.tokenizer, self.kind, self.name = [Path(f) for f in files], tokenizer, kind, name
        self.pack, self.crop, self.supervise, self.seed = pack, pack == "crop", supervise, seed
        self.B, self.T, self.rank, self.world_size = batch_size, seq_len, rank, world_size
        self.device, self.buffer_docs = torch.device(device), buffer_docs
        self.threads, self.prefetch, self.max_epochs = threads or os.cpu_count(), prefetch, max_epochs
        self.units = assign_units(self.files, rank, world_size)
        if not self.units:
            raise ValueError(f"{name}: rank {rank} of {world_size} has no data in {', '.join(map(str, self.files))}")
        self.state = {"epoch": 0, "unit": 0, "doc": 0, "buffer": [], "stats": dict.fromkeys(STAT_KEYS, 0)}
        self._threads, self._batches = [], None  # the running pipeline's threads and its Pipe of batches
        self._reported = 0  # skipped conversations printed so far

    # --- state ---------------------------------------------------------------------------------------------------
    @property
    def epoch(self):
        """The pass over this rank's data that the next row comes from (0: the first; 1 and up: repeated data)."""
        return self.state["epoch"]

    def state_dict(self):
        buffer = self.state["buffer"]
        ids = np.concatenate([x for x, _, _ in buffer]) if buffer else np.zeros(0, np.int32)
        masks = np.concatenate([m for _, m, _ in buffer]) if buffer and self.kind == "chat" else np.zeros(0, np.int8)
        return {"epoch": self.state["epoch"], "unit": self.state["unit"], "doc": self.state["doc"],
                "stats": dict(self.state["stats"]), "buffer_ids": torch.from_numpy(ids),
                "buffer_masks": torch.from_numpy(masks),
                "buffer_lengths": torch.tensor([len(x) for x, _, _ in buffer], dtype=torch.int64),
                "buffer_arrivals": torch.tensor([a for _, _, a in buffer], dtype=torch.int64),
                "rank": self.rank, "world_size": self.world_size, "seq_len": self.T, "kind": self.kind,
                "pack": self.pack, "supervise": self.supervise, "seed": self.seed}

    def load_state_dict(self, sd):
        for key, mine in (("rank", self.rank), ("world_size", self.world_size), ("seq_len", self.T),
                          ("kind", self.kind), ("pack", self.pack), ("supervise", self.supervise), ("seed", self.seed)):
            if key in sd and sd[key] != mine:  # pack, supervise, seed: absent from states saved before they existed
                raise ValueError(f"{self.name} loader: state was saved with {key}={sd[key]}, this loader has {key}="
                                 f"{mine}; an exact resume needs the same {key}")
        if self._batches is not None:
            raise RuntimeError("load_state_dict() must come before the first batch: close() the loader first")
        bounds = np.cumsum([0, *sd["buffer_lengths"].tolist()])
        ids, masks = sd["buffer_ids"].numpy(), sd["buffer_masks"].numpy()
        buffer = [(ids[a:b].copy(), masks[a:b].copy() if self.kind == "chat" else None, arrival)
                  for (a, b), arrival in zip(itertools.pairwise(bounds), sd["buffer_arrivals"].tolist(), strict=True)]
        self.state = {"epoch": sd["epoch"], "unit": sd["unit"], "doc": sd["doc"], "buffer": buffer,
                      "stats": {**dict.fromkeys(STAT_KEYS, 0), **sd["stats"]}}

    def log_line(self):
        s = self.state["stats"]
        line = (f"{self.name} loader rank {self.rank}/{self.world_size}: epoch {self.state['epoch']}, "
                f"{s['batches']:,} batches, {s['tokens']:,} tokens, {s['docs']:,} docs, empty skipped {s['empty']:,}")
        cropped = f"{100 * s['cropped'] / s['doc_tokens']:.1f}%" if s["doc_tokens"] else "n/a"
        cropped = f", cropped {cropped} of document tokens (moved to a later row as a BOS-led piece; none discarded)"
        if self.kind == "text":
            return line + cropped
        padding = f"{100 * s['padding'] / (s['batches'] * self.B * (self.T + 1)):.1f}%" if s["batches"] else "n/a"
        supervised = f"{100 * s['supervised'] / s['tokens']:.1f}%" if s["tokens"] else "n/a"
        cropped = cropped if self.crop else ""
        return line + (f", supervised {supervised} of targets ({self.supervise}), padding {padding}{cropped}, "
                       f"skipped: no assistant turn {s['no_assistant']:,}, malformed {s['malformed']:,}, first "
                       f"exchange longer than a row {s['too_long']:,}, empty content {s['empty_content']:,}")

    # --- the pipeline --------------------------------------------------------------------------------------------
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

    def close(self, timeout=10):
        """Stop the threads; the next batch starts new ones from self.state."""
        if self._batches is not None:
            self._batches.stop.set()  # for good: this start's threads hold this event, whether they join in time or not
        for thread in self._threads:
            thread.join(timeout=timeout)
        self._threads, self._batches = [], None

    def _start(self):
        stop = threading.Event()  # this start's own (see Pipe)
        units, batches = Pipe(2, stop, self.name), Pipe(self.prefetch, stop, self.name)
        start = (self.state["epoch"], self.state["unit"], self.state["doc"])
        self._threads = [threading.Thread(target=self._guard, args=(batches, self._read, start, units), daemon=True),
                         threading.Thread(target=self._guard, args=(batches, self._pack, units, batches, self.state),
                                          daemon=True)]
        self._batches = batches
        for thread in self._threads:
            thread.start()

    def _guard(self, batches, fn, *args):
        try:
            fn(*args)
        except BaseException as e:  # noqa: BLE001 -- handed to the consumer, who raises it, instead of dying silently
            batches.put(e)

    def _read(self, start, out):
        """Reader thread: per row group, (epoch, unit, first doc index, [encoded doc, or None/reason if skipped]);
        unit and doc are positions in the epoch's visiting order (see the class docstring)."""
        epoch, first_unit, doc = start
        while epoch != self.max_epochs:
            order = list(range(len(self.units)))  # order[k]: the unit visited k-th this epoch
            if self.seed is not None:
                random.Random(f"{self.seed} {epoch}").shuffle(order)
            for unit in range(first_unit, len(self.units)):
                doc_order = None if self.seed is None else f"{self.seed} {epoch} {order[unit]}"
                if not out.put((epoch, unit, doc, self._encode(self.units[order[unit]], doc, doc_order))):
                    return
                doc = 0
            epoch, first_unit = epoch + 1, 0
        out.put(None)  # the data has ended (max_epochs)

    def _encode(self, unit, skip, doc_order=None):
        """The documents of a unit from position `skip` on, in file order or shuffled with the seed `doc_order`."""
        path, row_group, first, step = unit
        items = read_row_group(path, row_group, "text") if self.kind == "text" else chat_rows(path, row_group)
        rows = list(range(first, len(items), step))  # indices in the row group
        if doc_order is not None:
            random.Random(doc_order).shuffle(rows)
        rows = rows[skip:]
        if self.kind == "text":
            texts = [items[r] for r in rows]
            encoded = iter(self.tokenizer.encode_batch([t for t in texts if t], num_threads=self.threads))
            bos = self.tokenizer.bos_id
            return [np.array([bos, *next(encoded)], dtype=np.int32) if t else None for t in texts]
        out = []
        for r in rows:
            conversation, why = ("malformed", items[r]) if isinstance(items[r], str) else self._render(items[r])
            if why and self.rank == 0 and self._reported < REPORT_SKIPPED:
                self._reported += 1
                row = sum(open_parquet(path, None).metadata.row_group(g).num_rows for g in range(row_group)) + r
                more = f" (only the first {REPORT_SKIPPED} are printed; log_line() counts them all)" \
                    if self._reported == REPORT_SKIPPED else ""
                print(f"{self.name} loader: skipping {path} row {row}: {why}{more}")
            out.append(conversation)
        return out

    def _render(self, messages):
        """(ids, mask) arrays of one conversation, or the stats key it is skipped under; then why it is bad input,
        None if it is not. pack="pad" renders at most a row, cut after the last assistant turn that fits, so a kept
        conversation always has a supervised token; pack="crop" renders it whole (it is cut into pieces like text)."""
        if not messages:
            return None, "no messages"
        try:
            ids, mask = self.tokenizer.render_conversation(messages, max_tokens=None if self.crop else self.T + 1)
        except ValueError as e:  # an unknown role, content that is not a string, roles out of order
            return "malformed", str(e)
        if empty := [i for i, m in enumerate(messages) if m["role"] != "system" and isinstance(m["content"], str)
                     and not m["content"].strip()]:
            return "empty_content", f"message {empty[0]} ({messages[empty[0]]['role']}) has empty content"
        if not any(m["role"] == "assistant" for m in messages):
            return "no_assistant", "no assistant turn"
        if not ids:
            return "too_long", None  # not bad input: a longer row would take it
        mask = np.ones(len(ids), np.int8) if self.supervise == "all" else np.array(mask, np.int8)
        return (np.array(ids, np.int32), mask), None

    # --- packing -------------------------------------------------------------------------------------------------
    def _pack(self, units, batches, state):
        """Packer thread: fill rows from the buffer, ship each batch to the device with the state after it."""
        stats, buffer = dict(state["stats"]), PieceBuffer(state["buffer"])
        position = (state["epoch"], state["unit"], state["doc"])  # of the next unread document: where a resume reads on
        documents = self._documents(units, position, buffered=len(buffer))
        padded = self.kind == "chat" or self.max_epochs is not None  # a row that can end in padding needs a mask
        while len(buffer) or position is not None:
            rows = np.empty((self.B, self.T + 1), dtype=np.int32)
            masks = np.ones((self.B, self.T + 1), dtype=np.int8) if padded else None
            filled = 0
            for b in range(self.B):
                position = self._top_up(buffer, documents, stats, position)
                if not len(buffer):  # the data has ended and every piece is in a row: a short last batch
                    break
                self._fill_row(buffer, rows[b], None if masks is None else masks[b], stats)
                filled += 1
            if filled:
                stats["batches"], stats["tokens"] = stats["batches"] + 1, stats["tokens"] + filled * self.T
                stats["supervised"] += filled * self.T if masks is None else int(masks[:filled, 1:].sum())
                epoch, unit, doc = position or (self.max_epochs, 0, 0)  # None: the data has ended
                after = {"epoch": epoch, "unit": unit, "doc": doc, "stats": dict(stats), "buffer": list(buffer.pieces)}
                if not batches.put((self._to_device(rows[:filled], None if masks is None else masks[:filled]),
                                    after)):
                    return
        batches.put(StopIteration())  # max_epochs passes are done: __next__ raises it

    def _documents(self, units, start, buffered):
        """The documents from position `start` on, in order, each as (encoded document or why it is skipped, the
        position of the next unread document). That position comes with each document, so it is exact even when
        nothing has been read since a resume. A pass over all the data with no usable document is an error (the
        buffer would wait forever); `buffered` pieces restored from a checkpoint count as usable."""
        epoch, usable = start[0], buffered
        while (got := units.get()) is not None:
            item_epoch, unit, doc, items = got
            if item_epoch != epoch:
                if not usable:
                    raise ValueError(f"{self.name} loader: a whole pass over {len(self.units)} row groups found no "
                                     f"usable document ({self.log_line()})")
                if self.rank == 0:
                    print(f"{self.name} loader: epoch {item_epoch} starts (the data ran out, starting over)")
                epoch, usable = item_epoch, 0
            for read, item in enumerate(items, start=1):
                usable += not skipped(item)
                last = read == len(items)  # then the next document is the first of the next row group
                yield item, self._next_unit(epoch, unit) if last else (epoch, unit, doc + read)

    def _next_unit(self, epoch, unit):
        return (epoch + 1, 0, 0) if unit + 1 == len(self.units) else (epoch, unit + 1, 0)

    def _top_up(self, buffer, documents, stats, position):
        """Read documents into the buffer, in order, until it holds buffer_docs pieces; cropping also wants a row's
        worth of tokens, else the row would take every piece and find nothing left to crop. Returns the position of
        the next unread document, None once the data has ended (max_epochs)."""
        while position is not None and (len(buffer) < self.buffer_docs or
                                        (self.crop and buffer.tokens < self.T + 1)):
            item, position = next(documents, (None, None))
            if position is not None:
                self._add_document(buffer, item, stats)
        return position

    def _add_document(self, buffer, item, stats):
        """Buffer one document; a skipped one (None: empty, or the reason) is only counted. A document longer than a
        row is cut into row-sized BOS-led pieces here (pack="pad" renders at most a row), a conversation's mask with
        it: its tokens after the first piece are counted as 'cropped', moved to a later row cut off from the
        document's start."""
        if skipped(item):
            stats[item or "empty"] += 1
            return
        ids, mask = item if self.kind == "chat" else (item, None)
        stats["docs"], stats["doc_tokens"] = stats["docs"] + 1, stats["doc_tokens"] + len(ids)
        pieces = [(ids, mask)]
        if len(ids) > self.T + 1:
            stats["cropped"] += len(ids) - (self.T + 1)
            id_pieces = cut_into_pieces(ids, self.T + 1, self.tokenizer.bos_id)
            mask_pieces = [None] * len(id_pieces) if mask is None else cut_into_pieces(mask, self.T + 1, mask[0])
            pieces = list(zip(id_pieces, mask_pieces, strict=True))
        for piece, piece_mask in pieces:
            buffer.add(piece, piece_mask, stats["pieces"])  # arrival numbers count pieces: unique, and in order
            stats["pieces"] += 1

    def _fill_row(self, buffer, row, row_mask, stats):
        """The oldest piece opens the row, so nothing waits more than about buffer_docs rows (pure best-fit starves
        short documents indefinitely); then the largest piece that fits the space left, again and again."""
        pos, piece = 0, buffer.take_oldest()
        while piece is not None:
            ids, mask, _ = piece
            row[pos:pos + len(ids)] = ids
            if mask is not None:
                row_mask[pos:pos + len(ids)] = mask
            pos += len(ids)
            piece = buffer.take_largest(len(row) - pos)
        if pos < len(row):
            self._pad_or_crop(buffer, row, row_mask, pos, stats)

    def _pad_or_crop(self, buffer, row, row_mask, pos, stats):
        """No piece fits the rest of the row. pack="pad" pads it (inputs BOS, targets -1): conversations are never
        cropped. pack="crop" crops the smallest piece to fill it and puts the remainder back as a new BOS-led piece
        (its mask too: mask[0] is the piece's BOS's), under the same arrival number, so it opens a row soon: nothing
        is discarded, and the moved tokens are counted as 'cropped'."""
        bos, space = self.tokenizer.bos_id, len(row) - pos
        if not self.crop or not len(buffer):  # cropping pads only when the data has ended (max_epochs)
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


def chat_loader(chat_dir, split, tokenizer, batch_size, seq_len, *, pack="pad", supervise="assistant", seed=None,
                files=None, **kwargs):
    """The conversation loader over a chat directory's train or val files (or a list of files, e.g. mixture_files):
    pack="pad" for SFT (whole conversations, padded), pack="crop" for midtraining (packed like text);
    supervise="assistant" or "all" (see PackedLoader)."""
    return PackedLoader(files or chat_files(chat_dir, split), tokenizer, batch_size, seq_len, kind="chat", pack=pack,
                        supervise=supervise, seed=seed, **{"name": f"chat {split}", **kwargs})


def mixture_loader(sources, tokenizer, batch_size, seq_len, *, rank=0, world_size=1, device="cpu", seed=0, **kwargs):
    """Midtraining's loader: rows from a text corpus and conversation sets at configured token shares (MixtureLoader).
    sources: [{"name", "kind": "text"|"chat", "path": corpus dir (its train split) or chat dir (its train files),
    "share"}]; supervise="assistant"|"all" (in kwargs) picks the conversations' targets, other kwargs go to every
    source's PackedLoader."""
    return MixtureLoader(sources, tokenizer, batch_size, seq_len, rank=rank, world_size=world_size, device=device,
                         seed=seed, **kwargs)


def check_sources(sources):
    """A ValueError naming what is wrong with a mixture's sources and how to fix it."""
    if not sources:
        raise ValueError("a mixture needs at least one source")
    for i, source in enumerate(sources):
        missing = {"name", "kind", "path", "share"} - set(source)
        if missing:
            raise ValueError(f"mixture source {i} ({source}) lacks {', '.join(sorted(missing))}: each source is "
                             f"{{'name', 'kind': 'text'|'chat', 'path', 'share'}}")
        if source["kind"] not in ("text", "chat"):
            raise ValueError(f"mixture source {source['name']!r}: kind={source['kind']!r}: choose text or chat")
    shares = {source["name"]: source["share"] for source in sources}
    if len(shares) < len(sources):
        raise ValueError(f"mixture sources need distinct names, got {[source['name'] for source in sources]}")
    if any(share < 0 for share in shares.values()) or abs(sum(shares.values()) - 1) > 1e-6:
        raise ValueError(f"mixture shares {shares} sum to {sum(shares.values()):.6g}: they must be non-negative and "
                         f"sum to 1")


class MixtureLoader:
    """(inputs, targets) batches of shape (B, T) whose rows come from several sources at configured token shares.
    Each row is taken from the source whose realized token share is furthest below its target (ties: the first
    listed), so after n rows every source is within about a row of share * n rows: the mixture holds from the first
    batches on, not only on average. Each source is a one-row PackedLoader: text_loader over the train split of a
    corpus, or chat_loader over a chat directory's train files with pack="crop" (conversations packed BOS-aligned like
    text, no padding). The realized shares come from those loaders' token counts, which their states restore, so
    state_dict() is just theirs and a resume gives bit-identical batches."""

    def __init__(self, sources, tokenizer, batch_size, seq_len, *, rank=0, world_size=1, device="cpu", seed=0,
                 supervise="assistant", prefetch=2, name="mixture", **kwargs):
        check_sources(sources)
        self.names, self.targets = [s["name"] for s in sources], [float(s["share"]) for s in sources]
        self.B, self.T, self.rank, self.world_size = batch_size, seq_len, rank, world_size
        self.device, self.name, self.batches = torch.device(device), name, 0
        # each source keeps a batch's worth of rows ready (prefetch counts its one-row batches)
        common = {"rank": rank, "world_size": world_size, "seed": seed, "prefetch": prefetch * batch_size, **kwargs}
        self.loaders = []
        for source in sources:
            if source["kind"] == "text":
                loader = text_loader(source["path"], "train", tokenizer, 1, seq_len, name=source["name"], **common)
            else:
                loader = chat_loader(source["path"], "train", tokenizer, 1, seq_len, pack="crop", supervise=supervise,
                                     name=source["name"], **common)
            self.loaders.append(loader)

    def __iter__(self):
        return self

    def __next__(self):
        tokens = [loader.state["stats"]["tokens"] for loader in self.loaders]
        rows = []
        for _ in range(self.B):
            total = sum(tokens) + self.T  # with this row: the first goes to the largest share, not the first listed
            i = max(range(len(tokens)), key=lambda k: self.targets[k] * total - tokens[k])  # max keeps the first
            rows.append(next(self.loaders[i]))
            tokens[i] = self.loaders[i].state["stats"]["tokens"]
        self.batches += 1
        batch = torch.stack([torch.cat([x for x, _ in rows]), torch.cat([y for _, y in rows])])
        if self.device.type == "cuda":
            batch = batch.pin_memory().to(self.device, non_blocking=True)
        return batch[0], batch[1]

    def close(self, timeout=10):
        for loader in self.loaders:
            loader.close(timeout)

    @property
    def state(self):
        """The sources' counters summed, shaped like a PackedLoader's state["stats"] (what the training loop reads)."""
        stats = {key: sum(loader.state["stats"][key] for loader in self.loaders) for key in STAT_KEYS}
        return {"stats": {**stats, "batches": self.batches}}

    @property
    def epoch(self):
        """The furthest pass any source is in (0: the first)."""
        return max(loader.epoch for loader in self.loaders)

    def state_dict(self):
        return {"kind": "mixture", "names": list(self.names), "shares": list(self.targets), "batches": self.batches,
                "sources": [loader.state_dict() for loader in self.loaders]}

    def load_state_dict(self, sd):
        mine = list(zip(self.names, self.targets))
        saved = list(zip(sd["names"], sd["shares"])) if sd.get("kind") == "mixture" else None
        if saved != mine:
            by = f"the mixture {dict(saved)}" if saved else f"a {sd.get('kind')} loader"
            raise ValueError(f"{self.name} loader: state was saved by {by}, this loader has {dict(mine)}; an exact "
                             f"resume needs the same sources and shares, in the same order")
        for loader, state in zip(self.loaders, sd["sources"], strict=True):
            loader.load_state_dict(state)
        self.batches = sd["batches"]

    def mixture(self):
        """{name: {"tokens", "docs", "share" (realized), "target"}}: for a stage's final summary."""
        total = max(1, sum(loader.state["stats"]["tokens"] for loader in self.loaders))
        return {name: {"tokens": loader.state["stats"]["tokens"], "docs": loader.state["stats"]["docs"],
                       "share": loader.state["stats"]["tokens"] / total, "target": target}
                for name, target, loader in zip(self.names, self.targets, self.loaders)}

    def log_line(self):
        parts = []
        for (name, m), loader in zip(self.mixture().items(), self.loaders):
            s = loader.state["stats"]
            supervised = f", supervised {100 * s['supervised'] / s['tokens']:.1f}%" \
                if loader.kind == "chat" and s["tokens"] else ""
            parts.append(f"{name}: {m['tokens']:,} tokens, {m['docs']:,} docs{supervised}, share "
                         f"{100 * m['share']:.1f}% (target {100 * m['target']:.1f}%)")
        return f"{self.name} loader rank {self.rank}/{self.world_size}: {self.batches:,} batches; " + "; ".join(parts)


# -----------------------------------------------------------------------------

def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    p = commands.add_parser("download", help="pretraining shards from the hub, plus the last one as validation")
    p.add_argument("--shards", type=int, required=True, help="number of training shards to fetch (the validation shard comes too)")
    p.add_argument("--dataset", default="karpathy/fineweb-edu-100b-shuffle", help="hub dataset (default: %(default)s)")
    p.add_argument("--data_dir", default=None, help="where to put them (default: <cache>/data/<dataset name>; cache: "
                   f"$NANOCHAT_CACHE or {CACHE_DIR})")
    p.add_argument("--workers", type=int, default=4, help="parallel downloads (default: %(default)s)")
    p = commands.add_parser("download-chat", help="conversation and task datasets from the hub (identity: written "
                            "from identity.json)")
    p.add_argument("names", nargs="+", choices=sorted(CHAT_DATASETS), help="which ones")
    p.add_argument("--check", action="store_true", help="only list them on the hub (a gated or missing dataset fails "
                   "in seconds) unless complete on disk; download nothing (default: off)")
    p.add_argument("--workers", type=int, default=4, help="parallel downloads (default: %(default)s)")
    p = commands.add_parser("ingest", help="your own .txt/.jsonl/.parquet files as a corpus")
    p.add_argument("files", nargs="+", help=".txt (documents split on blank lines), .jsonl, .parquet")
    p.add_argument("--out", required=True, help="output corpus directory")
    p.add_argument("--column", default="text", help="jsonl field / parquet column (default: %(default)s)")
    p.add_argument("--one_per_file", action="store_true", help="each .txt file is one document (default: split on "
                   "blank lines)")
    p.add_argument("--seed", type=int, default=0, help="shuffle seed (default: %(default)s)")
    p.add_argument("--val_fraction", type=float, default=0.05, help="share of documents in the validation shard "
                   "(default: %(default)s)")
    args = parser.parse_args(argv)
    try:
        if args.command == "download":
            data_dir = Path(args.data_dir or default_data_dir(args.dataset))
            paths = download_shards(args.dataset, args.shards, data_dir, workers=args.workers)
            print(f"download: {len(paths) - 1} training shards + 1 validation shard in {data_dir}")
        elif args.command == "download-chat":
            for name in args.names:
                out = download_chat(name, workers=args.workers, check_only=args.check)
                print(f"download-chat: {name} {'is available' if args.check else 'in'} {out}")
        else:
            ingest(args.files, args.out, seed=args.seed, column=args.column, one_per_file=args.one_per_file,
                   val_fraction=args.val_fraction)
    except (ValueError, TypeError, FileNotFoundError, RuntimeError) as e:
        parser.exit(2, f"dataset.py {args.command}: error: {e}\n")


if __name__ == "__main__":
    main()
