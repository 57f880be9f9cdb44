"""speedrun.sh, the main job: the suite's demo pipeline (conftest's `speedrun` fixture) ran every stage and wrote a
report whose figures are the logs'; an interrupted run leaves no process behind and resumes to the same losses; the
NCCL probe falls back to the safe flags after a hang; GPUs held by other processes stop it before it starts."""
import fcntl
import itertools
import json
import os
import pty
import re
import shlex
import shutil
import signal
import subprocess
import sys
import termios
import time
from argparse import Namespace
from pathlib import Path

import pytest
import torch
from helpers import (
    ROOT,
    faults_env,
    held_out_questions,
    processes_mentioning,
    run_script,
    run_speedrun,
)

import chat_stage
import checkpoint
import gpu_plan
from tokenizer import Tokenizer

TRAIN_STAGES = ["pretrain", "midtrain", "sft", "rl"]


def table(md, header):
    """The rows of the markdown table whose header row starts with `header`, as dicts."""
    lines = md.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"| {header} |"))
    keys = [c.strip() for c in lines[start].strip("|").split("|")]
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        rows.append(dict(zip(keys, [c.strip() for c in line.strip("|").split("|")], strict=True)))
    return rows


def test_the_pipeline_ran_every_stage_and_the_report_shows_the_logs_figures(speedrun, demo_world):
    run, result = speedrun
    ran = [line.split("\t") for line in (run / "logs" / "stages.tsv").read_text().splitlines()]
    # the demo plan runs rl by default and chat_eval scores its model; --stage_evals pretrain,sft: sft's model gets
    # its own ChatCORE and CORE, pretrain's CORE is core_eval's (a base model gets no ChatCORE)
    assert [name for name, _, rc in ran if rc == "0"] == ["pretrain", "core_eval", "midtrain", "sft", "rl", "chat_eval",
                                                          "core_eval_sft", "chat_eval_sft", "report"], ran
    assert json.loads((run / "chat_eval.json").read_text())["checkpoint"].startswith(str(run / "rl" / "ckpt"))
    assert json.loads((run / "stage_evals" / "sft" / "chat_eval.json").read_text())["checkpoint"].startswith(
        str(run / "sft" / "ckpt"))
    assert f"stage data skipped: the demo world is in {demo_world / 'demo'}" in result.stdout
    assert "stage tokenizer skipped: using --tokenizer" in result.stdout
    assert "the old name goes in the next release" not in result.stdout + result.stderr  # speedrun.sh: current flags
    md = (run / "report.md").read_text()
    times = {name: float(seconds) for name, seconds, rc in ran if rc == "0"}
    rows = {r["stage"]: r for r in table(md, "stage")}
    assert list(rows) == TRAIN_STAGES
    for name in TRAIN_STAGES[:3]:  # rl's row has columns of its own (sampled tokens, pass@1): test_report
        row, done = rows[name], json.loads((run / name / "done.json").read_text())
        steps = [json.loads(line) for line in (run / name / "metrics.jsonl").read_text().splitlines()]
        steps = [r for r in steps if "loss" in r]
        log = (run / "logs" / f"{name}.log").read_text()
        assert row["steps"] == str(done["step"]) == str(len(steps))
        assert row["wall time (s)"] == f"{times[name]:.1f}"
        assert row["tokens"] == f"{steps[-1]['tokens']:,}"
        assert row["tok/s"] == f"{steps[-1]['tokens'] / sum(r['step_time'] for r in steps):,.0f}"
        assert row["MFU"] == "unknown"  # a CPU has no rated peak
        params = int(re.search(r"params: (\d+)", log).group(1))
        assert row["parameters"] == f"{params:,}" == "1,572,890"
        assert row["validation"] == (f"val bpb {done['val_bpb']:.4f}" if name == "pretrain" else
                                     f"val loss {done['val_loss']:.4f}")
        assert "synthetic demo data" in row["data"]
        hardware = next(line for line in log.splitlines() if line.startswith("distributed: "))
        assert f"- hardware, {name}: {hardware[len('distributed: '):]}\n" in md
        assert hardware.startswith("distributed: single process, device ")  # no torchrun for one CPU process
    core = json.loads((run / "core_eval" / "results.json").read_text())
    assert f"CORE {core['core']:.4f} (8 tasks" in md and f"val bpb {core['val_bpb']:.4f}" in md
    assert {r["task"]: r["accuracy"] for r in table(md, "task")[:8]} == {t["task"]: f"{t['accuracy']:.4f}"
                                                                         for t in core["tasks"]}
    chat = json.loads((run / "chat_eval.json").read_text())
    assert f"ChatCORE {chat['chatcore']:.4f}" in md
    assert [t["task"] for t in chat["tasks"]] == ["demo-choice", "demo-answer", "demo-problems", "demo-words"]
    for t in chat["tasks"]:
        centered = "not in ChatCORE" if t["task"] == "demo-words" else f"{t['centered']:.4f}"
        assert f"| {t['task']} | {t['correct']}/{t['items']} | {t['accuracy']:.4f} | {centered} |" in md
    items = [json.loads(line) for line in (run / "chat_eval_items.jsonl").read_text().splitlines()]
    answers = [i for i in items if i["task"] == "demo-answer"]
    hits = sum(any(re.search(rf"\b{re.escape(a.lower())}\b", i["reply"].lower()) for a in i["answers"]) for i in answers)
    assert f"demo-answer: {hits}/{len(answers)} replies contain an accepted answer as a word" in md
    assert "- transport: none (one CPU process)" in md
    assert (run / "transport.txt").read_text().strip() == "none (one CPU process)"
    commit = json.loads((run / "pretrain" / "config.json").read_text())["code"]["commit"]
    assert f"- code: commit {commit}," in md
    samples = [json.loads(line) for line in (run / "sft" / "samples.jsonl").read_text().splitlines()]
    assert f"- {samples[-1]['question']!r} -> {samples[-1]['answer']!r}" in md
    for png in ("loss.png", "val_bpb.png"):
        data = (run / png).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 2000, png
        assert f"![{png}]({png})" in md


def test_the_final_model_answers_a_held_out_demo_question(speedrun, demo_world):
    run, result = speedrun
    sft = checkpoint.list_checkpoints(run / "sft" / "ckpt")[-1]
    model, _ = checkpoint.load_model(sft, torch.device("cpu"))
    questions = held_out_questions()[:20]
    answers = chat_stage.chat_answers(model, Tokenizer.load(demo_world / "tokenizer"),
                                      [q for q, _ in questions], "float32", max_tokens=16)
    right = [a["answer"] for (_, word), a in zip(questions, answers, strict=True) if word.lower() in a["answer"].lower()]
    assert right, answers
    assert f"done. Chat with it: {sys.executable} {ROOT / 'chat.py'} --runs_dir {run}" in result.stdout  # no TTY


