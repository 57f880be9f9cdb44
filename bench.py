"""Benchmarks: figures printed with their targets. Not tests; nothing here is timed inside pytest.

    python bench.py              # every benchmark
    python bench.py train decode # a chosen few: train, decode, build, tokenizer, loader, pretrain, core_eval, sft,
                                 # chat_eval, generate, download, cpu, chat, fsdp, quality, compile

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
generate  batched generation (decode.py) beside the one-row paths, on an untrained --preset checkpoint: ChatCORE's
        generated answers (`python chat_eval.py --tasks demo-answer`, --batch_items 1 against 8 and 32) in items/s,
        every item's record compared (target >= 4x); RL's rollouts (rl.sample_group, one question per batch, against
        rl.sample_groups, 16 questions x 16 replies per batch) in sampled tokens/s (target >= 3x).
chat_eval  `python chat_eval.py` on the demo world's demo-choice (132 multiple-choice items) for a --preset model
        (vocab 1024, untrained: the work per item does not depend on the weights): items/s of the letters alone
        (--option_text off) one prompt per forward (--batch_items 1) and batched (8, the default), and with the
        option-text diagnostic on, batched.
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
        undone) and per seed (--seeds 3), --quality_jobs runs at a time; the median per row. dev/LOG.md: model quality.
gpu     (not part of "all") the GPU battery: pretraining tok/s, MFU and peak memory against model.py's estimate at
        d20, d12 and d26 beside nanochat's own scripts/base_train.py at the same shape and batch; validation bpb at
        d12 after the same tokens at 2^19 and 2^17 tokens a step, beside nanochat's; the demo plan end to end; chat
        decode tok/s. `python bench.py gpu_prepare --nanochat_mirror DIR --corpus DIR` first fills .bench/ (what a
        GPU machine without network needs); `python bench.py gpu --rows ...` on the GPU writes gpu_bench.json and
        gpu_bench.md to --out; `python bench.py gpu --dry_run` runs every row at toy size on the CPU.
compile  the first compiled training step (forward and backward as train_loop runs them) of a 2-layer, 128-wide
        model at vocabulary 512 (1 loss chunk) and 65,536 (32 chunks at --compile_batch 64), each in a fresh process
        with empty compile caches (cold), then again on those caches (warm): step 1, the steady step (median of 3),
        compilation = step 1 - steady step, peak memory; last line the vocab 65536 / 512 compilation ratio (target
        <= 1.5: compilation does not grow with the vocabulary).
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
import json
import math
import os
import statistics
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

import bench_gpu
import checkpoint
import common
import dataset
import distributed
import optim
import train_loop
from bench_gpu import bench_chat_decode, matmul_peak, sync
from dataset import iter_texts
from demo import write_demo
from loader import text_loader
from model import (
    KVCache,
    autocast_context,
    build_model,
    config_from_preset,
    flops_per_token,
    memory_estimate,
    num_params,
)
from tokenizer import Tokenizer, bytes_per_token, counting, train_tokenizer


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


def untrained_checkpoint(tmp, preset, stage, device):
    """A demo world, its vocab-1024 tokenizer and an untrained --preset model saved as `stage` saves one, under tmp
    (runs/bench/ckpt): what the evaluation benches run the real commands on."""
    write_demo(tmp / "demo")
    tok = train_tokenizer(iter_texts(tmp / "demo" / "pretrain", "train"), 1024)
    tok.save(tmp / "tokenizer")
    config = config_from_preset(preset, {"vocab_size": 1024})
    meta = {"stage": stage, "model_config": config.__dict__, "world_size": 1, "tokenizer": str(tmp / "tokenizer"),
            "tokenizer_sha256": tok.fingerprint(), "data_dir": str(tmp / "demo" / "pretrain")}
    checkpoint.save_checkpoint(tmp / "runs" / "bench" / "ckpt", 0, build_model(config, device), [], [], meta, 0, 1)


def bench_core_eval(args, device):
    """The real command on an untrained checkpoint of --preset, saved as pretrain.py saves one."""
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        untrained_checkpoint(tmp, args.preset, "pretrain", device)
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


def bench_chat_eval(args, device):
    """The real command on an untrained checkpoint of --preset (saved as sft.py saves one) over the demo world's
    multiple-choice items: one prompt per forward against nanochat's batching."""
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        untrained_checkpoint(tmp, args.preset, "sft", device)
        rates = {}
        for batch_items, option_text in ((1, "off"), (8, "off"), (8, "on")):
            out = tmp / f"out{batch_items}{option_text}.json"
            subprocess.run([sys.executable, str(Path(__file__).parent / "chat_eval.py"), "--checkpoint",
                            str(tmp / "runs" / "bench"), "--tasks", "demo-choice", "--batch_items", str(batch_items),
                            "--option_text", option_text, "--out", str(out)], check=True, capture_output=True)
            report = json.loads(out.read_text())
            rates[batch_items, option_text] = report["tasks"][0]["items"] / report["seconds"]
            print(f"chat_eval {args.preset} demo-choice: {rates[batch_items, option_text]:,.1f} items/s "
                  f"({report['tasks'][0]['items']} items, {report['seconds']:.1f} s, batch_items {batch_items}, option "
                  f"text {option_text}, {report['dtype']}, {report['device']})")
        print(f"chat_eval {args.preset} demo-choice letters: batched (8) {rates[8, 'off'] / rates[1, 'off']:.2f}x one "
              f"prompt per forward; the option-text diagnostic costs {rates[8, 'off'] / rates[8, 'on']:.2f}x the "
              f"letters' time")


