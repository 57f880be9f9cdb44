"""The fsdp and build benchmarks (moved out of bench.py: they checked big models on the CPU, dev/LOG.md).

    python dev/bench_fsdp.py --preset llama3-1b --fsdp_steps 2 --fsdp_seq 128

build: seconds to construct --preset on the meta device, and to materialize + initialize it on the CPU. fsdp: --preset
sharded by FSDP2 over 2 CPU processes (torchrun, gloo, one thread each), micro-batch 1 x --fsdp_seq tokens of
random ids, Muon, bf16 where native: seconds per step (steps after the first) and each rank's peak resident memory,
against model.py's estimate per rank ((weights + gradients + optimizer state) / 2 + activations + transient).
"""
import argparse
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import distributed
import optim
import train_loop
from model import build_model, config_from_preset, memory_estimate, num_params


def bench_build(name, device):
    """Seconds to construct the model on the meta device, and to materialize + initialize it on the device."""
    start = time.perf_counter()
    build_model(config_from_preset(name), device="meta")
    meta_s = time.perf_counter() - start
    start = time.perf_counter()
    model = build_model(config_from_preset(name), device=device)
    real_s = time.perf_counter() - start
    print(f"build {name}: meta {meta_s:.2f} s, materialize + init on {device} {real_s:.1f} s, {num_params(model):,} "
          f"params ({math.fsum(p.numel() * p.element_size() for p in model.parameters()) / 2**30:.2f} GiB fp32)")


def bench_fsdp(args):
    """Runs this file's fsdp_rank under torchrun on 2 processes and prints what rank 0 reports."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", __file__, "--rank",
               "--preset", args.preset, "--fsdp_steps", str(args.fsdp_steps), "--fsdp_seq", str(args.fsdp_seq)]
    result = subprocess.run(command, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                            check=False)
    if result.returncode:
        raise RuntimeError(f"fsdp: failed (exit {result.returncode}):\n{result.stderr[-3000:]}")
    print("\n".join(line for line in result.stdout.splitlines() if line.startswith(("fsdp", "distributed"))))


def bench_fsdp_rank(args):
    """One rank of bench_fsdp: the shared loop's pieces on a sharded model, timed; peak RSS gathered to rank 0."""
    import resource
    rank, _, world, device = distributed.setup_distributed()
    baseline = int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")  # torch, imported
    config = config_from_preset(args.preset, {"sequence_len": args.fsdp_seq})
    start = time.perf_counter()
    torch.manual_seed(0)
    model = build_model(config, device)
    dtype = distributed.matmul_dtype(device)
    run = argparse.Namespace(fsdp="true", optimizer="muon", adam8bit=False, dtype=dtype, compile=False, matrix_lr=0.02,
                             embedding_lr=0.2, head_lr=0.004, scalar_lr=0.04)
    sharding = train_loop.shard_model(model, run, world, device)
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
    est = memory_estimate(config, 1, args.fsdp_seq, optimizer="muon", bf16=dtype == "bfloat16",
                          device_type=device.type)
    sharded = (est["weights"] + est["gradients"] + est["optimizer"]) / world
    if rank == 0:
        print(f"fsdp {args.preset} ({num_params(config):,} params), {world} processes, micro-batch 1 x "
              f"{args.fsdp_seq}, Muon, {dtype}: {sharding}")
        print(f"fsdp build + shard {built:.1f} s; step times " + ", ".join(f"{t:.1f}" for t in times)
              + f" s (median after the first: {statistics.median(times[1:] or times):.1f} s)")
        print("fsdp peak resident memory per rank above its start (torch imported) " + ", ".join(
              f"{p / 2**30:.2f}" for p in peaks) + f" GiB; model.py's estimate per rank "
              f"{(sharded + est['activations'] + est['transient']) / 2**30:.2f} GiB (weights, gradients, optimizer / "
              f"{world}: {sharded / 2**30:.2f}; activations {est['activations'] / 2**30:.2f}; transient "
              f"{est['transient'] / 2**30:.2f})")
    distributed.teardown_distributed()


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="llama3-1b", help="model preset (default: %(default)s)")
    parser.add_argument("--fsdp_steps", type=int, default=3, help="steps timed (default: %(default)s)")
    parser.add_argument("--fsdp_seq", type=int, default=128, help="tokens per sequence (default: %(default)s; "
                        "llama3-1b at 256 does not fit 2 processes in 24 GB)")
    parser.add_argument("--rank", action="store_true", help="one rank, under the torchrun this script starts")
    args = parser.parse_args(argv)
    if args.rank:
        distributed.keep_freed_memory()  # as every stage does on CPU
        return bench_fsdp_rank(args)
    bench_build(args.preset, torch.device("cpu"))  # its model is freed before the ranks start
    bench_fsdp(args)


if __name__ == "__main__":
    main()