def test_after_the_speedrun_chat_export_and_chat_eval_take_its_final_model_with_no_flag(speedrun, tmp_path):
    """As a user runs them from the clone's root after `bash speedrun.sh`, whose stages write
    runs/speedrun/<stage>/ckpt/: chat.py, export.py and chat_eval.py without --checkpoint take the run's final
    model (RL's), not a stage's, and say which they took and why."""
    run, _ = speedrun
    for stage in TRAIN_STAGES:  # copy2: the checkpoints' times kept (the pick is the newest of RL's and SFT's)
        shutil.copytree(run / stage / "ckpt", tmp_path / "runs" / "speedrun" / stage / "ckpt")
    final = checkpoint.list_checkpoints(tmp_path / "runs" / "speedrun" / "rl" / "ckpt")[-1]
    said = f"runs/speedrun/rl/ckpt/{final.name} (newest rl checkpoint under runs"
    result = run_script("chat.py", ["-p", "Who are you?", "--max_new_tokens", "8"], tmp_path)
    assert f"checkpoint: {said}): stage rl, step " in result.stderr and result.stdout.strip(), result.stderr
    result = run_script("export.py", ["--out", "exported"], tmp_path)
    assert f"export: checkpoint {said}; stage rl, step " in result.stdout
    assert (tmp_path / "exported" / "config.json").is_file()
    result = run_script("chat_eval.py", ["--tasks", "demo-choice", "--max_items", "2", "--max_new_tokens", "4",
                                         "--out", "chat_eval.json"], tmp_path)
    assert f"checkpoint: {said}; stage rl, step " in result.stdout, result.stdout
    # a stage's --resume without --run_name finds the newest run of its stage in speedrun.sh's layout too
    args = Namespace(keep=1, resume="latest", run_name=None, runs_dir=str(tmp_path / "runs"), preset="tiny")
    sft = tmp_path / "runs" / "speedrun" / "sft"
    assert checkpoint.resolve_run(args, "sft") == (sft, checkpoint.list_checkpoints(sft / "ckpt")[-1])
    assert (args.runs_dir, args.run_name) == (str(sft.parent), "sft")  # what its resume command names


# A pretraining small and quick enough to interrupt and resume in seconds
SMALL = ("--sequence_len 64 --n_layer 1 --n_embd 64 --n_head 2 --n_kv_head 2 --micro_batch 4 --bpb_tokens 2048 "
         "--eval_every 0 --compile false --ckpt_every 10 --log_every 50 --steps 120")


def test_killing_speedrun_mid_pretraining_leaves_no_process_and_a_rerun_resumes_to_the_same_losses(demo_world,
                                                                                                    tmp_path):
    """`kill <speedrun.sh>` during pretraining, as a user would: the trap ends every stage's process group (the stage
    checkpoints first); the rerun skips what finished and resumes. Only pretraining runs (--stop_after pretrain): the
    later stages resume through the same code, and a second whole pipeline to compare with would cost minutes."""
    runs = tmp_path / "speedrun"  # and tmp_path / "straight": the uninterrupted run to compare with
    args = ["--plan", "demo", "--gpus", "0", "--runs_dir", runs, "--run_name", "r", "--data_dir",
            demo_world / "demo", "--tokenizer", demo_world / "tokenizer", "--stop_after", "pretrain"]
    env = {**os.environ, "SPEEDRUN_PYTHON": sys.executable, "PYTHONPATH": str(ROOT), "PRETRAIN_ARGS": SMALL}
    # started first: it needs nothing of the run that is stopped and resumed, and trains while that one does
    straight = subprocess.Popen([sys.executable, str(ROOT / "pretrain.py"), "--data_dir", demo_world / "demo" / "pretrain",
                                 "--tokenizer", demo_world / "tokenizer", "--runs_dir", tmp_path / "straight",
                                 "--run_name", "s", "--preset", "tiny", *SMALL.split()], cwd=tmp_path,
                                env={**env, "OMP_NUM_THREADS": "1"}, stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, text=True, start_new_session=True)
    proc = subprocess.Popen(["bash", str(ROOT / "speedrun.sh"), "--no_chat", *map(str, args)], cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    metrics = runs / "r" / "pretrain" / "metrics.jsonl"
    deadline = time.time() + 120
    while time.time() < deadline and (not metrics.is_file() or len(metrics.read_text().splitlines()) < 20):
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.02)
    os.kill(proc.pid, signal.SIGTERM)  # the shell only, as `kill PID` does
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 143, (out, err)
    assert "speedrun: stopped by SIGTERM" in err
    assert processes_mentioning(str(runs)) == []
    stopped = len(metrics.read_text().splitlines())
    assert 20 <= stopped < 120 and "stopped by signal at step" in out, out[-2000:]

    again = run_speedrun(args, tmp_path, {"PRETRAIN_ARGS": SMALL})
    assert again.returncode == 0, again.stdout[-2000:] + again.stderr[-2000:]
    assert "stage pretrain was interrupted: resuming from its last checkpoint" in again.stdout
    assert f"resume: from {runs / 'r' / 'pretrain' / 'ckpt'}/step_" in again.stdout

    _, err = straight.communicate(timeout=120)
    assert straight.returncode == 0, err[-3000:]

    def losses(path):
        return [(r["step"], r["loss"]) for r in map(json.loads, path.read_text().splitlines()) if "loss" in r]

    assert losses(metrics) == losses(tmp_path / "straight" / "s" / "metrics.jsonl")  # bitwise
    assert len(losses(metrics)) == 120


def test_a_failed_stage_stops_the_run_naming_it(demo_world, tmp_path):
    """A stage exits 7 (an interpreter that fails at once stands in for a crashing stage; setup's questions, `-c`, it
    passes to this one): the status survives the pipeline into the log, the run stops there with the stage's name and
    log, and exits with that status."""
    failing = tmp_path / "python"
    failing.write_text(f"#!/bin/sh\n[ \"$1\" = -c ] && exec {sys.executable} \"$@\"\necho 'stage output' >&2\nexit 7\n")
    failing.chmod(0o755)
    result = run_speedrun(["--plan", "demo", "--gpus", "0", "--runs_dir", tmp_path, "--data_dir", demo_world / "demo",
                           "--tokenizer", demo_world / "tokenizer"], tmp_path, {"SPEEDRUN_PYTHON": str(failing)})
    assert result.returncode == 7
    log = tmp_path / "speedrun" / "logs" / "pretrain.log"
    assert f"speedrun: stage pretrain failed (exit 7); log: {log}" in result.stderr
    assert "stage output" in log.read_text() and "stage output" in result.stdout
    assert "stage core_eval" not in result.stdout


def probe_only(tmp_path, command, **env):
    return run_speedrun(["--probe_only", "--gpus", "2", "--runs_dir", tmp_path, "--run_name", "p"], tmp_path,
                        {"SPEEDRUN_PROBE_CMD": command, "SPEEDRUN_PROBE_TIMEOUT": "2", **env}, timeout=60)


