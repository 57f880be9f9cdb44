"""Data for training: checked, resumable downloads (FineWeb-Edu shards, conversation sets,
any hub or URL file), your own text ingested as a corpus, and the tokenizer trained on a corpus.
A file gets its final name once size, hash and (parquet) footer check out. The hub's listing is
saved beside the files, so a rerun with intact files needs no hub.

    python prepare.py shards --shards 8  # FineWeb-Edu shards + the last one (validation)
    python prepare.py chat smoltalk gsm8k
    python prepare.py ingest --out DIR PATHS...      # your own .txt/.md/.jsonl/.parquet, or folders
    python prepare.py tokenizer --data_dir DIR --vocab_size 65536   # -> runs/tokenizer/
    python prepare.py bytes_per_token --data_dir DIR                # the tokenizer on the val split
    python prepare.py rows --chat my_chats.jsonl --tokenizer runs/tokenizer   # a batch's rows
    python prepare.py list openai/gsm8k  # a hub dataset's files: size, sha256 or git blob id
    python prepare.py get openai/gsm8k main/test-00000-of-00001.parquet --out DIR
    python prepare.py url URL --out FILE --sha256 HEX  # resumes from FILE.partial
"""
import argparse
import codecs
import hashlib
import itertools
import json
import logging
import os
import random
import re
import shutil
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import rustbpe

from dataset import (
    CACHE_DIR,
    CHAT_DATASETS,
    FINEWEB,
    ROW_GROUP_DOCS,
    SKIP_BAD_ROWS_HELP,
    chat_dir,
    default_data_dir,
    open_parquet,
    read_row_group,
    split_shards,
)
from tokenizer import SPECIAL_TOKENS, SPLIT_PATTERN, Tokenizer

# huggingface_hub is imported inside functions, not by every stage. hf_hub_download checks no
# size or hash and gives up on a 500 or a reset mid-body: the checks and retries are this file's.

DEFAULT_HUB_ENDPOINT = "https://huggingface.co"
# attempts per file: with the backoff, ~60 s in all, enough to ride out a hub hiccup
RETRIES = 8
BACKOFF_BASE, BACKOFF_MAX = 0.5, 30.0


class _Transient(Exception):
    """A downloaded file failed a check; a fresh download can fix it."""


def hub_endpoint():
    """$HF_ENDPOINT or the public hub, read per call (huggingface_hub reads it only at import)."""
    return os.environ.get("HF_ENDPOINT", DEFAULT_HUB_ENDPOINT).rstrip("/")


def _status(error):
    response = getattr(error, "response", None)
    return response.status_code if response is not None else None


def _first_line(error):
    return (str(error).strip().splitlines() or [type(error).__name__])[0]


def _transient(error):
    """Worth retrying: network errors, 408/429/5xx, short bodies, failed checks; not 401, 404,
    ..."""
    from huggingface_hub.utils import HfHubHTTPError, httpx
    if isinstance(error, HfHubHTTPError):
        code = _status(error)
        return code is None or code in (408, 429) or code >= 500
    return isinstance(error, (httpx.HTTPError, OSError, _Transient))


def _retrying(attempt, retries, gave_up):
    """attempt() up to `retries` times with backoff; non-transient errors raise at once, and
    after the last try gave_up(the error's first line)."""
    for i in range(retries):
        try:
            return attempt()
        except Exception as e:
            if not _transient(e):
                raise
            if i + 1 == retries:
                raise gave_up(_first_line(e)) from None
        # jitter: parallel workers hit by one 429 do not retry in lockstep
        time.sleep(min(BACKOFF_BASE * 2 ** i, BACKOFF_MAX) * random.uniform(0.5, 1.0))


def _hash_file(path, digest):
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def _mismatch(path, size=None, sha256=None, git_sha1=None):
    """How path differs from the expected size, sha256 or git blob id, or None."""
    got = path.stat().st_size
    if size is not None and got != size:
        return f"size {got} bytes, expected {size}"
    if sha256 and (digest := _hash_file(path, hashlib.sha256())) != sha256.lower():
        return f"sha256 {digest} does not match the expected {sha256}"
    if git_sha1 and (digest := _hash_file(path, hashlib.sha1(b"blob %d\0" % got,
                                                             usedforsecurity=False))) != git_sha1:
        return f"git blob id {digest} does not match the expected {git_sha1}"
    return None


