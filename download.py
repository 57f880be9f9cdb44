"""Checked, resumable downloads from a URL or a Hugging Face hub repo: a file gets its final name
only once size, hash and (parquet) footer check out; retried with backoff. The listing is saved
beside the files (.hub_listing.json), so a rerun with intact files needs no hub.

    python download.py shards --shards 8  # FineWeb-Edu shards + the last one (validation)
    python download.py chat smoltalk gsm8k
    python download.py list openai/gsm8k  # a hub dataset's files: size, sha256 or git blob id
    python download.py get openai/gsm8k main/test-00000-of-00001.parquet --out DIR
    python download.py url URL --out FILE --sha256 HEX  # resumes from FILE.partial
"""
import argparse
import hashlib
import json
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

from dataset import (
    CACHE_DIR,
    CHAT_DATASETS,
    FINEWEB,
    decode_utf8,
    default_data_dir,
    write_identity,
    write_parquet,
)

# huggingface_hub is imported inside functions, not by every stage (docs/data.md).
# hf_hub_download checks no size or hash and gives up on a 500 or a reset mid-body: the checks,
# retries and one-line errors are this file's (tests/test_download.py).

DEFAULT_HUB_ENDPOINT = "https://huggingface.co"
# attempts per file; with the backoff below they wait ~60 s in all: enough to ride out a hub hiccup
RETRIES = 8
BACKOFF_BASE, BACKOFF_MAX = 0.5, 30.0


class _Transient(Exception):
    """A downloaded file failed a check (size, hash, content); a fresh download can fix it."""


def hub_endpoint():
    """$HF_ENDPOINT or the public hub, read per call (huggingface_hub reads it only at import)."""
    return os.environ.get("HF_ENDPOINT", DEFAULT_HUB_ENDPOINT).rstrip("/")


def _status(error):
    response = getattr(error, "response", None)
    return response.status_code if response is not None else None


def _first_line(error):
    return (str(error).strip().splitlines() or [type(error).__name__])[0]


def _transient(error):
    """Worth retrying: network errors, 408/429/5xx, short bodies, failed checks. Other HTTP answers
    (401, 404, ...) are mistakes to report."""
    from huggingface_hub.utils import HfHubHTTPError, httpx
    if isinstance(error, HfHubHTTPError):
        code = _status(error)
        return code is None or code in (408, 429) or code >= 500
    return isinstance(error, (httpx.HTTPError, OSError, _Transient))


def _retrying(attempt, retries, gave_up):
    """attempt() up to `retries` times with exponential backoff; non-transient errors raise at
    once, and after the last try gave_up(first line of the error)."""
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
    """Raise _Transient and delete path (a bad prefix would poison every resume) unless it matches
    and verify(path) raises no ValueError."""
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
    """The silent part of tqdm's interface that huggingface_hub calls."""

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

    # update_transfer: hf_xet's network bytes; update() counts bytes written, enough
    update_transfer = set_transfer_postfix_str = refresh = close = set_postfix_str


def download_file(url, dest, size=None, sha256=None, verify=None, retries=RETRIES):
    """Stream a plain URL to dest + ".partial", resumed by later attempts and runs. dest appears
    once size, sha256 and verify(partial) pass; an existing dest of the right size is kept."""
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
        # network error, or a 429/5xx huggingface_hub already retried five times
        raise RuntimeError(f"could not list {repo} at {hub_endpoint()} ({_first_line(e)}): check "
                           "the network (and HF_ENDPOINT if set) and re-run the command, later if "
                           "the hub is failing") from None
    return [{"path": e.path, "size": e.size, "sha256": e.lfs.sha256 if e.lfs else None,
             "git_sha1": None if e.lfs else e.blob_id} for e in entries if isinstance(e, RepoFile)]


def _fetch_hub_file(repo, entry, dest, staging, revision, repo_type, bar):
    """One listed file: downloaded to staging, checked, renamed to dest."""
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
    """The footer parses and there are rows: catches truncation and HTML error pages in
    milliseconds; bit flips are the sha256's job."""
    try:
        num_rows = pq.ParquetFile(path).metadata.num_rows
    except (pa.ArrowInvalid, OSError) as e:
        raise ValueError(f"{path} is not a readable parquet file ({e})") from e
    if num_rows <= 0:
        raise ValueError(f"{path} is a parquet file with no rows")