def test_a_hung_nccl_probe_falls_back_to_the_safe_flags_and_leaves_nothing_running(tmp_path):
    marker = f"sleep 77.{os.getpid()}"  # hangs unless the safe flags are set
    measured = 'echo \'{"bus_bandwidth": "1.60 GB/s"}\' > "$1"'  # the probe's JSON, to the path it is given
    hang = f'[ "${{NCCL_P2P_DISABLE:-}}" = 1 ] && [ "$NCCL_NET" = Socket ] && {{ {measured}; exit 0; }}; {marker}'
    result = probe_only(tmp_path, hang)
    assert result.returncode == 0, result.stderr
    assert "NCCL probe failed (exit 124, hung past 2s): retrying with the safe flags NCCL_P2P_DISABLE=1 " \
           "NCCL_IB_DISABLE=1 NCCL_SOCKET_IFNAME=lo NCCL_NET=Socket NCCL_NET_PLUGIN=none" in result.stdout
    transport = (tmp_path / "p" / "transport.txt").read_text()
    assert transport.startswith("nccl safe flags (NCCL_P2P_DISABLE=1 ")
    assert transport.strip().endswith("all-reduce bus bandwidth 1.60 GB/s (64 MB message; default flags: none: it "
                                      "hung)")
    assert "the safe flags cost: all-reduce bus bandwidth 1.60 GB/s with them" in result.stdout
    assert processes_mentioning(marker) == []
    fast = measured.replace("1.60", "98.70")
    default = probe_only(tmp_path, fast)
    assert default.stdout.count("transport: nccl default, all-reduce bus bandwidth 98.70 GB/s (64 MB message)") == 1
    assert "transport: nccl default, all-reduce bus bandwidth unknown" in probe_only(tmp_path, "exit 0").stdout
    forced = probe_only(tmp_path, f"{marker}", NCCL_SAFE="1")
    assert "transport: nccl safe flags (NCCL_SAFE=1: NCCL_P2P_DISABLE=1" in forced.stdout
    failed = probe_only(tmp_path, "exit 3")
    assert failed.returncode == 3 and "stage nccl_probe failed (exit 3) even with the safe flags" in failed.stderr


def test_processes_holding_the_gpus_stop_it_with_the_kill_command(tmp_path):
    fake = tmp_path / "bin" / "nvidia-smi"
    fake.parent.mkdir()
    fake.write_text("#!/bin/sh\necho '4242, python'\necho '4343, python'\n")
    fake.chmod(0o755)
    result = run_speedrun(["--gpus", "0", "--runs_dir", tmp_path], tmp_path,
                          {"PATH": f"{fake.parent}:{os.environ['PATH']}"})
    assert result.returncode == 1
    assert "processes hold the GPUs" in result.stderr and "`kill 4242 4343`" in result.stderr


def test_help_lists_every_flag_with_its_default():
    result = subprocess.run(["bash", str(ROOT / "speedrun.sh"), "--help"], capture_output=True, text=True, check=True)
    for flag in ["--plan", "--depth N", "(default: 20)", "--run_name NAME", "(default: speedrun)", "--data_dir",
                 "--gpus", "--no_chat", "--runs_dir DIR", "(default: runs)", "PRETRAIN_ARGS", "CHAT_EVAL_ARGS",
                 "NCCL_SAFE=1"]:
        assert flag in result.stdout, flag


