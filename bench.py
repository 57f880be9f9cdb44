"""Benchmarks: figures printed with their targets. Not tests; nothing here is timed inside pytest.

    python bench.py              # every benchmark
    python bench.py train decode # a chosen few: train, decode, build, tokenizer, loader, pretrain, core_eval

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
"""
import argparse
import json
import math
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

import common as C
from dataset import iter_texts, text_loader
from demo import write_demo
from model import KVCache, autocast_context, build_model, config_from_preset, flops_per_token, num_params
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
                   "--micro_batch", "16", "--eval_every", "0", "--eval_tokens", "4096", "--dtype", dtype,
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
        C.save_checkpoint(tmp / "runs" / "bench" / "ckpt", 0, build_model(config, device), [], [], meta, 0, 1)
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


BENCHES = {"train": bench_train, "decode": bench_decode, "build": bench_build, "tokenizer": bench_tokenizer,
           "loader": bench_loader, "pretrain": bench_pretrain, "core_eval": bench_core_eval}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("which", nargs="*", default=list(BENCHES), help=f"any of {', '.join(BENCHES)} (default: all)")
    parser.add_argument("--preset", default="tiny", help="model preset for train and decode (default: %(default)s)")
    parser.add_argument("--batch", type=int, default=8, help="sequences per training step (default: %(default)s)")
    parser.add_argument("--steps", type=int, default=10, help="timed training steps (default: %(default)s)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed training steps first (default: %(default)s)")
    parser.add_argument("--decode_tokens", type=int, default=64, help="tokens generated (default: %(default)s)")
    parser.add_argument("--trials", type=int, default=5, help="decode trials, the median is reported (default: "
                        "%(default)s)")
    parser.add_argument("--corpus", default=str(Path(__file__).resolve().parent.parent / "shared/corpus/realtext"),
                        help="text corpus for the tokenizer benchmark (default: %(default)s)")
    parser.add_argument("--bundle", default=None, help="eval bundle directory for core_eval (default: the demo "
                        "world's)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        help="device (default: %(default)s)")
    args = parser.parse_args()
    device = torch.device(args.device)
    print(f"device: {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}, torch "
          f"{torch.__version__}, {torch.get_num_threads()} CPU threads")
    for name in args.which:
        if name not in BENCHES:
            parser.error(f"unknown benchmark {name!r}: choose from {', '.join(BENCHES)}")
        BENCHES[name](args, device)


if __name__ == "__main__":
    main()