def _check(path, size=None, sha256=None, git_sha1=None, verify=None):
    """Unless path matches and verify(path) passes, delete it (a bad prefix would poison every
    resume) and raise _Transient."""
    problem = _mismatch(path, size, sha256, git_sha1)
    if not problem and verify:
        try:
            verify(path)
        except ValueError as e:
            problem = f"content check failed: {e}"
    if problem:
        path.unlink()
        raise _Transient(problem)


class _Bar:
    """The part of tqdm's interface huggingface_hub calls, silent."""

    def __init__(self, initial=0, **kwargs):
        self.n = initial

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def update(self, n=1):
        self.n += n

    def set_postfix_str(self, *args, **kwargs):
        pass

    # update_transfer: hf_xet's network bytes; update() counts bytes written
    update_transfer = set_transfer_postfix_str = refresh = close = set_postfix_str


def download_file(url, dest, size=None, sha256=None, verify=None, retries=RETRIES):
    """Stream a URL to dest + ".partial", resumed by later attempts and runs; renamed to dest
    once size, sha256 and verify pass. An existing dest of the right size is kept."""
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
            partial.unlink()  # not a prefix of the server's file now: start over
            raise _Transient(f"server refused to resume at byte {offset} (HTTP 416)") from e
        _check(partial, size, sha256, verify=verify)
        os.replace(partial, dest)
        return dest

    def gave_up(error):
        kept = ""
        if partial.exists():
            kept = f"; the {partial.stat().st_size} bytes so far are kept in {partial}"
        return RuntimeError(f"could not download {dest.name} from {url} after {max(1, retries)} "
                            f"attempts (last error: {error}){kept}: re-run the command to resume")
    try:
        return _retrying(attempt, max(1, retries), gave_up)
    except HfHubHTTPError as e:
        raise RuntimeError(f"{url} answered HTTP {_status(e)}: check the URL") from None


def _hub_failure(what, error):
    """The error for a hub answer a retry cannot fix."""
    from huggingface_hub.utils import RepositoryNotFoundError
    code = _status(error)
    if code in (401, 403) or isinstance(error, RepositoryNotFoundError):
        # the hub answers 401 for a missing repo as well as a private one
        return RuntimeError(f"{what}: HTTP {code}: the repo is private or gated, or does not "
                            "exist: set HF_TOKEN to a token that can read it (and accept the "
                            "dataset's terms on its page if it is gated)")
    if code == 404:
        return RuntimeError(f"{what}: HTTP 404: not found: check the repo id, the revision and the "
                            "file path")
    return RuntimeError(f"{what}: {_first_line(error)}")


def list_hub_files(repo, revision="main", repo_type="dataset"):
    """A repo's files: {"path", "size", "sha256" (LFS), "git_sha1" (git)}."""
    from huggingface_hub import HfApi, RepoFile
    from huggingface_hub.utils import HfHubHTTPError, httpx
    api = HfApi(endpoint=hub_endpoint())
    try:
        entries = list(api.list_repo_tree(repo, recursive=True, revision=revision,
                                          repo_type=repo_type))
    except httpx.HTTPError as e:  # HfHubHTTPError is one
        if isinstance(e, HfHubHTTPError) and not _transient(e):
            raise _hub_failure(f"listing {repo} (revision {revision})", e) from None
        # network error, or a 429/5xx huggingface_hub already retried
        raise RuntimeError(f"could not list {repo} at {hub_endpoint()} ({_first_line(e)}): check "
                           "the network (and HF_ENDPOINT if set) and re-run the command, later if "
                           "the hub is failing") from None
    return [{"path": e.path, "size": e.size, "sha256": e.lfs.sha256 if e.lfs else None,
             "git_sha1": None if e.lfs else e.blob_id} for e in entries if isinstance(e, RepoFile)]


