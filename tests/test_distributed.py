"""Beyond one device (docs/distributed.md): FSDP2 takes DDP's steps, and 2 processes give one process's loss and
gradients; a rank that hangs stops the run with a message naming it and leaves no process (one that dies, and sharded
checkpoints resumed at another world size, consolidated, and two "nodes" meeting through c10d rendezvous:
tests/test_pretrain.py)."""
import json
import re
import time

import pytest
import torch
from helpers import ROOT, assert_same, processes_mentioning, run_script, step

SMALL = ["--sequence_len", "64", "--n_layer", "2", "--n_embd", "64", "--n_head", "2", "--n_kv_head", "2",
         "--micro_batch", "4", "--eval_every", "0", "--bpb_tokens", "4096", "--log_every", "1000", "--dtype", "float32"]


def pretrain_args(world, args):
    return ["--data_dir", str(world / "demo" / "pretrain"), "--tokenizer", str(world / "tokenizer"), "--runs_dir",
            str(world / "runs"), *SMALL, *args]


def losses(run_dir):
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records if "loss" in r}


@pytest.fixture(scope="session")
def worker_runs(tmp_path_factory):
    """tests/fsdp_worker.py's results, one torchrun launch for the tests below."""
    out = tmp_path_factory.mktemp("fsdp") / "runs.pt"
    run_script("tests/fsdp_worker.py", [str(out)], ROOT, nproc=2)
    return torch.load(out, weights_only=True)


def test_fsdp_takes_the_steps_ddp_takes_with_muon_and_adamw(worker_runs):
    """Stated tolerance: fp32 none, bitwise (train_loop.clip_grad_norm sums the squares in fp64, so sharding does not
    move the clip factor); bf16 1e-4 (FSDP2 casts the weights where autocast would; measured equal on this CPU).
    The AdamW FSDP2 run also recomputes its blocks (activation checkpointing): bitwise too."""
    for name, tolerance in [("muon float32", 0), ("adamw float32", 0), ("muon bfloat16", 1e-4)]:
        ddp, fsdp = worker_runs[f"ddp {name}"], worker_runs[f"fsdp {name}"]
        assert len(ddp) == len(fsdp) == 20 and ddp[-1] < ddp[0] - 0.02, (name, ddp)  # and it learns
        assert max(abs(a - b) for a, b in zip(ddp, fsdp, strict=True)) <= tolerance, (name, ddp, fsdp)
    rows = worker_runs["rows"]  # decode.py gathers a sharded model whole: the greedy rows of the same weights
    assert rows["fsdp muon float32"] == rows["ddp muon float32"] and rows["fsdp adamw float32"] == rows["ddp adamw float32"]


def test_two_processes_give_the_loss_and_gradients_of_one(worker_runs):
    """2 ranks x 2 micro-batches of 2 rows of test_train's global batch: DDP's all-reduce and no_sync accumulation."""
    saved = worker_runs["one step"]
    assert_same((saved["loss"].item(), saved["grads"]), step(8))


@pytest.mark.two_processes
def test_a_rank_that_hangs_stops_the_others_within_a_minute_naming_it(demo_world):
    """Rank 1 stops taking part in collectives just before step 3's first collective: rank 0's collective times out
    (--dist_timeout), it names rank 1 from torchrun's store, and torchrun ends everything. (A rank that dies: the
    SIGKILL test in tests/test_pretrain.py.)"""
    start = time.perf_counter()
    result = run_script("pretrain.py", pretrain_args(demo_world, ["--steps", "50", "--run_name", "rank_hangs",
                                                                  "--dist_timeout", "2"]),
                        demo_world, nproc=2, check=False, faults={"hang_at_step": 3})
    assert result.returncode != 0 and time.perf_counter() - start < 60
    assert "pretrain.py: error on rank 0: a collective failed (" in result.stderr, result.stderr[-3000:]
    assert "rank 1 is stuck: it last entered step 2, this rank is in step 3 (process " in result.stderr
    assert processes_mentioning("--run_name rank_hangs ") == []


