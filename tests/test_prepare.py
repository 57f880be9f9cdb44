"""The hub downloader (huggingface_hub underneath) against local servers that speak the hub's protocol and inject
network faults.

The hub server holds real parquet shards. Like the real hub, its tree API pages the listing with a `Link: rel="next"`
header; a HEAD or GET of the resolve URL of an LFS file answers 302 with the sha256 in X-Linked-Etag, the size in
X-Linked-Size and the commit in X-Repo-Commit, pointing at a second server on another port, the "CDN", which serves
the bytes (with Range support and an MD5-like ETag); a file kept in git is served by the resolve URL itself, its git
blob id as ETag. Neither sends Xet headers, so huggingface_hub downloads over plain HTTP. Faults are queued per file
and consumed one per GET of its bytes.
"""
import hashlib
import json
import random
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace
from urllib.parse import parse_qs, unquote, urlsplit

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from helpers import STALL_S, git_blob_id, resolve_headers, serve, tree_entry
from huggingface_hub import constants as hf_constants
from huggingface_hub.utils import http_backoff

import dataset as D
import prepare as P
import prepare as dl

REPO = "org/fineweb-mini"
NUM_SHARDS = 5  # shard_00000 .. shard_00004: four training shards, then the validation shard
PAGE_SIZE = 3  # tree entries per page: small, so the listing takes several pages
CHUNK = 4096  # huggingface_hub's read size here (10 MB by default): it resumes from the last whole chunk it wrote


def write_shard(path, rows, seed):
    rng = random.Random(seed)
    words = ["tokens", "shard", "hub", "parquet", "resume", "range", "bytes", "model", "data", "learning"]
    texts = [" ".join(rng.choice(words) for _ in range(rng.randint(20, 60))) for _ in range(rows)]
    pq.write_table(pa.table({"text": texts}), path, compression="none")  # uncompressed: tens of KB per shard
    return path.read_bytes()


def make_handler(hub):
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def send_json(self, status, obj, headers=()):
            payload = json.dumps(obj).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(payload)))
            for key, value in headers:
                self.send_header(key, value)
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(payload)

        def do_GET(self):
            url = urlsplit(self.path)
            path = unquote(url.path)
            self.entry = {"method": self.command, "path": path, "range": self.headers.get("Range"),
                          "auth": self.headers.get("Authorization"), "port": self.server.server_address[1]}
            hub.log.append(self.entry)
            self.route(path, parse_qs(url.query))

        do_HEAD = do_GET

        def send_response(self, code, message=None):
            self.entry["status"] = code  # logged as sent: a stalled or dropped body still shows its status
            super().send_response(code, message)

        def route(self, path, query):
            if hub.status is not None:
                return self.send_json(hub.status, {"error": "forced"})
            if path == f"/api/datasets/{REPO}/tree/main":
                assert query.get("recursive") == ["true"]
                cursor = int(query.get("cursor", ["0"])[0])
                page = hub.tree[cursor:cursor + PAGE_SIZE]
                headers = []
                if cursor + PAGE_SIZE < len(hub.tree):
                    next_url = f"{hub.url}/api/datasets/{REPO}/tree/main?recursive=true&cursor={cursor + PAGE_SIZE}"
                    headers.append(("Link", f'<{next_url}>; rel="next"'))
                return self.send_json(200, page, headers)
            prefix = f"/datasets/{REPO}/resolve/main/"
            if path.startswith(prefix) and path[len(prefix):] in hub.files:
                name = path[len(prefix):]
                if self.command == "GET" and not name.endswith(".parquet"):
                    return serve(hub, self, name)
                return resolve_headers(hub, self, name)
            if path.startswith("/cdn/") and path[len("/cdn/"):] in hub.files and self.command == "GET":
                return serve(hub, self, path[len("/cdn/"):])
            return self.send_json(404, {"error": "Entry not found"})
    return Handler


def start_server(hub):
    server = ThreadingHTTPServer(("127.0.0.1", 0), make_handler(hub))
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}"


