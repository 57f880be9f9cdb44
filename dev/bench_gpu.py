"""The GPU battery (`bench.py gpu`: bench.py parses its flags, add_gpu_args, and calls bench_gpu or gpu_probe), and the
device measurements bench.py shares with it. `python bench_gpu.py` prints this.

    python dev/gpu_carry.py prepare --nanochat_mirror DIR --corpus DIR  # on a machine with both: fills .bench/
    python dev/bench.py gpu --rows mfu_d20 --out $OUT                       # on the GPU, one device call per row group
    python dev/bench.py gpu --dry_run                                       # every row at toy size on the CPU
    python dev/gpu_carry.py merge A/gpu_bench.json B/gpu_bench.json     # the calls' files into one table

Rows, each figure read back from what its command wrote: pretraining tok/s, MFU and peak memory against model.py's
estimate at d20, d12 and d26, beside nanochat's scripts/base_train.py at the same shape, batch and micro-batch;
validation bpb at d12 after the same tokens at 2^19 and 2^17 tokens a step, beside nanochat's; the demo plan end to
end; bench.py decode's figures (chat_decode). Each phase of a row (the micro-batch probe, ours, nanochat's) runs in a
process of its own under a time limit (run_logged). dev/gpu_session.sh runs the battery on a lent GPU machine (each
row's expected GPU time is there); dev/gpu_carry.py makes what that machine cannot download.
"""
import argparse
import itertools
import json
import math
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # the repository's modules
import distributed
import model
import optim
import train_loop
from report import read_json


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def matmul_peak(device, dtype, n=2048, reps=10):
    """Measured dense matmul FLOP/s: the achievable peak of this device, for devices the MFU table does not list."""
    a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
    a @ b
    sync(device)
    start = time.perf_counter()
    for _ in range(reps):
        a @ b
    sync(device)
    return 2 * n ** 3 * reps / (time.perf_counter() - start)