def _progress_line(total, already):
    """Per-file tqdm_classes feeding one stderr line (MB, MB/s, ETA): rewritten twice a second on
    a terminal, a new line every 30 s in a log."""
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
    out_dir (same disk: the rename is atomic)."""
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
    """Download `paths` of a hub repo into out_dir by file name; complete files are skipped."""
    by_path = {f["path"]: f for f in list_hub_files(repo, revision, repo_type)}
    missing = [p for p in paths if p not in by_path]
    if missing:
        raise ValueError(f"{repo} (revision {revision}) has no file {', '.join(missing)}")
    return download_entries(repo, [by_path[p] for p in paths], out_dir, revision, repo_type,
                            workers)


# the listing (sizes, hashes) a download directory's files were checked with
LISTING = ".hub_listing.json"


def _complete_on_disk(entries, out_dir, workers=4):
    """True when every entry is in out_dir with its listed size and hash. Hashing ~20 GB of shards
    takes tens of seconds, a hub outage hours."""
    def ok(e):
        path = Path(out_dir) / Path(e["path"]).name
        return path.is_file() and bool(e["sha256"] or e["git_sha1"]) and \
            _mismatch(path, e["size"], e["sha256"], e["git_sha1"]) is None
    with ThreadPoolExecutor(max(1, workers)) as pool:
        return all(pool.map(ok, entries))


def listed_or_saved(repo, revision, out_dir, select, workers=4):
    """The entries select(listing) chooses. The saved listing is tried first: if every chosen file
    is on disk and matches, no hub call is made (offline, or a hub outage). Otherwise the hub is
    listed and the listing saved."""
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

# --- the corpora and chat sets this project trains on

SHARD_NAME = re.compile(r"shard_(\d+)\.parquet")


def download_shards(dataset, num_shards, data_dir, workers=4):
    """The first num_shards shards of a FineWeb-Edu-layout dataset plus its last (validation)
    shard, which sorts last in data_dir."""
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
    """Fetch a conversation dataset into out_dir (default: <cache>/chat/<name>); LIMA's jsonl
    becomes parquet. check_only: only list it, failing fast if gated or missing. "identity" is
    written from identity.json."""
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



def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    listing = commands.add_parser("list", help="a hub repo's files with their sizes and hashes")
    p = commands.add_parser("get", help="files of a hub repo, checked against its listing, into "
                            "one directory")
    for q in (listing, p):
        q.add_argument("repo", help="hub repo id, e.g. openai/gsm8k")
        q.add_argument("--revision", default="main", help="branch, tag or commit (default: "
                       "%(default)s)")
        q.add_argument("--repo_type", default="dataset", choices=["dataset", "model"], help=
                       "(default: %(default)s)")
    p.add_argument("paths", nargs="+", help="file paths inside the repo (see `list`)")
    p.add_argument("--out", required=True, help="directory to put them in, by file name (required)")
    p.add_argument("--workers", type=int, default=4, help="parallel downloads (default: "
                   "%(default)s)")
    p = commands.add_parser("shards", help="pretraining shards from the hub, plus the last one as "
                            "validation")
    p.add_argument("--shards", type=int, required=True, help="number of training shards to fetch "
                   "(the validation shard comes too)")
    p.add_argument("--dataset", default=FINEWEB, help=
                   "hub dataset (default: %(default)s)")
    p.add_argument("--data_dir", default=None, help="where to put them (default: "
                   f"<cache>/data/<dataset name>; cache: $NANOCHAT_CACHE or {CACHE_DIR})")
    p.add_argument("--workers", type=int, default=4, help="parallel downloads (default: "
                   "%(default)s)")
    p = commands.add_parser("chat", help="conversation and task datasets from the hub (identity: "
                            "written from identity.json)")
    p.add_argument("names", nargs="+", choices=sorted(CHAT_DATASETS), help="which ones")
    p.add_argument("--check", action="store_true", help="only list them on the hub (a gated or "
                   "missing dataset fails in seconds) unless complete on disk; download nothing "
                   "(default: off)")
    p.add_argument("--workers", type=int, default=4, help="parallel downloads (default: "
                   "%(default)s)")
    p = commands.add_parser("url", help="one file from a plain URL, resumable")
    p.add_argument("url", help="the file's URL")
    p.add_argument("--out", required=True, help="the file to write (required)")
    p.add_argument("--size", type=int, default=None, help="expected size in bytes (default: not "
                   "checked)")
    p.add_argument("--sha256", default=None, help="expected sha256 in hex (default: not checked)")
    args = parser.parse_args(argv)
    try:
        if args.command == "shards":
            data_dir = Path(args.data_dir or default_data_dir(args.dataset))
            paths = download_shards(args.dataset, args.shards, data_dir, workers=args.workers)
            print(f"download.py shards: {len(paths) - 1} training shards + 1 validation shard in "
                  f"{data_dir}")
        elif args.command == "chat":
            for name in args.names:
                out = download_chat(name, workers=args.workers, check_only=args.check)
                print(f"download.py chat: {name} {'is available' if args.check else 'in'} {out}")
        elif args.command == "list":
            for f in list_hub_files(args.repo, args.revision, args.repo_type):
                print(f"{f['path']}\t{f['size']}\t{f['sha256'] or 'git ' + str(f['git_sha1'])}")
        elif args.command == "get":
            paths = download_hub_files(args.repo, args.paths, args.out, args.revision,
                                       args.repo_type, args.workers)
            print(f"download.py get: {len(paths)} files of {args.repo} in {args.out}")
        else:
            print(f"download.py url: {download_file(args.url, args.out, args.size, args.sha256)}")
    except (ValueError, TypeError, RuntimeError, OSError) as e:
        parser.exit(2, f"download.py {args.command}: error: {e}\n")


if __name__ == "__main__":
    main()