def print_plan(tmp_path, args, env=None):
    """`bash speedrun.sh --print ARGS` in an empty directory, where every program a run starts is a stand-in that
    records its call and fails: the stages' interpreter (SPEEDRUN_PYTHON), and nvidia-smi, setsid and torchrun on PATH.
    Nothing may be called and nothing written. (the interpreter's path, [(stage, its command's words)] in order)."""
    stand_ins, calls, work = tmp_path / "bin", tmp_path / "calls.log", tmp_path / "work"
    stand_ins.mkdir(parents=True)
    for name in ("python", "nvidia-smi", "setsid", "torchrun"):
        (stand_ins / name).write_text(f'#!/bin/sh\necho "{name} $*" >> {calls}\nexit 1\n')
        (stand_ins / name).chmod(0o755)
    work.mkdir()
    env = {**{k: v for k, v in os.environ.items() if not k.endswith("_ARGS")},
           "PATH": f"{stand_ins}:{os.environ['PATH']}", "SPEEDRUN_PYTHON": str(stand_ins / "python"), **(env or {})}
    result = subprocess.run(["bash", str(ROOT / "speedrun.sh"), "--print", *args], cwd=work, env=env,
                            capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 0 and result.stderr == "", result.stderr
    assert not calls.exists() and list(work.iterdir()) == []  # no process started, no runs/ (or anything) written
    lines = result.stdout.splitlines()
    stages = [(line[2:].split(" (")[0], shlex.split(command)) for line, command in itertools.pairwise(lines)
              if line.startswith("# ") and not command.startswith("#")]
    return str(stand_ins / "python"), stages


def test_print_shows_every_stages_command_line_in_order_and_starts_nothing(tmp_path):
    py, demo = print_plan(tmp_path / "demo", ["--plan", "demo", "--gpus", "0"], {"PRETRAIN_ARGS": "--steps 5"})
    evals = ["core_eval_midtrain", "chat_eval_midtrain", "core_eval_sft", "chat_eval_sft", "core_eval_rl",
             "chat_eval_rl"]
    assert [name for name, _ in demo] == ["data", "tokenizer", "pretrain", "core_eval", "midtrain", "sft", "rl",
                                          "chat_eval", *evals, "report", "chat"]
    words = dict(demo)
    assert words["data"] == [py, str(ROOT / "demo.py"), "--out", "runs/speedrun/demo"]
    assert words["pretrain"][:10] == [py, str(ROOT / "pretrain.py"), "--data_dir", "runs/speedrun/demo/pretrain",
                                      "--tokenizer", "runs/speedrun/tokenizer", "--preset", "tiny", "--steps", "400"]
    assert words["pretrain"][-6:] == ["--steps", "5", "--runs_dir", "runs/speedrun", "--run_name", "pretrain"]  # ARGS
    assert words["midtrain"][words["midtrain"].index("Who are you?") - 1] == "--sample_prompt"  # one word, quoted
    assert words["chat_eval"][:4] == [py, str(ROOT / "chat_eval.py"), "--checkpoint", "runs/speedrun/rl"]
    assert words["chat"] == [py, str(ROOT / "chat.py"), "--runs_dir", "runs/speedrun"]

    py, gpu = print_plan(tmp_path / "gpu", ["--plan", "gpu", "--gpus", "8", "--data_dir", "/data/fineweb"])
    assert [name for name, _ in gpu] == [
        "check_batch", "probe", "preflight", "chatcore_tasks", "prefetch", "prefetch", "data", "tokenizer",
        "data_plan", "download", "rehearsal", "pretrain", "core_eval", "midtrain", "sft", "rl", "chat_eval", *evals,
        "report", "chat"]
    words, plan = dict(gpu), gpu_plan.command_lines(20)
    torchrun = [py, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=8"]
    assert words["check_batch"] == [py, str(ROOT / "pretrain.py"), "--check_batch", "8", *map(str, plan["PRETRAIN"])]
    assert words["probe"] == [*torchrun, str(ROOT / "distributed.py"), "probe", "--timeout", "120", "--mbytes", "64",
                              "--out", "runs/speedrun/logs/probe.json"]
    assert words["download"] == [py, str(ROOT / "prepare.py"), "shards", "--shards", "<shards from data_plan.json>",
                                 "--data_dir", "/data/fineweb"]
    assert words["rehearsal"][:5] == ["env", f"SPEEDRUN_PYTHON={py}", "bash", str(ROOT / "speedrun.sh"), "--rehearse"]
    assert words["pretrain"] == [*torchrun, str(ROOT / "pretrain.py"), "--data_dir", "/data/fineweb", "--tokenizer",
                                 "runs/speedrun/tokenizer", *map(str, plan["PRETRAIN"]), "--runs_dir", "runs/speedrun",
                                 "--run_name", "pretrain"]
    assert words["sft"] == [*torchrun, str(ROOT / "sft.py"), "--checkpoint", "runs/speedrun/midtrain",
                            *map(str, plan["SFT"]), "--runs_dir", "runs/speedrun", "--run_name", "sft"]

    # the flags decide what is left out: no rehearsal, no rl, sft's evaluations only, no chat; --shards as given
    _, fewer = print_plan(tmp_path / "fewer", ["--plan", "gpu", "--gpus", "2", "--data_dir", "/d", "--no_rehearse",
                                               "--rl", "off", "--stage_evals", "sft", "--no_chat", "--shards", "40"])
    assert [name for name, _ in fewer] == [
        "check_batch", "probe", "preflight", "chatcore_tasks", "prefetch", "prefetch", "data", "tokenizer", "data_plan",
        "download", "pretrain", "core_eval", "midtrain", "sft", "chat_eval", "core_eval_sft", "chat_eval_sft", "report"]
    assert dict(fewer)["download"][3:5] == ["--shards", "40"]
    refused = run_speedrun(["--print", "--plan", "gpu", "--gpus", "0"], tmp_path, timeout=60)
    assert refused.returncode == 2 and "--plan gpu --print: no GPU here; add --gpus N" in refused.stderr


def test_the_docs_print_blocks_are_the_scripts_output(tmp_path):
    """docs/speedrun.md's `$ bash speedrun.sh --print ...` blocks are that command's output (this checkout's path left
    out, .venv's interpreter): a block without `...` whole, one with `...` as an excerpt in order."""
    docs = (ROOT / "docs" / "speedrun.md").read_text()
    blocks = re.findall(r"```\n\$ bash speedrun.sh (--print[^\n]*)\n(.*?)```", docs, re.DOTALL)
    assert len(blocks) == 2
    env = {k: v for k, v in os.environ.items() if k != "SPEEDRUN_PYTHON" and not k.endswith("_ARGS")}
    for args, shown in blocks:
        result = subprocess.run(["bash", str(ROOT / "speedrun.sh"), *shlex.split(args)], cwd=tmp_path, env=env,
                                capture_output=True, text=True, timeout=120, check=False)
        printed, shown = result.stdout.replace(f"{ROOT}/", "").splitlines(), shown.splitlines()
        assert result.returncode == 0 and list(tmp_path.iterdir()) == [], result.stderr
        if "..." not in shown:
            assert shown == printed
        at = [printed.index(line) if line in printed else -1 for line in shown if line != "..."]
        assert -1 not in at and at == sorted(at), [line for line in shown if line not in printed]


# -----------------------------------------------------------------------------
# Stopping a two-process stage: torchrun's workers run in sessions of their own, so nothing of the run may depend on
# a signal to torchrun's process group reaching them. Every scenario runs at once (each alone takes ~20 s here).

STOP_ARGS = SMALL.replace("--steps 120", "--steps 100000")  # never ends by itself
CKPT_FILES = {"meta.json", "model.pt", "optimizers.pt", "rank000.pt", "rank001.pt"}


def whole_checkpoints(ckpt_dir):
    """The steps of ckpt_dir's checkpoints, each checked whole: every file there and loadable."""
    steps = []
    for ckpt in checkpoint.list_checkpoints(ckpt_dir):
        assert {p.name for p in ckpt.iterdir()} == CKPT_FILES, ckpt
        for name in CKPT_FILES - {"meta.json"}:
            torch.load(ckpt / name, map_location="cpu", weights_only=False)
        assert json.loads((ckpt / "meta.json").read_text())["step"] == checkpoint.checkpoint_step(ckpt)
        steps.append(checkpoint.checkpoint_step(ckpt))
    return steps


def start_two_process_pretraining(demo_world, run_dir, extra="", env=None, terminal=False):
    """speedrun.sh's pretraining stage with 2 CPU processes (gloo), in a new session as a terminal's job is; with
    terminal, in a pseudo-terminal that is its controlling terminal: (the process, the terminal's master end)."""
    args = ["--no_chat", "--plan", "demo", "--gpus", "2", "--runs_dir", run_dir, "--run_name", "r", "--data_dir",
            demo_world / "demo", "--tokenizer", demo_world / "tokenizer", "--stop_after", "pretrain"]
    env = {**os.environ, "SPEEDRUN_PYTHON": sys.executable, "PYTHONPATH": str(ROOT), "NCCL_SAFE": "1",
           "PRETRAIN_ARGS": f"{STOP_ARGS} {extra}", **(env or {})}
    command = ["bash", str(ROOT / "speedrun.sh"), *map(str, args)]
    if not terminal:
        return subprocess.Popen(command, cwd=run_dir, env=env, text=True, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, start_new_session=True), None
    master, slave = pty.openpty()

    def controlling_terminal():
        # a terminal's session starts with SIGHUP at its default; one inherited as ignored (pytest run under nohup)
        # would be ignored by bash too, which cannot trap a signal ignored at entry
        signal.signal(signal.SIGHUP, signal.SIG_DFL)
        os.setsid()
        fcntl.ioctl(0, termios.TIOCSCTTY, 0)
    process = subprocess.Popen(command, cwd=run_dir, env=env, stdin=slave, stdout=slave, stderr=slave,
                               preexec_fn=controlling_terminal)  # noqa: PLW1509
    os.close(slave)
    os.set_blocking(master, False)
    return process, master


def drain(master):
    """Read what a terminal shows, so that writes to it never block."""
    try:
        while os.read(master, 1 << 16):
            pass
    except (BlockingIOError, OSError):
        pass


def steps_logged(run_dir):
    metrics = run_dir / "metrics.jsonl"
    return len(metrics.read_text().splitlines()) if metrics.is_file() else 0


@pytest.mark.two_processes
def test_stopping_two_process_pretraining_leaves_no_process_and_whole_checkpoints(demo_world, tmp_path):
    """Ctrl-C (SIGINT to speedrun's process group, as a terminal sends it), the terminal closed (a pseudo-terminal whose
    master end closes: the kernel's SIGHUP, and output that can no longer be written), SIGTERM; a rank that ignores
    SIGTERM (stuck in C code: only SIGKILL ends it); a SIGTERM checkpoint slower than SPEEDRUN_KILL_WAIT (3 s here),
    which gets twice its measured save time; and torchrun itself SIGKILLed, its workers not told (one of them stuck).
    After each, no process of the run remains, and every checkpoint there is whole: a stop checkpoint at the step the
    stage says it stopped at, or none where a rank was stuck."""
    scenarios = {  # name: (how it is stopped, steps logged before, extra pretraining flags, environment)
        "ctrl_c": (lambda p: os.killpg(p.pid, signal.SIGINT), 20, "", {}),
        "hangup": (lambda p: os.close(terminals.pop("hangup")), 20, "", {}),
        "term": (lambda p: os.kill(p.pid, signal.SIGTERM), 20, "", {}),
        "stuck": (lambda p: os.kill(p.pid, signal.SIGTERM), 14, "",
                  {**faults_env(stuck_at_step=15), "SPEEDRUN_KILL_WAIT": "2"}),
        "slow": (lambda p: os.kill(p.pid, signal.SIGTERM), 12, "",
                 {**faults_env(checkpoint_delay=4), "SPEEDRUN_KILL_WAIT": "3"}),
    }
    runs, terminals = {}, {}
    for name, (_, _, extra, env) in scenarios.items():
        (tmp_path / name).mkdir()
        runs[name], master = start_two_process_pretraining(demo_world, tmp_path / name, extra, env,
                                                            terminal=name == "hangup")
        if master is not None:
            terminals[name] = master
    orphan_dir = tmp_path / "orphan"  # torchrun alone, SIGKILLed: its workers die with it (PR_SET_PDEATHSIG)
    torchrun = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                                 str(ROOT / "pretrain.py"), "--data_dir", str(demo_world / "demo" / "pretrain"),
                                 "--tokenizer", str(demo_world / "tokenizer"), "--preset", "tiny", *STOP_ARGS.split(),
                                 "--runs_dir", str(orphan_dir), "--run_name", "r"],
                                env={**os.environ, **faults_env(stuck_at_step=5)}, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        check_stops(scenarios, runs, terminals, torchrun, tmp_path, orphan_dir)
    finally:  # a failed assertion leaves nothing running either
        for master in terminals.values():
            os.close(master)
        for p in [*runs.values(), torchrun]:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for pid, _ in processes_mentioning(str(tmp_path)):  # workers in their own sessions
            os.kill(int(pid), signal.SIGKILL)


def check_stops(scenarios, runs, terminals, torchrun, tmp_path, orphan_dir):
    stopped, deadline = {}, time.time() + 240
    while len(stopped) < len(scenarios) + 1:
        for master in terminals.values():
            drain(master)
        assert time.time() < deadline, f"not all stopped: {sorted(stopped)}"
        for name, (stop, steps, _, _) in scenarios.items():
            if name not in stopped and steps_logged(tmp_path / name / "r" / "pretrain") >= steps:
                assert runs[name].poll() is None, runs[name].communicate()
                if name == "stuck":
                    time.sleep(1)  # rank 1 is inside step 15's hook now, ignoring signals
                if name != "slow" or (tmp_path / name / "r" / "pretrain" / "ckpt" / "save_seconds").is_file():
                    stop(runs[name])
                    stopped[name] = time.time()
        if "orphan" not in stopped and steps_logged(orphan_dir / "r") >= 4:
            time.sleep(1)
            torchrun.kill()  # SIGKILL: no chance to stop its workers
            stopped["orphan"] = time.time()
        time.sleep(0.05)
    codes = {"ctrl_c": 130, "hangup": 129, "term": 143, "stuck": 143, "slow": 143}
    for name, run in runs.items():
        _, err = run.communicate(timeout=120)
        err = err or ""  # the terminal's is gone with it
        out = (tmp_path / name / "r" / "logs" / "pretrain.log").read_text()
        assert run.returncode == codes[name], (name, out[-2000:], err[-2000:])
        assert time.time() - stopped[name] < 60
        assert processes_mentioning(str(tmp_path / name)) == [], name  # speedrun exits only when all are gone
        steps = whole_checkpoints(tmp_path / name / "r" / "pretrain" / "ckpt")
        if name == "stuck":  # no stop checkpoint: rank 1 never reached it; SIGKILL once the grace had passed
            assert steps == [10] and "killing them (SIGKILL)" in err, (steps, err[-2000:])
            continue
        at = int(re.search(r"stopped by signal at step (\d+); checkpoint ", out).group(1))
        assert at >= scenarios[name][1] and steps[-1] == at, (name, steps, out[-2000:])
        assert "killing them" not in err, name
    saved = float((tmp_path / "slow" / "r" / "pretrain" / "ckpt" / "save_seconds").read_text())
    assert saved >= 4  # the stop checkpoint took longer than SPEEDRUN_KILL_WAIT and was not killed
    torchrun.wait(timeout=30)
    deadline = time.time() + 10
    while processes_mentioning(str(orphan_dir)) and time.time() < deadline:
        time.sleep(0.1)
    assert processes_mentioning(str(orphan_dir)) == []  # the workers died with torchrun
    assert whole_checkpoints(orphan_dir / "r" / "ckpt") == []  # none written yet (every 10 steps)


FAKE_SMI = """#!/bin/sh
case "$*" in
    *query-compute-apps*) ;;
    *query-gpu=name*) echo 'NVIDIA H100 80GB HBM3'; echo 'NVIDIA H100 80GB HBM3' ;;
    *query-gpu=driver_version*) echo '470.57.02'; echo '470.57.02' ;;
    *) echo '| NVIDIA-SMI 470.57.02    Driver Version: 470.57.02    CUDA Version: 11.4     |' ;;
esac
"""


def test_gpus_the_driver_lists_but_torch_cannot_use_stop_the_run_naming_driver_and_wheel(tmp_path):
    """nvidia-smi (a fake on PATH) lists 2 GPUs with a driver for CUDA 11.4; this torch (the CPU wheel) sees none: the
    auto plan is an error naming the driver, the wheel's CUDA and the pip command, not a silent CPU demo."""
    fake = tmp_path / "bin" / "nvidia-smi"
    fake.parent.mkdir()
    fake.write_text(FAKE_SMI)
    fake.chmod(0o755)
    env = {"PATH": f"{fake.parent}:{os.environ['PATH']}", "SPEEDRUN_PROBE_CMD": "exit 0"}
    result = run_speedrun(["--runs_dir", tmp_path, "--probe_only"], tmp_path, env, timeout=120)
    assert result.returncode == 1, result.stdout + result.stderr
    cuda = torch.version.cuda or "none (a CPU-only wheel)"
    assert f"nvidia-smi lists 2 GPU(s) but torch {torch.__version__} sees none. The driver is 470.57.02 (it supports " \
           f"CUDA 11.4); this torch wheel was built for CUDA {cuda}." in result.stderr
    assert f"pip install torch=={torch.__version__.split('+')[0]} --index-url https://download.pytorch.org/whl/cuXYZ" \
           in result.stderr and "plan demo" not in result.stdout
    chosen = run_speedrun(["--runs_dir", tmp_path, "--probe_only", "--gpus", "0"], tmp_path, env, timeout=120)
    assert chosen.returncode == 0 and "plan demo" in chosen.stdout  # the CPU on purpose: allowed
    demo = run_speedrun(["--runs_dir", tmp_path, "--gpus", "0", "--stop_after", "download"], tmp_path, env, timeout=120)
    assert demo.returncode == 2 and "the demo plan has no download stage" in demo.stderr  # else it would run it all


def test_a_bad_rl_or_stage_evals_value_is_refused_before_any_stage(tmp_path):
    from helpers import run_speedrun
    for flags, says in ((["--rl", "maybe"], "argument --rl: invalid choice: 'maybe' (choose from 'on', 'off')"),
                        (["--stage_evals", "pretrain,core_eval"], ("--stage_evals pretrain,core_eval: core_eval is not "
                         "a stage with a model (use pretrain, midtrain, sft, rl, comma-separated, or none)"))):
        refused = run_speedrun(["--runs_dir", tmp_path, "--gpus", "0", *flags], tmp_path, timeout=60)
        assert refused.returncode == 2 and says in refused.stderr, refused.stderr
        assert "stage " not in refused.stdout and not any(tmp_path.iterdir())


def test_the_report_names_midtrainings_default_sources(tmp_path):
    """On the gpu plan midtrain.py runs with its default sources (no --source): the report's data column reads the
    sources the stage recorded in config.json, not the flags it was given."""
    import report
    corpus, chat = tmp_path / "fineweb", tmp_path / "smoltalk"
    for d, names in ((corpus, ["shard_00000.parquet", "shard_00001.parquet"]), (chat, ["train-0.parquet"])):
        d.mkdir()
        for name in names:
            (d / name).write_bytes(b"")
    config = {"stage": "midtrain", "args": {"source": None},
              "sources": [{"name": "text:fineweb", "kind": "text", "path": str(corpus), "share": 0.3},
                          {"name": "chat:smoltalk", "kind": "chat", "path": str(chat), "share": 0.7}]}
    assert report.data_of(config) == f"{corpus} (2 shards); {chat} (1 shards)"
    sft = {"stage": "sft", "chat_dir": str(chat), "sources": [{"path": str(chat), "epochs": 1},
                                                             {"path": str(corpus), "epochs": 3}]}
    assert report.data_of(sft) == f"{chat} (1 shards); {corpus} (2 shards) x3"  # every source, not the first alone


def test_a_half_installed_venv_is_repaired_and_a_completed_install_is_recorded(tmp_path):
    """speedrun.sh, launch.py and requirements.txt copied beside a .venv whose python is a stand-in (pip calls are
    logged, and fail when PIP_RC says so): a .venv without the record of a completed install is repaired, a failed pip
    is an error that records nothing, a .venv without python is recreated (python3 -m venv, a stand-in too; launch.py
    itself runs on this interpreter), and a recorded install is not touched again."""
    import hashlib
    import shutil
    repo, bin_dir, log = tmp_path / "repo", tmp_path / "bin", tmp_path / "pip.log"
    repo.mkdir()
    bin_dir.mkdir()
    for name in ("speedrun.sh", "launch.py", "gpu_plan.py", "report.py", "requirements.txt"):
        shutil.copy(ROOT / name, repo / name)
    fake_python = (f'#!/bin/sh\nif [ "$1 $2" = "-m pip" ]; then\n  [ "$3" = --version ] && exit 0\n'
                   f'  echo "$*" >> {log}; exit ${{PIP_RC:-0}}\nfi\nexec {sys.executable} "$@"\n')

    def make_venv():
        (repo / ".venv" / "bin").mkdir(parents=True)
        (repo / ".venv" / "bin" / "python").write_text(fake_python)
        (repo / ".venv" / "bin" / "python").chmod(0o755)
    (bin_dir / "python3").write_text(f'#!/bin/sh\n[ "$1" = -m ] && [ "$2" = venv ] || exec {sys.executable} "$@"\n'
                                     f'echo "venv $3" >> {log}\nmkdir -p "$3/bin"\n'
                                     f'printf %s \'{fake_python}\' > "$3/bin/python"\nchmod +x "$3/bin/python"\n')
    (bin_dir / "python3").chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k != "SPEEDRUN_PYTHON"}
    env.update(PATH=f"{bin_dir}:{os.environ['PATH']}", SPEEDRUN_PROBE_CMD="exit 0")

    def speedrun(**extra):
        return subprocess.run(["bash", str(repo / "speedrun.sh"), "--gpus", "0", "--probe_only", "--runs_dir",
                               str(tmp_path / "runs")], cwd=tmp_path, env={**env, **extra}, capture_output=True,
                              text=True, timeout=120, check=False)
    record = repo / ".venv" / "installed-requirements.sha256"
    want = hashlib.sha256((repo / "requirements.txt").read_bytes()).hexdigest()
    make_venv()  # bin/python exists, as after an interrupted pip: today's check counts that as installed
    failed = speedrun(PIP_RC="1")
    assert failed.returncode == 1 and "is a half install" in failed.stdout
    assert "pip install -r" in failed.stderr and "failed" in failed.stderr and not record.exists()
    repaired = speedrun()
    assert repaired.returncode == 0, repaired.stderr
    assert "is a half install (no record that pip install -r requirements.txt completed): repairing it" in \
        repaired.stdout
    assert record.read_text().strip() == want
    assert log.read_text().splitlines() == [f"-m pip install -q -r {repo / 'requirements.txt'}"] * 2
    again = speedrun()
    assert again.returncode == 0 and "requirements.txt" not in again.stdout and len(log.read_text().splitlines()) == 2
    shutil.rmtree(repo / ".venv")
    (repo / ".venv").mkdir()  # what python3 -m venv leaves when ensurepip is missing, roughly: no bin/python
    recreated = speedrun()
    assert recreated.returncode == 0 and "has no working python or pip" in recreated.stdout
    assert log.read_text().splitlines()[2:] == [f"venv {repo / '.venv'}", f"-m pip install -q -r {repo / 'requirements.txt'}"]
    assert record.read_text().strip() == want