def _fetch_hub_file(repo, entry, dest, staging, revision, repo_type, bar):
    from huggingface_hub import hf_hub_download
    from huggingface_hub.utils import HfHubHTTPError
    def attempt():
        path = Path(hf_hub_download(repo, entry["path"], repo_type=repo_type, revision=revision,
                                    local_dir=staging,
                                    endpoint=hub_endpoint(), tqdm_class=bar))
        verify = verify_parquet if dest.suffix == ".parquet" else None
        _check(path, entry["size"], entry["sha256"], entry["git_sha1"], verify)
        os.replace(path, dest)
        return dest

    def gave_up(error):
        return RuntimeError(f"could not download {entry['path']} from {repo} after {RETRIES} "
                            f"attempts (last error: {error}): check the network (and HF_ENDPOINT "
                            "if set) and re-run the command; complete files are kept")
    try:
        return _retrying(attempt, RETRIES, gave_up)
    except HfHubHTTPError as e:
        raise _hub_failure(f"{repo}: {entry['path']}", e) from None


def verify_parquet(path):
    """The footer parses and there are rows: catches truncation and HTML error pages; bit flips
    are the sha256's job."""
    try:
        num_rows = pq.ParquetFile(path).metadata.num_rows
    except (pa.ArrowInvalid, OSError) as e:
        raise ValueError(f"{path} is not a readable parquet file ({e})") from e
    if num_rows <= 0:
        raise ValueError(f"{path} is a parquet file with no rows")


def _progress_line(total, already):
    """Per-file tqdm_classes feeding one stderr line: rewritten twice a second on a terminal, a
    new line every 30 s in a log."""
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
        eta = "unknown" if left is None else \
            f"{left // 3600}:{left % 3600 // 60:02d}:{left % 60:02d}"
        line = (f"download: {total_done / 1e6:.1f}/{total / 1e6:.1f} MB, {rate / 1e6:.1f} MB/s, "
                f"ETA {eta}")
        print(("\r" if tty else "") + line + "   ", end="\n" if final or not tty else "",
              file=sys.stderr, flush=True)

    def for_file(key):
        # one per attempt, from the resumed bytes: done[key] is on disk
        class FileBar(_Bar):
            def update(self, n=1):
                super().update(n)
                with lock:
                    done[key] = self.n
                    show()
        return FileBar
    return for_file, show


def download_entries(repo, entries, out_dir, revision, repo_type, workers):
    """Download listed entries into out_dir by file name, in parallel, via a staging dir inside
    out_dir (the rename is atomic)."""
    out_dir = Path(out_dir)
    names = [Path(e["path"]).name for e in entries]
    if len(set(names)) != len(names):
        raise ValueError("two requested files share a name and would overwrite each other in "
                         f"{out_dir}: {names}")
    dests = [out_dir / name for name in names]
    todo = [(e, d) for e, d in zip(entries, dests)
            if not (d.exists() and d.stat().st_size == e["size"])]
    total = sum(e["size"] or 0 for e in entries)
    for_file, show = _progress_line(total, total - sum(e["size"] or 0 for e, _ in todo))
    out_dir.mkdir(parents=True, exist_ok=True)
    staging, errors = out_dir / ".hub_download", []
    with ThreadPoolExecutor(max(1, workers)) as pool:
        futures = [pool.submit(_fetch_hub_file, repo, e, d, staging, revision, repo_type,
                               for_file(d)) for e, d in todo]
        for future in as_completed(futures):
            try:
                future.result()
            # let the others finish: a rerun has less to fetch
            except (RuntimeError, ValueError, OSError) as e:
                errors.append(e)
    # nothing to resume in it: hf_hub_download deletes what it cut short
    shutil.rmtree(staging, ignore_errors=True)
    if todo:
        show(final=True)
    if len(errors) == 1:
        raise errors[0]
    if errors:
        raise RuntimeError(f"{len(errors)} of {len(todo)} downloads failed:\n" + "\n".join(map(
                str, errors)))
    return dests


def download_hub_files(repo, paths, out_dir, revision="main", repo_type="dataset", workers=4):
    """Download `paths` of a hub repo into out_dir; complete files are skipped."""
    by_path = {f["path"]: f for f in list_hub_files(repo, revision, repo_type)}
    missing = [p for p in paths if p not in by_path]
    if missing:
        raise ValueError(f"{repo} (revision {revision}) has no file {', '.join(missing)}")
    return download_entries(repo, [by_path[p] for p in paths], out_dir, revision, repo_type,
                            workers)


