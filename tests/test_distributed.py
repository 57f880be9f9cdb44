"""Beyond one device (README: scale-out): FSDP2 takes DDP's steps; two "nodes" meet through c10d rendezvous; a rank
that dies or hangs stops the run with a message naming it and leaves no process. (Sharded checkpoints resumed at
another world size and consolidated: tests/test_pretrain.py.)"""
import json
import os
import subprocess
import sys
import time

import pytest
import torch
from launch import ROOT, run_script
from test_speedrun import processes_mentioning

SMALL = ["--sequence_len", "64", "--n_layer", "2", "--n_embd", "64", "--n_head", "2", "--n_kv_head", "2",
         "--micro_batch", "4", "--eval_every", "0", "--eval_tokens", "4096", "--log_every", "1000", "--dtype", "float32"]


def pretrain(world, args, nproc=1, check=True):
    return run_script("pretrain.py", ["--data_dir", str(world / "demo" / "pretrain"), "--tokenizer",
                                      str(world / "tokenizer"), "--runs_dir", str(world / "runs"), *SMALL, *args],
                      world, nproc, check=check)


def losses(run_dir):
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records if "loss" in r}


def test_fsdp_takes_the_steps_ddp_takes_with_muon_and_adamw(tmp_path):
    """Stated tolerance: fp32 none, bitwise (common.clip_grad_norm sums the squares in fp64, so sharding does not
    move the clip factor); bf16 1e-4 (FSDP2 casts the weights where autocast would; measured equal on this CPU)."""
    out = tmp_path / "losses.pt"
    run_script("tests/fsdp_worker.py", [str(out)], ROOT, nproc=2)
    runs = torch.load(out, weights_only=True)
    for name, tolerance in [("muon float32", 0), ("adamw float32", 0), ("muon bfloat16", 1e-4)]:
        ddp, fsdp = runs[f"ddp {name}"], runs[f"fsdp {name}"]
        assert len(ddp) == len(fsdp) == 20 and ddp[-1] < ddp[0] - 0.02, (name, ddp)  # and it learns
        assert max(abs(a - b) for a, b in zip(ddp, fsdp, strict=True)) <= tolerance, (name, ddp, fsdp)
    assert runs["fsdp muon float32 checkpointed"] == runs["fsdp muon float32"]  # activation checkpointing: bitwise


def test_two_nodes_meet_through_c10d_rendezvous_and_the_first_line_lists_every_rank(demo_world):
    port = 29500 + os.getpid() % 1000
    command = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc_per_node=1",
               "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=two_nodes",
               str(ROOT / "pretrain.py"), "--data_dir", str(demo_world / "demo" / "pretrain"), "--tokenizer",
               str(demo_world / "tokenizer"), "--runs_dir", str(demo_world / "runs"), *SMALL, "--steps", "3",
               "--run_name", "two_nodes", "--fsdp", "true"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    nodes = [subprocess.Popen(command, cwd=demo_world, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for _ in range(2)]
    outputs = [node.communicate(timeout=300) for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], outputs
    first_lines = [out.splitlines()[0] for out, _ in outputs if out]
    assert len(first_lines) == 1  # rank 0 prints, on whichever node it landed
    host = os.uname().nodename
    assert first_lines[0].startswith("distributed: world size 2 (gloo): rank 0 cpu (") and f"on {host}, rank 1 cpu (" \
        in first_lines[0] and first_lines[0].endswith(f"on {host}"), first_lines[0]
    assert "done: 3 steps" in "".join(out for out, _ in outputs)


@pytest.mark.parametrize("failure", ["die", "hang"])
def test_a_rank_that_dies_or_hangs_stops_the_others_within_a_minute_naming_it(demo_world, failure):
    """Rank 1 is SIGKILLed, or stops taking part in collectives, just before step 3's first collective: rank 0 fails
    in that collective (connection reset, or --dist_timeout), names rank 1 from torchrun's store, and torchrun ends
    everything."""
    name = f"rank_{failure}s"
    start = time.perf_counter()
    result = pretrain(demo_world, ["--steps", "50", "--run_name", name, f"--{failure}_at_step", "3",
                                   "--dist_timeout", "3"], nproc=2, check=False)
    assert result.returncode != 0 and time.perf_counter() - start < 60
    said = {"die": "rank 1 died (process ", "hang": "rank 1 is stuck in step 2 (process "}[failure]
    assert "pretrain.py: error on rank 0: a collective failed (" in result.stderr and said in result.stderr, \
        result.stderr[-3000:]
    assert processes_mentioning(f"--run_name {name} ") == []
