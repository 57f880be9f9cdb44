"""train_loop.py's training loop: the loss of a step is exact however its global batch is split into micro-batches,
with masked targets (and into processes: tests/test_distributed.py); checkpoints ordered by step; resume sets abandoned
checkpoints aside and checks the layout; the exact resume command."""
import json
import math
import os
import shlex
import signal
import subprocess
import sys
from argparse import Namespace

import pytest
import torch
from helpers import ROOT, assert_same, global_batch, step, tiny_model

import checkpoint
import distributed
import optim
import train_loop


def test_loss_and_gradients_do_not_depend_on_the_micro_batch_split():
    whole = step(8)
    model = tiny_model()
    inputs, targets = global_batch()
    assert abs(whole[0] - model(inputs, targets).item()) < 1e-6  # the mean over the global batch's 128 - 56 targets
    for micro_batch in (2, 1):
        assert_same(step(micro_batch), whole)


def test_the_per_micro_batch_mean_would_give_other_gradients():
    """The test above can fail: the accumulation bug (each micro-batch's mean / accumulation steps) moves every
    gradient here by far more than its tolerance."""
    model = tiny_model()
    inputs, targets = global_batch()
    for r in range(8):
        (model(inputs[r:r + 1], targets[r:r + 1]) / 8).backward()
    exact = step(8)[1]
    worst = max((p.grad - exact[n]).abs().max().item() / exact[n].abs().max().item() for n, p in model.named_parameters())
    assert worst > 0.05, worst


LAYOUT = {"model_config": "tiny", "micro_batch": 4, "world_size": 1, "accum": 2}  # what a checkpoint's layout must match


def checkpoints_at(ckpt_dir, steps):
    model = tiny_model()
    for s in steps:
        checkpoint.save_checkpoint(ckpt_dir, s, model, [], ["stream 0", "stream 1"], {"stage": "pretrain", **LAYOUT}, 0,
                                   keep=10)


class Stream:
    """A data loader as resume sees it."""
    def load_state_dict(self, state):
        self.state = state


def test_a_save_prints_and_logs_its_size_and_seconds(tmp_path, capsys):
    """The size is the checkpoint's files on disk, the seconds the same as ckpt/save_seconds (what a stop's grace and
    the plan's prediction read)."""
    ckpt = tmp_path / "r" / "ckpt"
    path = checkpoint.save_checkpoint(ckpt, 5, tiny_model(), [], ["stream 0"], {"stage": "pretrain", **LAYOUT}, 0,
                                      keep=1, metrics=tmp_path / "r" / "metrics.jsonl")
    size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    assert size > sum(p.numel() * 4 for p in tiny_model().parameters())  # the fp32 weights are in it
    record = json.loads((tmp_path / "r" / "metrics.jsonl").read_text())
    assert record["step"] == 5 and record["save_bytes"] == size
    assert f"{record['save_s']:.1f}" == (ckpt / "save_seconds").read_text().strip()
    assert f"checkpoint: saved {size / 1e9:.2f} GB in {record['save_s']:.1f} s to {path}" in capsys.readouterr().out


