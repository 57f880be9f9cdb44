"""Beyond one device (README: scale-out): FSDP2 takes DDP's steps; a sharded checkpoint written by 2 processes resumes
on 1 with bitwise-equal losses and consolidates to the model.pt the run gathered; two "nodes" meet through c10d
rendezvous; a rank that dies or hangs stops the run with a message naming it and leaves no process."""
import json
import os
import shutil
import subprocess
import sys
import time

import pytest
import torch
from launch import ROOT, run_script
from test_speedrun import processes_mentioning

import common as C

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
    """Stated tolerances: fp32 1e-5 (the gradient norm is summed shard by shard, so a clipped step's scale differs in
    its last bits; AdamW measured equal, Muon 3e-6 apart after 20 steps), bf16 1e-4 (measured 5e-5)."""
    out = tmp_path / "losses.pt"
    run_script("tests/fsdp_worker.py", [str(out)], ROOT, nproc=2)
    runs = torch.load(out, weights_only=True)
    for name, tolerance in [("muon float32", 1e-5), ("adamw float32", 1e-5), ("muon bfloat16", 1e-4)]:
        ddp, fsdp = runs[f"ddp {name}"], runs[f"fsdp {name}"]
        assert len(ddp) == len(fsdp) == 20 and ddp[-1] < ddp[0] - 0.02, (name, ddp)  # and it learns
        assert max(abs(a - b) for a, b in zip(ddp, fsdp, strict=True)) < tolerance, (name, ddp, fsdp)
    assert runs["fsdp muon float32 checkpointed"] == runs["fsdp muon float32"]  # activation checkpointing: bitwise


def test_a_sharded_checkpoint_from_two_processes_resumes_on_one_bitwise_and_consolidates(demo_world, tmp_path,
                                                                                          capsys):
    """2 processes x 1 micro-step, sharded, checkpoint at step 4 of 8; then 1 process x 2 micro-steps from it: the
    same 2 data streams, so the same losses, bitwise."""
    run_dir = demo_world / "runs" / "sharded"
    batch = ["--steps", "8", "--ckpt_every", "4", "--total_batch_tokens", str(2 * 4 * 64), "--run_name", "sharded"]
    first = pretrain(demo_world, [*batch, "--fsdp", "true"], nproc=2).stdout
    assert "sharding: FSDP2 over 2 ranks (--fsdp true:" in first
    straight = losses(run_dir)
    step4, step8 = (run_dir / "ckpt" / f"step_00000{s}" for s in (4, 8))
    assert (step4 / "state").is_dir() and not (step4 / "model.pt").exists()  # every rank wrote its own shards
    assert (step8 / "model.pt").is_file()  # the last step is consolidated: the next stage reads it
    with pytest.raises(FileNotFoundError, match=f"python common.py consolidate {step4}"):
        C.load_model(step4, torch.device("cpu"))
    # consolidation in one process from the shards equals what the run gathered at its end
    copy = tmp_path / "step_000008"
    shutil.copytree(step8, copy, ignore=shutil.ignore_patterns("model.pt"))
    sys.argv, argv = ["common.py", "consolidate", str(copy)], sys.argv
    try:
        assert C.main() == 0
    finally:
        sys.argv = argv
    assert f"consolidate: wrote {copy / 'model.pt'} (229,376 parameters)" in capsys.readouterr().out
    gathered, consolidated = (torch.load(p / "model.pt", weights_only=True) for p in (step8, copy))
    assert gathered.keys() == consolidated.keys() and all(torch.equal(gathered[k], consolidated[k]) for k in gathered)

    resumed = pretrain(demo_world, [*batch, "--resume", str(step4)], nproc=1).stdout
    assert "accumulation 2 = 512" in resumed and "(2 -> 1 processes, sharded -> not sharded)" in resumed
    assert losses(run_dir) == straight  # bitwise: the JSON floats round-trip exactly


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
                                   "--dist_timeout", "5"], nproc=2, check=False)
    assert result.returncode != 0 and time.perf_counter() - start < 60
    said = {"die": "rank 1 died (process ", "hang": "rank 1 is stuck in step 2 (process "}[failure]
    assert "pretrain.py: error on rank 0: a collective failed (" in result.stderr and said in result.stderr, \
        result.stderr[-3000:]
    assert processes_mentioning(f"--run_name {name} ") == []