@pytest.mark.two_processes
def test_a_save_that_fails_on_one_rank_stops_every_rank_with_the_save_error(demo_world):
    """Rank 1's write of step 4's checkpoint fails (ENOSPC) while rank 0 writes the weights: every rank raises the
    save's error, rank 0 after rank 1 has exited (its error is its own, not a dead peer's), and the partial checkpoint
    goes once no rank writes to it."""
    ckpt = demo_world / "runs" / "save_fails" / "ckpt"
    result = run_script("pretrain.py", pretrain_args(demo_world, ["--steps", "6", "--ckpt_every", "2", "--run_name",
                                                                  "save_fails"]),
                        demo_world, nproc=2, check=False, faults={"save_fails_at_step": 4})
    assert result.returncode != 0
    error = f"pretrain.py: error: saving step 4 to {ckpt} failed ("
    assert f"{error}[Errno 28] No space left on device); " in result.stderr, result.stderr[-3000:]
    assert f"{error}on another rank); " in result.stderr
    assert "a collective failed" not in result.stderr
    assert sorted(p.name for p in ckpt.iterdir()) == ["save_seconds", "step_000002"]
    assert processes_mentioning("--run_name save_fails ") == []


@pytest.mark.two_processes
def test_the_nccl_probe_times_a_gradient_bucket_sized_all_reduce(tmp_path):
    """speedrun.sh's probe (distributed.py probe) on gloo, 2 processes: after the 4-byte check it all-reduces 25 MB, a
    DDP bucket, checks the sums and prints the time and bus bandwidth it measured."""
    result = run_script("distributed.py", ["probe", "--timeout", "60", "--mbytes", "25"], tmp_path, nproc=2)
    assert "probe: 4-byte all-reduce over 2 ranks (gloo, " in result.stdout and ": ok" in result.stdout
    line = next(x for x in result.stdout.splitlines() if x.startswith("probe: 25 MB all-reduce over 2 ranks (gloo"))
    match = re.search(r": ok, ([\d.]+) ms each \(5 timed\), bus bandwidth ([\d.]+) GB/s$", line)
    assert match, line
    ms, bus = map(float, match.groups())
    assert ms > 0 and bus == pytest.approx(25e6 / (ms / 1e3) * 2 * (2 - 1) / 2 / 1e9, rel=0.02)


def test_fsdp_auto_counts_the_process_and_the_activations_not_only_the_state(monkeypatch):
    """--fsdp auto shards when the step would not fit: a device that holds weights + gradients + optimizer state with
    a byte to spare, but not the activations and the process itself, is sharded (one process says it has nothing to
    shard with); with room for the whole step it is not."""
    from types import SimpleNamespace

    import train_loop
    from model import build_model, config_from_preset, memory_estimate
    config = config_from_preset("tiny", {"vocab_size": 256})
    model = build_model(config, torch.device("cpu"))
    args = SimpleNamespace(optimizer="muon", adam8bit=False, dtype="float32", fsdp="auto", micro_batch=4)
    estimate = memory_estimate(config, 4, optimizer="muon", bf16=False, device_type="cpu")
    state = estimate["weights"] + estimate["gradients"] + estimate["optimizer"]
    monkeypatch.setattr(train_loop, "device_memory", lambda device: state + 1)
    line = train_loop.shard_model(model, args, 1, torch.device("cpu"))
    assert line.startswith("sharding: none: one process has nothing to shard with (in use now ")
    assert "micro-batch 4's activations = " in line and f" > {train_loop.fmt_bytes(state + 1)} per process" in line
    monkeypatch.setattr(train_loop, "device_memory", lambda device: 2 ** 40)
    assert train_loop.shard_model(model, args, 1, torch.device("cpu")).startswith("sharding: none, one process")


# peak resident GiB per rank of pretrain.py (dev/rank_memory.py: vocabulary 65,536, sequence 128, micro-batch 2,
# Muon, bf16, 3 steps, a checkpoint and the final evaluation; 2 and 3 ranks with --fsdp true), dev/LOG.md 2026-11-29:
# the estimate's constants were fitted to d4 and d8; d6 was measured after, to check it
MEASURED = {(4, 1): [2.43, 2.55, 2.99], (4, 2): [1.93, 1.93, 1.90, 1.93], (4, 3): [1.67, 1.69, 1.72],
            (8, 1): [5.32], (8, 2): [4.33, 4.39], (8, 3): [4.02, 4.08, 4.13],
            (6, 1): [3.49], (6, 2): [2.85, 2.86], (6, 3): [2.64, 2.66, 2.67]}