def test_a_save_that_cannot_write_says_where_and_keeps_the_complete_checkpoints(tmp_path):
    """A file-size limit makes the writes fail for real (EFBIG), as a full disk does (ENOSPC); torch's own error
    names neither the directory nor what to do."""
    ckpt = tmp_path / "r" / "ckpt"
    program = f"""
import resource, signal, sys
sys.path[:0] = [{str(ROOT)!r}, {str(ROOT / "tests")!r}]
import checkpoint
from helpers import tiny_model
model, meta = tiny_model(), {{"stage": "pretrain", **{LAYOUT!r}}}
checkpoint.save_checkpoint({str(ckpt)!r}, 1, model, [], ["stream 0"], meta, 0, keep=2)
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (4096, resource.RLIM_INFINITY))
try:
    checkpoint.save_checkpoint({str(ckpt)!r}, 2, model, [], ["stream 0"], meta, 0, keep=2)
except RuntimeError as e:
    print(e)
"""
    done = subprocess.run([sys.executable, "-c", program], check=False, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    error = done.stdout.splitlines()[-1]
    assert error.startswith(f"saving step 2 to {ckpt} failed (")
    assert f"GB free there: free some space, then rerun with --resume (from {ckpt / 'step_000001'}:" in error
    assert sorted(p.name for p in ckpt.iterdir()) == ["save_seconds", "step_000001"]  # the partial one is gone
    saved, expected = torch.load(ckpt / "step_000001" / "model.pt", weights_only=True), tiny_model().state_dict()
    assert saved.keys() == expected.keys() and all(torch.equal(saved[k], expected[k]) for k in expected)


def test_the_newest_checkpoint_is_the_highest_step_not_the_last_name(tmp_path):
    checkpoints_at(tmp_path / "r" / "ckpt", [999_999, 1_000_000])
    assert [c.name for c in checkpoint.list_checkpoints(tmp_path / "r" / "ckpt")] == ["step_999999", "step_1000000"]
    assert checkpoint.find_checkpoint(tmp_path / "r").name == "step_1000000"


def test_resuming_from_an_older_checkpoint_sets_the_newer_ones_aside(tmp_path, capsys):
    ckpt = tmp_path / "r" / "ckpt"
    checkpoints_at(ckpt, [2, 4, 6])
    model = tiny_model()
    with pytest.raises(ValueError, match="1 processes x 2 accumulation steps = 2 data streams, this run has 1 x 1 = 1"):
        checkpoint.resume(ckpt / "step_000002", tmp_path / "r", model, [], [], {**LAYOUT, "accum": 1}, 0,
                          torch.device("cpu"))
    with pytest.raises(ValueError, match="its micro_batch is 4, this run's is 8"):
        checkpoint.resume(ckpt / "step_000002", tmp_path / "r", model, [], [], {**LAYOUT, "micro_batch": 8}, 0,
                          torch.device("cpu"))
    streams = [Stream(), Stream()]
    step = checkpoint.resume(ckpt / "step_000002", tmp_path / "r", model, [], streams, LAYOUT, 0, torch.device("cpu"))
    assert [s.state for s in streams] == ["stream 0", "stream 1"]
    assert step == 2 and [c.name for c in checkpoint.list_checkpoints(ckpt)] == ["step_000002"]
    aside = list((tmp_path / "r" / "ckpt_abandoned").glob("*/step_*"))
    assert sorted(c.name for c in aside) == ["step_000004", "step_000006"]  # moved, not deleted
    assert all((c / "model.pt").is_file() for c in aside) and "moved to" in capsys.readouterr().out


def test_a_loaded_optimizer_keeps_this_runs_kernel_and_newton_schulz_dtype_and_takes_the_saved_moments(tmp_path):
    """A checkpoint written by a foreach AdamW (an older version's CPU choice) and a Newton-Schulz in the other dtype
    (another device's choice) loads into this run's optimizers: the moments and step are the saved ones, the kernel
    stays fused and Newton-Schulz in this device's dtype (a param group's saved keys would bring the writer's back)."""
    args = Namespace(optimizer="muon", adam8bit=False, matrix_lr=0.02, embedding_lr=0.2, head_lr=0.004, scalar_lr=0.04)
    torch.manual_seed(0)
    model = tiny_model()
    optimizers = optim.build_optimizers(model, args, 32, 128, torch.device("cpu"))
    for group in optimizers[0].param_groups:
        group.update(foreach=True, fused=None)
    mine = optimizers[1].param_groups[0]["ns_dtype"]
    optimizers[1].param_groups[0]["ns_dtype"] = {"float32": "bfloat16", "bfloat16": "float32"}[mine]
    model(*global_batch()[:2], reduction="sum").backward()
    for opt in optimizers:
        opt.step()
    checkpoint.save_checkpoint(tmp_path / "ckpt", 1, model, optimizers, [], {"stage": "pretrain", **LAYOUT}, 0, keep=1)
    loaded_model = tiny_model()
    fresh = optim.build_optimizers(loaded_model, args, 32, 128, torch.device("cpu"))
    checkpoint.load_state(tmp_path / "ckpt" / "step_000001", loaded_model, fresh, torch.device("cpu"))
    assert all(g["fused"] is True and not g["foreach"] for g in fresh[0].param_groups)
    assert fresh[1].param_groups[0]["ns_dtype"] == mine == optim.matmul_dtype(torch.device("cpu"), 32)
    saved, loaded = optimizers[0].state_dict()["state"], fresh[0].state_dict()["state"]
    assert saved.keys() == loaded.keys() and all(torch.equal(saved[i][k], loaded[i][k]) for i in saved for k in saved[i])


def test_keep_must_leave_at_least_one_checkpoint(tmp_path):
    args = Namespace(keep=0, resume=None, run_name="r", runs_dir=str(tmp_path), preset="tiny")
    with pytest.raises(ValueError, match="--keep 0: keep at least 1"):
        checkpoint.resolve_run(args, "pretrain")


@pytest.mark.parametrize("argv", [["--steps", "9", "--resume", "runs/old/ckpt/step_000004", "--seed", "1"],
                                  ["--resume=runs/old/ckpt/step_000004", "--steps", "9", "--seed", "1"],
                                  ["--run_name", "old", "--steps", "9", "--resume", "--seed", "1"],
                                  ["--run_name=old", "--runs_dir", "elsewhere", "--steps", "9", "--seed", "1"]])
def test_the_resume_command_drops_the_old_resume_and_names_the_run(argv, monkeypatch):
    monkeypatch.setattr("sys.argv", ["pretrain.py", *argv])
    for name in ("LOCAL_WORLD_SIZE", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    args = Namespace(runs_dir="runs", run_name="old")
    expected = ["pretrain.py", "--steps", "9", "--seed", "1", "--runs_dir", "runs", "--run_name", "old", "--resume"]
    words = shlex.split(checkpoint.resume_command(args))
    assert words[0] == sys.executable and sorted(words[1:]) == sorted(expected) and words[-1] == "--resume"
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("WORLD_SIZE", "2")
    words = shlex.split(checkpoint.resume_command(args))
    assert words[:5] == [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    assert sorted(words[5:]) == sorted(expected)


def reference_muon_step(param, grad, state, lr=0.02, momentum=0.95, weight_decay=0.1, beta2=0.95):
    """The update rule written out for one matrix in fp64: Nesterov momentum, Polar Express's five quintics on the
    wide orientation, NorMuon's per-neuron normalization, Keller's shape scale, decoupled weight decay."""
    buffer = state.setdefault("momentum", torch.zeros_like(grad))
    buffer.mul_(momentum).add_(grad, alpha=1 - momentum)
    update = grad * (1 - momentum) + buffer * momentum
    tall = update.size(0) > update.size(1)
    x = update.mT if tall else update
    x = x / (x.norm() * 1.02)
    for a, b, c in optim.POLAR_EXPRESS:
        gram = x @ x.mT
        x = a * x + (b * gram + c * gram @ gram) @ x
    x = x.mT if tall else x
    mean_square = x.square().mean(dim=-1 if x.size(0) >= x.size(1) else -2, keepdim=True)
    second = state.setdefault("second", torch.zeros_like(mean_square))
    second.mul_(beta2).add_(mean_square, alpha=1 - beta2)
    normalized = x / second.sqrt()
    normalized = normalized * (x.norm() / normalized.norm())
    scale = max(1, param.size(0) / param.size(1)) ** 0.5
    return param * (1 - lr * weight_decay) - lr * scale * normalized


def test_our_muon_takes_the_reference_steps_in_fp64_and_stays_close_in_fp32_and_bf16():
    """optim.Muon's update rule equals the written-out reference (reference_muon_step) in fp64 over 3 steps, also for
    the matrices of one shape up to a transpose that it orthogonalizes as one stack; fp32 and bf16 Newton-Schulz
    differ from it only by rounding."""
    shapes = [(96, 32), (32, 64), (96, 32), (32, 96)]
    generator = torch.Generator().manual_seed(0)
    initial = [torch.randn(shape, dtype=torch.float64, generator=generator) for shape in shapes]
    grads = [[torch.randn(shape, dtype=torch.float64, generator=generator) for shape in shapes] for _ in range(3)]
    expected, states = [p.clone() for p in initial], [{} for _ in shapes]
    for grads_now in grads:
        expected = [reference_muon_step(p, g, st) for p, g, st in zip(expected, grads_now, states, strict=True)]
    for dtype, tolerance in (("float64", 1e-12), ("float32", 1e-4), ("bfloat16", 0.05)):
        params = [torch.nn.Parameter(p.clone().to(torch.float64 if dtype == "float64" else torch.float32))
                  for p in initial]
        opt = optim.Muon(params, ns_dtype=dtype, lr=0.02, momentum=0.95, nesterov=True, weight_decay=0.1)
        for grads_now in grads:
            for p, g in zip(params, grads_now, strict=True):
                p.grad = g.to(p.dtype)
            opt.step()
        for ours, theirs, start in zip(params, expected, initial, strict=True):
            moved = (theirs - start).abs().max()  # 3 steps of lr 0.02 x shape scale, and weight decay
            assert (ours.detach().double() - theirs).abs().max() <= tolerance * moved, dtype
    assert optim.newton_schulz(torch.randn(2, 8, 4), 5, "float32").dtype == torch.float32


def test_newton_schulz_gram_form_is_the_same_iteration_and_stays_close_in_fp32_on_ill_conditioned_matrices():
    """Wide matrices take the Gram form in fp32/fp64 (fewer FLOPs): in fp64 it equals the direct iteration to
    rounding; in fp32 it stays within 2e-3 of it where the singular values span 1e-4 (measured 1.1e-3 with Polar
    Express's steep first quintic; the direct form in fp32: 9e-6), 20x closer than bf16 rounding gets (0.26 there;
    bf16 would lose the small singular values, so bf16 keeps the direct form: bit-identical)."""
    def direct(x):  # the iteration, written out
        x = x / (x.norm(dim=(-2, -1), keepdim=True) * 1.02)
        for a, b, c in optim.POLAR_EXPRESS:
            gram = x @ x.mT
            x = a * x + (b * gram + c * gram @ gram) @ x
        return x
    generator = torch.Generator().manual_seed(0)
    left, _ = torch.linalg.qr(torch.randn(3, 32, 32, dtype=torch.float64, generator=generator))
    right, _ = torch.linalg.qr(torch.randn(3, 128, 32, dtype=torch.float64, generator=generator))
    wide = (left * torch.logspace(0, -4, 32, dtype=torch.float64)) @ right.mT  # 3 x 32 x 128, condition 1e4
    reference = direct(wide)
    assert (optim.newton_schulz(wide.clone(), 5, "float64") - reference).abs().max() < 1e-12
    relative = (optim.newton_schulz(wide.float(), 5, "float32").double() - reference).norm() / reference.norm()
    assert relative < 2e-3
    low = wide.bfloat16()
    x = low / (low.norm(dim=(-2, -1), keepdim=True) * 1.02)
    for a, b, c in optim.POLAR_EXPRESS:
        gram = x @ x.mT
        x = torch.baddbmm(x, torch.baddbmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    assert torch.equal(optim.newton_schulz(wide.bfloat16(), 5, "bfloat16"), x)
    assert 20 * relative < (x.double() - reference).norm() / reference.norm()


def muon_args(dtype):
    return Namespace(optimizer="muon", adam8bit=False, matrix_lr=0.02, embedding_lr=0.2, head_lr=0.004,
                     scalar_lr=0.04, dtype=dtype)


@pytest.mark.parametrize("avx512_bf16,amx", [(False, False), (True, False), (False, True)])
def test_a_cpu_picks_fp32_untimed_where_bf16_is_emulated_and_by_timing_where_native(avx512_bf16, amx, tmp_path,
                                                                                      monkeypatch):
    """AVX2-only CPUs emulate bf16 matmuls (~20-100x slower): there fp32 is the answer without timing anything. With
    AVX512-BF16 or AMX the faster one as timed here wins (here bf16, 2x), and Muon's Newton-Schulz follows it."""
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    monkeypatch.setattr(distributed, "CACHE_DIR", tmp_path)
    timed = []
    monkeypatch.setattr(distributed, "time_linear", lambda dtype, width: timed.append(dtype) or
                        {"float32": 0.5, "bfloat16": 0.25}[dtype])
    cpu, native = torch.device("cpu"), avx512_bf16 or amx
    expected = "bfloat16" if native else "float32"
    assert distributed.matmul_dtype(cpu, 32) == expected
    assert timed == (["float32", "bfloat16"] if native else [])
    optimizers = optim.build_optimizers(tiny_model(), muon_args(expected), 32, 2048, cpu)
    assert optimizers[1].param_groups[0]["ns_dtype"] == expected
    why = (f"bf16: 2.0x faster than fp32 here, measured earlier ({tmp_path / 'precision.json'})" if native
           else "bf16 is not native on this CPU (emulated), so not timed")
    assert optim.precision_line(muon_args(expected), cpu, optimizers, 32) == (
        f"precision: fp32 weights, compute {expected}, Muon Newton-Schulz {expected} ({why}) on "
        f"{distributed.device_name(cpu)}")
    if native:  # --dtype float32 against the measured bf16: the line says both
        assert optim.precision_line(muon_args("float32"), cpu, optimizers, 32).endswith(
            f"(given or inherited; the choice here would be bfloat16, {why}) on {distributed.device_name(cpu)}")


def test_the_probe_picks_the_faster_precision_and_a_tie_goes_to_fp32():
    slower_bf16 = distributed.pick_precision({"float32": 0.1, "bfloat16": 0.19})
    assert slower_bf16 == ("float32", "fp32: 1.9x faster than bf16 here, measured")
    faster_bf16 = distributed.pick_precision({"float32": 0.3, "bfloat16": 0.1})
    assert faster_bf16 == ("bfloat16", "bf16: 3.0x faster than fp32 here, measured")
    assert distributed.pick_precision({"float32": 0.2, "bfloat16": 0.2})[0] == "float32"


def test_the_measured_precision_is_kept_per_cpu_model_and_torch_version_and_not_trusted_across_them(tmp_path,
                                                                                                  monkeypatch):
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: True)
    monkeypatch.setattr(distributed, "CACHE_DIR", tmp_path / "cache")
    timings = {"float32": 0.1, "bfloat16": 0.2}
    timed = []
    monkeypatch.setattr(distributed, "time_linear", lambda dtype, width: timed.append((dtype, width)) or timings[dtype])
    cpu = torch.device("cpu")
    kept = tmp_path / "cache" / "precision.json"
    assert distributed.precision(cpu, 64) == ("float32", f"fp32: 2.0x faster than bf16 here, measured (kept in {kept})")
    assert timed == [("float32", 64), ("bfloat16", 64)]
    timings.update(float32=0.4)  # a second stage on this machine reads the first one's answer, it does not re-time
    assert distributed.precision(cpu, 64) == ("float32", f"fp32: 2.0x faster than bf16 here, measured earlier ({kept})")
    assert len(timed) == 2
    monkeypatch.setattr(torch, "__version__", "9.9.9")  # another torch: measured again, and now bf16 wins
    assert distributed.precision(cpu, 64)[0] == "bfloat16" and len(timed) == 4
    monkeypatch.setattr(distributed, "device_name", lambda device: "another CPU")  # another CPU model: again
    assert distributed.precision(cpu, 64)[0] == "bfloat16" and len(timed) == 6
    assert len(json.loads(kept.read_text())) == 3
    kept.write_text("{damaged")  # a damaged file is measured over, not an error
    assert distributed.precision(cpu, 64)[0] == "bfloat16" and len(timed) == 8


def test_the_probe_times_a_real_linear_layer_in_either_precision():
    for dtype in ("float32", "bfloat16"):
        seconds = distributed.time_linear(dtype, 16, rows=32, reps=2)
        assert 0 < seconds < 1


def test_a_stage_ends_with_one_line_for_our_errors_and_a_traceback_for_others(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("sys.argv", ["pretrain.py"])
    # raised by this project, naming the fix
    assert distributed.run_main(lambda: checkpoint.find_checkpoint(tmp_path)) == 1
    assert capsys.readouterr().err == f"pretrain.py: error: --checkpoint {tmp_path}: neither a checkpoint " \
        f"(runs/<run>/ckpt/step_*/meta.json) nor a run directory with checkpoints in {tmp_path}/ckpt/\n"
    assert distributed.run_main(lambda: torch.zeros(2) @ torch.zeros(3)) == 1  # raised inside torch: where is the
    # question
    err = capsys.readouterr().err
    assert err.startswith("Traceback") and err.endswith("pretrain.py: error: inconsistent tensor size, expected "
                                                        "tensor [2] and src [3] to have the same number of elements, "
                                                        "but got 2 and 3 elements respectively\n")
    assert distributed.run_main(lambda: signal.SIGTERM) == 128 + signal.SIGTERM
    assert distributed.run_main(lambda: None) == 0


def test_a_script_ends_after_its_atexit_handlers_and_skips_the_interpreters_finalization(tmp_path):
    """A stage run by python ends like one under torchrun, at once after main() and its exit handlers: buffered output
    and atexit handlers still come out, the interpreter's teardown (a module global's __del__ here) never runs."""
    script = tmp_path / "stage.py"
    script.write_text("import atexit, signal, sys\nimport distributed\n\n\n"
                      "class Finalized:\n    def __del__(self):\n        print('finalized', flush=True)\n\n\n"
                      "kept = Finalized()  # freed only by the interpreter's finalization\n\n\n"
                      "def main():\n    atexit.register(lambda: print(' and atexit ran', flush=True))\n"
                      "    print('main ran', end='')  # still in stdout's buffer when main returns\n"
                      "    return signal.SIGTERM\n\n\nsys.exit(distributed.run_main(main))\n")
    result = subprocess.run([sys.executable, str(script)], env={**os.environ, "PYTHONPATH": str(ROOT)},
                            capture_output=True, text=True, timeout=120, check=False)
    assert (result.returncode, result.stdout, result.stderr) == (128 + signal.SIGTERM, "main ran and atexit ran\n", "")


@pytest.mark.two_processes
def test_muon_under_ddp_divides_the_orthogonalization_between_ranks_and_takes_the_same_steps(two_rank_results):
    """2 gloo processes (tests/muon_worker.py): each rank runs Newton-Schulz on its share of each shape's stack and an
    all-gather gives every rank all of them; 3 steps equal, bitwise, the steps of one process computing every matrix
    (fp32 and bf16 Newton-Schulz), and each rank orthogonalized half of the 10 matrices (the lone gate: rank 0). After
    distributed.teardown_distributed no gloo thread is left: before, the process group outlived it (see
    distributed.init_process_group) and a rank now and then aborted at exit."""
    result = two_rank_results["muon"]
    for dtype in ("float32", "bfloat16"):
        for divided, alone in zip(result[f"divided {dtype}"], result[f"alone {dtype}"], strict=True):
            assert torch.equal(divided, alone), dtype
        assert all(not torch.equal(p, start) for p, start in zip(result[f"divided {dtype}"], result["initial"],
                                                                  strict=True))  # every matrix took its steps
    # per step, 5 squares: 3 + 2; 4 of the MLP shape up to a transpose: 2 + 2; the gate: 1 + 0; 3 steps
    assert result["counts per rank"] == [3 * 6, 3 * 4]
    assert result["gloo threads after teardown"] == []


def test_compiled_graphs_go_to_one_cache_per_torch_version(tmp_path, monkeypatch):
    """Every stage of every run compiles into the same directory, one per torch version, under the downloads' cache,
    even after torch._dynamo's import (an optimizer's) wrote torch's own default into the environment;
    $TORCHINDUCTOR_CACHE_DIR, where the user set it, wins."""
    env = {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_CACHE_DIR"} | {"NANOCHAT_CACHE": str(tmp_path)}
    program = ("import os, pretrain, train_loop, torch._dynamo; "
               "print(train_loop.compile_cache(), os.environ['TORCHINDUCTOR_CACHE_DIR'])")
    out = subprocess.run([sys.executable, "-c", program], cwd=ROOT, env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == [str(tmp_path / "compile" / f"torch-{torch.__version__}")] * 2
    import train_loop
    monkeypatch.setattr(train_loop, "CACHE_DIR", tmp_path)
    monkeypatch.setattr(train_loop, "USER_COMPILE_CACHE", None)
    monkeypatch.setattr(torch, "__version__", "9.9.9")
    assert train_loop.compile_cache() == tmp_path / "compile" / "torch-9.9.9"
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "compile" / "torch-9.9.9")
    monkeypatch.setattr(train_loop, "USER_COMPILE_CACHE", str(tmp_path / "mine"))
    assert train_loop.compile_cache() == tmp_path / "mine"


def test_clipping_scales_gradients_only_above_the_limit_and_keeps_a_finite_norm_past_fp32s_range():
    """train_loop.clip_grad_norm: the norm of all gradients within fp32's rounding of the fp64 norm; above max_norm the
    gradients scaled as torch.nn.utils.clip_grad_norm_ scales them; below it they keep their bits; gradients whose
    squares pass fp32's range (~1e19 each) still give their finite norm (row norms in fp32 would be infinite)."""
    generator = torch.Generator().manual_seed(0)
    shapes = [(64, 32), (32,), (8, 4, 16)]
    grads = [torch.randn(shape, generator=generator) for shape in shapes]
    exact = torch.cat([g.double().flatten() for g in grads]).norm().item()

    def params(scale):
        made = [torch.nn.Parameter(torch.zeros(shape)) for shape in shapes]
        for p, g in zip(made, grads, strict=True):
            p.grad = g * scale
        return made
    ours, theirs = params(1.0), params(1.0)
    assert abs(train_loop.clip_grad_norm(ours, 1.0).item() - exact) <= 1e-6 * exact
    torch.nn.utils.clip_grad_norm_(theirs, 1.0)
    assert all(torch.allclose(a.grad, b.grad, rtol=1e-6, atol=0) for a, b in zip(ours, theirs, strict=True))
    below = params(1.0)
    train_loop.clip_grad_norm(below, 2 * exact)
    assert all(torch.equal(p.grad, g) for p, g in zip(below, grads, strict=True))
    huge = train_loop.clip_grad_norm(params(1e20), float("inf")).item()
    assert math.isfinite(huge) and abs(huge - exact * 1e20) <= 1e-6 * exact * 1e20


class HostReads(torch.overrides.TorchFunctionMode):
    """Records every read of a tensor's value by the host (a wait for the device off the CPU)."""
    def __init__(self):
        super().__init__()
        self.reads = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in ("__bool__", "item", "tolist", "__float__", "__int__", "cpu", "numpy"):
            self.reads.append(func.__name__)
        return func(*args, **(kwargs or {}))


def test_the_clip_off_the_cpu_reads_nothing_and_gives_the_cpus_bits():
    """clip_grad_norm's device form (host_branches=False, what runs off the CPU) reads no value on the host, and gives
    the bits of the CPU's branches: clipped, below the limit, past fp32's range (the fp64 fallback chosen on the
    device) and NaN."""
    generator = torch.Generator().manual_seed(1)
    shapes = [(64, 32), (32,), (8, 4, 16)]
    grads = [torch.randn(shape, generator=generator) for shape in shapes]
    exact = torch.cat([g.double().flatten() for g in grads]).norm().item()
    with_nan = [g.clone() for g in grads]
    with_nan[1][3] = float("nan")
    cases = {"clipped": (grads, 1.0), "below": (grads, 2 * exact), "huge": ([g * 1e20 for g in grads], float("inf")),
             "nan": (with_nan, 1.0)}
    for name, (case, max_norm) in cases.items():
        results = []
        for host_branches in (True, False):
            made = [torch.nn.Parameter(torch.zeros(shape)) for shape in shapes]
            for p, g in zip(made, case, strict=True):
                p.grad = g.clone()
            with HostReads() as seen:
                norm = train_loop.clip_grad_norm(made, max_norm, host_branches=host_branches)
            results.append((norm, [p.grad for p in made], seen.reads))
        (host_norm, host_grads, host_reads), (norm, device_grads, reads) = results
        assert reads == [] and host_reads, name  # the CPU's form reads (its branches); the device's form does not
        assert torch.equal(norm, host_norm) if name != "nan" else norm.isnan() and host_norm.isnan()
        assert name != "huge" or math.isfinite(norm.item())
        for a, b in zip(device_grads, host_grads, strict=True):  # NaN where the CPU's are (NaN != NaN for equal)
            assert torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num()), name