def bench_generate(args, device):
    """Batched generation (decode.py) against the one-row paths it replaced, one run of each side by side on an
    untrained checkpoint of --preset (vocab 1024; an untrained model rarely ends a reply, so replies run to their
    budget: the lengths are printed). ChatCORE's generated answers: `python chat_eval.py --tasks demo-answer`
    --batch_items 1 (model.generate, one item at a time) and the default, items/s and whether every item's record is
    the same. RL's rollouts: rl.sample_group (one question's replies per batch, model.forward) against
    rl.sample_groups (every question's replies in one batch), 16 questions x 16 replies at temperature 1, top_k 50,
    on rl.py's one rollout thread: sampled tokens/s."""
    import rl  # here: the other benchmarks do not need it
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        untrained_checkpoint(tmp, args.preset, "sft", device)
        rates, records = {}, {}
        for batch_items in (1, 8, 32):
            out = tmp / f"out{batch_items}.json"
            subprocess.run([sys.executable, str(Path(__file__).parent / "chat_eval.py"), "--checkpoint",
                            str(tmp / "runs" / "bench"), "--tasks", "demo-answer", "--max_items",
                            str(args.generate_items), "--max_new_tokens", str(args.generate_tokens), "--batch_items",
                            str(batch_items), "--dtype", "float32", "--out", str(out)],
                           check=True, capture_output=True)
            report = json.loads(out.read_text())
            records[batch_items] = [json.loads(line) for line in out.with_name(out.stem + "_items.jsonl")
                                    .read_text().splitlines()]
            rates[batch_items] = report["tasks"][0]["items"] / report["seconds"]
            lengths = [len(r["reply"]) for r in records[batch_items]]
            print(f"generate chat_eval {args.preset} demo-answer, batch_items {batch_items:2d}: "
                  f"{rates[batch_items]:6.2f} items/s ({report['tasks'][0]['items']} items in "
                  f"{report['seconds']:.1f} s; replies {min(lengths)}-{max(lengths)} characters, max_new_tokens "
                  f"{args.generate_tokens}; {report['device']})")
        same = all(records[b] == records[1] for b in records)
        best = rates[8] / rates[1]
        print(f"generate chat_eval: batched (8, the default) {best:.2f}x one item at a time, (32) "
              f"{rates[32] / rates[1]:.2f}x (target >= 4x: {'met' if best >= 4 else 'MISSED'}); every item's record "
              f"identical: {same}")
        tok = Tokenizer.load(tmp / "tokenizer")
        model = checkpoint.load_model(tmp / "runs" / "bench" / "ckpt" / "step_000000", device)[0]
        items = rl.demo_items(tmp / "demo")[::187][:16]
        prompts = [rl.prompt_ids(tok, item["prompt"], model.config.sequence_len, 1)[0] for item in items]
        threads = torch.get_num_threads()
        torch.set_num_threads(rl.CPU_ROLLOUT_THREADS if device.type == "cpu" else threads)
        speeds = {}
        for name in ("sample_group", "sample_groups"):
            start = time.perf_counter()
            if name == "sample_group":
                sampled = [s for p in prompts for s in rl.sample_group(model, tok, p, 16, args.generate_tokens, 1.0,
                                                                       50, 0, "float32")[1]]
            else:
                sampled = rl.sample_groups(model, tok, prompts, 16, args.generate_tokens, 1.0, 50, 0, "float32")[1]
            seconds = time.perf_counter() - start
            speeds[name] = sum(map(sum, sampled)) / seconds
            print(f"generate rl {args.preset} {name:13s}: {speeds[name]:7,.0f} sampled tok/s ({sum(map(sum, sampled)):,}"
                  f" tokens, {len(sampled)} replies of {len(prompts)} questions in {seconds:.1f} s, "
                  f"{torch.get_num_threads()} thread(s))")
        torch.set_num_threads(threads)
        ratio = speeds["sample_groups"] / speeds["sample_group"]
        print(f"generate rl: all questions per batch {ratio:.2f}x one question per batch (target >= 3x: "
              f"{'met' if ratio >= 3 else 'MISSED'})")


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
    """pretrain.py at nanochat's tiny CPU configuration on real text: every compile/optimizer combination in the
    precision common.precision chooses, and the defaults in the other precision."""
    corpus = Path(args.corpus)
    if not corpus.is_dir():
        return print(f"cpu: skipped, no corpus at {corpus}")
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        train_tokenizer(iter_texts(corpus, "train"), 8192).save(tmp / "tokenizer")
        chosen, why = common.precision(device)
        other, rates = "bfloat16" if chosen == "float32" else "float32", {}
        # every optimizer and compile setting in the chosen precision, the other precision at the defaults only:
        # where bf16 is emulated (20-100x slower on an AVX2-only CPU) four runs in it would dominate the row
        for optimizer, compiled, dtype in [(o, c, chosen) for o in ("muon", "adamw") for c in ("false", "true")] + [
                ("muon", "true", other)]:
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
        print(f"cpu precision: {chosen} ({why}); Muon compiled: fp32 {rates['muon_float32_compiled']:,.0f} tok/s, "
              f"bf16 {rates['muon_bfloat16_compiled']:,.0f} tok/s")
        muon_share(device, 2048 / rates[f"muon_{chosen}_compiled"])