# the listing (sizes, hashes) a download directory's files were checked with
LISTING = ".hub_listing.json"


def _complete_on_disk(entries, out_dir, workers=4):
    """Every entry is in out_dir with its listed size and hash (hashing takes seconds, a hub
    outage hours)."""
    def ok(e):
        path = Path(out_dir) / Path(e["path"]).name
        return path.is_file() and bool(e["sha256"] or e["git_sha1"]) and \
            _mismatch(path, e["size"], e["sha256"], e["git_sha1"]) is None
    with ThreadPoolExecutor(max(1, workers)) as pool:
        return all(pool.map(ok, entries))


def listed_or_saved(repo, revision, out_dir, select, workers=4):
    """The entries select(listing) chooses: from the saved listing if every chosen file is on
    disk and matches (no hub call), else from the hub's, which is saved."""
    listing = Path(out_dir) / LISTING
    try:
        saved = json.loads(listing.read_text())
        chosen = select(saved["files"]) if (saved.get("repo"), saved.get("revision")) == (
                repo, revision) else None
    # no saved listing, or one that cannot answer (more shards than it had)
    except (OSError, ValueError):
        chosen = None
    if chosen and _complete_on_disk(chosen, out_dir, workers):
        return chosen
    files = list_hub_files(repo, revision)
    chosen = select(files)
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    tmp = listing.with_name(LISTING + ".tmp")
    tmp.write_text(json.dumps({"repo": repo, "revision": revision, "files": files}))
    os.replace(tmp, listing)
    return chosen


# -----------------------------------------------------------------------------
# The corpora and chat sets this project trains on

SHARD_NAME = re.compile(r"shard_(\d+)\.parquet")


def download_shards(dataset, num_shards, data_dir, workers=4):
    """The first num_shards shards of a FineWeb-Edu-layout dataset plus its last (validation)
    shard."""
    def select(files):
        shards = sorted((f for f in files if SHARD_NAME.fullmatch(Path(f["path"]).name)),
                        key=lambda f: int(SHARD_NAME.fullmatch(Path(f["path"]).name).group(1)))
        if len(shards) < 2:
            raise ValueError(f"{dataset} has {len(shards)} shard_NNNNN.parquet files; a corpus "
                             "needs training shards and a validation shard (the last one)")
        available = len(shards) - 1
        if not 1 <= num_shards <= available:
            raise ValueError(f"--shards {num_shards} is not available: {dataset} has {available} "
                             f"training shards (plus the validation shard): choose 1..{available}")
        return shards[:num_shards] + shards[-1:]
    chosen = listed_or_saved(dataset, "main", data_dir, select, workers)
    return download_entries(dataset, chosen, data_dir, "main", "dataset", workers)


def download_chat(name, out_dir=None, workers=4, check_only=False):
    """Fetch a conversation dataset into out_dir (default: <cache>/chat/<name>); jsonl becomes
    parquet. check_only: only list it. "identity" is written from identity.json."""
    if name not in CHAT_DATASETS:
        raise ValueError(f"unknown conversation dataset {name!r}: choose from "
                         f"{', '.join(CHAT_DATASETS)}")
    repo, pattern = CHAT_DATASETS[name]
    out_dir = Path(out_dir or CACHE_DIR / "chat" / name)
    if repo is None:
        return write_identity(out_dir)

    def select(files):
        entries = [f for f in files if re.fullmatch(pattern, f["path"])]
        if not entries:
            raise ValueError(f"{repo} has no files matching {pattern}: the dataset's layout "
                             "changed; please report it")
        return entries
    entries = listed_or_saved(repo, "main", out_dir, select, workers)
    if check_only:
        return out_dir
    for path in download_entries(repo, entries, out_dir, "main", "dataset", workers):
        if path.suffix == ".jsonl" and not path.with_suffix(".parquet").exists():
            text, _ = decode_utf8(path.read_bytes())
            rows = [json.loads(line)["conversations"] for line in text.splitlines() if line.strip()]
            write_parquet(path.with_suffix(".parquet"), {"conversations": pa.array(
                    rows, pa.list_(pa.string()))})
    return out_dir


