"""pretrain.py and the shared loop (train_loop.py): learning, exact resume after SIGKILL (2 sharded processes) and
SIGTERM (1 process), 1 process = 2 sharded processes, resumes across world sizes and sharding (2 -> 1; 1 -> two
"nodes"), consolidation, NaN stop, frozen-parameter monitor, schedules, batch planning, status."""
import json
import math
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
from argparse import Namespace

import pytest
import torch
from helpers import ROOT, processes_mentioning, run_in_process, run_script

import checkpoint
import dataset as D
import model as M
import optim
import prepare as P
import pretrain
import train_loop
from model import autocast_context, build_model, config_from_preset

SMALL = ["--sequence_len", "64", "--n_layer", "2", "--n_embd", "64", "--n_head", "2", "--n_kv_head", "2",
         "--micro_batch", "4", "--eval_every", "0", "--bpb_tokens", "4096", "--log_every", "1000"]


@pytest.fixture(scope="module")
def world(demo_world):
    return demo_world


def run(world, args, nproc=1, check=True, faults=None):
    """pretrain.py on the demo world, as a user runs it (faults: tests/faults.py's)."""
    return run_script("pretrain.py", ["--data_dir", str(world / "demo" / "pretrain"), "--tokenizer",
                                      str(world / "tokenizer"), "--runs_dir", str(world / "runs"), *args],
                      world, nproc, check=check, faults=faults)


def in_process(world, args, capsys):
    """(exit code, stdout, stderr) of pretrain.py stopping before training (bad input), without a new interpreter."""
    return run_in_process(pretrain.main, ["--data_dir", world / "demo" / "pretrain", "--tokenizer", world / "tokenizer",
                                          "--runs_dir", world / "runs", *args], capsys, stage="pretrain.py")


