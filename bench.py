"""Benchmarks: figures printed with their targets. Not tests; nothing here is timed inside pytest.

    python bench.py              # every benchmark
    python bench.py train decode # a chosen few: train, decode, build, tokenizer, loader, pretrain, core_eval, sft,
                                 # download, cpu, chat, fsdp, quality

train   forward+backward tokens/s of a preset on this machine: eager fp32, torch.compile fp32, compile + bf16 autocast.
        Target: compile + bf16 >= 2x eager fp32.
decode  generation tokens/s with the KV cache vs recomputing the whole context every token, context ending at the
        preset's sequence length (256 for tiny). Target: >= 5x.
build   seconds to construct llama3-1b on the meta device and materialize + initialize it on the device.
tokenizer  seconds to train a vocab-8192 BPE tokenizer on the training split of the real-text corpus at --corpus
        (../shared/corpus/realtext: ~16 MB of training text; skipped if absent), reading the shards included, and
        bytes/token on its validation split. Target: <= 10 s for 50 MB (projected from the measured MB/s).
pretrain  `python pretrain.py` itself on the demo world (30 steps, micro-batch 16): tokens/s from its metrics.jsonl,
        eager fp32 and compile + bf16, and MFU against this device's measured matmul throughput.
core_eval  `python core_eval.py` on the demo world's 8 tasks (513 items) for a --preset model (vocab 1024, untrained:
        the work per item does not depend on the weights): items/s from its results.json, batch_items 1 and 8.
        --bundle DIR evaluates that bundle instead (the real one: nanochat's eval_bundle.zip, unzipped).
loader  one process's streaming loader (read + tokenize + pack) over one epoch of the same corpus at T = 256, 1024,
        2048: tokens/s (target >= 1M) and the share of document tokens cropped, i.e. moved to a later row as a
        BOS-led piece, cut off from their document's start (target <= 20% at T = 2048; nothing is discarded).
cpu     `python pretrain.py` at nanochat's tiny CPU shape (4 layers, width 256, 4 heads of 64, T 256, 8 x 256 tokens a
        step, vocab 8192 trained on --corpus) on the real-text corpus: eager and compiled, fp32 and (where native) bf16,
        Muon and AdamW; tok/s the median of steps 11-40 from its metrics.jsonl, with the share of step time waiting
        for data. Then, in-process, the Muon step's share of an eager fp32 step. Targets (2 cores): compiled Muon
        >= 2x nanochat's tok/s on the same machine; the Muon step <= 15% of the step.
chat    chat.py's second turn of a 2,000-token conversation (a --preset model with sequence_len 2304, random weights):
        time to the first token with the KV cache kept vs re-prefilling the history (target >= 5x); and greedy decode
        tok/s of chat.py's decode paths (lean, static, compiled) vs generate() at the preset's shape (target: lean
        >= 1.5x generate(), measured in the same run).
fsdp    `--preset` (default of this benchmark: llama3-1b) sharded by FSDP2 over 2 CPU processes (torchrun,
        gloo, one thread each), micro-batch 1 x --fsdp_seq tokens of random ids, Muon, bf16 where native: seconds per
        step (steps after the first) and each rank's peak resident memory, against model.py's estimate per rank
        ((weights + gradients + optimizer state) / 2 + activations + transient).
quality `python pretrain.py` at nanochat's tiny CPU shape (as cpu above; compiled, bf16 where native) for 300 steps of
        2,048 tokens (614,400 tokens), on the real-text corpus: the final validation bpb over the validation shard's
        first 524,288 tokens, per row of QUALITY_VARIANTS (the defaults, and the defaults with one issue-16 change
        undone) and per seed (--seeds 3), --quality_jobs runs at a time; the median per row. README: Model quality.
gpu     (not part of "all") the GPU battery: pretraining tok/s, MFU and peak memory against model.py's estimate at
        d20, d12 and d26 beside nanochat's own scripts/base_train.py at the same shape and batch; validation bpb at
        d12 after the same tokens at 2^19 and 2^17 tokens a step, beside nanochat's; the demo plan end to end; chat
        decode tok/s. `python bench.py gpu_prepare --nanochat_mirror DIR --corpus DIR` first fills .bench/ (what a
        GPU machine without network needs); `python bench.py gpu --rows ...` on the GPU writes gpu_bench.json and
        gpu_bench.md to --out; `python bench.py gpu --dry_run` runs every row at toy size on the CPU.
download  `download_shards` of 16 training shards + 1 validation shard (~4 MB parquet each) from a hub stand-in on
        loopback, 4 workers: shards/s and MB/s of the old client (dataset.py at commit 1d71acd, its own HTTP code on
        requests, read with `git show`) and of the new one (huggingface_hub), median of --trials rounds, alternating.
        Loopback measures client overhead only (the server runs in the same process, a share of the same cores),
        not the network nor the hub's Xet storage, which only the new client can use.
"""
import argparse
import hashlib
import importlib.util
import io
import itertools
import json
import math
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace
from urllib.parse import unquote, urlsplit

import pyarrow as pa
import pyarrow.parquet as pq
import torch

import checkpoint
import common
import dataset
import distributed
import optim
import train_loop
from dataset import iter_texts
from demo import write_demo
from loader import text_loader
from model import (
    DEPTH_ASPECT,
    DEPTH_HEAD_DIM,
    KVCache,
    autocast_context,
    build_model,
    config_from_preset,
    flops_per_token,
    generate,
    memory_estimate,
    num_params,
)
from tokenizer import bytes_per_token, counting, train_tokenizer


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def bench_train(args, device):
    config = config_from_preset(args.preset)
    torch.manual_seed(0)
    idx = torch.randint(0, config.vocab_size, (args.batch, config.sequence_len), device=device)
    targets = idx.roll(-1, 1)
    tokens = idx.numel()
    results = {}
    for label, compiled, dtype in (("eager fp32", False, "float32"), ("compile fp32", True, "float32"),
                                   ("compile + bf16", True, "bfloat16")):
        model = build_model(config, device)
        step = torch.compile(model) if compiled else model
        warmup_start = time.perf_counter()
        for _ in range(args.warmup):  # the first compiled call compiles; later ones are steady state
            with autocast_context(device.type, dtype):
                step(idx, targets).backward()
        sync(device)
        warmup_s = time.perf_counter() - warmup_start
        start = time.perf_counter()
        for _ in range(args.steps):
            with autocast_context(device.type, dtype):
                step(idx, targets).backward()
        sync(device)
        seconds = time.perf_counter() - start
        results[label] = tokens * args.steps / seconds
        print(f"train {args.preset} ({num_params(config):,} params) {label:15s}: {results[label]:9,.0f} tok/s "
              f"(batch {args.batch} x {config.sequence_len}, {args.steps} steps after {args.warmup} warmup "
              f"taking {warmup_s:.1f} s)")
    ratio = results["compile + bf16"] / results["eager fp32"]
    print(f"train: compile + bf16 / eager fp32 = {ratio:.2f}x (target >= 2x: {'met' if ratio >= 2 else 'MISSED'})")