@pytest.fixture
def hub(tmp_path_factory, monkeypatch):
    source = tmp_path_factory.mktemp("source")
    files = {f"shard_{i:05d}.parquet": write_shard(source / f"shard_{i:05d}.parquet", 200 + 50 * i, seed=i)
             for i in range(NUM_SHARDS)}
    files = {"README.md": b"# fineweb-mini\n", **files}
    tree = [tree_entry(path, data) for path, data in files.items()]
    tree.append({"type": "directory", "path": "extra", "oid": "2" * 40})
    hub = SimpleNamespace(files=files, tree=tree, faults={}, log=[], status=None)
    (server, hub.url), (cdn, hub.cdn_url) = start_server(hub), start_server(hub)  # another port: another host
    hub.servers = [server, cdn]
    monkeypatch.setenv("HF_ENDPOINT", hub.url + "/")  # a trailing slash must not matter
    monkeypatch.setenv("NO_PROXY", "127.0.0.1")
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setattr(hf_constants, "HF_HUB_CACHE", str(tmp_path_factory.mktemp("hf_cache")))  # not the user's
    monkeypatch.setattr(hf_constants, "DOWNLOAD_CHUNK_SIZE", CHUNK)
    monkeypatch.setattr(dl, "BACKOFF_BASE", 0.0)
    for wait in ("base_wait_time", "max_wait_time"):  # huggingface_hub's own retries (a stopped hub: 23 s a call)
        monkeypatch.setitem(http_backoff.__kwdefaults__, wait, 0)
    yield hub
    for s in (server, cdn):
        if s.socket.fileno() != -1:  # not stopped by the test
            s.shutdown()
            s.server_close()


def requests_to(hub, part, method=None):
    return [e for e in hub.log if part in e["path"] and method in (None, e["method"])]


def cdn_url(hub, name):
    return f"{hub.cdn_url}/cdn/{name}"


def test_the_endpoint_comes_from_the_environment_at_each_call(monkeypatch):
    monkeypatch.delenv("HF_ENDPOINT", raising=False)
    assert dl.hub_endpoint() == "https://huggingface.co"
    monkeypatch.setenv("HF_ENDPOINT", "http://mirror.local:8080/")
    assert dl.hub_endpoint() == "http://mirror.local:8080"


def test_listing_follows_pagination_and_reads_the_lfs_sha256(hub):
    files = dl.list_hub_files(REPO)
    assert [f["path"] for f in files] == ["README.md"] + [f"shard_{i:05d}.parquet" for i in range(NUM_SHARDS)]
    assert len(requests_to(hub, "/tree/")) == 3  # 7 entries, 3 per page
    readme = hub.files["README.md"]
    assert files[0] == {"path": "README.md", "size": len(readme), "sha256": None, "git_sha1": git_blob_id(readme)}
    for f in files[1:]:
        assert f["size"] == len(hub.files[f["path"]]) and f["git_sha1"] is None
        assert f["sha256"] == hashlib.sha256(hub.files[f["path"]]).hexdigest()


def test_every_fault_is_survived_and_every_shard_ends_byte_identical(hub, tmp_path, monkeypatch):
    monkeypatch.setattr(hf_constants, "HF_HUB_DOWNLOAD_TIMEOUT", STALL_S / 2)  # here only: a loaded machine could trip it
    hub.faults = {
        "shard_00000.parquet": ["drop", "500", "short", "norange"],  # norange: a partial exists, server sends it all
        "shard_00001.parquet": ["429", "flip", "stall"],
        "shard_00002.parquet": ["short", "short"],  # resumed twice with Range
        "shard_00004.parquet": ["garbage", "drop", "500"],
    }
    out = tmp_path / "data"
    paths = dl.download_shards(REPO, 4, out, workers=3)
    assert paths == [out / f"shard_{i:05d}.parquet" for i in range(NUM_SHARDS)]
    for path in paths:
        assert path.read_bytes() == hub.files[path.name]
    assert sorted(p.name for p in out.iterdir()) == [dl.LISTING] + [p.name for p in paths]  # no staging dir, no partial
    assert all(not queue for queue in hub.faults.values())
    resumed = [e for e in requests_to(hub, "/cdn/") if e["status"] == 206 and int(e["range"][6:-1]) > 0]
    assert any(e["path"].endswith("shard_00002.parquet") for e in resumed)
    ignored = [e for e in requests_to(hub, "/cdn/shard_00000") if e["range"] and e["status"] == 200]
    assert len(ignored) == 1  # the norange answer: the client started over instead of appending
    assert not requests_to(hub, "xet")  # plain HTTP: the servers advertise no Xet storage