def losses(world, name):
    records = [json.loads(line) for line in (world / "runs" / name / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records if "loss" in r}


def test_a_small_model_learns_the_demo_world(world, learned):
    run_dir, out = learned
    bpb = json.loads((run_dir / "done.json").read_text())["val_bpb"]
    tok = pretrain.Tokenizer.load(world / "tokenizer")
    _, n_bytes, n_tokens = P.text_stats(tok, P.iter_texts(world / "demo" / "pretrain", "val"))
    uniform = math.log2(tok.vocab_size) / (n_bytes / n_tokens)
    assert bpb < 0.25 * uniform, (bpb, uniform)  # measured: 0.305 at 100 steps against 2.65 for a uniform guess
    assert "params: 1572890" in out and "tokens per step = micro_batch 32 x sequence_len 128 x world size 1 x " \
        "accumulation 1 = 4,096" in out
    assert "budget: 100 steps, 409,600 tokens" in out
    # the code that ran: this checkout's commit, recorded in config.json and in every checkpoint's meta.json
    git = [subprocess.run(["git", "-C", str(ROOT), *words], capture_output=True, text=True, check=False)
           for words in (["rev-parse", "HEAD"], ["status", "--porcelain", "--untracked-files=no"])]
    code = {"commit": git[0].stdout.strip(), "dirty": bool(git[1].stdout.strip())} if git[0].returncode == 0 else \
        {"commit": "unknown", "dirty": "unknown"}  # a copy of the tree without .git
    meta = json.loads((checkpoint.list_checkpoints(run_dir / "ckpt")[-1] / "meta.json").read_text())
    assert json.loads((run_dir / "config.json").read_text())["code"] == meta["code"] == code
    assert f"code: commit {code['commit']}, uncommitted changes: {code['dirty']}" in out


# One global batch of 2 x 4 rows of 64 tokens: 1 process x 2 accumulation micro-steps, or 2 processes x 1, the 2
# processes sharding the model (FSDP2); fp32, where the two are bitwise equal (bf16: FSDP2's casts are not autocast's)
KILL_RUN = [*SMALL, "--steps", "14", "--ckpt_every", "4", "--total_batch_tokens", str(2 * 4 * 64), "--dtype", "float32"]


# session-scoped: conftest sorts this file's 2-process tests after its others, and a module-scoped fixture would be
# torn down in between and run again
@pytest.fixture(scope="session")
def straight(demo_world):
    """An uninterrupted run of KILL_RUN on 1 process (x 2 micro-steps): its stdout."""
    return run(demo_world, [*KILL_RUN, "--run_name", "straight1"]).stdout


@pytest.fixture(scope="session")
def killed(demo_world):
    """KILL_RUN on 2 sharded processes (x 1 micro-step) whose rank 1 is SIGKILLed in step 10, then resumed: (killed,
    the checkpoints it left, resumed)."""
    args = [*KILL_RUN, "--fsdp", "true", "--run_name", "killed2"]
    killed = run(demo_world, [*args, "--dist_timeout", "30"], 2, check=False, faults={"die_at_step": 10})
    left = [p.name for p in checkpoint.list_checkpoints(demo_world / "runs" / "killed2" / "ckpt")]
    return killed, left, run(demo_world, [*args, "--resume"], 2)


def test_a_rank_killed_mid_step_stops_the_run_naming_it_and_the_resume_gives_bitwise_equal_losses(world, straight,
                                                                                                   killed):
    """Rank 1 of the 2 sharded processes dies by SIGKILL just before step 10's first collective (a machine going
    away): rank 0 names it and torchrun ends the run, no process left. Resumed, they log the losses of the 1
    uninterrupted process, bitwise: the same data streams, and accumulation, DDP and FSDP2 add the same numbers (1
    process resumed: the SIGTERM test; a hung rank: tests/test_distributed.py)."""
    assert killed[0].returncode != 0 and killed[1] == ["step_000004", "step_000008"]
    assert "pretrain.py: error on rank 0: a collective failed (" in killed[0].stderr
    assert "rank 1 died (process " in killed[0].stderr and "; it last entered step 9; a rank gone without an error " \
        "of its own was most likely killed by the kernel's out-of-memory killer" in killed[0].stderr
    assert processes_mentioning("--run_name killed2 ") == []
    assert "resume: from" in killed[2].stdout and "at step 8 (2 -> 2 processes, sharded -> sharded)" in killed[2].stdout
    assert "world size 2 (gloo): rank 0 cpu" in killed[2].stdout and "rank 1 cpu" in killed[2].stdout
    again = losses(world, "killed2")
    assert sorted(again) == list(range(1, 15)) and again == losses(world, "straight1")  # JSON floats round-trip


def test_two_processes_match_one_with_the_same_global_batch(straight, killed):
    assert "world size 1 x accumulation 2 = 512" in straight
    assert "world size 2 x accumulation 1 = 512" in killed[0].stdout
    assert "sharding: FSDP2 over 2 ranks (--fsdp true:" in killed[0].stdout


def test_a_sharded_checkpoint_of_two_processes_resumes_on_one_bitwise_and_consolidates(world, straight, killed,
                                                                                        tmp_path, capsys):
    """A copy of killed2 (2 sharded processes x 1 micro-step) resumes on 1 process x 2 micro-steps: the same 2 data
    streams, the same losses, bitwise."""
    step12, step14 = (world / "runs" / "killed2" / "ckpt" / f"step_0000{s}" for s in (12, 14))
    assert (step12 / "state").is_dir() and not (step12 / "model.pt").exists()  # every rank wrote its own shards
    assert (step14 / "model.pt").is_file()  # the last step is consolidated: the next stage reads it
    with pytest.raises(FileNotFoundError, match=f"python checkpoint.py consolidate {step12}"):
        checkpoint.load_model(step12, torch.device("cpu"))
    copy = tmp_path / "step_000014"  # consolidated in one process from the shards = what the run gathered at its end
    shutil.copytree(step14, copy, ignore=shutil.ignore_patterns("model.pt"))
    code, out, _ = run_in_process(checkpoint.main, ["consolidate", copy], capsys)
    assert code == 0 and f"consolidate: wrote {copy / 'model.pt'} (294,940 parameters)" in out
    gathered, consolidated = (torch.load(p / "model.pt", weights_only=True) for p in (step14, copy))
    assert gathered.keys() == consolidated.keys() and all(torch.equal(gathered[k], consolidated[k]) for k in gathered)
    shutil.copytree(world / "runs" / "killed2", world / "runs" / "sharded_to_one")
    resumed = run(world, [*KILL_RUN, "--resume", str(world / "runs" / "sharded_to_one" / "ckpt" / "step_000012")])
    assert "accumulation 2 = 512" in resumed.stdout and "(2 -> 1 processes, sharded -> not sharded)" in resumed.stdout
    assert losses(world, "sharded_to_one") == losses(world, "straight1")  # bitwise: JSON floats round-trip exactly


@pytest.mark.two_processes
def test_two_nodes_meet_through_c10d_and_resume_a_one_process_checkpoint_sharded_to_its_losses(world, straight):
    """Two torchrun "nodes" of one process each, rendezvous on 127.0.0.1 (docs/distributed.md), resume a copy of
    straight1 (1 process x 2 micro-steps, not sharded) at step 8 as 2 sharded processes x 1: the same losses, bitwise.
    The first line lists both ranks with their host and device."""
    shutil.copytree(world / "runs" / "straight1", world / "runs" / "two_nodes")
    port = 29500 + os.getpid() % 1000
    command = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc_per_node=1",
               "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=two_nodes",
               str(ROOT / "pretrain.py"), "--data_dir", str(world / "demo" / "pretrain"), "--tokenizer",
               str(world / "tokenizer"), *KILL_RUN, "--fsdp", "true",
               "--resume", str(world / "runs" / "two_nodes" / "ckpt" / "step_000008")]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    nodes = [subprocess.Popen(command, cwd=world, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    outputs = [node.communicate(timeout=300) for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], outputs
    first_lines = [out.splitlines()[0] for out, _ in outputs if out]
    assert len(first_lines) == 1  # rank 0 prints, on whichever node it landed
    host = os.uname().nodename
    assert first_lines[0].startswith("distributed: world size 2 (gloo): rank 0 cpu (") and f"on {host}, rank 1 cpu (" \
        in first_lines[0] and first_lines[0].endswith(f"on {host}"), first_lines[0]
    out = "".join(out for out, _ in outputs)
    assert "distributed: a collective waits at most 600 s for the other ranks (--dist_timeout)" in out
    assert "(1 -> 2 processes, not sharded -> sharded)" in out and "done: 14 steps" in out
    assert losses(world, "two_nodes") == losses(world, "straight1")


def test_nan_stops_the_run_and_keeps_the_last_good_checkpoint(world):
    result = run(world, [*SMALL, "--steps", "12", "--ckpt_every", "3", "--run_name", "nan"], check=False,
                 faults={"inject_nan_step": 7})
    assert result.returncode != 0
    assert "step 7: loss nan" in result.stderr and "last good checkpoint: " in result.stderr
    ckpts = checkpoint.list_checkpoints(world / "runs" / "nan" / "ckpt")
    assert [p.name for p in ckpts] == ["step_000003", "step_000006"]  # step 7's NaN update is saved nowhere
    state = torch.load(ckpts[-1] / "model.pt", weights_only=True)
    assert all(torch.isfinite(t).all() for t in state.values())
    assert all(math.isfinite(v) for v in losses(world, "nan").values())


def test_sigterm_finishes_the_step_checkpoints_and_says_how_to_resume(world, straight, capsys):
    result = run(world, [*KILL_RUN, "--ckpt_every", "100", "--run_name", "term"], check=False,
                 faults={"signal_at_step": 5})
    assert result.returncode == 128 + signal.SIGTERM
    assert "stopped by signal at step 5" in result.stdout
    assert [p.name for p in checkpoint.list_checkpoints(world / "runs" / "term" / "ckpt")] == ["step_000005"]
    pretrain.main(["--status", str(world / "runs" / "term")])  # in-process: it reads files only
    status = capsys.readouterr().out
    assert "not finished; step 5/14" in status and "checkpoints: step_000005" in status
    command = result.stdout.split("Resume with: ")[1].splitlines()[0]  # run exactly what it printed
    resumed = subprocess.run(shlex.split(command), cwd=world, capture_output=True, text=True, check=False,
                             env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "resume: from" in resumed.stdout and "at step 5" in resumed.stdout and "done: 14 steps" in resumed.stdout
    assert losses(world, "term") == losses(world, "straight1")  # bitwise, as after a SIGKILL on 2 processes
    code, out, _ = in_process(world, [*KILL_RUN, "--resume", world / "runs" / "term" / "ckpt" / "step_000014"], capsys)
    assert code == 0 and "at step 14" in out and "done: 14 steps" in out  # the run dir comes from the path
    code, _, err = in_process(world, [*SMALL, "--steps", "7", "--run_name", "empty", "--resume"], capsys)
    assert code == 1 and "runs/empty/ckpt has no checkpoint yet" in err


def test_bad_batch_arithmetic_names_the_nearest_valid_values(world, capsys):
    code, _, err = in_process(world, [*SMALL, "--steps", "2", "--run_name", "bad", "--total_batch_tokens", "900"],
                              capsys)  # 3.5 micro-steps of 256: none within 3% (1000 would take 1024, +2.4%)
    assert code == 1 and err == "pretrain.py: error: --total_batch_tokens 900 is not a multiple of " \
        "micro_batch 4 x sequence_len 64 x world size 1 = 256: nearest valid values are 768 and 1024\n"


def test_frozen_monitor_names_bf16_norm_weights():
    torch.manual_seed(0)
    model = build_model(config_from_preset("tiny", {"norm_learnable": True, "n_layer": 2, "sequence_len": 32}))
    for name, p in model.named_parameters():
        if "norm" in name:
            p.data = p.data.to(torch.bfloat16)  # bf16 parameters' bug, on the norms only
    samples = train_loop.param_samples(model)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    idx = torch.randint(0, 1024, (2, 32))
    for _ in range(10):
        with autocast_context("cpu", "bfloat16"):
            model(idx, idx.roll(-1, 1)).backward()
        for p in model.parameters():
            p.grad = p.grad.to(p.dtype)
        opt.step()
        opt.zero_grad()
    frozen = train_loop.frozen_parameters(model, samples)
    assert frozen and frozen == [n for n, _ in model.named_parameters() if "norm" in n]


def test_a_run_in_which_no_parameter_moves_is_stopped_and_one_that_moves_is_warned_about():
    model = build_model(config_from_preset("tiny", {"n_layer": 1, "sequence_len": 32}))
    initial, args = train_loop.param_samples(model), Namespace(frozen_check_step=10)
    with pytest.raises(RuntimeError, match="no parameter changed in 10 steps: every gradient is zero"):
        train_loop.health_warning(model, initial, [], {"cuda_mem_alloc": None}, 10, args)
    with torch.no_grad():
        model.lm_head.weight.add_(1.0)
    warning = train_loop.health_warning(model, initial, [], {"cuda_mem_alloc": None}, 10, args)
    assert warning.startswith("parameters unchanged after 10 steps: resid_lambdas, x0_lambdas, wte.weight")
    assert "lm_head" not in warning


def test_micro_batch_probe_takes_the_largest_that_fits():
    tried = []

    def try_step(micro):
        tried.append(micro)
        if micro > 6:
            raise torch.OutOfMemoryError("CUDA out of memory")
    assert train_loop.find_micro_batch(try_step, [1, 2, 4, 8, 16]) == 4 and tried == [16, 8, 4]
    with pytest.raises(RuntimeError, match="even micro_batch=8 runs out of memory"):
        train_loop.find_micro_batch(try_step, [8, 16])


def test_without_a_total_batch_the_probe_is_not_capped_at_8():
    """No --total_batch_tokens: the probe's candidates go up to 1024 sequences, so a GPU on which 48 fit gets 32 (the
    largest power of two that fits), not 8; with a total, the divisors of its per-rank sequences, as before."""
    def try_step(micro):
        if micro > 48:
            raise torch.OutOfMemoryError("CUDA out of memory")
    candidates = train_loop.micro_batch_candidates(None, 2048, 8)
    assert max(candidates) == 1024 and train_loop.find_micro_batch(try_step, candidates) == 32
    assert train_loop.micro_batch_candidates(524288, 2048, 8) == [1, 2, 4, 8, 16, 32]


def test_a_stage_restarted_before_its_first_checkpoint_counts_each_step_once(world):
    """The first start dies (SIGKILL) at step 3, before any checkpoint; speedrun's rerun then starts it over (no
    checkpoint, no --resume): metrics.jsonl holds that second start's steps only, each once."""
    args = [*SMALL, "--run_name", "restart", "--steps", "6", "--ckpt_every", "100", "--compile", "false"]
    died = run(world, args, check=False, faults={"die_at_step": 3})
    assert died.returncode != 0
    metrics = world / "runs" / "restart" / "metrics.jsonl"
    assert [r["step"] for r in map(json.loads, metrics.read_text().splitlines()) if "loss" in r] == [1, 2]
    again = run(world, args)
    assert "of an earlier start without a checkpoint removed: starting over" in again.stdout
    steps = [r["step"] for r in map(json.loads, metrics.read_text().splitlines()) if "loss" in r]
    assert steps == [1, 2, 3, 4, 5, 6]


def test_micro_batch_probe_holds_optimizer_state_and_gradients_at_its_peak():
    """The probe must allocate what step 1 of training does: at its last optimizer step every parameter has a
    gradient (what DDP's buckets hold: gradient_as_bucket_view) and its optimizer state (AdamW: 2 moments, Muon: a
    momentum buffer). A fake OOM there, over a memory budget counted from those very tensors, picks the micro-batch
    that fits once they are counted; no weight changes."""
    torch.manual_seed(0)
    model = build_model(config_from_preset("tiny", {"n_layer": 1, "sequence_len": 32}))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    args = Namespace(optimizer="muon", adam8bit=False, matrix_lr=0.02, embedding_lr=0.2, head_lr=0.004, scalar_lr=0.04)
    optimizers = optim.build_optimizers(model, args, 256, 1, torch.device("cpu"))
    weights = sum(p.numel() for p in model.parameters())
    matrices = sum(p.numel() for n, p in model.named_parameters() if n.startswith("blocks.") and p.ndim == 2)
    neurons = sum(max(p.shape) for n, p in model.named_parameters() if n.startswith("blocks.") and p.ndim == 2)
    assert neurons == M.muon_neurons(model.config)
    # Muon: 1 momentum buffer and NorMuon's second moment per neuron; AdamW: exp_avg, exp_avg_sq
    state_needed = matrices + neurons + 2 * (weights - matrices)
    budget = weights + state_needed + 45_000  # in elements: room for 4 micro-batch rows of 10,000 below
    peaks = {}

    def at_peak(opt, *_):
        if opt is not optimizers[-1]:
            return
        grads = sum(p.grad.numel() for p in model.parameters() if p.grad is not None)
        state = sum(t.numel() for o in optimizers for s in o.state.values() for t in s.values() if t.dim() > 0)
        peaks[micro[0]] = (grads, state)
        if grads + state + micro[0] * 10_000 > budget:  # without the state, 8 rows would fit
            raise torch.OutOfMemoryError("fake: CUDA out of memory")
    for opt in optimizers:
        opt.register_step_post_hook(at_peak)
    micro = [0]
    probe = train_loop.probe_step(model, optimizers, 32, 1024, "float32", torch.device("cpu"))

    def try_step(m):
        micro[0] = m
        probe(m)
    assert train_loop.find_micro_batch(try_step, [1, 2, 4, 8]) == 4
    assert peaks[8] == peaks[4] == (weights, state_needed)
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())  # lr 0: a probe, not a step
    assert all(p.grad is None for p in model.parameters())


def test_schedules():
    base = {"warmup_steps": 10, "schedule": "cosine", "min_lr_frac": 0.1, "warmdown_frac": 0.2, "stage2_step": 0,
            "stage1_end_frac": 0.667, "stage2_lr_frac": 0.667, "weight_decay": 0.1, "stage2_weight_decay": 0.0}
    a = Namespace(**base)
    assert optim.lr_multiplier(0, 110, a) == pytest.approx(0.1) and optim.lr_multiplier(9, 110, a) == 1.0
    assert optim.lr_multiplier(10, 110, a) == 1.0 and optim.lr_multiplier(60, 110, a) == pytest.approx(0.55)
    assert optim.lr_multiplier(110, 110, a) == pytest.approx(0.1)
    w = Namespace(**{**base, "schedule": "wsd"})
    assert optim.lr_multiplier(89, 110, w) == 1.0 and optim.lr_multiplier(100, 110, w) == pytest.approx(0.55)
    # a real run's two-stage schedule: warmup 375, 0.0015 -> 0.001 over stage 1, then 0.001 -> 0.000015 from step 200k, weight decay 0.1 -> 0
    s = Namespace(**{**base, "warmup_steps": 375, "schedule": "linear", "stage2_step": 200_000, "min_lr_frac": 0.01,
                     "stage1_end_frac": 0.001 / 0.0015, "stage2_lr_frac": 0.001 / 0.0015})
    assert 0.0015 * optim.lr_multiplier(199_999, 400_000, s) == pytest.approx(0.001, rel=1e-4)
    assert 0.0015 * optim.lr_multiplier(200_000, 400_000, s) == pytest.approx(0.001)
    assert 0.0015 * optim.lr_multiplier(400_000, 400_000, s) == pytest.approx(0.000015)
    assert (optim.weight_decay_at(199_999, s), optim.weight_decay_at(200_000, s)) == (0.1, 0.0)


def test_muon_momentum_rises_from_0_85_to_0_95_over_the_warmup_and_is_applied_by_the_schedule():
    args = Namespace(muon_momentum_warmup=300, warmup_steps=0, stage2_step=0, schedule="constant", min_lr_frac=0.0,
                     warmdown_frac=0.2, weight_decay=0.0)
    assert [optim.muon_momentum(step, args) for step in (0, 150, 300, 5000)] == [0.85, pytest.approx(0.90), 0.95, 0.95]
    assert optim.muon_momentum(0, Namespace(muon_momentum_warmup=0)) == 0.95
    muon = optim.Muon([{"params": [torch.nn.Parameter(torch.zeros(4, 4))], "base_lr": 0.02, "wd_on": True}])
    optim.apply_schedule([muon], 30, 1000, args)
    assert muon.param_groups[0]["momentum"] == pytest.approx(0.86)


def test_optimizer_groups_and_lr_rule(monkeypatch):
    # Newton-Schulz's dtype is not what this test is about: on a CPU with native bf16 and no precision.json entry for
    # width 3072 yet, distributed.precision would time that width's matmuls first (~12 s on a 2-core Xeon with AMX, more
    # where bf16 is the slower)
    monkeypatch.setattr(optim, "matmul_dtype", lambda device, width=256: "float32")
    model = build_model(config_from_preset("tiny", {"norm_learnable": True}))
    args = Namespace(optimizer="muon", adam8bit=False, matrix_lr=0.02, embedding_lr=0.2, head_lr=0.004, scalar_lr=0.04)
    adam, muon = optim.build_optimizers(model, args, width=3072, batch_tokens=2 ** 17, device=torch.device("cpu"))
    lrs = {g["name"]: g["lr"] for opt in (adam, muon) for g in opt.param_groups}
    batch = 0.25 ** (1 / 8)  # batch 2^17 = 2^19 / 4; width 4 x 768 -> 1/2
    assert lrs == pytest.approx({"embedding": 0.2 * 0.5 * batch, "value_embedding": 0.1 * 0.5 * batch,
                                 "head": 0.004 * 0.5 * batch, "scalar": 0.04 * 0.5 * batch, "matrix": 0.02,
                                 "resid_lambdas": 0.005, "x0_lambdas": 0.5})  # nanochat's, unscaled
    assert [g["betas"] for g in adam.param_groups if g["name"] == "x0_lambdas"] == [(0.96, 0.95)]
    assert {id(p) for p in muon.param_groups[0]["params"]} == {id(p) for n, p in model.named_parameters()
                                                              if n.startswith("blocks.") and p.ndim == 2}
    n_params = sum(len(g["params"]) for opt in (adam, muon) for g in opt.param_groups)
    assert n_params == len(list(model.parameters()))


def test_bf16_run_evaluates_and_samples(world):
    out = run(world, [*SMALL, "--steps", "4", "--eval_every", "2", "--dtype", "bfloat16", "--run_name", "bf16"]).stdout
    records = [json.loads(line) for line in (world / "runs" / "bf16" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "val_bpb" in r] == [2] and "final_val_bpb" in records[-1]
    samples = [json.loads(line) for line in (world / "runs" / "bf16" / "samples.jsonl").read_text().splitlines()]
    assert [s["step"] for s in samples] == [2] * 4 + [4] * 4 and "eval step 2: val bpb" in out


def test_adam8bit_without_bitsandbytes_says_how_to_get_it():
    pytest.importorskip("torch")
    try:
        import bitsandbytes  # noqa: F401
        pytest.skip("bitsandbytes is installed here")
    except ImportError:
        pass
    args = Namespace(optimizer="muon", adam8bit=True, matrix_lr=0.02, embedding_lr=0.2, head_lr=0.004, scalar_lr=0.04)
    with pytest.raises(ImportError, match="--adam8bit needs bitsandbytes: `pip install bitsandbytes`"):
        optim.build_optimizers(build_model(config_from_preset("tiny")), args, 256, 4096, torch.device("cpu"))


def test_memory_growth_warning_needs_steady_growth():
    mib = 2 ** 20
    assert train_loop.memory_growing([i * 2 * mib for i in range(60)])  # +2 MiB every step: 98 MiB over the last 50
    assert not train_loop.memory_growing([i * 2 * mib for i in range(40)])  # too few steps to say
    assert not train_loop.memory_growing([(i % 2) * 200 * mib + i * mib for i in range(60)])  # it falls sometimes
    assert not train_loop.memory_growing([i * mib // 4 for i in range(60)])  # steady but tiny: 12 MiB


def test_a_budget_larger_than_the_corpus_says_so_in_the_plan_every_log_line_and_the_report(world, tmp_path,
                                                                                                     capsys):
    """A corpus of 2 training shards of 1,200 short documents against a budget of 1.4 times its tokens: --data_plan
    asks for the shards the budget needs (counted with the tokenizer, as the test counts them here); the run's plan
    says it repeats data, every progress line and metrics record carries the epoch (the pass the loader reads, up to
    1,000 documents ahead of the rows trained: 0.4 of a pass here), and the report's data column says so."""
    import report
    from tokenizer import Tokenizer
    rng = __import__("random").Random(0)
    words = ["river", "stone", "light", "garden", "music", "winter", "paper", "market"]
    texts = [" ".join(rng.choice(words) for _ in range(rng.randint(3, 6))) for _ in range(2520)]
    corpus = tmp_path / "corpus"
    P.write_text_shards(texts, corpus, shard_docs=1200, val_fraction=0.05)
    (corpus / "ingest.json").write_text(json.dumps({"documents": 2520, "val_documents": 126}))  # prepare.py ingest's
    tok = Tokenizer.load(world / "tokenizer")

    def tokens(path):
        return sum(len(tok.encode(t)) + 1 for i in range(D.open_parquet(path).num_row_groups)
                   for t in D.read_row_group(path, i) if t)
    per_shard = tokens(corpus / "shard_00000.parquet")
    corpus_tokens = sum(tokens(p) for p in sorted(corpus.glob("*.parquet"))[:-1])
    steps = math.ceil(1.4 * corpus_tokens / 256)  # micro_batch 4 x sequence_len 64
    common = ["--data_dir", str(corpus), "--tokenizer", str(world / "tokenizer"), "--runs_dir", str(tmp_path / "runs"),
              "--sequence_len", "64", "--n_layer", "1", "--n_embd", "64", "--n_head", "2", "--n_kv_head", "2",
              "--eval_every", "0", "--bpb_tokens", "512", "--compile", "false", "--steps", str(steps)]
    code, plan, err = run_in_process(pretrain.main, [*common, "--total_batch_tokens", "256", "--data_plan"], capsys,
                                     stage="pretrain.py")  # in this process: the plan trains nothing
    assert code == 0, err[-3000:]
    shards = json.loads((tmp_path / "runs" / "data_plan.json").read_text())["shards"]
    assert shards == math.ceil(steps * 256 / per_shard) + 1 and f"data plan: {shards} training shards (" in plan
    assert f"{per_shard:,} tokens in shard_00000.parquet (1,200 documents" in plan
    planned = json.loads((tmp_path / "runs" / "data_plan.json").read_text())["epochs"]  # your corpus: its epochs
    assert planned == pytest.approx(1.4, rel=0.05) and f"{planned:.2f} epochs of it: pretraining repeats" in plan
    result = run_script("pretrain.py", [*common, "--micro_batch", "4", "--log_every", "1", "--run_name", "r",
                                        "--ckpt_every", "1000"], tmp_path)
    line = next(x for x in result.stdout.splitlines() if x.startswith("data: budget"))
    epochs = float(re.search(r": ([\d.]+) epochs\. This run REPEATS data", line).group(1))
    assert line.endswith("passes over the corpus (fewer --steps, or more text in the corpus)")  # not FineWeb's
    assert epochs == pytest.approx(steps * 256 / corpus_tokens, rel=0.05)  # the estimate: shard 0's mean length
    progress = [x for x in result.stdout.splitlines() if x.startswith("step ")]
    assert len(progress) == steps and all(re.search(r" epoch [12]( \(repeating data\))? ETA", x) for x in progress)
    assert " epoch 1 ETA" in progress[0] and " epoch 2 (repeating data) ETA" in progress[-1]
    records = [json.loads(x) for x in (tmp_path / "runs" / "r" / "metrics.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in records if "loss" in r][-1] == 2
    config = json.loads((tmp_path / "runs" / "r" / "config.json").read_text())
    assert f"{config['data']['epochs']:.2f} epochs of it (this run REPEATED data)" in report.data_of(config)


def test_the_data_plan_stops_when_the_disk_cannot_hold_the_checkpoints(world, tmp_path, monkeypatch, capsys):
    """--data_plan's plan, checked by the gpu plan's disk check (gpu_plan.check_disk: free disk against the
    checkpoints to come, gpu_plan.plan_checkpoints x their size, and the shards still missing); with 1 MB free it
    stops naming the need and the fixes, with plenty it passes."""
    import shutil
    from collections import namedtuple

    import gpu_plan
    usage = namedtuple("usage", "total used free")
    args = ["--data_dir", str(world / "demo" / "pretrain"), "--tokenizer", str(world / "tokenizer"), "--runs_dir",
            str(tmp_path / "runs"), "--preset", "tiny", "--tokens_per_param", "20", "--total_batch_tokens", "8192",
            "--keep", "2", "--data_plan"]
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10 ** 12, 0, 10 ** 12))
    pretrain.main(args)
    plan = json.loads((tmp_path / "runs" / "data_plan.json").read_text())
    out = capsys.readouterr().out + gpu_plan.check_disk(plan)
    config = config_from_preset("tiny", {"vocab_size": 1024})
    params, each = M.num_params(config), pretrain.checkpoint_bytes(config, "muon")
    assert f"checkpoints: pretraining keeps 2 (holding 3 while it saves), midtraining 2 (holding 3), SFT up to --keep " \
           f"2 (one more while it saves), RL 2 (holding 3): at most 9 at once x {each / 1e9:.2f} GB ({params:,} " \
           f"parameters" in out
    planned = json.loads((tmp_path / "runs" / "data_plan.json").read_text())["shards"]
    assert f"data plan: {planned} training shards (" in out
    shards, ckpts = map(float, re.search(r"data plan disk: ([\d.]+) GB of shards .* = ([\d.]+) GB", out).groups())
    assert ckpts == round(9 * each / 1e9, 1)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10 ** 12, 0, 10 ** 6))
    with pytest.raises(ValueError, match=rf"not enough disk: shards in .*, checkpoints in {tmp_path / 'runs'} need "
                                         rf"([\d.]+) GB, 0.0 GB are free there: .*--keep 1") as err:
        gpu_plan.check_disk(plan)  # one disk here: the shards and the checkpoints together
    need = float(re.search(r"need ([\d.]+) GB", str(err.value)).group(1))
    assert need == pytest.approx(shards + ckpts, abs=0.11)



def test_your_own_corpus_has_no_shards_to_fetch_in_the_disk_plan(world, tmp_path, monkeypatch, capsys):
    """speedrun.sh --corpus on the gpu plan: the disk plan still counts the checkpoints to come, and no shard to fetch,
    though the budget wants more shards than the corpus has (it repeats instead; before, the check was skipped)."""
    import shutil
    from collections import namedtuple

    import dataset as D
    import gpu_plan
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10 ** 12, 0, 10 ** 12))
    texts = tmp_path / "texts"
    texts.mkdir()
    for i in range(3):
        (texts / f"{i}.txt").write_text("\n\n".join(f"Document {i}.{j} about rivers and hills." for j in range(60)))
    P.ingest([texts], tmp_path / "corpus")
    args = ["--data_dir", str(tmp_path / "corpus"), "--tokenizer", str(world / "tokenizer"), "--runs_dir",
            str(tmp_path / "runs"), "--preset", "tiny", "--steps", "50", "--total_batch_tokens", "8192", "--data_plan"]
    pretrain.main(args)
    plan = json.loads((tmp_path / "runs" / "data_plan.json").read_text())
    assert plan["shards"] > len(D.split_shards(tmp_path / "corpus", "train")) and plan["epochs"] > 1
    assert gpu_plan.check_disk(plan).startswith("data plan disk: 0.0 GB of shards still to fetch; checkpoints: ")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10 ** 12, 0, 10 ** 3))
    with pytest.raises(ValueError, match=rf"not enough disk: shards in {tmp_path / 'corpus'}, checkpoints in "):
        gpu_plan.check_disk(plan)
    capsys.readouterr()