GPU_VOCAB = 32768  # nanochat's default tokenizer size (2^15): both sides train their own on the carried corpus
BIG_BATCH, SMALL_BATCH = 2 ** 19, 2 ** 17  # tokens per optimizer step: nanochat's d20 batch, and a quarter of it
BPB_TOKENS = 64 * BIG_BATCH  # training tokens of each bpb row: 64 steps at 2^19, 256 at 2^17
EVAL_TOKENS = 2 ** 18  # validation tokens of each bpb row (the validation shard holds ~2^19 at vocab 32768)
MFU_EVAL_TOKENS = 2 ** 16  # an MFU row's one evaluation (pretrain.py always ends with one): 32 rows of 2048, seconds
# the rows, in the order to run them when the whole battery does not fit: d20's MFU beside nanochat, d12's bpb at 2^19
# beside nanochat, then the rest. d12's throughput, MFU and memory are bpb_d12_b19's (the same shape and batch).
GPU_ROWS = {
    "mfu_d20": {"depth": 20, "batch": BIG_BATCH, "steps": 20},  # 17 timed after 3
    "bpb_d12_b19": {"depth": 12, "batch": BIG_BATCH, "steps": BPB_TOKENS // BIG_BATCH, "bpb": True},
    "bpb_d12_b17": {"depth": 12, "batch": SMALL_BATCH, "steps": BPB_TOKENS // SMALL_BATCH, "bpb": True},
    "mfu_d26": {"depth": 26, "batch": BIG_BATCH, "steps": 11},  # 8 timed after 3
    "demo": {}, "chat_decode": {},
}
# one device call each, under 10 minutes by dev/gpu_session.sh's estimate: a row's two runs each pay start-up and
# compilation besides their steps
GPU_CALLS = [["mfu_d20"], ["bpb_d12_b19"], ["bpb_d12_b17"], ["mfu_d26"], ["demo", "chat_decode"]]
# the dry run: every row at a toy size on the CPU (depth 2, sequence 64, the demo world, vocab 1024)
DRY = {"seq_len": 64, "micro": 4, "vocab": 1024, "steps_scale": 1 / 16, "skip": 1}
# the optimizers of gpu_probe and of bench.py cpu's Muon share (the lrs change neither time nor memory)
MUON_RUN = argparse.Namespace(optimizer="muon", adam8bit=False, matrix_lr=0.02, embedding_lr=0.2, head_lr=0.004,
                              scalar_lr=0.04)


def nanochat_data(base, corpus):
    """$NANOCHAT_BASE_DIR's data folder as nanochat expects it: the corpus shards (links), the last one validation."""
    data = base / "base_data_climbmix"
    data.mkdir(parents=True, exist_ok=True)
    for shard in sorted(Path(corpus).glob("shard_*.parquet")):
        (data / shard.name).symlink_to(shard.resolve())


def nanochat_env(bench, base):
    """Environment for nanochat's scripts: its base dir, the wandb stub (and the carried wheels) on PYTHONPATH."""
    return {**os.environ, "NANOCHAT_BASE_DIR": str(base), "WANDB_MODE": "disabled", "PYTHONUNBUFFERED": "1",
            "PYTHONPATH": os.pathsep.join(filter(None, [str(Path(bench) / "stub"), os.environ.get("PYTHONPATH")]))}


def run_logged(command, log, phase, timeout, cwd=None, env=None):
    """A command with its output in `log`, a line printed as the phase starts and one as it ends; past `timeout` seconds
    its process group stopped (SIGTERM, SIGKILL 10 s later). (exit status or "timed out after N s", wall seconds, peak
    resident bytes of the process and its waited-for children: wait4's)"""
    print(f"gpu: {phase}: started (log {log}, timeout {timeout:.0f} s)", flush=True)
    start = time.perf_counter()
    with open(log, "w") as out:
        print("$", *command, file=out, flush=True)
        # a stop signal while Popen runs is held until the try below, whose finally stops the phase: raised in
        # Popen, it would leave the phase running with no one to stop it
        held = []
        handlers = {s: signal.signal(s, lambda signum, _: held.append(signum)) for s in (signal.SIGINT, signal.SIGTERM)}
        try:  # its own session: a timeout stops it and what it started (torch.compile's workers), not this process
            process = subprocess.Popen(list(map(str, command)), stdout=out, stderr=subprocess.STDOUT, cwd=cwd,
                                       env=env, start_new_session=True)
        finally:  # also when Popen fails: the handlers must not stay holding
            for signum, handler in handlers.items():
                signal.signal(signum, handler if handler is not None else signal.SIG_DFL)
        stopped_at, waited = None, (0, 0, None)
        try:
            for signum in held:
                signal.raise_signal(signum)
            while not (waited := os.wait4(process.pid, os.WNOHANG))[0]:
                elapsed = time.perf_counter() - start
                if stopped_at is None and elapsed > timeout:
                    stopped_at = elapsed
                    os.killpg(process.pid, signal.SIGTERM)
                elif stopped_at is not None and elapsed > stopped_at + 10:
                    os.killpg(process.pid, signal.SIGKILL)
                time.sleep(0.2)
        finally:
            if not waited[0]:  # this process was stopped (Ctrl-C, the device call's timeout): the phase goes with it
                os.killpg(process.pid, signal.SIGKILL)
    process.returncode = status = os.waitstatus_to_exitcode(waited[1])
    wall, status = time.perf_counter() - start, f"timed out after {timeout:.0f} s" if stopped_at is not None else status
    print(f"gpu: {phase}: {'exit ' + str(status) if isinstance(status, int) else status}, {wall:.0f} s", flush=True)
    return status, wall, waited[2].ru_maxrss * 1024


def tail(path, lines=15):
    return "\n".join(Path(path).read_text(errors="replace").splitlines()[-lines:])


def failure(status, log):
    """A failed or timed-out phase's status line: why, and the last lines of its log."""
    return f"{status} (--phase_timeout, --deadline_s); log tail:\n{tail(log, 8)}" if isinstance(status, str) else \
        "failed: " + ("out of memory" if out_of_memory(log) else f"exit {status}; log tail:\n{tail(log, 8)}")


def out_of_memory(log):
    return any(error in Path(log).read_text(errors="replace") for error in ("OutOfMemoryError", "CUDA out of memory"))


def gpu_probe(args, device):
    """`bench.py gpu_probe`: the largest micro-batch (a power of 2 up to --max_micro; on a CPU, that) with which a
    training step of --preset fits, by pretrain.py's probe. A process of its own: the rows start with the GPU empty."""
    overrides = {"vocab_size": args.gpu_vocab, **({"sequence_len": args.probe_seq_len} if args.probe_seq_len else {})}
    config = model.config_from_preset(args.preset, overrides)
    net = model.build_model(config, device)
    optimizers = optim.build_optimizers(net, MUON_RUN, config.n_embd, 1, device)
    dtype = "bfloat16" if device.type == "cuda" else "float32"  # the battery's training dtype there
    try_step = train_loop.probe_step(net, optimizers, config.sequence_len, config.vocab_size, dtype, device)
    micro = train_loop.find_micro_batch(try_step, [2 ** k for k in range(int(math.log2(args.max_micro)) + 1)])
    print(f"micro_batch {micro}")


class GpuBattery:
    """The rows of `bench.py gpu`: each a dict of what ran and what it measured ('unknown' or 'unavailable: <why>' where
    a figure could not be had). Logs and our run directories (no checkpoints) go to --out/logs, which the device tool
    brings back; scratch (nanochat's data and checkpoint folder, the demo's run) to bench.py's --work."""

    def __init__(self, args, device, demo_files, bench_decode):  # bench.py's (it imports this module)
        self.args, self.device, self.dry, self.bench_decode = args, device, args.dry_run, bench_decode
        self.bench, self.here = Path(args.bench_dir).resolve(), ROOT
        self.logs, self.work = Path(args.out).resolve() / "logs", Path(args.work) / "gpu"
        for folder in (self.logs, self.work):
            folder.mkdir(parents=True, exist_ok=True)
        # each phase's limit: --phase_timeout, or less when --deadline_s (from the call's start) leaves less
        self.deadline = time.perf_counter() + args.deadline_s if args.deadline_s else math.inf
        # bf16 on the GPU, as nanochat there; fp32 in the dry run, as nanochat on a CPU
        self.dtype = "bfloat16" if device.type == "cuda" else "float32"
        self.peak = distributed.peak_flops(distributed.device_name(device), self.dtype)
        self.peak_source = "rated dense bf16 peak (distributed.PEAK_BF16_FLOPS)"
        if self.peak is None:  # a CPU, or a GPU the table lacks: this device's own measured matmul throughput
            self.peak = matmul_peak(device, getattr(torch, self.dtype))
            self.peak_source = f"measured 2048x2048 {self.dtype} matmul throughput of this device"
        if self.dry:  # the toy world: bench.py's demo world and its vocab-1024 tokenizer
            self.corpus, self.tok_ours = demo_files(args) / "demo" / "pretrain", Path(args.work) / "tokenizer_1024"
        else:
            self.corpus, self.tok_ours = self.bench / "corpus", self.bench / "tokenizer_ours"
        self.vocab = DRY["vocab"] if self.dry else (read_json(self.bench / "PREPARED.json") or {}).get("vocab")
        self.tok_nanochat = self.bench / "tokenizer_nanochat"
        if not (self.tok_ours / "tokenizer.json").is_file():
            raise FileNotFoundError(f"gpu: no tokenizer in {self.tok_ours}: run `python dev/gpu_carry.py prepare` "
                                    "where the nanochat mirror and the corpus are, and carry its folder (--bench_dir)")
        self.nanochat_missing, self.micro_cache = self.check_nanochat(), {}

    def timeout(self):
        """Seconds the next phase may take: --phase_timeout, or what --deadline_s leaves (at least 1)."""
        return max(1.0, min(self.args.phase_timeout, self.deadline - time.perf_counter()))

    def check_nanochat(self):
        """Why nanochat's rows cannot run here, or None."""
        tree, prepare = self.bench / "nanochat", "(run `python dev/gpu_carry.py prepare`"
        if not (tree / "scripts" / "base_train.py").is_file():
            return f"no nanochat tree at {tree} {prepare} where the mirror is, and carry it)"
        if not (self.bench / "stub" / "wandb.py").is_file():
            return f"no wandb stub in {self.bench / 'stub'} {prepare})"
        imports = "import tiktoken, rustbpe, pyarrow, filelock, jinja2, yaml, requests, wandb"
        check = subprocess.run([sys.executable, "-c", imports], env=nanochat_env(self.bench, self.work),
                               capture_output=True, text=True, check=False)
        if check.returncode:
            return "nanochat's dependencies do not import: " + check.stderr.strip().splitlines()[-1]
        if not (self.tok_nanochat / "tokenizer.pkl").is_file():  # the dry run's too: its vocab, on the toy world
            return f"no nanochat tokenizer in {self.tok_nanochat} {prepare})"
        return None

    def size(self, spec):
        """(preset, overrides, tokens a step, steps, steps untimed: compilation, warm-up) of a training row: d{depth}
        at sequence 2048; the dry run's d2 at 64, 2^19 tokens a step -> 16 rows (the two batches' ratio kept)."""
        if self.dry:
            return ("d2", {"sequence_len": DRY["seq_len"], "vocab_size": self.vocab}, spec["batch"] * DRY["seq_len"]
                    // 2048 // 16, max(3, round(spec["steps"] * DRY["steps_scale"])), DRY["skip"])
        steps = self.args.bpb_tokens // spec["batch"] if spec.get("bpb") else spec["steps"]
        return f"d{spec['depth']}", {"vocab_size": self.vocab}, spec["batch"], steps, 3

    def micro_batch(self, name, preset, overrides, per_step):
        """The largest micro-batch that fits, capped at the step's rows: `bench.py gpu_probe` (pretrain.py's probe)
        in its own process, once per preset; the dry run's probe, on the CPU, tries up to DRY["micro"]."""
        cap = DRY["micro"] if self.dry else 256
        if preset not in self.micro_cache:
            log = self.logs / f"{name}_probe.log"
            command = [sys.executable, self.here / "dev" / "bench.py", "gpu_probe", "--preset", preset, "--gpu_vocab",
                       overrides["vocab_size"], "--max_micro", cap, "--probe_seq_len",
                       overrides.get("sequence_len", 0), "--device", self.device.type]
            status, _, _ = run_logged(command, log, f"{name} probe ({preset})", self.timeout())
            found = [line for line in log.read_text().splitlines() if line.startswith("micro_batch ")]
            if status != 0 or not found:
                raise RuntimeError(f"micro-batch probe of {preset} " + (failure(status, log) if status != 0 else
                                   f"exited 0 without a `micro_batch N` line; log tail:\n{tail(log, 8)}"))
            self.micro_cache[preset] = int(found[-1].split()[1])
            print(f"gpu: {name} probe ({preset}): micro-batch {self.micro_cache[preset]}", flush=True)
        return min(self.micro_cache[preset], per_step), (f"largest that fits, up to {cap} (bench.py gpu_probe: "
                                                         "pretrain.py's probe, eager)")

    def phase(self, row, command, label, log, **popen):
        """One phase of a row, run (run_logged) and recorded in it: exit, wall seconds, log, status. (status, rss)"""
        status, wall, rss = run_logged(command, log, label, self.timeout(), **popen)
        row.update(exit=status, wall_s=wall, log=str(log), status="ok" if status == 0 else failure(status, log))
        return status, rss

    def ours(self, name, spec):
        """pretrain.py at the row's shape and batch, at the largest micro-batch that fits, one evaluation at its end."""
        preset, overrides, batch, steps, skip = self.size(spec)
        config = model.config_from_preset(preset, overrides)
        micro, how = self.micro_batch(name, preset, overrides, batch // config.sequence_len)
        run_dir = self.logs / f"{name}_ours"
        # no checkpoint: none every 10^6 steps, none at the end (d20's is ~9 GB, d26's tens: 64 GiB of disk)
        command = [sys.executable, self.here / "pretrain.py", "--preset", preset, *itertools.chain.from_iterable(
                   (f"--{k}", v) for k, v in overrides.items() if k != "vocab_size"),
                   "--data_dir", self.corpus, "--tokenizer", self.tok_ours, "--runs_dir", run_dir.parent,
                   "--run_name", run_dir.name, "--steps", steps, "--total_batch_tokens", batch, "--micro_batch", micro,
                   "--eval_every", 0, "--bpb_tokens", 4096 if self.dry else EVAL_TOKENS if spec.get("bpb") else
                   MFU_EVAL_TOKENS, "--ckpt_every", 10 ** 6, "--final_checkpoint", "false", "--dtype", self.dtype,
                   "--compile", "false" if self.dry else "true", "--log_every", 1]
        row = {"row": name, "side": "ours", "model": preset, "n_layer": config.n_layer, "n_embd": config.n_embd,
               "vocab": config.vocab_size, "seq_len": config.sequence_len, "micro_batch": micro,
               "micro_batch_from": how, "tokens_per_step": batch, "steps": steps, "dtype": self.dtype,
               "compiled": not self.dry, "attention": "SDPA (torch.nn.functional.scaled_dot_product_attention)",
               "flops_per_token": model.flops_per_token(config), "params": model.num_params(config),
               "memory_estimate": model.memory_estimate(config, micro, optimizer="muon", bf16=self.dtype == "bfloat16",
                                                        device_type=self.device.type)["total"],
               "command": " ".join(map(str, command)).replace(str(self.logs), "$OUT/logs"), "run_dir": str(run_dir)}
        status, rss = self.phase(row, command, f"{name} ours (pretrain.py: compilation, {steps} steps, evaluation)",
                                 self.logs / f"{name}_ours.log")
        records = metrics.read_text().splitlines() if (metrics := run_dir / "metrics.jsonl").is_file() else []
        if logged := [r for r in map(json.loads, records) if "loss" in r]:  # its steps (a timed-out run's too)
            print(f"gpu: {name} ours: step 1 (compilation) {logged[0]['step_time']:.1f} s; {len(logged)} steps logged")
            self.throughput(row, [r["step_time"] for r in logged if r["step"] > skip], skip)
            cuda = self.device.type == "cuda"
            row.update(peak_memory=logged[-1]["cuda_mem_peak"] if cuda else rss, loss_first_last=[logged[0]["loss"],
                       logged[-1]["loss"]], peak_memory_kind="torch.cuda.max_memory_allocated" if cuda else
                       "peak resident set of the process (CPU: includes torch itself)")
        if status == 0:
            row["val_bpb"] = json.loads((run_dir / "done.json").read_text())["val_bpb"]
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
        print(f"gpu: {row['row']} {row['side']}: steps {row['steps_timed']} median {median:.3f} s, "
              f"{row['tok_per_s']:,.0f} tok/s, MFU {100 * row['mfu']:.1f}%", flush=True)

    def nanochat(self, name, spec, ours):
        """nanochat's scripts/base_train.py at the shape, batch and micro-batch of `ours`, full attention (the window
        pattern L: this repository has no sliding window), its defaults otherwise; its last checkpoint to /dev/null."""
        commit = self.bench / "nanochat" / "COMMIT"
        row = {"row": name, "side": "nanochat", "nanochat_commit": (commit.read_text() if commit.is_file() else
                                                                    "unknown").strip()}
        if self.nanochat_missing or "micro_batch" not in ours:
            return {**row, "status": f"unavailable: {self.nanochat_missing}" if self.nanochat_missing else
                    "unavailable: this repository's run of the row did not start"}
        depth, seq, micro = ours["n_layer"], ours["seq_len"], ours["micro_batch"]
        batch, steps, skip = ours["tokens_per_step"], ours["steps"], self.size(spec)[4]
        base = self.work / f"nc_{name}"
        nanochat_data(base, self.corpus)
        shutil.copytree(self.tok_nanochat, base / "tokenizer")
        saved = base / "base_checkpoints" / f"bench_{name}"  # base_train.py's checkpoint_dir for --model-tag
        saved.mkdir(parents=True)
        for file in (f"model_{steps:06d}.pt", f"optim_{steps:06d}_rank0.pt"):
            (saved / file).symlink_to(os.devnull)
        bpb = spec.get("bpb") or self.dry
        row.update(model=f"d{depth}", seq_len=seq, tokens_per_step=batch, steps=steps,
                   flops_per_token=ours["flops_per_token"], compiled=True,
                   attention="SDPA (FA3 needs the `kernels` package and the hub: unavailable offline)")
        log = self.logs / f"{name}_nanochat.log"
        while True:  # ours' micro-batch; halved while nanochat runs out of memory at it (it has no probe)
            command = [sys.executable, "-m", "scripts.base_train", "--run=dummy", f"--device-type={self.device.type}",
                       f"--depth={depth}", f"--aspect-ratio={model.DEPTH_ASPECT}",
                       f"--head-dim={model.DEPTH_HEAD_DIM}", "--window-pattern=L", f"--max-seq-len={seq}",
                       f"--device-batch-size={micro}", f"--total-batch-size={batch}", f"--num-iterations={steps}",
                       f"--eval-every={steps if bpb else -1}", f"--eval-tokens={EVAL_TOKENS if not self.dry else 4096}",
                       "--core-metric-every=-1", "--sample-every=-1", "--save-every=-1", f"--model-tag=bench_{name}"]
            status, rss = self.phase(row, command, f"{name} nanochat (base_train.py: compilation, {steps} steps"
                                     f"{', evaluation' if bpb else ''}; micro-batch {micro})", log,
                                     cwd=self.bench / "nanochat",
                                     env={**nanochat_env(self.bench, base), "OMP_NUM_THREADS":
                                          str(torch.get_num_threads())})
            if not (status != 0 and out_of_memory(log) and micro > 1):
                break
            row.setdefault("out_of_memory_at_micro_batch", []).append(micro)
            micro //= 2
        row.update(micro_batch=micro, command=f"cd {self.bench / 'nanochat'} && NANOCHAT_BASE_DIR=$WORK/{base.name} "
                   f"PYTHONPATH={self.bench / 'stub'} " + " ".join(map(str, command)).replace(sys.executable, "python"))
        text = log.read_text(errors="replace")
        lines = re.findall(r"^step (\d+)/\d+ .*?\| dt: ([\d.]+)ms \| tok/sec: ([\d,]+) \| bf16_mfu: ([\d.]+)", text,
                           re.MULTILINE)
        # nanochat numbers its steps from 0: its step i is this repository's step i + 1
        timed = [(int(s) + 1, float(dt) / 1000, float(m)) for s, dt, _, m in lines if int(s) + 1 > skip]
        if lines:  # a timed-out run's steps still give its throughput
            self.throughput(row, [t[1] for t in timed], skip)
            if timed and self.device.type == "cuda":
                row["mfu_nanochat_reported"] = statistics.median(t[2] for t in timed) / 100  # its own FLOPs/token
        # its own prints: each figure "unknown" where it printed none; bpb its last step's (it evaluates at step 0
        # too: a run stopped before its end has only that one)
        for key, pattern, value in (("dtype", r"^COMPUTE_DTYPE: torch\.(\w+)", str),
                                    ("flops_per_token_nanochat", r"Estimated FLOPs per token: ([\d.e+]+)", float),
                                    ("params", r"^total\s*: ([\d,]+)$", lambda v: int(v.replace(",", ""))),
                                    ("peak_memory", r"Peak memory usage: ([\d.]+)MiB", lambda v: float(v) * 2 ** 20),
                                    ("val_bpb", rf"^Step {steps:05d} \| Validation bpb: ([\d.]+)", float)):
            found = re.search(pattern, text, re.MULTILINE)
            row[key] = value(found[1]) if found else "unknown"
        on_gpu = self.device.type == "cuda"
        row.update(val_bpb=row["val_bpb"] if bpb else None, peak_memory=row["peak_memory"] if on_gpu else rss,
                   peak_memory_kind="torch.cuda.max_memory_allocated (its own print)" if on_gpu else
                   "peak resident set of the process (CPU)")
        row["checkpoint_bytes_on_disk"] = sum(f.stat().st_size for f in saved.iterdir() if not f.is_symlink())
        shutil.rmtree(base, ignore_errors=True)
        if status == 0 and "out_of_memory_at_micro_batch" in row:
            row["status"] += f" at micro-batch {micro} (out of memory at {row['out_of_memory_at_micro_batch']})"
        return row

    def demo(self):
        """speedrun.sh --plan demo end to end (the dry run: every stage at a few steps)."""
        run = self.work / "demo_run"
        command = ["bash", self.here / "speedrun.sh", "--plan", "demo", "--gpus", "1" if self.device.type == "cuda"
                   else "0", "--no_chat", "--runs_dir", run.parent, "--run_name", run.name]
        env = {**os.environ, "SPEEDRUN_PYTHON": sys.executable}
        if self.dry:
            command += ["--tokenizer", self.tok_ours, "--data_dir", self.corpus.parent]
            env.update(PRETRAIN_ARGS="--steps 3 --bpb_tokens 4096 --n_layer 1 --n_embd 64 --n_head 1 --n_kv_head 1",
                       MIDTRAIN_ARGS="--steps 2 --eval_rows 4", SFT_ARGS="--steps 2 --eval_rows 4",
                       CORE_ARGS="--bpb_tokens 4096 --max_new_tokens 4 --max_items 4",
                       CHAT_EVAL_ARGS="--max_items 2 --max_new_tokens 4")
        row = {"row": "demo", "side": "ours", "command": " ".join(map(str, command)).replace(str(self.work), "$WORK")}
        self.phase(row, command, "demo (speedrun.sh --plan demo)", self.logs / "demo.log", cwd=self.work, env=env)
        core = sorted(run.glob("core_eval/**/results.json"))
        row.update(val_bpb=(read_json(run / "pretrain" / "done.json") or {}).get("val_bpb", "unknown"),
                   core=read_json(core[-1])["core"] if core else "unknown",
                   chatcore=(read_json(run / "chat_eval.json") or {}).get("chatcore", "unknown"))
        shutil.rmtree(run, ignore_errors=True)  # its checkpoints
        return row

    def chat_decode(self):
        """bench.py decode at preset tiny, in this process, in chat.py's dtype and paths (the dry run: eager alone)."""
        args = argparse.Namespace(**{**vars(self.args), "preset": "tiny"})
        print("gpu: chat_decode: started", flush=True)
        row = {"row": "chat_decode", "side": "ours", "command": f"python dev/bench.py decode --preset tiny --decode_tokens "
               f"{args.decode_tokens} --trials {args.trials} --generate_tokens {args.generate_tokens} (random weights)"}
        try:  # in this process, unlike the other rows: a failure (a compilation error) is the row's, not the call's
            row.update(status="ok", **self.bench_decode(args, self.device))
        except Exception as e:  # noqa: BLE001  (any error: reported in the row, the table still written)
            row["status"] = f"failed: {type(e).__name__}: {e}"
        print(f"gpu: chat_decode: {'done' if row['status'] == 'ok' else row['status']}", flush=True)
        return row


def gpu_environment(device, bench_dir):
    """Device, driver, torch and the code, for the battery's header."""
    driver, code, prepared = "none (CPU)", distributed.code_version(), read_json(Path(bench_dir) / "PREPARED.json")
    try:
        driver = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                capture_output=True, text=True, timeout=30, check=True).stdout.strip() \
            if device.type == "cuda" else driver
    except (OSError, subprocess.SubprocessError):
        driver = "unknown (nvidia-smi did not answer)"
    return {"device": distributed.device_name(device), "driver": driver, "torch": torch.__version__,
            "cuda": torch.version.cuda or "none", "python": sys.version.split()[0], "commit": code["commit"],
            "dirty": code["dirty"], "prepared_at_commit": prepared["code"]["commit"] if prepared else "unknown",
            "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}


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
    header += "".join(f"; another call: {e['device']}, driver {e['driver']}, torch {e['torch']}, commit {e['commit']}, "
                      f"{e['date']}" for e in result.get("environments", []) if e != env)  # gpu_carry.py merge's
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


def bench_gpu(args, device, demo_files, bench_decode):
    """`bench.py gpu`: the rows chosen by --rows, in GPU_ROWS's order, to --out/gpu_bench.json and .md (printed)."""
    out = Path(args.out)
    if device.type != "cuda" and not args.dry_run:
        raise ValueError("gpu: no CUDA device; on a CPU run `python dev/bench.py gpu --dry_run` (toy sizes)")
    battery = GpuBattery(args, device, demo_files, bench_decode)
    result = {"dry_run": args.dry_run, "environment": gpu_environment(device, args.bench_dir), "rows": [],
              "calls": [" ".join(["python3 dev/bench.py gpu --rows", *rows, "--out $OUT"]) for rows in GPU_CALLS]}

    def save():  # after every side of every row: a call killed later keeps what it finished
        (out / "gpu_bench.json").write_text(json.dumps(result, indent=1) + "\n")
        (out / "gpu_bench.md").write_text(gpu_markdown(result))
    for name, spec in [(r, spec) for r, spec in GPU_ROWS.items() if r in args.rows]:
        print(f"gpu: row {name} ...", flush=True)
        if "depth" in spec:
            try:
                ours = battery.ours(name, spec)
            except RuntimeError as e:  # the probe failed (it says how): nothing of the row ran
                ours = {"row": name, "side": "ours", "status": str(e)}
            result["rows"].append(ours)
            save()
            result["rows"].append(battery.nanochat(name, spec, ours))
        else:
            result["rows"].append(battery.demo() if name == "demo" else battery.chat_decode())
        save()
    print(gpu_markdown(result))
    print(f"gpu: {out / 'gpu_bench.json'}, {out / 'gpu_bench.md'}; logs in {battery.logs}")


def add_gpu_args(parser):
    """bench.py's flags for the battery (gpu, gpu_probe)."""
    g = parser.add_argument_group("gpu battery (gpu, gpu_probe)")
    g.add_argument("--rows", nargs="+", default=list(GPU_ROWS), choices=GPU_ROWS, help="gpu: rows to run (default: "
                   "all; one device call each: " + "; ".join(" ".join(c) for c in GPU_CALLS) + ")")
    g.add_argument("--out", default=os.environ.get("OUT") or "runs/gpu_bench", help="gpu: where gpu_bench.json and "
                   ".md go (default: $OUT when set, else runs/gpu_bench; now: %(default)s)")
    g.add_argument("--bench_dir", default=str(ROOT / ".bench"), help="the carry folder "
                   "dev/gpu_carry.py prepare fills and gpu reads (default: %(default)s)")
    g.add_argument("--gpu_vocab", type=int, default=GPU_VOCAB, help="gpu_probe: vocabulary (default: %(default)s)")
    g.add_argument("--bpb_tokens", type=int, default=BPB_TOKENS, help="gpu: training tokens of each bpb row, both "
                   "batches (default: %(default)s = 64 steps of 2^19, ~9 epochs of the carried corpus at vocab 32768)")
    g.add_argument("--max_micro", type=int, default=256, help="gpu_probe: largest micro-batch tried (default: 256)")
    g.add_argument("--probe_seq_len", type=int, default=0, help="gpu_probe: sequence_len (default: 0 = the preset's)")
    g.add_argument("--phase_timeout", type=float, default=300, help="gpu: seconds a phase of a row (the probe, ours, "
                   "nanochat's, the demo) may take, then it is stopped (default: %(default)s)")
    g.add_argument("--deadline_s", type=float, default=0, help="gpu: seconds from this call's start by which every "
                   "phase is stopped, the table written before the device's own limit; 0 = none (default: 0)")

if __name__ == "__main__":
    print(__doc__)