def test_a_flipped_byte_is_caught_by_the_listed_sha256_and_fetched_again(hub, tmp_path):
    name = "shard_00001.parquet"
    hub.faults[name] = ["flip"]
    dl.download_hub_files(REPO, [name], tmp_path)
    assert (tmp_path / name).read_bytes() == hub.files[name]
    assert len(requests_to(hub, f"/cdn/{name}")) == 2


def test_a_file_kept_in_git_is_checked_against_its_git_blob_id(hub, tmp_path):
    hub.faults["README.md"] = ["flip"]
    dl.download_hub_files(REPO, ["README.md"], tmp_path)
    assert (tmp_path / "README.md").read_bytes() == hub.files["README.md"]
    assert len(requests_to(hub, "/resolve/main/README.md", "GET")) == 2


def test_a_shard_failing_every_check_never_appears_and_the_error_says_what_to_do(hub, tmp_path, monkeypatch):
    name = "shard_00002.parquet"
    monkeypatch.setattr(dl, "RETRIES", 2)
    hub.faults[name] = ["flip", "garbage"]
    with pytest.raises(RuntimeError) as err:
        dl.download_hub_files(REPO, [name], tmp_path)
    message = str(err.value)
    assert "\n" not in message and name in message and "after 2 attempts" in message and "sha256" in message
    assert "re-run" in message
    assert list(tmp_path.iterdir()) == []  # neither the final name nor the staging dir


def test_a_bad_file_never_appears_under_its_name_and_the_error_says_what_to_do(hub, tmp_path):
    name = "shard_00002.parquet"
    sha = hashlib.sha256(hub.files[name]).hexdigest()
    seen = []
    hub.faults[name] = ["flip"]
    with pytest.raises(RuntimeError) as err:
        dl.download_file(cdn_url(hub, name), tmp_path / name, sha256=sha, verify=seen.append, retries=1)
    message = str(err.value)
    assert name in message and "sha256" in message and "after 1 attempts" in message and "re-run" in message
    assert seen == []  # the checksum failed before the content check ran
    assert list(tmp_path.iterdir()) == []  # neither the final name nor a corrupt .partial

    # while a file is checked it is still the .partial; its final name does not exist yet
    def verify(path):
        seen.append((path.name, (tmp_path / name).exists()))
    dl.download_file(cdn_url(hub, name), tmp_path / name, sha256=sha, verify=verify)
    assert seen == [(name + ".partial", False)]
    assert (tmp_path / name).read_bytes() == hub.files[name]


def test_a_failing_content_check_fetches_again(hub, tmp_path):
    name = "shard_00000.parquet"
    hub.faults[name] = ["garbage"]  # right size, no sha256 known (the CDN's ETag is an MD5): only verify can tell
    dest = dl.download_file(cdn_url(hub, name), tmp_path / name, size=len(hub.files[name]), verify=dl.verify_parquet)
    assert dest.read_bytes() == hub.files[name]
    assert len(requests_to(hub, f"/cdn/{name}")) == 2


def test_retries_run_out_with_an_error_that_keeps_the_partial_for_the_next_run(hub, tmp_path):
    name = "shard_00003.parquet"
    # the short body is resumed at once, within the first attempt (huggingface_hub's http_get), and meets a 500
    hub.faults[name] = ["short", "500", "500", "500"]
    with pytest.raises(RuntimeError) as err:
        dl.download_file(cdn_url(hub, name), tmp_path / name, size=len(hub.files[name]), retries=3)
    assert "after 3 attempts" in str(err.value) and "500" in str(err.value) and ".partial" in str(err.value)
    assert "\n" not in str(err.value)
    assert len(requests_to(hub, f"/cdn/{name}")) == 4
    kept = (tmp_path / (name + ".partial")).stat().st_size
    assert len(hub.files[name]) - 100 - CHUNK <= kept <= len(hub.files[name]) - 100
    assert not (tmp_path / name).exists()
    dl.download_file(cdn_url(hub, name), tmp_path / name, size=len(hub.files[name]))  # the re-run resumes
    assert (tmp_path / name).read_bytes() == hub.files[name]
    assert hub.log[-1]["range"] == f"bytes={kept}-" and hub.log[-1]["status"] == 206