REHEARSAL_STAGES = ["preflight", "chatcore_tasks", "data", "tokenizer", "data_plan", "download", "pretrain",
                    "core_eval", "midtrain", "sft", "rl", "chat_eval", "core_eval_rl", "report", "chat",
                    "predict"]  # --stage_evals pretrain,rl: the gpu plan's CORE of a later stage (a base model: CORE only)


@pytest.fixture(scope="module")
def rehearsal(tmp_path_factory):
    """`bash speedrun.sh --rehearse --gpus 2 --depth 1` without CUDA (the gpu plan on 2 CPU processes, gloo) against
    dev/hub_stand_in.py, with MIDTRAIN_ARGS="--micro_batch 8": 32 midtraining streams, as on 80 GB cards at d24. Beside
    it, from its start, the same command against a second stand-in hub that lacks a chat source, with a data directory
    and caches of its own: it stops at the preflight (it runs beside the first one's early stages, which use one
    process: a core is free). (run dir, the finished process, the missing source's finished process, the hub, its env,
    tmp dir)."""
    import hub_stand_in
    tmp = tmp_path_factory.mktemp("rehearsal")
    hub, servers, url = hub_stand_in.start()
    without = {k: v for k, v in hub.files.items() if not k.startswith("HuggingFaceH4/")}  # ultrachat's repository
    _, servers_without, url_without = hub_stand_in.start(without)
    env = {"HF_ENDPOINT": url, "NO_PROXY": "127.0.0.1", "HF_HOME": str(tmp / "hf"),
           "NANOCHAT_CACHE": str(tmp / "cache"), "CORE_ARGS": f"--bundle {url}/eval_bundle.zip",
           "MIDTRAIN_ARGS": "--micro_batch 8"}
    env_without = {**env, "HF_ENDPOINT": url_without, "HF_HOME": str(tmp / "hf_missing"),
                   "NANOCHAT_CACHE": str(tmp / "cache_missing"), "CORE_ARGS": f"--bundle {url_without}/eval_bundle.zip"}
    args = ["--rehearse", "--gpus", "2", "--depth", "1", "--vocab_size", "512", "--stage_evals", "pretrain,rl",
            "--runs_dir", tmp / "runs"]
    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.delenv("HF_TOKEN", raising=False)
        try:
            outputs = [tmp / "missing.out", tmp / "missing.err"]  # files: nobody reads a pipe meanwhile
            with open(outputs[0], "w") as out, open(outputs[1], "w") as err:
                missing = subprocess.Popen(
                    ["bash", str(ROOT / "speedrun.sh"), "--no_chat", *map(str, args), "--data_dir",
                     str(tmp / "corpus_missing"), "--run_name", "missing"], cwd=tmp, stdout=out, stderr=err,
                    env={**os.environ, "SPEEDRUN_PYTHON": sys.executable, "PYTHONPATH": str(ROOT), **env_without})
            result = run_speedrun([*args, "--data_dir", tmp / "corpus"], tmp, env)
            missing = subprocess.CompletedProcess(missing.args, missing.wait(timeout=300),
                                                  *(path.read_text() for path in outputs))
            missing.corpus_made = (tmp / "corpus_missing").exists()
            yield tmp / "runs" / "speedrun-rehearsal", result, missing, hub, env, tmp
        finally:
            hub_stand_in.stop(servers + servers_without)


