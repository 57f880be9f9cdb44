"""dev/hub_stand_in.py serves the gpu plan as the hub does: its FineWeb-Edu text trains the plan's default vocabulary,
and every answer about a repository's file carries the headers huggingface_hub reads (1.x refuses one without
X-Repo-Commit, and follows a redirect to the same host name: the stand-in's "CDN")."""
import hashlib
import http.client
import io
import re
from urllib.parse import urlsplit

import pyarrow.parquet as pq

import hub_stand_in
import prepare
import tokenizer
from prepare import download_hub_files


def test_one_stand_in_shard_trains_the_default_65536_vocabulary(tmp_path, capsys):
    """The rehearsal's tokenizer stage as speedrun.sh runs it (`prepare.py tokenizer`, its default --vocab_size, the
    rehearsal's --max_chars) on the first shard and the validation shard, the two the rehearsal downloads first: all
    65,536 ids are trained (rustbpe stops early, and dataset.py refuses, when the text allows fewer merges), and a
    made-up place name is one token."""
    files = hub_stand_in.build_files(shards=2, chat_rows=8)
    data = tmp_path / "corpus"
    data.mkdir()
    for i in range(2):
        (data / f"shard_{i:05d}.parquet").write_bytes(files[f"{hub_stand_in.FINEWEB}/shard_{i:05d}.parquet"])
    prepare.main(["tokenizer", "--data_dir", str(data), "--out", str(tmp_path / "tok"), "--max_chars", "20000000"])
    assert "vocab size: 65536 (256 bytes + 65271 merges + 9 special tokens)" in capsys.readouterr().out
    tok = tokenizer.Tokenizer.load(tmp_path / "tok")
    assert tok.vocab_size == 65536
    place = hub_stand_in.place_names()[0]
    texts = pq.read_table(data / "shard_00000.parquet").column("text").to_pylist()
    assert sum(len(re.findall(rf"\b{place}\b", t)) for t in texts) == 1  # each shard names each place once
    assert len(tok.encode(f" {place}")) == 1
    sentence = f"The river carries fresh water to {place}."
    assert tok.decode(tok.encode(sentence)) == sentence


def request(url, method):
    """(status, headers, body) of one request, redirects not followed."""
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=30)
    try:
        conn.request(method, parts.path)
        response = conn.getresponse()
        return response.status, dict(response.getheaders()), response.read()
    finally:
        conn.close()


def test_every_resolve_answer_carries_the_repo_commit_and_the_file_s_headers(tmp_path, monkeypatch):
    """HEAD and GET of every repository file's resolve URL, and of the redirect's target: X-Repo-Commit, an ETag and
    Content-Length on each; an LFS file's sha256 and size (X-Linked-Etag, X-Linked-Size) on each of its answers, its
    bytes from the target; a git file's bytes from the resolve URL, its blob id as ETag. Then prepare.py fetches
    ARC's test file through huggingface_hub, checked against the listing's sha256."""
    files = hub_stand_in.build_files(shards=2, chat_rows=8)
    hub, servers, url = hub_stand_in.start(files)
    try:
        repo_files = {name: data for name, data in files.items() if name != "eval_bundle.zip"}
        repos = {"/".join(name.split("/")[:2]) for name in repo_files}
        assert {"allenai/ai2_arc", "karpathy/fineweb-edu-100b-shuffle", "openai/openai_humaneval"} <= repos
        answers = 0
        for name, data in repo_files.items():
            repo, path = "/".join(name.split("/")[:2]), "/".join(name.split("/")[2:])
            lfs = name.endswith(".parquet")
            for method in ("HEAD", "GET"):
                status, headers, body = request(f"{url}/datasets/{repo}/resolve/main/{path}", method)
                targets = [(status, headers, body)]
                if lfs:
                    assert status == 302 and headers["Location"] == f"{hub.cdn_url}/cdn/{name}"
                    assert headers["Content-Length"] == "0" and body == b""
                    pointer = hub_stand_in.lfs_pointer(data)
                    assert headers["ETag"] == f'"{hub_stand_in.git_blob_id(pointer)}"'
                    assert hub_stand_in.tree_entry(path, data)["oid"] == hub_stand_in.git_blob_id(pointer)
                    targets.append(request(headers["Location"], method))
                else:
                    assert status == 200 and headers["ETag"] == f'"{hub_stand_in.git_blob_id(data)}"'
                for status, headers, body in targets:
                    answers += 1
                    assert headers["X-Repo-Commit"] == hub_stand_in.COMMIT, (name, method, status)
                    assert headers["ETag"].startswith('"') and headers["ETag"].endswith('"')
                    if lfs:
                        assert headers["X-Linked-Etag"] == f'"{hashlib.sha256(data).hexdigest()}"'
                        assert headers["X-Linked-Size"] == str(len(data))
                    else:
                        assert "X-Linked-Etag" not in headers and "X-Linked-Size" not in headers
                    if status == 200:
                        assert headers["Content-Length"] == str(len(data))
                        assert body == (data if method == "GET" else b"")
        assert answers == 2 * sum(2 if name.endswith(".parquet") else 1 for name in repo_files)
        # the CORE bundle is a plain URL, not a repository's file: no hub headers
        status, headers, body = request(f"{url}/eval_bundle.zip", "GET")
        assert status == 200 and body == files["eval_bundle.zip"] and "X-Repo-Commit" not in headers

        monkeypatch.setenv("HF_ENDPOINT", url)
        monkeypatch.setenv("NO_PROXY", "127.0.0.1")
        monkeypatch.delenv("HF_TOKEN", raising=False)
        [got] = download_hub_files("allenai/ai2_arc", ["ARC-Easy/test-00000-of-00001.parquet"], tmp_path / "arc")
        assert got.read_bytes() == files["allenai/ai2_arc/ARC-Easy/test-00000-of-00001.parquet"]
        assert pq.read_table(io.BytesIO(got.read_bytes())).num_rows == 60
    finally:
        hub_stand_in.stop(servers)
