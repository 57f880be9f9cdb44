"""The compile benchmark (moved out of bench.py: it checked that compilation does not grow with the vocabulary once the
chunked loss stopped unrolling into the graph; docs/model.md, dev/LOG.md).

    python dev/bench_compile.py --compile_batch 64

The first compiled training step (forward and backward as train_loop runs them) of a 2-layer, 128-wide model at
vocabulary 512 (1 loss chunk) and 65,536 (at --compile_batch 64: 32 chunks on the CPU, 4 on CUDA, whose chunks are
8x larger: model.loss_chunk_elements), each in a fresh process with empty compile caches (cold), then again on those
caches (warm): step 1, the steady step (median of 3), compilation = step 1 - steady step, peak memory; last line the
vocab 65536 / 512 compilation ratio (target <= 1.5).
"""
import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import distributed
import train_loop
from bench_gpu import sync
from model import build_model, config_from_preset, loss_chunk_elements


def compile_case(vocab, micro_batch, seq_len, device_name, dtype, steady_steps):
    """One compile case, in a fresh process (its own peak memory and compile caches): the first compiled
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
    train_model = train_loop.wrap_model(model, argparse.Namespace(compile=True), 1, 0, device)
    idx = torch.randint(0, vocab, (micro_batch, seq_len), device=device)
    times = []
    for _ in range(1 + steady_steps):
        start = time.perf_counter()
        train_loop.forward_backward(train_model, [(idx, idx.roll(-1, 1))], dtype, device, 1)
        sync(device)
        times.append(time.perf_counter() - start)
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else \
        resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps({"first": times[0], "steady": statistics.median(times[1:]), "peak": peak}))


def bench_compile(args):
    """The first compiled training step at vocabulary 512 (one loss chunk) and 65,536 (several), cold (empty compile
    caches) then warm (a second process on the same caches, as a run's next stage starts)."""
    device = torch.device(args.device)
    dtype, rows = distributed.matmul_dtype(device), args.compile_batch * 256
    compilation = {}
    for vocab in (512, 65536):
        chunks = math.ceil(rows * vocab / loss_chunk_elements(device.type))
        with tempfile.TemporaryDirectory() as cache:
            env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache, "TRITON_CACHE_DIR": str(Path(cache) / "triton")}
            for label in ("cold", "warm"):
                case = [sys.executable, __file__, "--case", str(vocab), "--compile_batch", str(args.compile_batch),
                        "--device", str(device)]
                out = subprocess.run(case, env=env, capture_output=True, text=True, check=False)
                if out.returncode:
                    raise RuntimeError(f"compile case vocab {vocab} failed:\n{out.stderr[-3000:]}")
                r = json.loads(out.stdout.strip().splitlines()[-1])
                compilation.setdefault(vocab, r["first"] - r["steady"])  # the cold one
                print(f"compile vocab {vocab:6d} ({chunks} loss chunks of {args.compile_batch} x 256 rows, {dtype}) "
                      f"{label}: step 1 {r['first']:6.1f} s, steady step {r['steady']:.3f} s (median of 3), "
                      f"compilation {r['first'] - r['steady']:6.1f} s, peak memory {distributed.fmt_bytes(r['peak'])}")
    ratio = compilation[65536] / compilation[512]
    print(f"compile: vocab 65536 / vocab 512 compilation ratio {ratio:.2f} (target <= 1.5: "
          f"{'met' if ratio <= 1.5 else 'MISSED'})")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--compile_batch", type=int, default=64, help="sequences of 256 tokens in the micro-batch "
                        "(default: %(default)s: at vocabulary 65,536, 32 loss chunks on the CPU, 4 on CUDA)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="device (default: "
                        "%(default)s)")
    parser.add_argument("--case", type=int, default=None, help="one case at this vocabulary, in this process (what "
                        "the benchmark runs)")
    args = parser.parse_args(argv)
    if args.case is None:
        return bench_compile(args)
    device = torch.device(args.device)
    compile_case(args.case, args.compile_batch, 256, args.device, distributed.matmul_dtype(device), 3)


if __name__ == "__main__":
    main()