def test_complete_shards_are_not_downloaded_again(hub, tmp_path):
    dl.download_shards(REPO, 2, tmp_path)
    assert len(requests_to(hub, "/resolve/")) == 3
    hub.log.clear()
    dl.download_shards(REPO, 2, tmp_path)
    assert requests_to(hub, "/resolve/") == [] and requests_to(hub, "/cdn/") == []
    dl.download_shards(REPO, 3, tmp_path)  # one more training shard: only that one is fetched
    assert [e["path"] for e in requests_to(hub, "/resolve/")] == [f"/datasets/{REPO}/resolve/main/shard_00002.parquet"]


def test_download_shards_takes_the_first_n_training_shards_and_the_last_shard(hub, tmp_path):
    paths = dl.download_shards(REPO, 2, tmp_path)
    names = ["shard_00000.parquet", "shard_00001.parquet", "shard_00004.parquet"]
    assert [p.name for p in paths] == names
    assert sorted(p.name for p in tmp_path.iterdir()) == [dl.LISTING, *names]  # the validation shard sorts last
    with pytest.raises(ValueError, match="has 4 training shards"):
        dl.download_shards(REPO, 5, tmp_path / "more")
    with pytest.raises(ValueError, match="has 4 training shards"):
        dl.download_shards(REPO, 0, tmp_path / "none")


def test_not_found_fails_at_once_and_names_the_path(hub, tmp_path):
    url = f"{hub.url}/datasets/{REPO}/resolve/main/shard_09999.parquet"
    with pytest.raises(RuntimeError, match=r"shard_09999\.parquet.*404"):
        dl.download_file(url, tmp_path / "shard_09999.parquet")
    assert len(hub.log) == 1
    with pytest.raises(ValueError, match="shard_09999.parquet"):
        dl.download_hub_files(REPO, ["shard_09999.parquet"], tmp_path)
    assert len(requests_to(hub, "/resolve/")) == 1  # the first call's: the second knew from the listing, fetched nothing


def test_forbidden_says_to_set_hf_token_and_the_token_goes_to_the_hub_only(hub, tmp_path, monkeypatch):
    hub.status = 401
    with pytest.raises(RuntimeError, match="HF_TOKEN") as err:
        dl.list_hub_files(REPO)
    assert "\n" not in str(err.value)
    assert len(hub.log) == 1
    hub.status, hub.log[:] = None, []
    monkeypatch.setenv("HF_TOKEN", "hf_secret")
    dl.download_hub_files(REPO, ["README.md", "shard_00001.parquet"], tmp_path)
    assert (tmp_path / "README.md").read_bytes() == hub.files["README.md"]
    hub_port = int(hub.url.rsplit(":", 1)[1])
    to_hub = [e for e in hub.log if e["port"] == hub_port]
    to_cdn = [e for e in hub.log if e["port"] != hub_port]
    assert {e["path"].split("/")[1] for e in to_hub} == {"api", "datasets"} and to_cdn
    assert all(e["auth"] == "Bearer hf_secret" for e in to_hub)
    assert all(e["auth"] is None for e in to_cdn)  # the CDN is another host: the token stays with the hub


def test_verify_parquet_rejects_random_bytes_and_an_empty_table(tmp_path):
    good = tmp_path / "good.parquet"
    write_shard(good, 10, seed=0)
    dl.verify_parquet(good)
    noise = tmp_path / "noise.parquet"
    noise.write_bytes(random.Random(0).randbytes(5000))
    with pytest.raises(ValueError, match="noise.parquet"):
        dl.verify_parquet(noise)
    empty = tmp_path / "empty.parquet"
    pq.write_table(pa.table({"text": pa.array([], pa.string())}), empty)
    with pytest.raises(ValueError, match="empty.parquet.*no rows"):
        dl.verify_parquet(empty)