def test_a_resumed_runs_saved_checkpoints_count_as_space_it_holds_already(world, tmp_path, monkeypatch, capsys):
    """A rerun after three stages finished: their checkpoints are on disk and among those the plan counts, so the data
    plan needs only the rest (a resume of the d20 rehearsal on one GPU box was refused: 4 x 15.2 GB counted, 3 saved)."""
    import shutil
    from collections import namedtuple

    import gpu_plan
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10 ** 12, 0, 10 ** 6))
    runs = tmp_path / "runs"
    args = ["--data_dir", str(world / "demo" / "pretrain"), "--tokenizer", str(world / "tokenizer"), "--runs_dir",
            str(runs), "--preset", "d20", "--steps", "3", "--total_batch_tokens", "8192", "--keep", "1", "--data_plan"]
    each = pretrain.checkpoint_bytes(config_from_preset("d20", {"vocab_size": 1024}), "muon")
    for saved_stages in ([], ["pretrain", "midtrain", "sft"]):
        for stage in saved_stages:  # sparse files: a checkpoint's size without taking the disk
            (runs / stage / "ckpt" / "step_000003").mkdir(parents=True)
            with open(runs / stage / "ckpt" / "step_000003" / "model.pt", "wb") as f:
                f.truncate(each)
        pretrain.main(args)
        plan = json.loads((runs / "data_plan.json").read_text())
        with pytest.raises(ValueError, match=r"not enough disk: .* need ([\d.]+) GB") as err:
            gpu_plan.check_disk(plan)
        monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10 ** 12, 0, 10 ** 12))
        out = gpu_plan.check_disk(plan)
        monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10 ** 12, 0, 10 ** 6))
        shards = float(re.search(r"data plan disk: ([\d.]+) GB of shards", out).group(1))
        need = float(re.search(r"need ([\d.]+) GB", str(err.value)).group(1))
        assert f"at most 4 at once x {each / 1e9:.2f} GB" in out
        assert need == pytest.approx(shards + (4 - len(saved_stages)) * each / 1e9, abs=0.11)
    assert f"= {4 * each / 1e9:.1f} GB, {3 * each / 1e9:.1f} GB of them saved already in {runs}: {each / 1e9:.1f} GB " \
           f"to come" in out


def test_a_shards_token_count_is_cached_and_a_read_only_corpus_still_counts(world, tmp_path):
    from tokenizer import Tokenizer
    corpus = tmp_path / "corpus"
    shutil.copytree(world / "demo" / "pretrain", corpus)
    tok = Tokenizer.load(world / "tokenizer")
    first = min(corpus.glob("*.parquet"))
    texts = [t for i in range(D.open_parquet(first).num_row_groups) for t in D.read_row_group(first, i) if t]
    counted = (sum(len(tok.encode(t)) + 1 for t in texts), len(texts))
    assert pretrain.shard_tokens(first, tok) == counted
    assert json.loads((corpus / pretrain.TOKEN_COUNTS).read_text())[tok.fingerprint()][first.name] == list(counted)
    (corpus / pretrain.TOKEN_COUNTS).unlink()
    corpus.chmod(0o555)
    try:
        if os.access(corpus, os.W_OK):  # root ignores the mode: make the cache write fail another way
            (corpus / pretrain.TOKEN_COUNTS).mkdir()
        assert pretrain.shard_tokens(first, tok) == counted
        assert not list(corpus.glob("*.tmp"))  # no temporary file left behind
    finally:
        corpus.chmod(0o755)