@pytest.mark.two_processes  # its fixture runs the rehearsal: after the pipeline, on free cores
def test_a_chat_source_missing_from_the_hub_stops_the_rehearsal_at_the_preflight(rehearsal):
    _, _, missing, _, _, _ = rehearsal
    assert missing.returncode == 1 and "speedrun: stage preflight failed (exit 1)" in missing.stderr  # prepare.py's error
    assert "HuggingFaceH4/ultrachat_200k has no files matching" in missing.stdout
    assert "stage tokenizer" not in missing.stdout and not missing.corpus_made


@pytest.mark.two_processes
def test_the_gpu_plans_rehearsal_runs_every_stage_on_two_cpu_processes(rehearsal):
    """Every stage of the gpu plan, with its own command lines and the stand-in hub's data, on 2 gloo ranks: each
    stage's outputs, the budget it printed against what ran, and the report's figures against their sources."""
    import math

    import pyarrow.parquet as pq

    import hub_stand_in
    run, result, _, hub, _, tmp = rehearsal
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    out = result.stdout
    assert "the old name goes in the next release" not in out + result.stderr
    assert sorted(p.name for p in run.parent.iterdir()) == ["missing-rehearsal", "speedrun-rehearsal"]  # its own dirs
    ran = [line.split("\t") for line in (run / "logs" / "stages.tsv").read_text().splitlines()]
    assert [(name, rc) for name, _, rc in ran] == [(name, "0") for name in REHEARSAL_STAGES]
    for name, seconds, _ in ran:  # each stage's time, printed when it ended and in the closing table
        assert f"speedrun: stage {name} done in {seconds} s\n" in out
        assert re.search(rf"^  {name} +{re.escape(seconds)}$", out, re.MULTILINE), name
    record = json.loads((run / "rehearsed.json").read_text())
    assert record["stages"] == {name: float(seconds) for name, seconds, _ in ran}
    assert (record["plan"], record["processes"], record["cpu"]) == ("gpu", 2, True)
    assert f"speedrun: rehearsal passed in {record['seconds']} s" in out
    assert "plan gpu (rehearsal), run " in out and "2 process(es) per stage (CPU)" in out
    assert (run / "transport.txt").read_text().strip() == "gloo (cpu)"

    # data, tokenizer, data plan, download: the hub's bytes; the shards the rehearsal's budget needs
    corpus, fineweb = tmp / "corpus", "karpathy/fineweb-edu-100b-shuffle"
    tok = Tokenizer.load(run / "tokenizer")
    assert tok.vocab_size == 512 and tok.decode(tok.encode("The river carries water.")) == "The river carries water."
    shard0 = pq.read_table(corpus / "shard_00000.parquet").column("text").to_pylist()
    per_shard = sum(len(tok.encode(t)) + 1 for t in shard0)
    want = math.ceil(3 * 32768 / per_shard) + 1
    assert json.loads((run / "data_plan.json").read_text())["shards"] == want
    assert f"data plan: {want} training shards (" in out
    shards = sorted(p.name for p in corpus.glob("*.parquet"))
    assert shards == [f"shard_{i:05d}.parquet" for i in [*range(max(2, want)), 9]]
    for name in shards:
        assert (corpus / name).read_bytes() == hub.files[f"{fineweb}/{name}"]
    for name, count in (("smoltalk", 3), ("ultrachat", 2), ("mmlu", 1), ("arc-easy", 1), ("arc-challenge", 1),
                        ("gsm8k", 1), ("identity", 1)):
        assert len(list((tmp / "cache" / "chat" / name).glob("*.parquet"))) == count, name

    # the three training stages: the budget printed (speedrun's and each stage's) is what ran, on 2 ranks
    assert "speedrun: rehearsal: pretrain 3 steps, midtrain 3, sft 3 (each saving once, at its last step), CORE 4 " \
           "items a task, ChatCORE 2; on the CPU: --sequence_len 128 --total_batch_tokens 32768" in out
    for name, micro in (("pretrain", 128), ("midtrain", 8), ("sft", 8)):  # SFT inherits midtraining's
        log = (run / "logs" / f"{name}.log").read_text()
        steps = [r for r in map(json.loads, (run / name / "metrics.jsonl").read_text().splitlines()) if "loss" in r]
        done = json.loads((run / name / "done.json").read_text())
        assert [r["step"] for r in steps] == [1, 2, 3] and done["step"] == 3, name
        assert [r["tokens"] for r in steps] == [32768, 65536, 98304], name
        assert "budget: 3 steps" in log and "world size 2 (gloo)" in log, name
        assert f"batch: tokens per step = micro_batch {micro} x sequence_len 128 x world size 2 x accumulation " \
               f"{128 // micro} = 32,768" in log, name
        assert [p.name for p in (run / name / "ckpt").glob("step_*")] == ["step_000003"], name  # --keep 1
        assert all(math.isfinite(r["loss"]) for r in steps)
    assert "budget: 3 steps, 98,304 tokens" in (run / "logs" / "pretrain.log").read_text()

    # CORE: nanochat's 22 tasks from the bundle, 4 items each; ChatCORE: the 5 hub tasks, 2 items each
    core = json.loads((run / "core_eval" / "results.json").read_text())
    assert [t["task"] for t in core["tasks"]] == [t[0] for t in hub_stand_in.CORE_TASKS]
    chat = json.loads((run / "chat_eval.json").read_text())
    assert [(t["task"], t["items"]) for t in chat["tasks"]] == [(t, 2) for t in ("ARC-Easy", "ARC-Challenge", "MMLU",
                                                                                 "GSM8K", "HumanEval")]

    # the report's figures are their sources'
    md = (run / "report.md").read_text()
    times = {name: float(seconds) for name, seconds, _ in ran}
    rows = {r["stage"]: r for r in table(md, "stage")}
    for name in ("pretrain", "midtrain", "sft"):
        steps = [r for r in map(json.loads, (run / name / "metrics.jsonl").read_text().splitlines()) if "loss" in r]
        done = json.loads((run / name / "done.json").read_text())
        assert rows[name]["steps"] == "3" and rows[name]["wall time (s)"] == f"{times[name]:.1f}"
        assert rows[name]["tokens"] == "98,304"
        assert rows[name]["tok/s"] == f"{98304 / sum(r['step_time'] for r in steps):,.0f}"
        assert rows[name]["validation"] == (f"val bpb {done['val_bpb']:.4f}" if name == "pretrain" else
                                            f"val loss {done['val_loss']:.4f}")
    assert f"CORE {core['core']:.4f} (22 tasks" in md
    assert {r["task"]: r["accuracy"] for r in table(md, "task")[:22]} == {t["task"]: f"{t['accuracy']:.4f}"
                                                                          for t in core["tasks"]}
    assert f"ChatCORE {chat['chatcore']:.4f}" in md
    for t in chat["tasks"]:
        assert f"| {t['task']} | {t['correct']}/{t['items']} | {t['accuracy']:.4f} | {t['centered']:.4f} |" in md

    # the chat answer: chat.py's greedy reply is the one computed here from the final checkpoint
    model, _ = checkpoint.load_model(checkpoint.list_checkpoints(run / "rl" / "ckpt")[-1], torch.device("cpu"))
    (answer,) = chat_stage.chat_answers(model, tok, ["Why do plants need light?"], "float32",
                                        max_tokens=32)
    assert answer["answer"].strip() and answer["answer"].strip() in (run / "logs" / "chat.log").read_text()