# -----------------------------------------------------------------------------
# Writing shards, and the identity conversations

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
    """Shuffled documents as corpus shards, the last holding val_fraction of them (at least
    one). Returns the paths."""
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
    tmp = path.with_name(path.name + ".tmp")
    pq.write_table(pa.table(columns), tmp, compression="zstd", **kwargs)
    os.replace(tmp, path)
    return path


IDENTITY_FILE = Path(__file__).resolve().parent / "identity.json"


def load_identity(path=IDENTITY_FILE):
    """(the assistant's name, [(question, answer)])."""
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
    """Each file given, and each directory's INGEST_SUFFIXES files, sorted."""
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
    """Files or directories into a corpus; ingest.json, written last, says it is whole."""
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
    """A handler printing rustbpe's messages with seconds since start, merge progress every
    every_percent."""
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
    """BPE with exactly vocab_size ids, SPECIAL_TOKENS included."""
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
    """Yield texts, counting documents, characters and bytes; the rate printed every every_s."""
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


def show_rows(args):
    from loader import chat_loader, text_loader  # torch: only this command needs it
    tokenizer = Tokenizer.load(args.tokenizer)
    if args.data_dir:
        loader = text_loader(args.data_dir, args.split, tokenizer, args.batch_size, args.seq_len)
    else:
        loader = chat_loader(chat_dir(args.chat), args.split, tokenizer, args.batch_size,
                             args.seq_len, pack=args.pack, supervise=args.supervise,
                             skip_bad_rows=args.skip_bad_rows)
    inputs, targets = next(loader)
    loader.close()
    for i in range(min(args.rows, len(inputs))):
        trained = targets[i][targets[i] != -1].tolist()
        print(f"--- row {i}: {len(trained)} of {args.seq_len} targets; "
              f"inputs:\n{tokenizer.decode(inputs[i].tolist())}")
        if len(trained) < args.seq_len:
            print(f"--- row {i}: its targets (the tokens it trains on), "
                  f"joined:\n{tokenizer.decode(trained)}")
    print(loader.log_line())


def add_corpus_commands(commands):
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
    train.add_argument("--out", default="runs/tokenizer", help="directory for tokenizer.json "
                       "(default: %(default)s)")
    measure = commands.add_parser("bytes_per_token", help="a tokenizer's bytes per token on a "
                                  "corpus's validation split")
    measure.add_argument("--data_dir", required=True, help="corpus directory of parquet shards")
    measure.add_argument("--tokenizer", default="runs/tokenizer", help="directory of "
                         "tokenizer.json (default: %(default)s)")
    rows = commands.add_parser("rows", help="a batch's rows from a corpus or conversations, "
                               "decoded, and the tokens each trains on")
    source = rows.add_mutually_exclusive_group(required=True)
    source.add_argument("--data_dir", help="a text corpus directory")
    source.add_argument("--chat", help="a conversation directory or .jsonl file, or a `prepare.py "
                        "chat` name")
    rows.add_argument("--tokenizer", default="runs/tokenizer", help="directory of tokenizer.json "
                      "(default: %(default)s)")
    rows.add_argument("--split", default="train", choices=["train", "val"], help=
                      "(default: %(default)s)")
    rows.add_argument("--batch_size", type=int, default=4, help="rows per batch (default: "
                      "%(default)s)")
    rows.add_argument("--seq_len", type=int, default=256, help="tokens per row (default: "
                      "%(default)s)")
    rows.add_argument("--pack", default="pad", choices=["pad", "crop"], help=
                      "conversations: pad (SFT) or crop (midtraining) (default: %(default)s)")
    rows.add_argument("--supervise", default="assistant", choices=["assistant", "all"], help=
                      "conversations: which tokens are targets (default: %(default)s)")
    rows.add_argument("--skip_bad_rows", action="store_true", help=SKIP_BAD_ROWS_HELP)
    rows.add_argument("--rows", type=int, default=2, help="rows of the first batch to print "
                      "(default: %(default)s)")


