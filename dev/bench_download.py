"""The download benchmark of the finished migration to huggingface_hub (moved out of bench.py, dev/LOG.md).

    python dev/bench_download.py --trials 5

`download_shards` of 16 training shards + 1 validation shard (~4 MB parquet each) from a hub stand-in on loopback, 4
workers: shards/s and MB/s of the old client (dataset.py at commit 1d71acd, its own HTTP code on requests, read with
`git show`) and of the new one (huggingface_hub), median of --trials rounds, alternating. Loopback measures client
overhead only (the server runs in the same process, a share of the same cores), not the network nor the hub's Xet
storage, which only the new client can use.
"""
import argparse
import hashlib
import importlib.util
import io
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pyarrow as pa
import pyarrow.parquet as pq
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
import dataset
import distributed

OLD_DOWNLOAD_CLIENT = "1d71acd"  # the last commit whose dataset.py downloads with its own HTTP code on requests


def hub_standin(files):
    """A loopback server answering what both clients ask: the tree API (one page, LFS sha256s) and resolve URLs, HEAD
    and GET, with the headers hf_hub_download reads (X-Repo-Commit, X-Linked-Etag, X-Linked-Size). No faults, so no
    Range: nothing is resumed."""
    shas = {name: hashlib.sha256(data).hexdigest() for name, data in files.items()}
    tree = json.dumps([{"type": "file", "path": name, "size": len(data), "oid": "0" * 40,
                        "lfs": {"oid": shas[name], "size": len(data), "pointerSize": 134}}
                       for name, data in files.items()]).encode()

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive, as the hub and its CDN

        def log_message(self, *args):
            pass

        def do_GET(self):
            path = unquote(urlsplit(self.path).path)
            name = path.rsplit("/", 1)[-1]
            if path.startswith("/api/"):
                body, headers = tree, {"Content-Type": "application/json"}
            else:
                body, headers = files[name], {"X-Repo-Commit": "0" * 40, "ETag": f'"{shas[name]}"',
                                              "X-Linked-Etag": f'"{shas[name]}"', "X-Linked-Size": str(len(files[name]))}
            self.send_response(200)
            for key, value in {**headers, "Content-Length": str(len(body))}.items():
                self.send_header(key, value)
            self.end_headers()
            if self.command == "GET":
                self.wfile.write(body)

        do_HEAD = do_GET

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def old_download_client(tmp):
    """dataset.py as of OLD_DOWNLOAD_CLIENT, as a module of its own (written into tmp)."""
    path = Path(tmp) / f"dataset_{OLD_DOWNLOAD_CLIENT}.py"
    path.write_text(subprocess.run(["git", "show", f"{OLD_DOWNLOAD_CLIENT}:dataset.py"], cwd=ROOT,
                                   capture_output=True, text=True, check=True).stdout)
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def shard_bytes(mb=4):
    """A parquet shard of random hex text: every shard distinct, nothing compresses."""
    texts = [os.urandom(2048).hex() for _ in range(mb * 1000 * 1000 // 4096)]
    buf = io.BytesIO()
    pq.write_table(pa.table({"text": texts}), buf, compression="none")
    return buf.getvalue()


def bench_download(trials):
    files = {f"shard_{i:05d}.parquet": shard_bytes() for i in range(17)}
    total_mb = sum(map(len, files.values())) / 1e6
    server = hub_standin(files)
    os.environ.update(HF_ENDPOINT=f"http://127.0.0.1:{server.server_address[1]}", NO_PROXY="127.0.0.1")
    with tempfile.TemporaryDirectory() as tmp:
        clients = {f"old (requests, {OLD_DOWNLOAD_CLIENT})": old_download_client(tmp), "new (huggingface_hub)": dataset}
        seconds = {label: [] for label in clients}
        for trial in range(trials):
            for label, client in clients.items():
                out = Path(tmp) / f"{trial}{label[:3]}"
                start = time.perf_counter()
                client.download_shards("bench/shards", 16, out, workers=4)
                seconds[label].append(time.perf_counter() - start)
                assert all((out / name).read_bytes() == data for name, data in files.items())
    server.shutdown()
    for label, times in seconds.items():
        median = sorted(times)[len(times) // 2]
        print(f"download {label:26s}: {len(files) / median:6.1f} shards/s, {total_mb / median:7.1f} MB/s (median of "
              f"{trials}; {len(files)} shards, {total_mb:.0f} MB, 4 workers, loopback)")
    print(f"download: CPU {distributed.device_name(torch.device('cpu'))}, {os.cpu_count()} cores")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trials", type=int, default=5, help="rounds, the median is reported (default: %(default)s)")
    bench_download(parser.parse_args(argv).trials)


if __name__ == "__main__":
    main()
