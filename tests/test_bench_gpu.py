"""bench.py gpu --dry_run: the GPU battery's rows at toy size on the CPU, their figures computed from what ran."""
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import ROOT

import bench_gpu
from model import config_from_preset, flops_per_token, memory_estimate


def test_gpu_dry_run_rows_hold_figures_computed_from_the_runs(tmp_path):
    """One training row of each kind (throughput at 2^19 scaled down, bpb at 2^17 scaled down) and the decode row,
    without a nanochat tree (its rows say why they did not run). The figures are recomputed here from the run's own
    metrics.jsonl and model.py, so a table that printed anything else would fail."""
    out, empty = tmp_path / "out", tmp_path / "no_bench"
    empty.mkdir()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TMPDIR": str(tmp_path), "PYTHONPATH": str(ROOT)}
    result = subprocess.run([sys.executable, str(ROOT / "bench.py"), "gpu", "--dry_run", "--rows", "mfu_d20",
                             "bpb_d12_b17", "chat_decode", "--bench_dir", str(empty), "--out", str(out)],
                            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    data = json.loads((out / "gpu_bench.json").read_text())
    assert data["dry_run"] is True
    assert data["environment"]["torch"] and data["environment"]["device"]
    rows = {(r["row"], r["side"]): r for r in data["rows"]}
    assert set(rows) == {("mfu_d20", "ours"), ("mfu_d20", "nanochat"), ("bpb_d12_b17", "ours"),
                         ("bpb_d12_b17", "nanochat"), ("chat_decode", "ours")}
    for name in ("mfu_d20", "bpb_d12_b17"):
        row = rows[(name, "ours")]
        assert row["status"] == "ok", row
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
    assert decode["decode_tok_per_s_lean"] > 0 and decode["decode_tok_per_s_generate()"] > 0
    markdown = (out / "gpu_bench.md").read_text()
    assert "unavailable: no nanochat tree" in markdown and "--dry_run" in markdown
    both = bench_gpu.merge_gpu_results([data, data])  # two calls' files, as `bench.py gpu --merge` reads them
    assert both["rows"] == data["rows"] + data["rows"]  # one call's rows after the other's, unchanged
    assert bench_gpu.gpu_markdown(both).count("| mfu_d20 | ours |") == 2