@pytest.mark.two_processes
def test_a_rehearsed_pretraining_stopped_on_two_ranks_resumes_on_one(rehearsal):
    """The rehearsal's own pretraining command line (its config.json's), stopped by a signal at step 2 on 2 ranks,
    resumes on 1 rank from that checkpoint and ends at step 3."""
    run, result, _, _, env, tmp = rehearsal
    assert result.returncode == 0, result.stderr[-3000:]
    argv = json.loads((run / "pretrain" / "config.json").read_text())["argv"]  # as torchrun gave it to each rank
    assert Path(argv[0]) == ROOT / "pretrain.py"
    args = [*argv[1:], "--runs_dir", tmp / "resume", "--run_name", "r"]
    two = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    full = {**os.environ, **env, "PYTHONPATH": str(ROOT)}
    stopped = subprocess.run([*two, str(ROOT / "pretrain.py"), *map(str, args)], env={**full,
                             **faults_env(signal_at_step=2)}, capture_output=True, text=True, timeout=600, check=False)
    assert "stopped by signal at step 2" in stopped.stdout, stopped.stdout[-3000:] + stopped.stderr[-3000:]
    resumed = subprocess.run([sys.executable, str(ROOT / "pretrain.py"), *map(str, args), "--resume"], env=full,
                             capture_output=True, text=True, timeout=600, check=False)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert f"resume: from {tmp / 'resume' / 'r' / 'ckpt'}/step_000002" in resumed.stdout
    assert re.search(r"x sequence_len 128 x world size 1 x accumulation \d+ = 32,768", resumed.stdout)  # one rank
    steps = [r for r in map(json.loads, (tmp / "resume" / "r" / "metrics.jsonl").read_text().splitlines()) if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2, 3] and json.loads((tmp / "resume" / "r" / "done.json").read_text())[
        "step"] == 3
    straight = [r for r in map(json.loads, (run / "pretrain" / "metrics.jsonl").read_text().splitlines()) if "loss" in r]
    assert [r["loss"] for r in steps[:2]] == [r["loss"] for r in straight[:2]]  # the same run up to the stop
    assert abs(steps[2]["loss"] - straight[2]["loss"]) < 1e-3, (steps[2], straight[2])  # then the same data