def compile_case(vocab, micro_batch, seq_len, device_name, dtype, steady_steps):
    """One bench.py compile case, in a fresh process (its own peak memory and compile caches): the first compiled
    training step (forward and backward through train_loop, as a stage runs them) and the median of the steady steps
    after it. Prints one JSON line."""
    import resource
    device = torch.device(device_name)
    if device.type == "cpu":
        distributed.keep_freed_memory()  # as every stage does on CPU
    config = config_from_preset("tiny", {"n_layer": 2, "n_embd": 128, "n_head": 2, "n_kv_head": 2,
                                         "vocab_size": vocab, "sequence_len": seq_len})
    torch.manual_seed(0)
    model = build_model(config, device)
    run = argparse.Namespace(compile=True)
    train_model = train_loop.wrap_model(model, run, 1, 0, device)
    idx = torch.randint(0, vocab, (micro_batch, seq_len), device=device)
    batches = [(idx, idx.roll(-1, 1))]
    times = []
    for _ in range(1 + steady_steps):
        start = time.perf_counter()
        train_loop.forward_backward(train_model, batches, dtype, device, 1)
        sync(device)
        times.append(time.perf_counter() - start)
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else \
        resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps({"first": times[0], "steady": statistics.median(times[1:]), "peak": peak}))