def test_a_partial_that_is_already_complete_is_checked_and_renamed_without_a_request(hub, tmp_path):
    name = "shard_00001.parquet"  # an earlier run got every byte, then died before it could verify and rename
    (tmp_path / (name + ".partial")).write_bytes(hub.files[name])
    sha = hashlib.sha256(hub.files[name]).hexdigest()
    dl.download_file(cdn_url(hub, name), tmp_path / name, size=len(hub.files[name]), sha256=sha)
    assert hub.log == [] and (tmp_path / name).read_bytes() == hub.files[name]
    assert not (tmp_path / (name + ".partial")).exists()


def host_repo(hub, monkeypatch, repo, files):
    """Serve another repo from the same server: nested paths, parquet files as LFS, others as plain git files."""
    monkeypatch.setitem(globals(), "REPO", repo)
    hub.files = files
    hub.tree = [tree_entry(path, data) for path, data in files.items()]


def parquet_bytes(tmp_path, name, column, rows):
    pq.write_table(pa.table({column: rows}), tmp_path / name)
    return (tmp_path / name).read_bytes()


def test_download_chat_fetches_only_the_dataset_files_and_converts_lima(hub, tmp_path, monkeypatch):
    conv = [[{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}] for i in range(5)]
    files = {f"data/all/train-0000{i}-of-00002.parquet": parquet_bytes(tmp_path, f"t{i}", "messages", conv)
             for i in range(2)}
    files["data/all/test-00000-of-00001.parquet"] = parquet_bytes(tmp_path, "v", "messages", conv[:2])
    files["data/other/train-00000-of-00001.parquet"] = parquet_bytes(tmp_path, "o", "messages", conv)  # not asked for
    files["README.md"] = b"# smoltalk\n"
    host_repo(hub, monkeypatch, "HuggingFaceTB/smoltalk", files)
    hub.faults = {"data/all/train-00001-of-00002.parquet": ["drop", "500"]}
    out = dl.download_chat("smoltalk", tmp_path / "smoltalk")
    assert sorted(p.name for p in out.iterdir()) == [dl.LISTING, "test-00000-of-00001.parquet",
                                                     "train-00000-of-00002.parquet", "train-00001-of-00002.parquet"]
    for path, data in files.items():
        if path.startswith("data/all/"):
            assert (out / path.split("/")[-1]).read_bytes() == data
    assert D.chat_files(out, "val") == [out / "test-00000-of-00001.parquet"]
    assert [p.name for p in D.chat_files(out, "train")] == ["train-00000-of-00002.parquet",
                                                             "train-00001-of-00002.parquet"]

    lima = [{"conversations": ["How?", "Like this.", "And then?", "Then that."], "source": "x"},
            {"conversations": ["Why?", "Because."], "source": "y"}]
    host_repo(hub, monkeypatch, "GAIR/lima", {"train.jsonl": "".join(json.dumps(r) + "\n" for r in lima).encode(),
                                             "test.jsonl": b'{"conversations": ["no answer"]}\n'})
    out = dl.download_chat("lima", tmp_path / "lima")
    assert sorted(p.name for p in out.iterdir()) == [dl.LISTING, "train.jsonl", "train.parquet"]
    rows = pq.read_table(out / "train.parquet").column("conversations").to_pylist()
    assert rows == [r["conversations"] for r in lima]
    assert D.conversation_messages(rows[1]) == [{"role": "user", "content": "Why?"},
                                                 {"role": "assistant", "content": "Because."}]
    with pytest.raises(FileNotFoundError, match="no val conversation files"):
        D.chat_files(out, "val")
    with pytest.raises(ValueError, match="unknown conversation dataset 'alpaca'"):
        dl.download_chat("alpaca", tmp_path / "x")


def test_the_cli_exits_1_with_one_line_that_says_what_to_do(hub, tmp_path, capsys):
    hub.status = 401
    with pytest.raises(SystemExit) as exit_info:
        dl.main(["shards", "--shards", "2", "--dataset", REPO, "--data_dir", str(tmp_path / "data")])
    err = capsys.readouterr().err
    assert exit_info.value.code == 1 and err.startswith("prepare.py shards: error: ") and "HF_TOKEN" in err
    assert err.count("\n") == 1 and not (tmp_path / "data").exists()


