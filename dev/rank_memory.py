"""Peak resident memory of each rank of a short pretrain.py under torchrun on CPU processes, beside the estimate the
run prints (its `sharding:` line): the figures behind the per-rank memory estimate (dev/LOG.md, 2026-11-29).

    python dev/rank_memory.py --nproc 3 --depth 8 --tokenizer DIR --data_dir DIR -- --fsdp true

Each worker's VmHWM (/proc/PID/status) is read every 50 ms while it runs; the highest reading per rank is printed."""
import argparse
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def workers(parent):
    """The pids of pretrain.py processes whose parent is `parent` (torchrun's workers)."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            stat, command = (entry / "stat").read_text(), (entry / "cmdline").read_bytes()
        except (OSError, ValueError):
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == parent and b"pretrain.py" in command:
            found.append(int(entry.name))
    return found


def high_water_mark(pid):
    """Bytes: the process's peak resident set so far, or None once it has ended."""
    try:
        lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    except OSError:
        return None
    return next(int(line.split()[1]) * 1024 for line in lines if line.startswith("VmHWM:"))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc", type=int, default=1)
    p.add_argument("--depth", type=int, default=4)
    p.add_argument("--tokenizer", required=True)
    p.add_argument("--data_dir", required=True)
    p.add_argument("--runs_dir", default="/tmp/rank_memory")
    p.add_argument("extra", nargs="*", help="more pretrain.py flags, after --")
    args = p.parse_args()
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.nproc}",
               str(ROOT / "pretrain.py"), "--data_dir", args.data_dir, "--tokenizer", args.tokenizer, "--preset",
               f"d{args.depth}", "--sequence_len", "128", "--total_batch_tokens", str(128 * 2 * args.nproc * 2),
               "--micro_batch", "2", "--steps", "3", "--eval_every", "0", "--ckpt_every", "3", "--keep", "1",
               "--bpb_tokens", "8192", "--compile", "false", "--runs_dir", args.runs_dir, "--run_name",
               f"n{args.nproc}_d{args.depth}", *args.extra]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               env={**os.environ, "OMP_NUM_THREADS": "1"})
    lines = []
    reader = threading.Thread(target=lambda: lines.extend(process.stdout))
    reader.start()
    peaks = {}
    while process.poll() is None:
        for pid in workers(process.pid):
            peaks[pid] = max(peaks.get(pid, 0), high_water_mark(pid) or 0)
        time.sleep(0.05)
    reader.join()
    print(f"d{args.depth} on {args.nproc} process(es) {' '.join(args.extra)}: exit {process.returncode}, peak resident "
          f"GiB per rank {sorted(round(v / 2 ** 30, 3) for v in peaks.values())}")
    print("".join(line for line in lines if line.startswith("sharding:")), end="")
    return process.returncode


if __name__ == "__main__":
    sys.exit(main())