def get_parser():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    listing = commands.add_parser("list", help="a hub repo's files with their sizes and hashes")
    get = commands.add_parser("get", help="files of a hub repo, checked against its listing")
    for q in (listing, get):
        q.add_argument("repo", help="hub repo id, e.g. openai/gsm8k")
        q.add_argument("--revision", default="main", help="branch, tag or commit (default: "
                       "%(default)s)")
        q.add_argument("--repo_type", default="dataset", choices=["dataset", "model"], help=
                       "(default: %(default)s)")
    get.add_argument("paths", nargs="+", help="file paths inside the repo (see `list`)")
    get.add_argument("--out", required=True, help="directory to put them in")
    shards = commands.add_parser("shards", help="pretraining shards from the hub, plus the last "
                                 "one as validation")
    shards.add_argument("--shards", type=int, required=True, help="number of training shards to "
                        "fetch (the validation shard comes too)")
    shards.add_argument("--dataset", default=FINEWEB, help="hub dataset (default: %(default)s)")
    shards.add_argument("--data_dir", default=None, help="where to put them (default: "
                        f"<cache>/data/<dataset name>; cache: $NANOCHAT_CACHE or {CACHE_DIR})")
    chat = commands.add_parser("chat", help="conversation and task datasets from the hub "
                               "(identity: written from identity.json)")
    chat.add_argument("names", nargs="+", choices=sorted(CHAT_DATASETS), help="which ones")
    chat.add_argument("--check", action="store_true", help="only list them on the hub unless "
                      "complete on disk (a gated or missing one fails fast); download nothing")
    for q in (get, shards, chat):
        q.add_argument("--workers", type=int, default=4, help="parallel downloads (default: "
                       "%(default)s)")
    p = commands.add_parser("url", help="one file from a plain URL, resumable")
    p.add_argument("url", help="the file's URL")
    p.add_argument("--out", required=True, help="the file to write")
    p.add_argument("--size", type=int, default=None, help="expected size in bytes (default: not "
                   "checked)")
    p.add_argument("--sha256", default=None, help="expected sha256 in hex (default: not checked)")
    add_corpus_commands(commands)
    return parser


def main(argv=None):
    parser = get_parser()
    args = parser.parse_args(argv)
    try:
        if args.command == "shards":
            data_dir = Path(args.data_dir or default_data_dir(args.dataset))
            paths = download_shards(args.dataset, args.shards, data_dir, workers=args.workers)
            print(f"prepare.py shards: {len(paths) - 1} training shards + 1 validation shard in "
                  f"{data_dir}")
        elif args.command == "chat":
            for name in args.names:
                out = download_chat(name, workers=args.workers, check_only=args.check)
                print(f"prepare.py chat: {name} {'is available' if args.check else 'in'} {out}")
        elif args.command == "list":
            for f in list_hub_files(args.repo, args.revision, args.repo_type):
                print(f"{f['path']}\t{f['size']}\t{f['sha256'] or 'git ' + str(f['git_sha1'])}")
        elif args.command == "get":
            paths = download_hub_files(args.repo, args.paths, args.out, args.revision,
                                       args.repo_type, args.workers)
            print(f"prepare.py get: {len(paths)} files of {args.repo} in {args.out}")
        elif args.command == "ingest":
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
        elif args.command == "rows":
            show_rows(args)
        elif args.command == "bytes_per_token":
            tokenizer = Tokenizer.load(args.tokenizer)
            docs, n_bytes, n_tokens = text_stats(tokenizer, iter_texts(args.data_dir, "val"))
            if n_tokens == 0:
                raise ValueError(f"the validation split of {args.data_dir} has no text")
            print(f"val split of {args.data_dir}: {docs:,} documents, {n_bytes:,} bytes, "
                  f"{n_tokens:,} tokens")
            print(f"bytes/token: {n_bytes / n_tokens:.6f} (tokenizer {args.tokenizer}, vocab size "
                  f"{tokenizer.vocab_size})")
        else:
            print(f"prepare.py url: {download_file(args.url, args.out, args.size, args.sha256)}")
    except (ValueError, TypeError, RuntimeError, OSError) as e:  # a bad flag: argparse's 2
        parser.exit(1, f"prepare.py {args.command}: error: {e}\n")


if __name__ == "__main__":
    main()