def bench_compile(args, device):
    """The first compiled training step at vocabulary 512 (one loss chunk) and 65,536 (32+), cold (empty compile
    caches) then warm (a second process on the same caches, as a run's next stage starts)."""
    import model as model_lib
    dtype, rows = common.matmul_dtype(device), args.compile_batch * 256
    ratio = {}
    for vocab in (512, 65536):
        chunks = math.ceil(rows * vocab / model_lib.LOSS_CHUNK_ELEMENTS)
        with tempfile.TemporaryDirectory() as cache:
            env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache, "TRITON_CACHE_DIR": str(Path(cache) / "triton")}
            for label in ("cold", "warm"):
                case = f"import bench; bench.compile_case({vocab}, {args.compile_batch}, 256, {str(device)!r}, {dtype!r}, 3)"
                out = subprocess.run([sys.executable, "-c", case], cwd=Path(__file__).parent, env=env,
                                     capture_output=True, text=True, check=False)
                if out.returncode:
                    raise RuntimeError(f"compile case vocab {vocab} failed:\n{out.stderr[-3000:]}")
                r = json.loads(out.stdout.strip().splitlines()[-1])
                compile_s = r["first"] - r["steady"]
                if label == "cold":
                    ratio[vocab] = compile_s
                print(f"compile vocab {vocab:6d} ({chunks} loss chunks of {args.compile_batch} x 256 rows, {dtype}) "
                      f"{label}: step 1 {r['first']:6.1f} s, steady step {r['steady']:.3f} s (median of 3), "
                      f"compilation {compile_s:6.1f} s, peak memory {common.fmt_bytes(r['peak'])}")
    print(f"compile: vocab 65536 / vocab 512 compilation ratio {ratio[65536] / ratio[512]:.2f}")


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


BENCHES = {"train": bench_train, "decode": bench_decode, "build": bench_build, "tokenizer": bench_tokenizer,
           "loader": bench_loader, "pretrain": bench_pretrain, "core_eval": bench_core_eval, "sft": bench_sft,
           "chat_eval": bench_chat_eval, "generate": bench_generate,
           "download": bench_download, "cpu": bench_cpu, "chat": bench_chat, "fsdp": bench_fsdp,
           "quality": bench_quality, "compile": bench_compile}


def main(argv=None):
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
    parser.add_argument("--generate_items", type=int, default=64, help="generate: demo-answer items (default: "
                        "%(default)s)")
    parser.add_argument("--generate_tokens", type=int, default=64, help="generate: max_new_tokens per reply "
                        "(default: %(default)s)")
    parser.add_argument("--compile_batch", type=int, default=64, help="compile: sequences of 256 tokens in the "
                        "micro-batch (default: %(default)s: 32 loss chunks at vocabulary 65,536)")
    parser.add_argument("--fsdp_steps", type=int, default=3, help="fsdp: steps timed (default: %(default)s)")
    parser.add_argument("--fsdp_seq", type=int, default=128, help="fsdp: tokens per sequence (default: %(default)s; "
                        "llama3-1b at 256 does not fit 2 processes in 24 GB)")
    parser.add_argument("--variants", nargs="+", default=list(QUALITY_VARIANTS), help="quality: which rows (default: "
                        "all)")
    parser.add_argument("--seeds", type=int, default=3, help="quality: seeds per row (default: %(default)s)")
    parser.add_argument("--quality_jobs", type=int, default=2, help="quality: runs at a time (default: %(default)s)")
    bench_gpu.add_gpu_args(parser)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        help="device (default: %(default)s)")
    args = parser.parse_args(argv)
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
            return {"gpu": bench_gpu.bench_gpu, "gpu_prepare": bench_gpu.gpu_prepare,
                    "gpu_probe": bench_gpu.gpu_probe}[args.which[0]](args, device)
        except (FileNotFoundError, ValueError) as e:  # ours, each naming its fix: one line, not a traceback
            parser.exit(1, f"bench.py: error: {e}\n")
    for name in args.which:
        if name not in BENCHES:
            parser.error(f"unknown benchmark {name!r}: choose from {', '.join(BENCHES)}")
        BENCHES[name](args, device)


if __name__ == "__main__":
    main()
