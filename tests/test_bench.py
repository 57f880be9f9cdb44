"""bench.py --dry_run: every benchmark, the GPU battery's rows included, at its smallest size in one process, each
printed figure checked against the files it was read from; the battery's pieces (phase timeouts, chat.py's dtype,
the rated peaks)."""
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from helpers import ROOT

import bench
import bench_gpu
from model import config_from_preset, flops_per_token, memory_estimate


def figure(printed, line_start):
    """The number after `line_start` on the line of `printed` that starts with it."""
    lines = [line for line in printed.splitlines() if line.startswith(line_start)]
    assert len(lines) == 1, (line_start, lines)
    return float(lines[0][len(line_start):].split()[0].replace(",", "").rstrip("x"))


def stage_values(work, name, label, kind):
    """A stage row's figure recomputed here from the files its command wrote, not by bench.stage_figure."""
    slug = re.sub(r"\W+", "_", f"{name} {label}")
    if kind == "items/s":
        out = work / "out" / slug
        report = json.loads((out / "results.json" if out.is_dir() else out.with_suffix(".json")).read_text())
        return sum(task["items"] for task in report["tasks"]) / report["seconds"]
    records = [json.loads(line) for line in (work / "runs" / slug / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "loss" in r]
    tokens = [b["tokens"] - a["tokens"] for a, b in zip([{"tokens": 0}, *steps], steps)]  # "tokens" is cumulative
    rates = [t / r["step_time"] for t, r in zip(tokens, steps, strict=True)][len(steps) // 4:]
    return statistics.median(rates)


def test_every_benchmark_s_dry_run_prints_figures_computed_from_what_ran(bench_dry_run):
    """One `bench.py --dry_run` of every benchmark and the battery's training rows and chat_decode (helpers'
    start_bench_dry_run, started by conftest). Each stage row's printed figure is recomputed here from its run's
    metrics.jsonl (tokens over step seconds) or its report (items over seconds), and each ratio from those; the
    battery's from its pretrain.py run and model.py, as its table must show them."""
    code, tmp = bench_dry_run
    work, out, printed = tmp / "work", tmp / "out", (tmp / "bench.out").read_text()
    assert code == 0, printed[-3000:] + (tmp / "bench.err").read_text()[-3000:]

    # the stage rows run in the precision this CPU picks (fp32 where bf16 is emulated or slower, else bf16)
    dtype = re.search(r"^cpu precision: (float32|bfloat16) ", printed, re.MULTILINE).group(1)
    other = {"float32": "bfloat16", "bfloat16": "float32"}[dtype]
    values = {}
    for name, label, _, kind in bench.STAGE_ROWS:
        label = label.format(dtype=dtype, other_dtype=other)
        values[name, label] = stage_values(work, name, label, kind)
        assert figure(printed, f"{name} {label}: ") == pytest.approx(values[name, label], rel=1e-3, abs=0.006), (
            name, label)
    for name, top, bottom, _ in bench.STAGE_RATIOS:
        assert figure(printed, f"{name}: {top} / {bottom} = ") == pytest.approx(
            values[name, top] / values[name, bottom], rel=0.02, abs=0.006)
    records = {(work / "out" / f"generate_batch_items_{b}_items.jsonl").read_text() for b in (1, 8, 32)}
    assert f"every item's record identical at batch_items 1, 8 and 32: {len(records) == 1}" in printed
    assert "cpu Muon step" in printed

    decode = {path: figure(printed, f"decode tiny float32 {path:9s}: ") for path in ("recompute", "kv_cache", "eager")}
    assert "decode tiny float32 compiled" not in printed  # the dry run compiles nothing
    for top, bottom in (("kv_cache", "recompute"), ("eager", "kv_cache")):
        ratio = decode[top] / decode[bottom]  # of rates printed as whole tok/s (at 16 tok/s that alone moves it 3%)
        rounding = 0.0051 + ratio * (0.5 / decode[top] + 0.5 / decode[bottom])  # and the ratio printed to 0.01
        assert figure(printed, f"decode: {top} / {bottom} = ") == pytest.approx(ratio, rel=0, abs=rounding)
    assert printed.count("greedy tokens identical: True") >= 3  # chat.py's step as the KV cache, and recompute
    for line in ("decode chat second turn", "decode rl per_question ", "decode rl all_questions", "decode rl: all",
                 "tokenizer: trained vocab 1024", "tokenizer: bytes/token", "loader T=2048"):
        assert f"\n{line}" in printed, line

    data = json.loads((out / "gpu_bench.json").read_text())
    assert data["dry_run"] is True and data["environment"]["prepared_at_commit"] == "f00dcafe"
    logs = out / "logs"
    assert printed.count("probe (d2): started") == 1 and not (logs / "bpb_d12_b17_probe.log").exists()
    assert (logs / "mfu_d20_probe.log").read_text().splitlines()[-1] == "micro_batch 4"
    rows = {(r["row"], r["side"]): r for r in data["rows"]}
    assert set(rows) == {("mfu_d20", "ours"), ("mfu_d20", "nanochat"), ("bpb_d12_b17", "ours"),
                         ("bpb_d12_b17", "nanochat"), ("chat_decode", "ours")}
    config = config_from_preset("d2", {"sequence_len": 64, "vocab_size": 1024})
    for name in ("mfu_d20", "bpb_d12_b17"):
        row = rows[(name, "ours")]
        assert row["status"] == "ok" and row["micro_batch"] == 4 and "--final_checkpoint false" in row["command"]
        assert sorted(p.name for p in Path(row["run_dir"]).iterdir()) == ["config.json", "done.json",
                                                                         "metrics.jsonl", "progress", "samples.jsonl"]
        assert row["flops_per_token"] == flops_per_token(config)
        assert row["memory_estimate"] == memory_estimate(config, 4, bf16=False, device_type="cpu")["total"]
        records = [json.loads(line) for line in (Path(row["run_dir"]) / "metrics.jsonl").read_text().splitlines()]
        times = [r["step_time"] for r in records if "loss" in r and r["step"] > 1]  # the dry run times steps 2..
        assert len(times) == row["steps"] - 1 and row["step_time_median_s"] == statistics.median(times)
        assert row["tok_per_s"] == pytest.approx(row["tokens_per_step"] / statistics.median(times))
        assert row["mfu"] == pytest.approx(row["flops_per_token"] * row["tok_per_s"] / row["peak_flops"])
        assert row["val_bpb"] == [r["final_val_bpb"] for r in records if "final_val_bpb" in r][-1]
        assert f"{row['tok_per_s']:,.0f}" in (out / "gpu_bench.md").read_text()
        assert rows[(name, "nanochat")]["status"].startswith("unavailable: no nanochat tree")
    # the 2^19 row's batch is 4x the 2^17 row's, at the same micro-batch: accumulation, not a larger forward
    assert rows[("mfu_d20", "ours")]["tokens_per_step"] == 4 * rows[("bpb_d12_b17", "ours")]["tokens_per_step"]
    decode_row = rows[("chat_decode", "ours")]
    assert decode_row["status"] == "ok" and decode_row["dtype"] == "float32"  # chat.py's on a CPU, bf16 on a GPU
    gpu_part = printed[printed.index("gpu: chat_decode: started"):]
    assert f"decode tiny float32 eager    : {decode_row['decode_tok_per_s_eager']:7,.0f} tok/s" in gpu_part
    assert "eager" in (out / "gpu_bench.md").read_text()


def test_a_phase_past_its_timeout_is_stopped_with_its_children_and_reported_with_its_log_tail(tmp_path, capsys):
    """run_logged stops the phase's whole process group (a child that would outlive its shell included) and says
    so; failure() turns that into the row's status with the log's last lines."""
    log, marker = tmp_path / "phase.log", tmp_path / "child_alive"
    command = ["bash", "-c", f"echo compiling; (sleep 3; touch {marker}) & sleep 30"]
    status, wall, _ = bench_gpu.run_logged(command, log, "row phase", timeout=0.5)
    assert status == "timed out after 0 s" and wall < 10
    time.sleep(3.5)
    assert not marker.exists()  # the background child was stopped too
    printed = capsys.readouterr().out.splitlines()
    assert printed[0] == f"gpu: row phase: started (log {log}, timeout 0 s)"
    assert printed[1].startswith("gpu: row phase: timed out after 0 s, ")
    assert bench_gpu.failure(status, log) == "timed out after 0 s (--phase_timeout, --deadline_s); log tail:\n" + \
        "$ bash -c " + command[2] + "\ncompiling"
    status, _, _ = bench_gpu.run_logged(["bash", "-c", "echo no; exit 3"], log, "row phase", timeout=30)
    assert status == 3 and bench_gpu.failure(status, log).startswith("failed: exit 3; log tail:\n")
    # each phase's limit: --phase_timeout, or what --deadline_s leaves of the call, at least 1 s
    battery = SimpleNamespace(args=SimpleNamespace(phase_timeout=300.0), deadline=time.perf_counter() + 100)
    assert 99 < bench_gpu.GpuBattery.timeout(battery) <= 100
    battery.deadline = time.perf_counter() + 1000
    assert bench_gpu.GpuBattery.timeout(battery) == 300.0
    battery.deadline = time.perf_counter() - 5
    assert bench_gpu.GpuBattery.timeout(battery) == 1.0


def test_the_decode_benchmark_times_chat_py_s_dtype(monkeypatch):
    """On a GPU chat.py decodes in bf16 (its compiled path): the benchmark times that dtype, not fp32."""
    import distributed
    assert bench.chat_decode_paths(torch.device("cpu")) == ("float32", "eager", ("eager", "compiled"))
    monkeypatch.setattr(distributed, "native_bf16", lambda device: True)  # an H100 / H200
    assert bench.chat_decode_paths(torch.device("cuda")) == ("bfloat16", "compiled", ("eager", "compiled"))


def test_the_battery_s_calls_merge_into_one_table(tmp_path):
    """dev/gpu_carry.py merge: one call's rows after the other's, unchanged, every call's environment kept."""
    import gpu_carry
    environment = {"device": "cpu", "driver": "-", "torch": "2", "cuda": "none", "python": "3", "commit": "c",
                   "dirty": False, "prepared_at_commit": "p", "date": "d"}
    call = {"dry_run": True, "environment": environment, "calls": [],
            "rows": [{"row": "mfu_d20", "side": "ours", "status": "ok", "tok_per_s": 1234.0}]}
    (tmp_path / "a.json").write_text(json.dumps(call))
    gpu_carry.main(["merge", str(tmp_path / "a.json"), str(tmp_path / "a.json"), "--out", str(tmp_path)])
    both = json.loads((tmp_path / "gpu_bench.json").read_text())
    assert both["rows"] == call["rows"] * 2 and len(both["environments"]) == 2
    assert (tmp_path / "gpu_bench.md").read_text().count("| mfu_d20 | ours |") == 2


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_battery_stopped_mid_phase_stops_the_phase_s_processes_with_it(tmp_path, signum):
    """A device call's limit stops bench.py (Ctrl-C or SIGTERM) while a phase runs in a session of its own: the phase
    and what it started end with it, not left running on the lent machine."""
    marker = tmp_path / "child_alive"
    # as bench.py's __main__: SIGTERM exits, SIGINT raises KeyboardInterrupt even where this suite runs with SIGINT
    # ignored (a background job inherits it so)
    program = ("import signal, sys, bench_gpu; signal.signal(signal.SIGTERM, lambda s, f: sys.exit(128 + s)); "
               "signal.signal(signal.SIGINT, signal.default_int_handler); "
               f"bench_gpu.run_logged(['bash', '-c', 'echo started; (sleep 4; touch {marker}) & sleep 60'], "
               f"'{tmp_path / 'phase.log'}', 'row phase', timeout=120)")
    battery = subprocess.Popen([sys.executable, "-c", program], cwd=ROOT, stdout=subprocess.PIPE, text=True,
                               env={**os.environ, "PYTHONPATH": str(ROOT / "dev")})
    log, deadline = tmp_path / "phase.log", time.monotonic() + 30
    # the phase's own line, not the command line run_logged writes first (a signal before the phase runs
    # would test nothing)
    while not (log.exists() and "started" in log.read_text().splitlines()):
        assert time.monotonic() < deadline, "the phase did not start"
        time.sleep(0.1)
    battery.send_signal(signum)
    assert battery.wait(timeout=30) != 0
    time.sleep(4.5)
    assert not marker.exists()  # the phase's background child was stopped with it


def test_a_stop_signal_while_popen_starts_the_phase_still_stops_the_phase(tmp_path):
    """The signal lands after the phase started but before Popen returned its pid: run_logged holds it until its
    finally can stop the phase, rather than dying with the phase left running."""
    marker, log = tmp_path / "child_alive", tmp_path / "phase.log"
    program = ("import os, signal, subprocess, sys, time, bench_gpu\n"
               "signal.signal(signal.SIGTERM, lambda s, f: sys.exit(128 + s))\n"
               "real = subprocess.Popen\n"
               "def popen(*args, **kwargs):\n"
               "    process = real(*args, **kwargs)\n"
               f"    while 'started' not in open({str(log)!r}).read().split():\n"
               "        time.sleep(0.05)\n"
               "    os.kill(os.getpid(), signal.SIGTERM)\n"
               "    return process\n"
               "bench_gpu.subprocess.Popen = popen\n"
               f"bench_gpu.run_logged(['bash', '-c', 'echo started; (sleep 4; touch {marker}) & sleep 60'], "
               f"{str(log)!r}, 'row phase', timeout=120)\n")
    battery = subprocess.run([sys.executable, "-c", program], cwd=ROOT, capture_output=True, text=True, timeout=60,
                             check=False, env={**os.environ, "PYTHONPATH": str(ROOT / "dev")})
    assert battery.returncode == 128 + signal.SIGTERM, battery.stderr
    time.sleep(4.5)
    assert not marker.exists()  # the phase's background child was stopped with it


def test_h200_nvl_and_b200_have_their_dense_bf16_peaks():
    from distributed import peak_flops
    assert peak_flops("NVIDIA H200 NVL", "bfloat16") == 836e12  # not the SXM's 989e12: MFU 15% too low
    assert peak_flops("NVIDIA H200", "bfloat16") == 989e12
    assert peak_flops("NVIDIA B200", "bfloat16") == 2250e12
    assert peak_flops("NVIDIA H100 NVL", "bfloat16") == 835e12