def test_download_py_lists_a_repo_with_its_hashes_and_gets_the_files_named_byte_identical(hub, tmp_path, capsys):
    """`python prepare.py list REPO` prints each file's path, size and sha256 (git blob id for a file kept in git);
    `get REPO PATHS --out DIR` puts exactly those files in DIR."""
    dl.main(["list", REPO])
    listed = sorted(line.split("\t") for line in capsys.readouterr().out.splitlines())
    assert listed == sorted([path, str(len(data)), hashlib.sha256(data).hexdigest() if path.endswith(".parquet")
                             else f"git {git_blob_id(data)}"] for path, data in hub.files.items())
    names = ["shard_00003.parquet", "README.md"]
    dl.main(["get", REPO, *names, "--out", str(tmp_path / "out")])
    assert capsys.readouterr().out == f"prepare.py get: 2 files of {REPO} in {tmp_path / 'out'}\n"
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == sorted(names)
    assert all((tmp_path / "out" / name).read_bytes() == hub.files[name] for name in names)


def stop(hub):
    """The hub and its CDN go away: every later request to them is refused (connection refused, not an HTTP error)."""
    for server in hub.servers:
        server.shutdown()
        server.server_close()


def test_a_rerun_with_every_file_on_disk_and_matching_needs_no_hub(hub, tmp_path, monkeypatch):
    out = tmp_path / "data"
    first = dl.download_shards(REPO, 2, out)
    conv = [[{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]]
    files = {"data/all/train-00000-of-00001.parquet": parquet_bytes(tmp_path, "t", "messages", conv),
             "data/all/test-00000-of-00001.parquet": parquet_bytes(tmp_path, "v", "messages", conv)}
    host_repo(hub, monkeypatch, "HuggingFaceTB/smoltalk", files)
    chat_out = dl.download_chat("smoltalk", tmp_path / "smoltalk")
    monkeypatch.setitem(globals(), "REPO", "org/fineweb-mini")
    stop(hub)
    hub.log.clear()
    assert dl.download_shards(REPO, 2, out) == first  # offline: the listing saved at download time, hashes checked
    assert dl.download_shards(REPO, 1, out) == [first[0], first[-1]]  # fewer shards: still all on disk
    assert dl.download_chat("smoltalk", chat_out) == chat_out
    assert hub.log == []
    # a file changed on disk since (one flipped byte, same size): the hub is needed, and its absence is an error
    data = bytearray(first[1].read_bytes())
    data[len(data) // 2] ^= 0xFF
    first[1].write_bytes(bytes(data))
    with pytest.raises(RuntimeError, match="could not list"):
        dl.download_shards(REPO, 2, out)
    with pytest.raises(RuntimeError, match="could not list"):  # more shards than are on disk: the hub too
        dl.download_shards(REPO, 3, tmp_path / "other")


def test_check_only_lists_a_chat_dataset_without_downloading_and_a_gated_one_fails_at_once(hub, tmp_path, monkeypatch):
    conv = [[{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]]
    host_repo(hub, monkeypatch, "HuggingFaceTB/smoltalk",
              {"data/all/train-00000-of-00001.parquet": parquet_bytes(tmp_path, "t", "messages", conv)})
    out = dl.download_chat("smoltalk", tmp_path / "smoltalk", check_only=True)
    assert requests_to(hub, "/tree/") and not requests_to(hub, "/resolve/") and not list(out.glob("*.parquet"))
    hub.status = 401  # gated: the error says what to do, before anything else has run
    with pytest.raises(RuntimeError, match="HF_TOKEN"):
        dl.download_chat("smoltalk", tmp_path / "gated", check_only=True)


def table_bytes(tmp_path, name, rows):
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / name)
    return (tmp_path / name).read_bytes()


def test_task_sets_come_through_the_hub_verified_and_read_as_conversations(hub, tmp_path, monkeypatch):
    """MMLU auxiliary_train (its rows nested under `train`), ARC and GSM8K: only their training files are fetched
    (their test files are chat_eval's), each checked against the listing, and each row reads as the conversation
    ChatCORE asks for: a letter, or the calculator's calls and the final '#### N'."""
    mmlu = [{"train": {"question": "2+2?", "subject": "math", "choices": ["3", "4", "5", "6"], "answer": 1}}]
    files = {"all/auxiliary_train-00000-of-00001.parquet": table_bytes(tmp_path, "m", mmlu),
             "all/test-00000-of-00001.parquet": table_bytes(tmp_path, "mt", mmlu)}
    host_repo(hub, monkeypatch, "cais/mmlu", files)
    hub.faults = {"all/auxiliary_train-00000-of-00001.parquet": ["drop", "500"]}
    out = dl.download_chat("mmlu", tmp_path / "mmlu")
    assert sorted(p.name for p in out.iterdir()) == [dl.LISTING, "auxiliary_train-00000-of-00001.parquet"]
    assert (out / "auxiliary_train-00000-of-00001.parquet").read_bytes() == files[
        "all/auxiliary_train-00000-of-00001.parquet"]
    [path] = D.chat_files(out, "train")
    assert D.chat_rows(path, 0) == [[
        {"role": "user", "content": "Multiple Choice question: 2+2?\n- 3=A\n- 4=B\n- 5=C\n- 6=D\n\nRespond only with "
                                    "the letter of the correct answer."}, {"role": "assistant", "content": "B"}]]

    arc = [{"id": "x", "question": "Sky?", "choices": {"text": ["red", "blue", "green"], "label": ["1", "2", "3"]},
            "answerKey": "2"}, {"id": "y", "question": "Bad?", "choices": {"text": ["a"], "label": ["A"]},
                                "answerKey": "E"}]
    host_repo(hub, monkeypatch, "allenai/ai2_arc", {"ARC-Easy/train-00000-of-00001.parquet": table_bytes(
        tmp_path, "a", arc), "ARC-Easy/test-00000-of-00001.parquet": table_bytes(tmp_path, "at", arc)})
    out = dl.download_chat("arc-easy", tmp_path / "arc")
    rows = D.chat_rows(out / "train-00000-of-00001.parquet", 0)
    assert rows[0][1] == {"role": "assistant", "content": "2"} and "- blue=2\n" in rows[0][0]["content"]
    assert rows[1] == "answerKey 'E' is not among the labels ['A']"  # skipped as malformed by the loader

    answer = "Weng earns 12/60 = $<<12/60=0.2>>0.2 per minute.\nShe earned 0.2 x 50 = $<<0.2*50=10>>10.\n#### 10"
    gsm = [{"question": "How much did she earn?", "answer": answer}]
    host_repo(hub, monkeypatch, "openai/gsm8k", {"main/train-00000-of-00001.parquet": table_bytes(tmp_path, "g", gsm),
                                                 "socratic/train-00000-of-00001.parquet": table_bytes(tmp_path, "s",
                                                                                                      gsm)})
    out = dl.download_chat("gsm8k", tmp_path / "gsm8k")
    assert sorted(p.name for p in out.iterdir()) == [dl.LISTING, "train-00000-of-00001.parquet"]
    [[user, assistant]] = D.chat_rows(out / "train-00000-of-00001.parquet", 0)
    assert user == {"role": "user", "content": "How much did she earn?"}
    assert assistant["content"] == [
        {"type": "text", "text": "Weng earns 12/60 = $"}, {"type": "python", "text": "12/60"},
        {"type": "python_output", "text": "0.2"}, {"type": "text", "text": "0.2 per minute.\nShe earned 0.2 x 50 = $"},
        {"type": "python", "text": "0.2*50"}, {"type": "python_output", "text": "10"},
        {"type": "text", "text": "10.\n#### 10"}]


def test_the_identity_set_is_every_question_with_every_answer_of_the_one_file(tmp_path):
    spec = tmp_path / "identity.json"
    spec.write_text(json.dumps({"name": "Quill", "questions": ["Who are you?", "Your name?"],
                                "answers": ["I am {name}.", "{name} here, a small model."]}))
    out = P.write_identity(tmp_path / "identity", spec)
    rows = pq.read_table(out / "train.parquet").column("messages").to_pylist()
    assert [(r[0]["content"], r[1]["content"]) for r in rows] == [
        ("Who are you?", "I am Quill."), ("Who are you?", "Quill here, a small model."), ("Your name?", "I am Quill."),
        ("Your name?", "Quill here, a small model.")]
    spec.write_text(json.dumps({"name": "Quill", "questions": ["Who?"]}))
    with pytest.raises(ValueError, match="not a usable identity file .*\"answers\""):
        P.write_identity(tmp_path / "identity", spec)