# -----------------------------------------------------------------------------
# Your own data: --corpus PATH... and --chat FILE (docs/own-data.md)

def test_print_with_corpus_and_chat_shows_the_ingest_and_every_stage_reading_it(tmp_path):
    args = ["--corpus", "/data/text", "notes.md", "--chat", "mine.jsonl"]
    py, demo = print_plan(tmp_path / "demo", ["--plan", "demo", "--gpus", "0", *args])
    assert [name for name, _ in demo][:4] == ["data", "ingest", "tokenizer", "pretrain"]
    words, corpus = dict(demo), "runs/speedrun/corpus"
    assert words["ingest"] == [py, str(ROOT / "prepare.py"), "ingest", "--out", corpus, "/data/text", "notes.md"]
    assert words["tokenizer"][:5] == [py, str(ROOT / "prepare.py"), "tokenizer", "--data_dir", corpus]
    assert words["pretrain"][2:4] == ["--data_dir", corpus]
    assert words["core_eval"][-2:] == ["--bundle", "runs/speedrun/demo/eval_bundle"]  # the demo world's bundle
    mid = words["midtrain"]
    assert mid[mid.index("--checkpoint") + 2:mid.index("--checkpoint") + 6] == [
        "--source", f"text:{corpus}:0.2", "--source", "chat:runs/speedrun/demo/conversations:0.4"]
    assert mid[mid.index("--add_source") + 1] == "chat:mine.jsonl:0.2"
    assert words["sft"][words["sft"].index("--add_source") + 1] == "mine.jsonl:2"
    assert words["sft"][3:6] == ["runs/speedrun/midtrain", "--source", "runs/speedrun/demo/conversations:1"]

    py, gpu = print_plan(tmp_path / "gpu", ["--plan", "gpu", "--gpus", "8", *args])
    names, words = [name for name, _ in gpu], dict(gpu)
    assert "data" not in names and "download" not in names  # FineWeb-Edu's stages: the ingest instead
    assert names[names.index("ingest"):names.index("ingest") + 4] == ["ingest", "tokenizer", "data_plan", "rehearsal"]
    assert words["ingest"][-4:] == ["--out", corpus, "/data/text", "notes.md"]
    assert words["data_plan"][3:5] == ["--data_dir", corpus] and "--data_dir" not in words["rehearsal"]
    rehearsal = words["rehearsal"]
    assert rehearsal[rehearsal.index("--corpus"):rehearsal.index("--corpus") + 5] == [*args]
    assert words["midtrain"][-6:-4] == ["--add_source", "chat:mine.jsonl:0.2"]  # beside the default sources


def test_corpus_of_txt_md_jsonl_parquet_is_ingested_once_and_the_tokenizer_trained_on_it(demo_world, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq
    source = tmp_path / "mine"
    (source / "more").mkdir(parents=True)
    line = "the river runs past the old stone mill where the miller grinds wheat into flour"
    (source / "a.txt").write_text("\n\n".join(f"{line} {i}" for i in range(30)))
    (source / "b.md").write_text("\n\n".join(f"# Note {i}\n{line} again" for i in range(20)))
    (source / "more" / "c.jsonl").write_text("".join(json.dumps({"text": f"{line} {i}"}) + "\n" for i in range(25)))
    pq.write_table(pa.table({"text": [f"{line} parquet {i}" for i in range(25)]}), source / "more" / "d.parquet")
    args = ["--plan", "demo", "--gpus", "0", "--data_dir", demo_world / "demo", "--corpus", source, "--vocab_size",
            "300", "--stop_after", "tokenizer", "--runs_dir", tmp_path / "runs"]
    result = run_speedrun(args, tmp_path, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    corpus = tmp_path / "runs" / "speedrun" / "corpus"
    shards = sorted(corpus.glob("shard_*.parquet"))
    rows = [pq.ParquetFile(shard).metadata.num_rows for shard in shards]
    assert len(shards) >= 2 and sum(rows) == 100 and rows[-1] == 5  # the last: validation, 5% of the documents
    assert json.loads((corpus / "ingest.json").read_text())["documents"] == 100
    assert (tmp_path / "runs" / "speedrun" / "tokenizer" / "tokenizer.json").is_file()
    again = run_speedrun(args, tmp_path, timeout=300)  # a rerun: both stages skipped
    assert again.returncode == 0, again.stderr
    assert "stage ingest skipped" in again.stdout and "stage tokenizer skipped" in again.stdout