def test_the_per_rank_estimate_is_within_a_tenth_of_each_measured_peak():
    """The figure a sharded run prints per rank, and the rehearsal's memory check counts, against each rank's peak
    resident set measured at three depths on 1, 2 and 3 CPU processes (medians of the runs). The state alone (weights,
    gradients and optimizer over the ranks) was the line's figure before: 0.35 GiB against 1.69 for d4 on 3."""
    import statistics
    from types import SimpleNamespace

    import train_loop
    from model import config_from_preset
    args = SimpleNamespace(optimizer="muon", adam8bit=False, dtype="bfloat16")
    for (depth, ranks), peaks in MEASURED.items():
        config = config_from_preset(f"d{depth}", {"sequence_len": 128})
        estimate = train_loop.step_estimate(config, args, 2, "cpu")
        figure = train_loop.rank_memory(config, estimate, ranks, ranks > 1, "cpu") / 2 ** 30
        assert abs(figure / statistics.median(peaks) - 1) <= 0.10, (depth, ranks, figure, peaks)
    config = config_from_preset("d8", {"sequence_len": 128})
    estimate = train_loop.step_estimate(config, args, 2, "cpu")
    state = (estimate["weights"] + estimate["gradients"] + estimate["optimizer"]) / 3 / 2 ** 30
    assert abs(state / statistics.median(MEASURED[8, 3]) - 1) > 0.5  # what the line said before


def test_cpu_processes_that_cannot_fit_are_refused_naming_a_depth_and_a_count_that_fit(monkeypatch):
    """pretrain.py --check_batch N on a machine without CUDA (the gpu plan's rehearsal on CPU processes) adds up what
    N ranks hold against the memory available: d64 on 8 fits no machine this runs on; the depth it names fits and the
    next one up does not; the process count it names fits; the line for a plan that fits says each rank's figure."""
    import argparse

    import pretrain
    import train_loop
    from model import config_from_preset
    assert 0 < pretrain.available_memory() <= train_loop.device_memory(torch.device("cpu"))  # MemAvailable <= RAM
    monkeypatch.setattr(pretrain, "available_memory", lambda: 24 * 2 ** 30)  # a 24 GiB machine, whatever runs here

    def args(preset, nproc):
        return argparse.Namespace(preset=preset, sequence_len=128, micro_batch=0, optimizer="muon", adam8bit=False,
                                  dtype=None, fsdp="auto", check_batch=nproc)
    with pytest.raises(ValueError) as refused:
        pretrain.check_cpu_memory(args("d64", 8), 8)
    said = str(refused.value)
    assert re.match(r"8 processes on this CPU x about [\d.]+ GiB each at its peak \(FSDP2, micro-batch 1\) = [\d.]+ GiB, of "
                    r"[\d.]+ GiB available now: they would not fit with a tenth to spare, and the out-of-memory killer "
                    r"would end a rank. Rehearse with --depth \d+", said), said
    depth = int(re.search(r"--depth (\d+)", said).group(1))
    assert depth == 6 and said.endswith("Rehearse with --depth 6")  # 8 x 2.31 GiB (x1.1: 20.3) fits; d7: 8 x 3.36
    for d, fits in ((depth, True), (depth + 1, False)):
        config = config_from_preset(f"d{d}", {"sequence_len": 128})
        assert pretrain.cpu_processes_fit(config, args(f"d{d}", 8), 8, 24 * 2 ** 30)[0] is fits
    line = pretrain.check_cpu_memory(args(f"d{depth}", 8), 8)
    assert line.startswith("memory: 8 processes on this CPU x about ") and line.endswith(" available now")
    if (fewer := re.search(r"--gpus (\d+)", said)) is not None:
        n = int(fewer.group(1))
        assert pretrain.check_cpu_memory(args("d64", n), n).startswith(f"memory: {n} process")
    with pytest.raises(ValueError, match=re.escape(said)):  # the same through pretrain.py's flags
        pretrain.main(["--preset", "d64", "--sequence_len", "128", "--total_batch_tokens", "32768",
                       "--tokens_per_param", "20", "--check_batch", "8"])