def bench_decode(args, device):
    config = config_from_preset(args.preset)
    torch.manual_seed(0)
    model = build_model(config, device).eval()
    new_tokens = args.decode_tokens
    prompt = torch.randint(0, config.vocab_size, (1, config.sequence_len - new_tokens), device=device)

    def run(cached):
        """Greedy decoding of new_tokens after the prompt; returns (tokens/s excluding the prefill, token ids)."""
        sync(device)
        cache = KVCache(config, 1, config.sequence_len) if cached else None
        logits = model(prompt, kv_cache=cache, last_only=True)[:, -1]
        sync(device)
        start, seq = time.perf_counter(), prompt
        for _ in range(new_tokens):
            next_id = logits.argmax(-1, keepdim=True)
            seq = torch.cat([seq, next_id], 1)
            logits = model(next_id, kv_cache=cache)[:, -1] if cached else model(seq, last_only=True)[:, -1]
        sync(device)
        return new_tokens / (time.perf_counter() - start), seq

    with torch.inference_mode():
        run(True), run(False)  # warm up
        trials = [(run(False), run(True)) for _ in range(args.trials)]  # interleaved, so load drifts hit both
    ratios = sorted(cached[0] / recompute[0] for recompute, cached in trials)
    median = ratios[len(ratios) // 2]
    same = all(torch.equal(recompute[1], cached[1]) for recompute, cached in trials)
    for label, index in (("recompute", 0), ("kv cache", 1)):
        rates = sorted(trial[index][0] for trial in trials)
        print(f"decode {args.preset} {label:10s}: {rates[len(rates) // 2]:8,.0f} tok/s median of {args.trials} "
              f"(range {rates[0]:,.0f}-{rates[-1]:,.0f}; {new_tokens} tokens, context {prompt.size(1)} -> "
              f"{config.sequence_len})")
    print(f"decode: kv cache / recompute = {median:.1f}x median (range {ratios[0]:.1f}-{ratios[-1]:.1f}; target >= 5x: "
          f"{'met' if median >= 5 else 'MISSED'}); greedy tokens identical: {same}")


def bench_chat(args, device):
    """chat.py's two claims on random weights (timing does not depend on them): a second turn of a 2,000-token
    conversation starts sooner when the cache is kept than when the whole history is prefilled again, and its decode
    step is faster than generate()'s."""
    torch.manual_seed(0)
    config = config_from_preset(args.preset, {"sequence_len": 2304})
    model = build_model(config, device).eval()
    history, turn = torch.randint(0, config.vocab_size, (1, 2000), device=device), torch.randint(0, 1000, (1, 20))

    def first_token(kept):
        """Seconds from a 20-token turn to its first sampled token: prefill the turn alone (cache kept) or the
        history + turn (nanochat's CLI re-prefills every turn)."""
        cache = KVCache(config, 1, config.sequence_len)
        if kept:
            model(history, kv_cache=cache)
        sync(device)
        start = time.perf_counter()
        ids = turn.to(device) if kept else torch.cat([history, turn.to(device)], 1)
        model(ids, kv_cache=cache, last_only=True)[:, -1].argmax(-1).item()
        return time.perf_counter() - start

    with torch.inference_mode():
        first_token(True), first_token(False)
        trials = [(first_token(True), first_token(False)) for _ in range(args.trials)]
    kept, again = (sorted(t[i] for t in trials)[len(trials) // 2] for i in (0, 1))
    ratio = sorted(b / a for a, b in trials)[len(trials) // 2]
    print(f"chat second turn (20 tokens after 2,000; {args.preset} with sequence_len 2304, random weights): first "
          f"token after {1000 * kept:.1f} ms with the cache kept, {1000 * again:.1f} ms re-prefilling the history; "
          f"{ratio:.1f}x median of {args.trials} interleaved (target >= 5x: {'met' if ratio >= 5 else 'MISSED'})")
    bench_chat_decode(args, device)


def bench_chat_decode(args, device, decodes=("lean", "static", "compiled")):
    """Greedy decode tok/s at the preset's own shape, context 192 -> 256 as in `decode`: generate() against
    chat.py's decode paths (fp32), interleaved trials, the same tokens checked. Returns {path: median tok/s}."""
    import chat  # here: the other benchmarks do not need it
    torch.manual_seed(0)
    config = config_from_preset(args.preset)
    model = build_model(config, device).eval()
    n = args.decode_tokens
    prompt = torch.randint(0, config.vocab_size, (config.sequence_len - n - 1,)).tolist()

    def with_generate():
        tokens = generate(model, prompt, n + 1, temperature=0)
        out = [next(tokens)]  # the prefill's token
        start = time.perf_counter()
        out += list(tokens)
        return n / (time.perf_counter() - start), out

    def with_chat(conv):
        def run():
            conv.ids, conv.cache.pos = [], 0
            logits = conv.forward(prompt)
            start, out = time.perf_counter(), []
            with torch.inference_mode():
                for _ in range(n + 1):
                    token = logits.argmax(-1, keepdim=True)
                    out.append(token.item())
                    if len(out) <= n:
                        logits = conv.step(token)
            return n / (time.perf_counter() - start), out
        return run

    tok = SimpleNamespace(special_tokens={"<|assistant_end|>": 0}, special_id=lambda name: 0, bos_id=0)
    paths = {"generate()": with_generate}
    for decode in decodes:
        start = time.perf_counter()
        paths[decode] = with_chat(chat.Conversation(model, tok, True, decode))
        paths[decode]()  # warm up; compiles the compiled one
        if decode == "compiled":
            print(f"chat decode compiled: first call (compilation) {time.perf_counter() - start:.1f} s")
    results = {name: [] for name in paths}
    for _ in range(args.trials):
        for name, run in paths.items():
            results[name].append(run())
    base = sorted(r[0] for r in results["generate()"])[args.trials // 2]
    for name, runs in results.items():
        rate = sorted(r[0] for r in runs)[args.trials // 2]
        same = all(r[1] == results["generate()"][0][1] for r in runs)
        print(f"chat decode {args.preset} {name:11s}: {rate:6,.0f} tok/s median of {args.trials} ({rate / base:.2f}x "
              f"generate(); greedy tokens identical: {same})")
    lean = sorted(r[0] for r in results["lean"])[args.trials // 2]
    verdict = "met" if lean >= 1.5 * base else "MISSED"
    print(f"chat decode: lean / generate() = {lean / base:.2f}x (target >= 1.5x: {verdict}; generate() recorded at "
          f"276 tok/s in the README's decode row, an earlier session)")
    return {name: sorted(r[0] for r in runs)[args.trials // 2] for name, runs in results.items()}


def bench_build(args, device):
    config = config_from_preset("llama3-1b")
    start = time.perf_counter()
    model = build_model(config, device="meta")
    meta_s = time.perf_counter() - start
    start = time.perf_counter()
    model = build_model(config, device=device)
    sync(device)
    real_s = time.perf_counter() - start
    count = sum(p.numel() for p in model.parameters())
    print(f"build llama3-1b: meta {meta_s:.2f} s, materialize + init on {device} {real_s:.1f} s, {count:,} params "
          f"({math.fsum(p.numel() * p.element_size() for p in model.parameters()) / 2**30:.2f} GiB fp32)")


def bench_tokenizer(args, device):
    corpus = Path(args.corpus)
    if not corpus.is_dir():
        print(f"tokenizer: skipped, no corpus at {corpus} (pass --corpus DIR: parquet shards, the last one validation)")
        return
    stats = {"docs": 0, "chars": 0, "bytes": 0}
    start = time.perf_counter()  # streaming the shards is part of training, as in `python tokenizer.py train`
    tokenizer = train_tokenizer(counting(iter_texts(corpus, "train"), stats), 8192)
    seconds = time.perf_counter() - start
    mb = stats["bytes"] / 1e6
    projected = 50 / (mb / seconds)
    print(f"tokenizer: trained vocab {tokenizer.vocab_size} on {stats['docs']:,} documents, {stats['chars']:,} "
          f"characters, {mb:.1f} MB in {seconds:.2f} s: {mb / seconds:.1f} MB/s")
    print(f"tokenizer: projected {projected:.1f} s for 50 MB (target <= 10 s: {'met' if projected <= 10 else 'MISSED'})")
    print(f"tokenizer: bytes/token on the validation split: {bytes_per_token(tokenizer, iter_texts(corpus, 'val')):.3f}")


def bench_loader(args, device):
    corpus = Path(args.corpus)
    if not corpus.is_dir():
        print(f"loader: skipped, no corpus at {corpus} (pass --corpus DIR: parquet shards, the last one validation)")
        return
    tokenizer = train_tokenizer(iter_texts(corpus, "train"), 8192)
    for seq_len in (256, 1024, 2048):
        loader = text_loader(corpus, "train", tokenizer, 16, seq_len, device=device)
        next(loader)  # the first batch waits for the first row group: count from the steady state
        tokens, start = 0, time.perf_counter()
        while loader.state["epoch"] == 0:
            inputs, _ = next(loader)
            tokens += inputs.numel()
        rate = tokens / (time.perf_counter() - start)
        stats = loader.state["stats"]
        loader.close()
        cropped = stats["cropped"] / stats["doc_tokens"]
        target = f" (target <= 20%: {'met' if cropped <= 0.2 else 'MISSED'})" if seq_len == 2048 else ""
        print(f"loader T={seq_len:4d}: {rate:10,.0f} tok/s (target >= 1M: {'met' if rate >= 1e6 else 'MISSED'}), "
              f"cropped {100 * cropped:.1f}% of document tokens{target}, none discarded; one epoch of "
              f"{stats['docs']:,} documents, batch 16")


def matmul_peak(device, dtype, n=2048, reps=10):
    """Measured dense matmul FLOP/s: the achievable peak of this device, for devices the MFU table does not list."""
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    a @ b
    sync(device)
    start = time.perf_counter()
    for _ in range(reps):
        a @ b
    sync(device)
    return 2 * n ** 3 * reps / (time.perf_counter() - start)


def bench_pretrain(args, device):
    """The real command: pretrain.py on the demo world, throughput from its own metrics.jsonl."""
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        write_demo(tmp / "demo")
        train_tokenizer(iter_texts(tmp / "demo" / "pretrain", "train"), 1024).save(tmp / "tokenizer")
        config = config_from_preset(args.preset, {"vocab_size": 1024})
        for label, dtype, compiled in (("eager fp32", "float32", "false"), ("compile + bf16", "bfloat16", "true")):
            cmd = [sys.executable, str(Path(__file__).parent / "pretrain.py"), "--preset", args.preset,
                   "--data_dir", str(tmp / "demo" / "pretrain"), "--tokenizer", str(tmp / "tokenizer"),
                   "--runs_dir", str(tmp / "runs"), "--run_name", label.replace(" ", ""), "--steps", "30",
                   "--micro_batch", "16", "--eval_every", "0", "--bpb_tokens", "4096", "--dtype", dtype,
                   "--compile", compiled, "--ckpt_every", "1000"]
            subprocess.run(cmd, check=True, capture_output=True)
            records = [json.loads(line) for line in
                       (tmp / "runs" / label.replace(" ", "") / "metrics.jsonl").read_text().splitlines()]
            rates = sorted(r["tok_per_s"] for r in records if "tok_per_s" in r and r["step"] > 5)
            rate = rates[len(rates) // 2]
            peak = matmul_peak(device, torch.bfloat16 if dtype == "bfloat16" else torch.float32)
            print(f"pretrain {args.preset} {label:15s}: {rate:8,.0f} tok/s (median of steps 6-30, micro-batch 16 x "
                  f"{config.sequence_len}); MFU {100 * rate * flops_per_token(config) / peak:.1f}% of this "
                  f"device's measured {dtype} matmul peak {peak / 1e9:,.0f} GFLOP/s (the run itself logs MFU "
                  f"'unknown': no rated peak for '{'cpu' if device.type == 'cpu' else torch.cuda.get_device_name()}')")


def bench_sft(args, device):
    """sft.py on the demo conversations from an untrained checkpoint of --preset: tokens/s from its metrics.jsonl and
    the shares of supervised and padding positions from its done.json."""
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        write_demo(tmp / "demo")
        train_tokenizer(iter_texts(tmp / "demo" / "pretrain", "train"), 1024).save(tmp / "tokenizer")
        script = Path(__file__).parent
        subprocess.run([sys.executable, str(script / "pretrain.py"), "--preset", args.preset, "--data_dir",
                        str(tmp / "demo" / "pretrain"), "--tokenizer", str(tmp / "tokenizer"), "--runs_dir",
                        str(tmp / "runs"), "--run_name", "base", "--steps", "1", "--micro_batch", "16",
                        "--bpb_tokens", "4096"], check=True, capture_output=True)
        subprocess.run([sys.executable, str(script / "sft.py"), "--runs_dir", str(tmp / "runs"), "--run_name", "sft",
                        "--chat_dir", str(tmp / "demo" / "conversations"), "--steps", "30", "--eval_every", "0",
                        "--eval_rows", "16"], check=True, capture_output=True)
        records = [json.loads(line) for line in (tmp / "runs" / "sft" / "metrics.jsonl").read_text().splitlines()]
        rates = sorted(r["tok_per_s"] for r in records if "tok_per_s" in r and r["step"] > 5)
        rows = json.loads((tmp / "runs" / "sft" / "done.json").read_text())["rows"]
        print(f"sft {args.preset} on the demo conversations: {rates[len(rates) // 2]:,.0f} tok/s (median of steps "
              f"6-30, padding included, the pretrain run's micro-batch 16 and dtype); {rows['supervised']:.1%} of "
              f"positions supervised, {rows['padding']:.1%} padding")


def bench_core_eval(args, device):
    """The real command on an untrained checkpoint of --preset, saved as pretrain.py saves one."""
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        write_demo(tmp / "demo")
        tok = train_tokenizer(iter_texts(tmp / "demo" / "pretrain", "train"), 1024)
        tok.save(tmp / "tokenizer")
        config = config_from_preset(args.preset, {"vocab_size": 1024})
        meta = {"stage": "pretrain", "model_config": config.__dict__, "world_size": 1, "tokenizer": str(tmp / "tokenizer"),
                "tokenizer_sha256": tok.fingerprint(), "data_dir": str(tmp / "demo" / "pretrain")}
        checkpoint.save_checkpoint(tmp / "runs" / "bench" / "ckpt", 0, build_model(config, device), [], [], meta, 0, 1)
        bundle = args.bundle or str(tmp / "demo" / "eval_bundle")
        for batch_items in (1, 8):
            out = tmp / f"out{batch_items}"
            subprocess.run([sys.executable, str(Path(__file__).parent / "core_eval.py"), "--checkpoint",
                            str(tmp / "runs" / "bench"), "--bundle", bundle, "--batch_items", str(batch_items),
                            "--bpb_tokens", "0", "--max_new_tokens", "1", "--out", str(out)], check=True,
                           capture_output=True)
            report = json.loads((out / "results.json").read_text())
            items = sum(t["items"] for t in report["tasks"])
            print(f"core_eval {args.preset}: {report['items_per_second']:,.1f} items/s ({items} items in "
                  f"{len(report['tasks'])} tasks, {report['seconds']:.1f} s, batch_items {batch_items}, "
                  f"{report['dtype']}, {report['device']})")


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
    path.write_text(subprocess.run(["git", "show", f"{OLD_DOWNLOAD_CLIENT}:dataset.py"], cwd=Path(__file__).parent,
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


def bench_download(args, device):
    files = {f"shard_{i:05d}.parquet": shard_bytes() for i in range(17)}
    total_mb = sum(map(len, files.values())) / 1e6
    server = hub_standin(files)
    os.environ.update(HF_ENDPOINT=f"http://127.0.0.1:{server.server_address[1]}", NO_PROXY="127.0.0.1")
    with tempfile.TemporaryDirectory() as tmp:
        clients = {f"old (requests, {OLD_DOWNLOAD_CLIENT})": old_download_client(tmp), "new (huggingface_hub)": dataset}
        seconds = {label: [] for label in clients}
        for trial in range(args.trials):
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
              f"{args.trials}; {len(files)} shards, {total_mb:.0f} MB, 4 workers, loopback)")
    print(f"download: CPU {common.device_name(torch.device('cpu'))}, {os.cpu_count()} cores")


def bench_cpu(args, device):
    """pretrain.py at nanochat's tiny CPU configuration on real text, every precision/compile/optimizer combination."""
    corpus = Path(args.corpus)
    if not corpus.is_dir():
        return print(f"cpu: skipped, no corpus at {corpus}")
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        train_tokenizer(iter_texts(corpus, "train"), 8192).save(tmp / "tokenizer")
        dtypes, rates = ["float32", "bfloat16"] if common.native_bf16(device) else ["float32"], {}
        for optimizer in ("muon", "adamw"):
            for compiled in ("false", "true"):
                for dtype in dtypes:
                    name = f"{optimizer}_{dtype}_{'compiled' if compiled == 'true' else 'eager'}"
                    subprocess.run([sys.executable, str(Path(__file__).parent / "pretrain.py"), "--preset", "tiny",
                                    "--data_dir", str(corpus), "--tokenizer", str(tmp / "tokenizer"), "--runs_dir",
                                    str(tmp / "runs"), "--run_name", name, "--steps", "40", "--micro_batch", "8",
                                    "--eval_every", "0", "--bpb_tokens", "4096", "--ckpt_every", "1000",
                                    "--optimizer", optimizer, "--dtype", dtype, "--compile", compiled],
                                   check=True, capture_output=True)
                    records = [json.loads(line) for line in
                               (tmp / "runs" / name / "metrics.jsonl").read_text().splitlines() if '"loss"' in line]
                    timed = [r for r in records if r["step"] > 10]
                    rate = rates[name] = sorted(r["tok_per_s"] for r in timed)[len(timed) // 2]
                    wait = sum(r["data_wait"] for r in timed) / len(timed)
                    print(f"cpu {name:26s}: {rate:7,.0f} tok/s (median of steps 11-40), waiting for data "
                          f"{100 * wait:.1f}% of the step")
        muon_share(device, 2048 / rates[f"muon_{common.matmul_dtype(device)}_compiled"])


# bench.py quality: each row is pretrain.py's defaults plus these flags (the first row: the defaults themselves).
# At 2^11 tokens a step, AdamW lrs 8x smaller are the square-root rule's (2^-8)^(1/2) against (2^-8)^(1/8).
SQRT_RULE_LRS = ["--embedding_lr", "0.025", "--head_lr", "0.0005", "--scalar_lr", "0.005"]
# each issue-16 change that has a flag, undone; Polar Express + NorMuon have none (they replaced the old Muon), so
# "without_issue16" is the old defaults with the new Muon
QUALITY_VARIANTS = {"defaults": [], "no_value_embeds": ["--value_embeds", "false"],
                    "no_resid_lambdas": ["--resid_lambdas", "false"],
                    "no_momentum_warmup": ["--muon_momentum_warmup", "0"], "sqrt_rule_lrs": SQRT_RULE_LRS,
                    "without_issue16": ["--value_embeds", "false", "--resid_lambdas", "false", "--muon_momentum_warmup",
                                        "0", *SQRT_RULE_LRS]}


def quality_run(corpus, tokenizer, runs, name, seed, flags, threads):
    """One pretrain.py run at nanochat's tiny CPU shape; its final validation bpb, from its done.json."""
    command = [sys.executable, str(Path(__file__).parent / "pretrain.py"), "--preset", "tiny", "--vocab_size", "8192",
               "--data_dir", str(corpus), "--tokenizer", str(tokenizer), "--runs_dir", str(runs), "--run_name",
               f"{name}_s{seed}", "--seed", str(seed), "--steps", "300", "--micro_batch", "8", "--total_batch_tokens",
               "2048", "--eval_every", "0", "--bpb_tokens", "524288", "--ckpt_every", "1000", "--compile", "true",
               *flags]
    subprocess.run(command, check=True, capture_output=True, env={**os.environ, "OMP_NUM_THREADS": str(threads)})
    return json.loads((Path(runs) / f"{name}_s{seed}" / "done.json").read_text())["val_bpb"]


def bench_quality(args, device):
    """Validation bpb after 614,400 tokens at nanochat's tiny CPU shape on the real-text corpus, per variant and seed,
    --quality_jobs runs at a time (each on cores / jobs threads): the medians README's quality table reports."""
    from concurrent.futures import ThreadPoolExecutor
    corpus = Path(args.corpus)
    if not corpus.is_dir():
        return print(f"quality: skipped, no corpus at {corpus}")
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        train_tokenizer(iter_texts(corpus, "train"), 8192).save(tmp / "tokenizer")
        threads = max(1, (os.cpu_count() or 1) // args.quality_jobs)
        jobs = [(name, seed) for name in args.variants for seed in range(args.seeds)]
        with ThreadPoolExecutor(args.quality_jobs) as pool:
            bpbs = list(pool.map(lambda job: quality_run(corpus, tmp / "tokenizer", tmp / "runs", *job,
                                                          QUALITY_VARIANTS[job[0]], threads), jobs))
        config = config_from_preset("tiny", {"vocab_size": 8192})
        for name in args.variants:
            mine = [bpb for (n, _), bpb in zip(jobs, bpbs, strict=True) if n == name]
            print(f"quality {name:14s}: val bpb median {statistics.median(mine):.4f} over seeds {list(range(args.seeds))}"
                  f" ({', '.join(f'{b:.4f}' for b in mine)}); flags: {' '.join(QUALITY_VARIANTS[name]) or '(none)'}")
        print(f"quality: FLOPs/token {flops_per_token(config):.4e}, parameters {num_params(config):,} (defaults)")


def bench_fsdp(args, device):
    """Runs this file's fsdp_rank under torchrun on 2 processes and prints what rank 0 reports."""
    preset = args.preset if args.preset != "tiny" else "llama3-1b"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", __file__,
               "fsdp_rank", "--preset", preset, "--fsdp_steps", str(args.fsdp_steps), "--fsdp_seq", str(args.fsdp_seq)]
    result = subprocess.run(command, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                            check=False)
    if result.returncode:
        return print(f"fsdp: failed (exit {result.returncode}):\n{result.stderr[-3000:]}")
    print("\n".join(line for line in result.stdout.splitlines() if line.startswith(("fsdp", "distributed"))))


def bench_fsdp_rank(args, device):
    """One rank of bench_fsdp: the shared loop's pieces on a sharded model, timed; peak RSS gathered to rank 0."""
    import resource
    rank, _, world, device = distributed.setup_distributed()
    baseline = int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")  # torch, imported
    config = config_from_preset(args.preset, {"sequence_len": args.fsdp_seq})
    start = time.perf_counter()
    torch.manual_seed(0)
    model = build_model(config, device)
    dtype = common.matmul_dtype(device)
    run = argparse.Namespace(fsdp="true", optimizer="muon", adam8bit=False, dtype=dtype, compile=False, matrix_lr=0.02,
                             embedding_lr=0.2, head_lr=0.004, scalar_lr=0.04)
    sharding = distributed.shard_model(model, run, world, device)
    optimizers = optim.build_optimizers(model, run, config.n_embd, world * args.fsdp_seq, device)
    built, times = time.perf_counter() - start, []
    for _ in range(args.fsdp_steps):
        start = time.perf_counter()
        ids = torch.randint(0, config.vocab_size, (1, args.fsdp_seq + 1))
        train_loop.forward_backward(model, [(ids[:, :-1], ids[:, 1:])], dtype, device, world)
        train_loop.clip_grad_norm(model.parameters(), 1.0)
        for opt in optimizers:
            opt.step()
        model.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - start)
    peaks = [None] * world
    torch.distributed.all_gather_object(peaks, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - baseline)
    est = memory_estimate(config, 1, args.fsdp_seq, optimizer="muon", bf16=dtype == "bfloat16")
    per_rank = (est["weights"] + est["gradients"] + est["optimizer"]) / world + est["activations"] + est["transient"]
    if rank == 0:
        print(f"fsdp {args.preset} ({num_params(config):,} params), {world} processes, micro-batch 1 x "
              f"{args.fsdp_seq}, Muon, {dtype}: {sharding}")
        median = statistics.median(times[1:] or times)
        print(f"fsdp build + shard {built:.1f} s; step times " + ", ".join(f"{t:.1f}" for t in times)
              + f" s (median after the first: {median:.1f} s)")
        print("fsdp peak resident memory per rank above its start (torch imported) " + ", ".join(
              f"{p / 2**30:.2f}" for p in peaks) + f" GiB; model.py's estimate per rank {per_rank / 2**30:.2f} GiB (weights, gradients, optimizer / {world}: "
              f"{(est['weights'] + est['gradients'] + est['optimizer']) / world / 2**30:.2f}; activations "
              f"{est['activations'] / 2**30:.2f}; transient {est['transient'] / 2**30:.2f})")
    distributed.teardown_distributed()


def muon_share(device, step_seconds, steps=10):
    """Median seconds of the Muon step for the tiny shape at vocab 8192 (and of forward+backward, compiled in the
    default compute dtype, and the AdamW step beside it), and its share of step_seconds, the median training step of
    pretrain.py in the same configuration."""
    config = config_from_preset("tiny", {"vocab_size": 8192})
    model = build_model(config, device)
    train_model, dtype = torch.compile(model), common.matmul_dtype(device)
    args = argparse.Namespace(optimizer="muon", adam8bit=False, matrix_lr=0.02, embedding_lr=0.2, head_lr=0.004,
                              scalar_lr=0.04)
    adam, muon = optim.build_optimizers(model, args, config.n_embd, 2048, device)
    idx = torch.randint(0, 8192, (8, 256), device=device)

    def forward_backward():
        with autocast_context(device.type, dtype):
            loss = train_model(idx, idx)
        loss.backward()
    times = {"forward+backward": [], "AdamW step": [], "Muon step": []}
    for _ in range(steps + 3):
        for label, work in (("forward+backward", forward_backward), ("AdamW step", adam.step),
                            ("Muon step", muon.step)):
            start = time.perf_counter()
            work()
            sync(device)
            times[label].append(time.perf_counter() - start)
        model.zero_grad(set_to_none=True)
    median = {label: sorted(t[3:])[steps // 2] for label, t in times.items()}
    print(f"cpu Muon step (Newton-Schulz in {muon.param_groups[0]['ns_dtype']}): {1000 * median['Muon step']:.1f} ms, "
          f"{100 * median['Muon step'] / step_seconds:.1f}% of pretrain.py's compiled {dtype} Muon step "
          f"({1000 * step_seconds:.0f} ms); alone: " + ", ".join(f"{label} {1000 * t:.1f} ms"
                                                                 for label, t in median.items()))


# -----------------------------------------------------------------------------
# bench.py gpu: the battery a session with a GPU runs first (README: the GPU battery). Every row runs a real command
# (pretrain.py, nanochat's scripts/base_train.py, speedrun.sh) and its figures are read back from that command's own
# files and output. `gpu_prepare` makes the carry folder (.bench/) on a machine with the nanochat mirror and the corpus.

NANOCHAT_COMMIT = "92d63d4e8bb4df75c3b71618f31ddde2378b2bcd"  # the commit the CPU side-by-side measured
GPU_VOCAB = 32768  # nanochat's default tokenizer size (2^15): both sides train their own on the carried corpus
BIG_BATCH, SMALL_BATCH = 2 ** 19, 2 ** 17  # tokens per optimizer step: nanochat's d20 batch, and a quarter of it
BPB_TOKENS = 64 * BIG_BATCH  # training tokens of each bpb row: 64 steps at 2^19, 256 at 2^17
EVAL_TOKENS = 2 ** 18  # validation tokens of each bpb row (the validation shard holds ~2^19 at vocab 32768)
# the rows, in the order to run them when the whole battery does not fit: d20's MFU beside nanochat, d12's bpb at 2^19
# beside nanochat, then the rest. d12's throughput, MFU and memory are bpb_d12_b19's (the same shape and batch).
GPU_ROWS = {
    "mfu_d20": {"depth": 20, "batch": BIG_BATCH, "steps": 12, "nanochat": True},
    "bpb_d12_b19": {"depth": 12, "batch": BIG_BATCH, "steps": BPB_TOKENS // BIG_BATCH, "nanochat": True, "bpb": True},
    "bpb_d12_b17": {"depth": 12, "batch": SMALL_BATCH, "steps": BPB_TOKENS // SMALL_BATCH, "nanochat": True,
                    "bpb": True},
    "mfu_d26": {"depth": 26, "batch": BIG_BATCH, "steps": 8, "nanochat": True},
    "demo": {},
    "chat_decode": {},
}
# one `run` call each, under 10 minutes on one H100 by this estimate (not yet measured): a row's two runs (ours,
# nanochat's) each pay start-up, compilation and a final checkpoint besides their steps
GPU_CALLS = [["mfu_d20"], ["bpb_d12_b19"], ["bpb_d12_b17"], ["mfu_d26"], ["demo", "chat_decode"]]
# the dry run: every row at a toy size on the CPU (depth 2, sequence 64, the demo world, vocab 1024)
DRY = {"seq_len": 64, "micro": 4, "vocab": 1024, "steps_scale": 1 / 16, "skip": 1}
NANOCHAT_PIP = ["tiktoken", "rustbpe", "regex", "filelock", "jinja2", "markupsafe", "pyyaml", "requests", "urllib3",
                "idna", "certifi", "charset-normalizer"]
WANDB_STUB = '''"""Stand-in for wandb (bench.py gpu_prepare): nanochat's base_train imports it unconditionally and, with
--run dummy, never calls it."""


def init(*args, **kwargs):
    raise RuntimeError("wandb stub: run nanochat with --run dummy")
'''
SITECUSTOMIZE = '''"""bench.py gpu_prepare: packages this machine lacks come from ../pylib (appended: its own
come first)."""
import sys
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parent.parent / "pylib"))
'''


def gpu_prepare(args, device):
    """Fill --bench_dir (default .bench, ignored by git) with what the battery carries to a GPU machine that has no
    network: nanochat's tree at a pinned commit (from a local mirror, no .git), the corpus shards, both tokenizers
    trained on the corpus's training split, a wandb stub, and wheels of nanochat's pure dependencies for the GPU
    machine's Python (--wheels_python; skipped with --wheels_python none)."""
    bench, corpus = Path(args.bench_dir).resolve(), Path(args.corpus)
    mirror = Path(args.nanochat_mirror)
    if not sorted(corpus.glob("shard_*.parquet")):
        raise FileNotFoundError(f"gpu_prepare: no shard_*.parquet in {corpus}: pass --corpus DIR (the last shard is "
                                "the validation split)")
    if not (mirror / "HEAD").is_file() and not (mirror / ".git").exists():
        raise FileNotFoundError(f"gpu_prepare: {mirror} is not a git directory: fetch github:karpathy/nanochat and "
                                "pass --nanochat_mirror <its git dir>")
    bench.mkdir(parents=True, exist_ok=True)
    tree = bench / "nanochat"
    shutil.rmtree(tree, ignore_errors=True)
    tree.mkdir()
    archive = subprocess.run(["git", f"--git-dir={mirror / '.git' if (mirror / '.git').exists() else mirror}",
                              "archive", args.nanochat_commit], capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(tree)], input=archive, check=True)
    (tree / "COMMIT").write_text(args.nanochat_commit + "\n")
    shutil.rmtree(bench / "corpus", ignore_errors=True)
    (bench / "corpus").mkdir()
    for shard in sorted(corpus.glob("shard_*.parquet")):
        shutil.copy(shard, bench / "corpus" / shard.name)
    vocab = args.gpu_vocab
    start = time.perf_counter()
    train_tokenizer(iter_texts(bench / "corpus", "train"), vocab).save(bench / "tokenizer_ours")
    print(f"gpu_prepare: this repository's tokenizer, vocab {vocab}: {time.perf_counter() - start:.1f} s")
    nc_base = bench / "nc_base_prepare"
    shutil.rmtree(nc_base, ignore_errors=True)
    nanochat_data(nc_base, bench / "corpus")
    start = time.perf_counter()
    result = subprocess.run([sys.executable, "-m", "scripts.tok_train", f"--vocab-size={vocab}",
                             "--max-chars=1000000000"], cwd=tree, env=nanochat_env(bench, nc_base),
                            capture_output=True, text=True, check=False)
    if result.returncode:
        raise RuntimeError(f"gpu_prepare: nanochat's tok_train failed:\n{result.stdout[-2000:]}\n"
                           f"{result.stderr[-2000:]}")
    shutil.rmtree(bench / "tokenizer_nanochat", ignore_errors=True)
    shutil.copytree(nc_base / "tokenizer", bench / "tokenizer_nanochat")
    shutil.rmtree(nc_base)
    print(f"gpu_prepare: nanochat's tokenizer (scripts.tok_train), vocab {vocab}: {time.perf_counter() - start:.1f} s")
    (bench / "stub").mkdir(exist_ok=True)
    (bench / "stub" / "wandb.py").write_text(WANDB_STUB)
    (bench / "stub" / "sitecustomize.py").write_text(SITECUSTOMIZE)
    if args.wheels_python != "none":
        shutil.rmtree(bench / "pylib", ignore_errors=True)
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--target", str(bench / "pylib"), "--no-deps",
                        "--only-binary=:all:", "--platform", "manylinux2014_x86_64", "--python-version",
                        args.wheels_python, *NANOCHAT_PIP], check=True)
    size = sum(f.stat().st_size for f in bench.rglob("*") if f.is_file())
    record = {"nanochat_commit": args.nanochat_commit, "vocab": vocab, "corpus": str(corpus),
              "wheels_python": args.wheels_python, "bytes": size, "code": common.code_version(),
              "prepared": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}
    (bench / "PREPARED.json").write_text(json.dumps(record, indent=1) + "\n")
    print(f"gpu_prepare: {bench} holds {size / 2**20:.1f} MiB (the device tool carries at most 64 MiB)")
    print("then, on the GPU machine, one call each (carry: [\"" + os.path.relpath(bench) + "\"]):")
    for rows in GPU_CALLS:
        print(f"    python3 bench.py gpu --rows {' '.join(rows)} --out $OUT")


def nanochat_data(base, corpus):
    """$NANOCHAT_BASE_DIR's data folder as nanochat expects it: the corpus shards (links), the last one validation."""
    data = base / "base_data_climbmix"
    data.mkdir(parents=True, exist_ok=True)
    for shard in sorted(Path(corpus).glob("shard_*.parquet")):
        (data / shard.name).symlink_to(shard.resolve())


def nanochat_env(bench, base, threads=None):
    """Environment for nanochat's scripts: its base dir, the wandb stub (and the carried wheels) on PYTHONPATH."""
    env = {**os.environ, "NANOCHAT_BASE_DIR": str(base), "WANDB_MODE": "disabled", "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(Path(bench) / "stub"), os.environ.get("PYTHONPATH")]))}
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    return env


def run_logged(command, log, cwd=None, env=None):
    """Run a command with its output in `log`; returns (exit status, wall seconds, peak resident bytes of the
    process and its waited-for children, from wait4)."""
    start = time.perf_counter()
    with open(log, "w") as out:
        out.write("$ " + " ".join(map(str, command)) + "\n")
        out.flush()
        process = subprocess.Popen(list(map(str, command)), stdout=out, stderr=subprocess.STDOUT, cwd=cwd, env=env)
        _, status, usage = os.wait4(process.pid, 0)
    process.returncode = os.waitstatus_to_exitcode(status)
    return process.returncode, time.perf_counter() - start, usage.ru_maxrss * 1024


def tail(path, lines=15):
    return "\n".join(Path(path).read_text(errors="replace").splitlines()[-lines:])


def out_of_memory(log):
    text = Path(log).read_text(errors="replace")
    return "OutOfMemoryError" in text or "CUDA out of memory" in text


def gpu_probe(args, device):
    """`bench.py gpu_probe`: the largest micro-batch (a power of 2 up to --max_micro) with which a training step of
    --preset fits this GPU, by pretrain.py's own probe (forward, backward and optimizer state at that batch). Runs in
    its own process so that the battery's runs start with the GPU's memory untouched."""
    config = config_from_preset(args.preset, {"vocab_size": args.gpu_vocab})
    model = build_model(config, device)
    run = argparse.Namespace(optimizer="muon", adam8bit=False, matrix_lr=0.02, embedding_lr=0.2, head_lr=0.004,
                             scalar_lr=0.04)
    optimizers = optim.build_optimizers(model, run, config.n_embd, 1, device)
    try_step = train_loop.probe_step(model, optimizers, config.sequence_len, config.vocab_size, "bfloat16", device)
    micro = train_loop.find_micro_batch(try_step, [2 ** k for k in range(int(math.log2(args.max_micro)) + 1)])
    print(f"micro_batch {micro}")


class GpuBattery:
    """The rows of `bench.py gpu`. Each row is a dict of what ran (command, status) and what it measured, with
    'unknown' or 'unavailable: <why>' where a figure could not be had."""

    def __init__(self, args, device):
        self.args, self.device, self.dry = args, device, args.dry_run
        self.bench = Path(args.bench_dir).resolve()
        self.work = Path(tempfile.mkdtemp(prefix="gpu_bench_"))
        self.here = Path(__file__).resolve().parent
        # bf16 on the GPU, as nanochat there; fp32 in the dry run, as nanochat on a CPU
        self.dtype = "bfloat16" if device.type == "cuda" else "float32"
        self.peak = common.peak_flops(common.device_name(device), self.dtype)
        self.peak_source = "rated dense bf16 peak (common.PEAK_BF16_FLOPS)"
        if self.peak is None:  # a CPU, or a GPU the table lacks: this device's own measured matmul throughput
            self.peak = matmul_peak(device, getattr(torch, self.dtype))
            self.peak_source = f"measured 2048x2048 {self.dtype} matmul throughput of this device"
        if self.dry:  # the toy world: the demo corpus and tokenizers trained on it here
            write_demo(self.work / "demo")
            self.corpus = self.work / "demo" / "pretrain"
            self.tok_ours = self.work / "tokenizer_ours"
            train_tokenizer(iter_texts(self.corpus, "train"), DRY["vocab"]).save(self.tok_ours)
            self.tok_nanochat = None  # trained by nanochat's tok_train when its tree is present
            self.vocab = DRY["vocab"]
        else:
            self.corpus, self.tok_ours = self.bench / "corpus", self.bench / "tokenizer_ours"
            self.tok_nanochat = self.bench / "tokenizer_nanochat"
            prepared = self.bench / "PREPARED.json"
            self.vocab = json.loads(prepared.read_text())["vocab"] if prepared.is_file() else None
        if not (self.tok_ours / "tokenizer.json").is_file():
            raise FileNotFoundError(f"gpu: no tokenizer in {self.tok_ours}: run `python bench.py gpu_prepare` where "
                                    "the nanochat mirror and the corpus are, and carry its folder (--bench_dir)")
        self.nanochat_missing = self.check_nanochat()
        self.micro_cache = {}

    def check_nanochat(self):
        """Why nanochat's rows cannot run here, or None."""
        tree = self.bench / "nanochat"
        if not (tree / "scripts" / "base_train.py").is_file():
            return f"no nanochat tree at {tree} (run `python bench.py gpu_prepare` where the mirror is, and carry it)"
        if not (self.bench / "stub" / "wandb.py").is_file():
            return f"no wandb stub in {self.bench / 'stub'} (run `python bench.py gpu_prepare`)"
        imports = "import tiktoken, rustbpe, pyarrow, filelock, jinja2, yaml, requests, wandb"
        check = subprocess.run([sys.executable, "-c", imports], env=nanochat_env(self.bench, self.work),
                               capture_output=True, text=True, check=False)
        if check.returncode:
            return "nanochat's dependencies do not import: " + check.stderr.strip().splitlines()[-1]
        if self.dry:  # its tokenizer for the toy world, by its own trainer
            base = self.work / "nc_tok"
            nanochat_data(base, self.corpus)
            result = subprocess.run([sys.executable, "-m", "scripts.tok_train", f"--vocab-size={DRY['vocab']}"],
                                    cwd=tree, env=nanochat_env(self.bench, base), capture_output=True, text=True,
                                    check=False)
            if result.returncode:
                return "nanochat's tok_train failed: " + (result.stdout + result.stderr).strip().splitlines()[-1]
            self.tok_nanochat = base / "tokenizer"
        elif not (self.tok_nanochat / "tokenizer.pkl").is_file():
            return f"no nanochat tokenizer in {self.tok_nanochat} (run `python bench.py gpu_prepare`)"
        return None

    def shape(self, depth):
        """(preset, config overrides, micro-batch cap) of a row's model: d{depth} at sequence 2048 on the GPU; the dry
        run's toy: depth 2 (one 128-wide head), sequence 64, its micro-batch fixed."""
        if self.dry:
            return "d2", {"sequence_len": DRY["seq_len"], "vocab_size": self.vocab}
        return f"d{depth}", {"vocab_size": self.vocab}

    def micro_batch(self, preset, overrides, per_step):
        """The largest micro-batch that fits (pretrain.py's probe, in its own process), capped at the step's rows."""
        if self.dry:
            return min(DRY["micro"], per_step), "fixed (dry run, CPU)"
        if preset not in self.micro_cache:
            log = self.work / f"probe_{preset}.log"
            status, _, _ = run_logged([sys.executable, Path(__file__), "gpu_probe", "--preset", preset, "--gpu_vocab",
                                       overrides["vocab_size"], "--max_micro", 256], log)
            found = [line for line in Path(log).read_text().splitlines() if line.startswith("micro_batch ")]
            if status or not found:
                raise RuntimeError(f"micro-batch probe of {preset} failed (exit {status}):\n{tail(log)}")
            self.micro_cache[preset] = int(found[-1].split()[1])
        return min(self.micro_cache[preset], per_step), "largest that fits (pretrain.py's probe, eager)"

    def row_size(self, spec):
        """(tokens per step, steps, steps skipped before timing) of a training row at this run's scale."""
        if self.dry:
            seq = DRY["seq_len"]
            batch = spec["batch"] * seq // 2048 // 16  # 2^19 -> 16 rows of 64: the same ratio between the two batches
            return batch, max(3, round(spec["steps"] * DRY["steps_scale"])), DRY["skip"]
        steps = self.args.bpb_tokens // spec["batch"] if spec.get("bpb") else spec["steps"]
        return spec["batch"], steps, 3  # steps 1-3: compilation and the allocator's warm-up

    def ours(self, name, spec):
        preset, overrides = self.shape(spec["depth"])
        config = config_from_preset(preset, overrides)
        seq = config.sequence_len
        batch, steps, skip = self.row_size(spec)
        micro, how = self.micro_batch(preset, overrides, batch // seq)
        run_dir = self.work / "runs" / f"{name}_ours"
        command = [sys.executable, self.here / "pretrain.py", "--preset", preset, *itertools.chain.from_iterable(
                   (f"--{k}", v) for k, v in overrides.items() if k != "vocab_size"),
                   "--data_dir", self.corpus, "--tokenizer", self.tok_ours, "--runs_dir", run_dir.parent,
                   "--run_name", run_dir.name, "--steps", steps, "--total_batch_tokens", batch, "--micro_batch", micro,
                   "--eval_every", 0, "--bpb_tokens", EVAL_TOKENS if not self.dry else 4096, "--ckpt_every", 10 ** 6,
                   "--dtype", self.dtype, "--compile", "false" if self.dry else "true", "--log_every", 1]
        row = {"row": name, "side": "ours", "model": preset, "n_layer": config.n_layer, "n_embd": config.n_embd,
               "vocab": config.vocab_size, "seq_len": seq, "micro_batch": micro, "micro_batch_from": how,
               "tokens_per_step": batch, "steps": steps, "dtype": self.dtype, "compiled": not self.dry,
               "attention": "SDPA (torch.nn.functional.scaled_dot_product_attention)",
               "flops_per_token": flops_per_token(config), "params": num_params(config),
               "memory_estimate": memory_estimate(config, micro, optimizer="muon",
                                                  bf16=self.dtype == "bfloat16")["total"]}
        status, wall, rss = run_logged(command, self.work / f"{name}_ours.log")
        row.update(command=" ".join(map(str, command)).replace(str(self.work), "$WORK"), exit=status, wall_s=wall)
        if status:
            row["status"] = "failed: " + ("out of memory" if out_of_memory(self.work / f"{name}_ours.log") else
                                          tail(self.work / f"{name}_ours.log", 3))
            return row
        records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        timed = [r for r in records if "loss" in r and r["step"] > skip]
        self.throughput(row, [r["step_time"] for r in timed], skip)
        steps_logged = [r for r in records if "loss" in r]  # the last record is the final evaluation's
        row["peak_memory"] = steps_logged[-1]["cuda_mem_peak"] if self.device.type == "cuda" else rss
        row["peak_memory_kind"] = "torch.cuda.max_memory_allocated" if self.device.type == "cuda" else \
            "peak resident set of the process (CPU: includes torch itself)"
        row["loss_first_last"] = [steps_logged[0]["loss"], steps_logged[-1]["loss"]]
        done = json.loads((run_dir / "done.json").read_text())
        row.update(val_bpb=done["val_bpb"], run_dir=str(run_dir), status="ok")
        shutil.rmtree(run_dir / "ckpt", ignore_errors=True)  # d26's is tens of GB: the device has 64 GiB of disk
        return row

    def throughput(self, row, step_times, skip):
        """tok/s from the median step time of the timed steps, and MFU = FLOPs/token x tok/s / peak."""
        if not step_times:
            row["tok_per_s"] = row["mfu"] = "unknown: no timed steps"
            return
        median = statistics.median(step_times)
        row.update(steps_timed=f"{skip + 1}-{skip + len(step_times)}", step_time_median_s=median,
                   tok_per_s=row["tokens_per_step"] / median, peak_flops=self.peak, peak_flops_source=self.peak_source)
        row["mfu"] = row["flops_per_token"] * row["tok_per_s"] / self.peak

    def nanochat(self, name, spec, ours):
        """nanochat's scripts/base_train.py at the shape and batch of `ours` (its micro-batch too), full attention
        (--window-pattern L: this repository has no sliding window), its own defaults otherwise."""
        row = {"row": name, "side": "nanochat", "nanochat_commit": (self.bench / "nanochat" / "COMMIT").read_text()
               .strip() if (self.bench / "nanochat" / "COMMIT").is_file() else "unknown"}
        if self.nanochat_missing:
            return {**row, "status": f"unavailable: {self.nanochat_missing}"}
        if ours.get("status") != "ok" and "micro_batch" not in ours:
            return {**row, "status": "unavailable: this repository's run of the row did not start"}
        depth, seq, micro = ours["n_layer"], ours["seq_len"], ours["micro_batch"]
        batch, steps, skip = ours["tokens_per_step"], ours["steps"], self.row_size(spec)[2]
        base = self.work / f"nc_{name}"
        nanochat_data(base, self.corpus)
        shutil.copytree(self.tok_nanochat, base / "tokenizer")
        bpb = spec.get("bpb") or self.dry
        row.update(model=f"d{depth}", seq_len=seq, tokens_per_step=batch, steps=steps,
                   flops_per_token=ours["flops_per_token"], compiled=True,
                   attention="SDPA (FA3 needs the `kernels` package and the hub: unavailable offline)")
        log = self.work / f"{name}_nanochat.log"
        while True:  # ours' micro-batch; halved while nanochat runs out of memory at it (it has no probe)
            command = [sys.executable, "-m", "scripts.base_train", "--run=dummy", f"--device-type={self.device.type}",
                       f"--depth={depth}", f"--aspect-ratio={DEPTH_ASPECT}", f"--head-dim={DEPTH_HEAD_DIM}",
                       "--window-pattern=L", f"--max-seq-len={seq}", f"--device-batch-size={micro}",
                       f"--total-batch-size={batch}", f"--num-iterations={steps}",
                       f"--eval-every={steps if bpb else -1}",
                       f"--eval-tokens={EVAL_TOKENS if not self.dry else 4096}", "--core-metric-every=-1",
                       "--sample-every=-1", "--save-every=-1", f"--model-tag=bench_{name}"]
            status, wall, rss = run_logged(command, log, cwd=self.bench / "nanochat",
                                           env=nanochat_env(self.bench, base, torch.get_num_threads()))
            if not (status and out_of_memory(log) and micro > 1):
                break
            row.setdefault("out_of_memory_at_micro_batch", []).append(micro)
            micro //= 2
        row.update(micro_batch=micro, exit=status, wall_s=wall,
                   command=f"cd {self.bench / 'nanochat'} && NANOCHAT_BASE_DIR=$WORK/{base.name} PYTHONPATH="
                   f"{self.bench / 'stub'} " + " ".join(map(str, command)).replace(sys.executable, "python"))
        if status:
            row["status"] = "failed: " + ("out of memory" if out_of_memory(log) else tail(log, 3))
            return row
        text = log.read_text(errors="replace")
        lines = re.findall(r"^step (\d+)/\d+ .*?\| dt: ([\d.]+)ms \| tok/sec: ([\d,]+) \| bf16_mfu: ([\d.]+)", text,
                           re.MULTILINE)
        # nanochat numbers its steps from 0: its step i is this repository's step i + 1
        timed = [(int(s) + 1, float(dt) / 1000, float(m)) for s, dt, _, m in lines if int(s) + 1 > skip]
        self.throughput(row, [t[1] for t in timed], skip)
        if timed and self.device.type == "cuda":
            row["mfu_nanochat_reported"] = statistics.median(t[2] for t in timed) / 100  # its own FLOPs/token
        dtype = re.search(r"^COMPUTE_DTYPE: torch\.(\w+)", text, re.MULTILINE)
        row["dtype"] = dtype[1] if dtype else "unknown"
        flops = re.search(r"Estimated FLOPs per token: ([\d.e+]+)", text)
        row["flops_per_token_nanochat"] = float(flops[1]) if flops else "unknown"
        params = re.search(r"^total\s*: ([\d,]+)$", text, re.MULTILINE)
        row["params"] = int(params[1].replace(",", "")) if params else "unknown"
        peak = re.search(r"Peak memory usage: ([\d.]+)MiB", text)
        if self.device.type == "cuda":
            row["peak_memory"] = float(peak[1]) * 2 ** 20 if peak else "unknown"
            row["peak_memory_kind"] = "torch.cuda.max_memory_allocated (its own print)"
        else:
            row["peak_memory"], row["peak_memory_kind"] = rss, "peak resident set of the process (CPU)"
        vals = re.findall(r"Validation bpb: ([\d.]+)", text)
        row["val_bpb"] = float(vals[-1]) if bpb and vals else None
        row["status"] = "ok" + (f" at micro-batch {micro} (out of memory at {row['out_of_memory_at_micro_batch']})"
                                if "out_of_memory_at_micro_batch" in row else "")
        shutil.rmtree(base / "base_checkpoints", ignore_errors=True)
        return row

    def demo(self):
        """speedrun.sh --plan demo end to end (the dry run: every stage at a few steps)."""
        run = self.work / "demo_run"
        gpus = "1" if self.device.type == "cuda" else "0"
        command = ["bash", self.here / "speedrun.sh", "--plan", "demo", "--gpus", gpus, "--no_chat", "--runs_dir",
                   run.parent, "--run_name", run.name]
        env = {**os.environ, "SPEEDRUN_PYTHON": sys.executable}
        if self.dry:
            command += ["--tokenizer", self.tok_ours, "--data_dir", self.work / "demo"]
            env.update(PRETRAIN_ARGS="--steps 3 --bpb_tokens 4096 --n_layer 1 --n_embd 64 --n_head 1 --n_kv_head 1",
                       MIDTRAIN_ARGS="--steps 2 --eval_rows 4", SFT_ARGS="--steps 2 --eval_rows 4",
                       CORE_ARGS="--bpb_tokens 4096 --max_new_tokens 4 --max_items 4",
                       CHAT_EVAL_ARGS="--max_items 2 --max_new_tokens 4")
        status, wall, _ = run_logged(command, self.work / "demo.log", cwd=self.work, env=env)
        row = {"row": "demo", "side": "ours", "command": " ".join(map(str, command)).replace(str(self.work), "$WORK"),
               "exit": status, "wall_s": wall, "status": "ok" if status == 0 else "failed: " + tail(self.work /
                                                                                                     "demo.log", 3)}
        done, core = run / "pretrain" / "done.json", sorted(run.glob("core_eval/**/results.json"))
        chat = run / "chat_eval.json"
        row["val_bpb"] = json.loads(done.read_text())["val_bpb"] if done.is_file() else "unknown"
        row["core"] = json.loads(core[-1].read_text())["core"] if core else "unknown"
        row["chatcore"] = json.loads(chat.read_text())["chatcore"] if chat.is_file() else "unknown"
        return row

    def chat_decode(self):
        args = argparse.Namespace(preset="tiny", decode_tokens=8 if self.dry else 64, trials=1 if self.dry else 5)
        paths = ("lean", "static") if self.dry else ("lean", "static", "compiled")
        rates = bench_chat_decode(args, self.device, paths)
        return {"row": "chat_decode", "side": "ours", "command": f"python bench.py gpu --rows chat_decode (bench.py "
                f"chat's decode part: preset tiny, random weights, greedy, {args.decode_tokens} tokens, median of "
                f"{args.trials})", "status": "ok", **{f"decode_tok_per_s_{k}": v for k, v in rates.items()}}


def gpu_environment(device):
    """Device, driver, torch and the code, for the battery's header."""
    driver = "none (CPU)"
    if device.type == "cuda":
        try:
            driver = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                    capture_output=True, text=True, timeout=30, check=True).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            driver = "unknown (nvidia-smi did not answer)"
    code = common.code_version()
    prepared = Path(".bench/PREPARED.json")
    return {"device": common.device_name(device), "driver": driver, "torch": torch.__version__,
            "cuda": torch.version.cuda or "none", "python": sys.version.split()[0], "commit": code["commit"],
            "dirty": code["dirty"], "prepared_at_commit": json.loads(prepared.read_text())["code"]["commit"]
            if prepared.is_file() else "unknown", "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}


def fmt(value, kind):
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return "—" if value is None else str(value)
    return {"tok": f"{value:,.0f}", "pct": f"{100 * value:.1f}%", "gib": f"{value / 2**30:.2f} GiB",
            "bpb": f"{value:.4f}", "s": f"{value:.0f} s"}[kind]


def gpu_markdown(result):
    """The battery's table: one line per row and side, the figures each run measured, and its command."""
    env = result["environment"]
    title = "# bench.py gpu" + (" --dry_run (toy sizes on the CPU: no figure here is a GPU figure)"
                                  if result["dry_run"] else "")
    header = (f"device {env['device']}; driver {env['driver']}; torch {env['torch']} (CUDA {env['cuda']}); Python "
              f"{env['python']}; commit {env['commit']} (uncommitted changes: {env['dirty']}; .bench prepared at "
              f"{env['prepared_at_commit']}); {env['date']}")
    notes = ("Attention: SDPA on both sides (nanochat's FA3 needs the `kernels` package and the hub: unavailable "
             "offline). MFU = model.py's FLOPs/token x tok/s / peak for both sides (the same shape, so the same "
             "FLOPs); nanochat's own figure beside it. tok/s = tokens per step / median step time of the timed steps.")
    columns = ("| row | side | model, micro x seq, tokens/step | steps (timed) | tok/s | MFU (nanochat's own) | "
               "peak memory / model.py estimate | val bpb | status | command |")
    others = [e for e in result.get("environments", []) if e != env]
    header += "".join(f"; another call: {e['device']}, driver {e['driver']}, torch {e['torch']}, commit {e['commit']}, "
                      f"{e['date']}" for e in others)
    out = [title, "", header, "", notes, "", columns, "|---" * 10 + "|"]
    for r in result["rows"]:
        shape = (f"{r.get('model', '')}, {r.get('micro_batch', '?')} x {r.get('seq_len', '?')}, "
                 f"{r.get('tokens_per_step', 0):,}" if "model" in r else "")
        mfu = fmt(r.get("mfu"), "pct") + (f" ({fmt(r['mfu_nanochat_reported'], 'pct')})"
                                           if "mfu_nanochat_reported" in r else "")
        memory = fmt(r.get("peak_memory"), "gib") + (f" / {fmt(r['memory_estimate'], 'gib')}"
                                                     if "memory_estimate" in r else "")
        if r["row"] == "chat_decode":
            mfu = ", ".join(f"{k.removeprefix('decode_tok_per_s_')} {v:,.0f} tok/s" for k, v in r.items()
                            if k.startswith("decode_tok_per_s_"))
        bpb = fmt(r.get("val_bpb"), "bpb") + (f"; CORE {fmt(r['core'], 'bpb')}, ChatCORE {fmt(r['chatcore'], 'bpb')}"
                                              f"; {fmt(r['wall_s'], 's')}" if r["row"] == "demo" else "")
        out.append(f"| {r['row']} | {r['side']} | {shape} | {r.get('steps', '')} ({r.get('steps_timed', '—')}) | "
                   f"{fmt(r.get('tok_per_s'), 'tok')} | {mfu} | {memory} | {bpb} | "
                   f"{str(r['status']).replace('|', '/').splitlines()[0][:200]} | `{r.get('command', '')}` |")
    return "\n".join(out) + "\n"


def merge_gpu_results(results):
    """One battery result from several calls' gpu_bench.json: their rows in call order; the first call's environment
    heads the table, and every call's environment is kept (a later call may have got another machine)."""
    environments = [r["environment"] for r in results]
    return {"dry_run": any(r["dry_run"] for r in results), "environment": environments[0],
            "environments": environments, "rows": [row for r in results for row in r["rows"]],
            "calls": results[0]["calls"]}


def bench_gpu(args, device):
    """`bench.py gpu`: the rows chosen by --rows, in the battery's order; writes gpu_bench.json and gpu_bench.md to
    --out (and prints the table)."""
    out = Path(args.out)
    if args.merge:  # no device needed: the calls' files, fetched from the GPU machine
        result = merge_gpu_results([json.loads(Path(path).read_text()) for path in args.merge])
        out.mkdir(parents=True, exist_ok=True)
        (out / "gpu_bench.json").write_text(json.dumps(result, indent=1) + "\n")
        (out / "gpu_bench.md").write_text(gpu_markdown(result))
        return print(gpu_markdown(result))
    if device.type != "cuda" and not args.dry_run:
        raise ValueError("gpu: no CUDA device; on a CPU run `python bench.py gpu --dry_run` (toy sizes)")
    unknown = [r for r in args.rows if r not in GPU_ROWS]
    if unknown:
        raise ValueError(f"gpu: unknown rows {unknown}: choose from {', '.join(GPU_ROWS)}")
    battery = GpuBattery(args, device)
    result = {"dry_run": args.dry_run, "environment": gpu_environment(device), "rows": [],
              "calls": [" ".join(["python3 bench.py gpu --rows", *rows, "--out $OUT"]) for rows in GPU_CALLS]}
    out.mkdir(parents=True, exist_ok=True)
    for name in [r for r in GPU_ROWS if r in args.rows]:
        print(f"gpu: row {name} ...", flush=True)
        spec = GPU_ROWS[name]
        if "depth" in spec:
            try:
                ours = battery.ours(name, spec)
            except RuntimeError as e:  # the probe failed: nothing of the row ran
                ours = {"row": name, "side": "ours", "status": f"failed: {e}"}
            result["rows"] += [ours, battery.nanochat(name, spec, ours)]
        else:
            result["rows"].append(battery.demo() if name == "demo" else battery.chat_decode())
        (out / "gpu_bench.json").write_text(json.dumps(result, indent=1) + "\n")  # after every row: a killed call
        (out / "gpu_bench.md").write_text(gpu_markdown(result))  # keeps what it finished
    print(gpu_markdown(result))
    print(f"gpu: {out / 'gpu_bench.json'}, {out / 'gpu_bench.md'}; logs in {battery.work}")


BENCHES = {"train": bench_train, "decode": bench_decode, "build": bench_build, "tokenizer": bench_tokenizer,
           "loader": bench_loader, "pretrain": bench_pretrain, "core_eval": bench_core_eval, "sft": bench_sft,
           "download": bench_download, "cpu": bench_cpu, "chat": bench_chat, "fsdp": bench_fsdp,
           "quality": bench_quality}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("which", nargs="*", default=list(BENCHES), help=f"any of {', '.join(BENCHES)} (default: all)")
    parser.add_argument("--preset", default="tiny", help="model preset for train and decode (default: %(default)s)")
    parser.add_argument("--batch", type=int, default=8, help="sequences per training step (default: %(default)s)")
    parser.add_argument("--steps", type=int, default=10, help="timed training steps (default: %(default)s)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed training steps first (default: %(default)s)")
    parser.add_argument("--decode_tokens", type=int, default=64, help="tokens generated (default: %(default)s)")
    parser.add_argument("--trials", type=int, default=5, help="decode and download trials, the median is reported "
                        "(default: %(default)s)")
    parser.add_argument("--corpus", default=str(Path(__file__).resolve().parent.parent / "shared/corpus/realtext"),
                        help="text corpus for the tokenizer benchmark (default: %(default)s)")
    parser.add_argument("--bundle", default=None, help="eval bundle directory for core_eval (default: the demo "
                        "world's)")
    parser.add_argument("--fsdp_steps", type=int, default=3, help="fsdp: steps timed (default: %(default)s)")
    parser.add_argument("--fsdp_seq", type=int, default=128, help="fsdp: tokens per sequence (default: %(default)s; "
                        "llama3-1b at 256 does not fit 2 processes in 24 GB)")
    parser.add_argument("--variants", nargs="+", default=list(QUALITY_VARIANTS), help="quality: which rows (default: "
                        "all)")
    parser.add_argument("--seeds", type=int, default=3, help="quality: seeds per row (default: %(default)s)")
    parser.add_argument("--quality_jobs", type=int, default=2, help="quality: runs at a time (default: %(default)s)")
    g = parser.add_argument_group("gpu battery (gpu, gpu_prepare)")
    g.add_argument("--rows", nargs="+", default=list(GPU_ROWS), help=f"gpu: rows to run, any of {', '.join(GPU_ROWS)}"
                   " (default: all; one device call each: " + "; ".join(" ".join(c) for c in GPU_CALLS) + ")")
    g.add_argument("--dry_run", action="store_true", help="gpu: every row at a toy size on the CPU (the demo world, "
                   "depth 2, sequence 64); nanochat's rows run when --bench_dir holds its tree")
    g.add_argument("--out", default=os.environ.get("OUT") or "runs/gpu_bench", help="gpu: where gpu_bench.json and "
                   "gpu_bench.md go (default: $OUT when set, else runs/gpu_bench; now: %(default)s)")
    g.add_argument("--bench_dir", default=str(Path(__file__).resolve().parent / ".bench"), help="the carry folder "
                   "gpu_prepare fills and gpu reads (default: %(default)s)")
    g.add_argument("--nanochat_mirror", default=os.environ.get("NANOCHAT_MIRROR"), help="gpu_prepare: git directory "
                   "of a karpathy/nanochat clone or mirror (default: $NANOCHAT_MIRROR)")
    g.add_argument("--nanochat_commit", default=NANOCHAT_COMMIT, help="gpu_prepare: nanochat commit (default: "
                   "%(default)s)")
    g.add_argument("--gpu_vocab", type=int, default=GPU_VOCAB, help="gpu_prepare: vocabulary of both tokenizers "
                   "(default: %(default)s, nanochat's)")
    g.add_argument("--wheels_python", default="3.12", help="gpu_prepare: Python version of the GPU machine, for the "
                   "wheels of nanochat's dependencies it may lack; none = no wheels (default: %(default)s)")
    g.add_argument("--bpb_tokens", type=int, default=BPB_TOKENS, help="gpu: training tokens of each bpb row, the "
                   "same at both batches (default: %(default)s = 64 steps of 2^19; the carried corpus's training "
                   "split is ~3.6M tokens at vocab 32768, so that is ~9 epochs)")
    g.add_argument("--merge", nargs="+", default=None, metavar="JSON", help="gpu: instead of running rows, merge "
                   "these gpu_bench.json files (one per call) into one gpu_bench.json + gpu_bench.md in --out")
    g.add_argument("--max_micro", type=int, default=256, help="gpu_probe: largest micro-batch tried (default: "
                   "%(default)s)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        help="device (default: %(default)s)")
    args = parser.parse_args()
    if args.dry_run:
        args.device = "cpu"
    device = torch.device(args.device)
    if device.type == "cpu":
        distributed.keep_freed_memory()  # as every stage does on CPU
    print(f"device: {common.device_name(device)}; bf16 native: {common.native_bf16(device)}; torch "
          f"{torch.__version__}, {torch.get_num_threads()} CPU threads, {os.cpu_count()} cores")
    if args.which == ["fsdp_rank"]:  # one rank of the fsdp benchmark, under the torchrun that bench_fsdp starts
        return bench_fsdp_rank(args, device)
    if args.which in (["gpu"], ["gpu_prepare"], ["gpu_probe"]):  # the GPU battery: never part of "all"
        if args.which == ["gpu_prepare"] and not args.nanochat_mirror:
            parser.error("gpu_prepare needs --nanochat_mirror (the git directory `fetch github:karpathy/nanochat` "
                         "gives) or $NANOCHAT_MIRROR")
        try:
            return {"gpu": bench_gpu, "gpu_prepare": gpu_prepare, "gpu_probe": gpu_probe}[args.which[0]](args, device)
        except (FileNotFoundError, ValueError) as e:  # ours, each naming its fix: one line, not a traceback
            parser.exit(1, f"bench.py: error: {e}\n")
    for name in args.which:
        if name not in BENCHES:
            parser.error(f"unknown benchmark {name!r}: choose from {', '.join(BENCHES)}")
        BENCHES[name](args, device)


if __name__ == "__main__":
    main()
