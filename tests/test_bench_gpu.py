"""bench.py gpu --dry_run: the GPU battery's rows at toy size on the CPU, their figures computed from what ran."""
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from helpers import ROOT

import bench_gpu
from model import config_from_preset, flops_per_token, memory_estimate


def test_gpu_dry_run_rows_hold_figures_computed_from_the_runs(tmp_path):
    """One training row of each kind (throughput at 2^19 scaled down, bpb at 2^17 scaled down) and the decode row,
    without a nanochat tree (its rows say why they did not run). The figures are recomputed here from the run's own
    metrics.jsonl and model.py, so a table that printed anything else would fail. The micro-batch comes from the real
    probe process (`bench.py gpu_probe`, on the CPU up to the dry run's 4), the logs and run directories are under
    --out, no checkpoint is written, and the header's .bench commit is read from --bench_dir (the test's working
    directory has no .bench)."""
    out, empty = tmp_path / "out", tmp_path / "no_bench"
    empty.mkdir()
    (empty / "PREPARED.json").write_text(json.dumps({"code": {"commit": "f00dcafe"}}))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TMPDIR": str(tmp_path), "PYTHONPATH": str(ROOT)}
    result = subprocess.run([sys.executable, str(ROOT / "bench.py"), "gpu", "--dry_run", "--rows", "mfu_d20",
                             "bpb_d12_b17", "chat_decode", "--bench_dir", str(empty), "--out", str(out)],
                            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    data = json.loads((out / "gpu_bench.json").read_text())
    assert data["dry_run"] is True
    assert data["environment"]["torch"] and data["environment"]["device"]
    assert data["environment"]["prepared_at_commit"] == "f00dcafe"
    logs = out / "logs"
    for phase in ("mfu_d20 probe (d2): started", "mfu_d20 probe (d2): exit 0", "mfu_d20 probe (d2): micro-batch 4",
                  "mfu_d20 ours (pretrain.py: compilation, 3 steps, evaluation): started", "chat_decode: started"):
        assert f"gpu: {phase}" in result.stdout, phase
    # the probe ran once for d2 (both rows' model): its own process, its log under --out
    assert result.stdout.count("probe (d2): started") == 1 and not (logs / "bpb_d12_b17_probe.log").exists()
    probe_log = (logs / "mfu_d20_probe.log").read_text()
    assert probe_log.startswith("$ ") and " gpu_probe --preset d2 " in probe_log
    assert probe_log.splitlines()[-1] == "micro_batch 4"
    rows = {(r["row"], r["side"]): r for r in data["rows"]}
    assert set(rows) == {("mfu_d20", "ours"), ("mfu_d20", "nanochat"), ("bpb_d12_b17", "ours"),
                         ("bpb_d12_b17", "nanochat"), ("chat_decode", "ours")}
    for name in ("mfu_d20", "bpb_d12_b17"):
        row = rows[(name, "ours")]
        assert row["status"] == "ok", row
        assert row["micro_batch"] == 4 and row["micro_batch_from"].startswith("largest that fits, up to 4")
        assert Path(row["run_dir"]) == logs / f"{name}_ours" and Path(row["log"]) == logs / f"{name}_ours.log"
        assert "--final_checkpoint false" in row["command"]
        assert sorted(p.name for p in Path(row["run_dir"]).iterdir()) == ["config.json", "done.json",
                                                                         "metrics.jsonl", "progress", "samples.jsonl"]
        config = config_from_preset("d2", {"sequence_len": 64, "vocab_size": 1024})
        assert row["flops_per_token"] == flops_per_token(config)
        assert row["memory_estimate"] == memory_estimate(config, row["micro_batch"], bf16=row["dtype"] == "bfloat16")[
            "total"]
        metrics = Path(row["run_dir"]) / "metrics.jsonl"
        records = [json.loads(line) for line in metrics.read_text().splitlines()]
        times = [r["step_time"] for r in records if "loss" in r and r["step"] > 1]  # the dry run times steps 2..
        assert len(times) == row["steps"] - 1
        assert row["step_time_median_s"] == statistics.median(times)
        assert row["tok_per_s"] == pytest.approx(row["tokens_per_step"] / statistics.median(times))
        assert row["mfu"] == pytest.approx(row["flops_per_token"] * row["tok_per_s"] / row["peak_flops"])
        assert 0 < row["mfu"] < 1
        assert row["peak_memory"] > 0
        final = [r["final_val_bpb"] for r in records if "final_val_bpb" in r]
        assert row["val_bpb"] == final[-1] and 0 < row["val_bpb"] < 20
        assert f"{row['tok_per_s']:,.0f}" in (out / "gpu_bench.md").read_text()
        assert rows[(name, "nanochat")]["status"].startswith("unavailable: no nanochat tree")
    # the 2^19 row's batch is 4x the 2^17 row's, at the same micro-batch: accumulation, not a larger forward
    assert rows[("mfu_d20", "ours")]["tokens_per_step"] == 4 * rows[("bpb_d12_b17", "ours")]["tokens_per_step"]
    decode = rows[("chat_decode", "ours")]
    assert decode["dtype"] == "float32"  # chat.py's on a CPU; bf16 on a GPU (test_chat_decode_times_chat_py_s_dtype)
    assert decode["decode_tok_per_s_lean"] > 0 and decode["decode_tok_per_s_generate()"] > 0
    markdown = (out / "gpu_bench.md").read_text()
    assert "unavailable: no nanochat tree" in markdown and "--dry_run" in markdown
    both = bench_gpu.merge_gpu_results([data, data])  # two calls' files, as `bench.py gpu --merge` reads them
    assert both["rows"] == data["rows"] + data["rows"]  # one call's rows after the other's, unchanged
    assert bench_gpu.gpu_markdown(both).count("| mfu_d20 | ours |") == 2


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


def test_chat_decode_times_chat_py_s_dtype(monkeypatch):
    """On a GPU chat.py decodes in bf16 (its compiled path): the row times that dtype, not fp32."""
    import common
    assert bench_gpu.chat_decode_paths(torch.device("cpu")) == ("float32", "lean", ("lean", "static", "compiled"))
    monkeypatch.setattr(common, "native_bf16", lambda device: True)  # an H100 / H200
    assert bench_gpu.chat_decode_paths(torch.device("cuda")) == ("bfloat16", "compiled", ("compiled", "static"))


def test_h200_nvl_and_b200_have_their_dense_bf16_peaks():
    from common import peak_flops
    assert peak_flops("NVIDIA H200 NVL", "bfloat16") == 836e12  # not the SXM's 989e12: MFU 15% too low
    assert peak_flops("NVIDIA H200", "bfloat16") == 989e12
    assert peak_flops("NVIDIA B200", "bfloat16") == 2250e12
    assert peak_flops("NVIDIA H100 NVL", "bfloat16") == 835e12
