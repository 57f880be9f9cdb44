"""launch.py, speedrun.sh's machinery, called directly: the flags, the rehearsal's budgets, the grace a stopped
stage gets, the end of a run's processes, one stage's run (its log, its record, --resume, a skip), and the rehearsal's
record. tests/test_speedrun.py runs the same code through speedrun.sh."""
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from types import SimpleNamespace

import pytest
from helpers import processes_mentioning

import gpu_plan
import launch
import sandbox
import tasks
import train_loop


def test_the_flags_have_their_defaults_and_a_bad_one_is_refused_with_its_fix():
    flags = launch.parse_flags([])
    assert {k: flags[k] for k in ("plan", "depth", "run_name", "runs_dir", "gpus", "rl", "stage_evals")} == {
        "plan": "auto", "depth": "20", "run_name": "speedrun", "runs_dir": "runs", "gpus": "auto", "rl": "on",
        "stage_evals": "pretrain,midtrain,sft,rl"}
    flags = launch.parse_flags(["--rehearse", "--run_name", "x", "--runs_dir", "/r", "--stage_evals", "none"])
    assert (launch.run_dir(flags), flags["stage_evals"], flags["rehearse"]) == ("/r/x-rehearsal", "", True)
    for argv, says in ((["--bogus"], "unknown flag --bogus (bash speedrun.sh --help lists them)"),
                       (["--plan", "tpu"], "argument --plan: invalid choice: 'tpu' (choose from 'auto', 'gpu'"),
                       (["--stop_after", "chat"], "argument --stop_after: invalid choice: 'chat' (choose from "),
                       (["--gpus", "two"], "--gpus two: use a whole number"),
                       (["--depth"], "argument --depth: expected one argument (bash speedrun.sh --help)")):
        with pytest.raises(launch.Refused) as refused:
            launch.parse_flags(argv)
        assert says in str(refused.value) and refused.value.status == 2, argv
    assert launch.parse_flags(["--help", "--bogus"])["help"] is True  # the help, whatever follows


def test_the_flags_reach_bash_as_the_same_words(tmp_path):
    """shell_assignments quotes every value: spaces, quotes and $ reach bash as they were, and nothing is run."""
    values = {"A": "it's $HOME; `rm -rf /`", "B": ["--sample_prompt", "Why do plants need light?", "a'b", ""]}
    script = launch.shell_assignments(values) + 'printf "%s\\n" "$A" "${B[@]}"'
    out = subprocess.run(["bash", "-c", script], capture_output=True, text=True, check=True).stdout
    assert out.splitlines() == [values["A"], *values["B"]]


def test_the_rehearsals_budgets_deal_a_question_to_every_rank_and_shrink_sequences_on_the_cpu():
    on_gpus = gpu_plan.rehearsal_budgets(8, on_cpu=False)
    assert on_gpus["R_RL"][on_gpus["R_RL"].index("--questions_per_step") + 1] == 8
    assert on_gpus["R_RL"][on_gpus["R_RL"].index("--eval_items") + 1] == 8
    assert on_gpus["R_SHAPE"] == [] and on_gpus["R_PRETRAIN"][:2] == ["--steps", 3]
    on_cpu = gpu_plan.rehearsal_budgets(1, on_cpu=True)
    assert on_cpu["R_RL"][on_cpu["R_RL"].index("--questions_per_step") + 1] == 2  # at least 2 a step
    assert on_cpu["R_SHAPE"] == ["--sequence_len", 128, "--total_batch_tokens", 32768]
    assert gpu_plan.rehearsal_line(on_cpu) == ("rehearsal: pretrain 3 steps, midtrain 3, sft 3 (each saving once, at "
                                               "its last step), CORE 4 items a task, ChatCORE 2; on the CPU: "
                                               "--sequence_len 128 --total_batch_tokens 32768")
    assert gpu_plan.rehearsal_line(on_gpus).endswith("ChatCORE 2")


def step_line(step, total, tokens, tok_per_s):
    record = {"step": step, "loss": 3.5, "lr_mult": 1.0, "grad_norm": 0.5, "tok_per_s": tok_per_s, "mfu": "unknown",
              "data_wait": 0.01, "tokens": tokens, "epoch": 1}
    return train_loop.progress_line(record, total, 1.0)


def test_a_stopped_stage_gets_kill_wait_plus_twice_its_last_checkpoint_save(tmp_path):
    ckpt = tmp_path / "ckpt"
    assert launch.checkpoint_grace(30, None) == 30 == launch.checkpoint_grace(30, ckpt)  # none saved yet
    ckpt.mkdir()
    (ckpt / "save_seconds").write_text("4.2\n")
    assert launch.checkpoint_grace(30, ckpt) == 39  # 30 + 8.4, rounded up
    (ckpt / "save_seconds").write_text("2.5")
    assert launch.checkpoint_grace(3, ckpt) == 8
    (ckpt / "save_seconds").write_text("garbage")
    assert launch.checkpoint_grace(3, ckpt) == 3


def test_a_checkpoint_being_written_and_one_saved_since_are_told_by_their_files(tmp_path):
    ckpt = tmp_path / "ckpt"
    assert not launch.writing_checkpoint(ckpt) and not launch.saved_since(ckpt, 0)
    part = ckpt / ".tmp_step_000010" / "model.pt"
    part.parent.mkdir(parents=True)
    part.write_bytes(b"x")
    assert launch.writing_checkpoint(ckpt)
    old = time.time() - 10
    for path in (part, part.parent):
        os.utime(path, (old, old))
    assert not launch.writing_checkpoint(ckpt)  # a leftover of a killed save, untouched for 10 s
    since = time.time()
    (ckpt / "save_seconds").write_text("1.0")
    assert launch.saved_since(ckpt, since - 1) and not launch.saved_since(ckpt, since + 60)


def marked_process(mark, code, env=None):
    """A python process in a session of its own carrying `mark`, running `code`."""
    return subprocess.Popen([sys.executable, "-c", code], env={**os.environ, "SPEEDRUN_MARK": mark, **(env or {})},
                            start_new_session=True)


def started(tmp_path, mark, on_term):
    """A marked process that runs `on_term` (python statements) on SIGTERM, then exits 0; once it waits for it."""
    ready = tmp_path / f"ready{time.time_ns()}"
    process = marked_process(mark, f"""import pathlib, signal, sys, time
def stop(*_):
{textwrap.indent(on_term, '    ')}
    sys.exit(0)
signal.signal(signal.SIGTERM, stop)
pathlib.Path({str(ready)!r}).touch()
time.sleep(60)""")
    while not ready.exists():
        time.sleep(0.02)
    return process


def test_ending_a_run_waits_for_a_checkpoint_being_written_and_saved_then_kills_what_ignores_sigterm(tmp_path,
                                                                                                   monkeypatch, capsys):
    """SPEEDRUN_KILL_WAIT=1: a stage that saved its checkpoint within the grace and exits 0.7 s after it gets that
    much again; one still writing its checkpoint at the deadline gets 5 s more at a time; one that ignores SIGTERM is
    SIGKILLed once the grace has passed, with the line that says so."""
    monkeypatch.setenv("SPEEDRUN_KILL_WAIT", "1")
    ckpt, mark = tmp_path / "ckpt", f"test-{os.getpid()}-{time.time_ns()}"
    ckpt.mkdir()
    save = f"pathlib.Path({str(ckpt)!r}, 'save_seconds').write_text('0.1')"
    saved = started(tmp_path, mark, f"time.sleep(0.5)\n{save}\ntime.sleep(1.2)")
    start = time.monotonic()
    launch.end_processes(mark, saved, ckpt)
    assert saved.returncode == 0 and 1.6 < time.monotonic() - start < 2.5
    writing = started(tmp_path, mark, f"""part = pathlib.Path({str(ckpt)!r}, '.tmp_step_000010', 'model.pt')
part.parent.mkdir()
for _ in range(8):
    part.write_bytes(b'x'); time.sleep(0.2)
{save}""")
    start = time.monotonic()
    launch.end_processes(mark, writing, ckpt)
    assert writing.returncode == 0 and 1.5 < time.monotonic() - start < 2.5
    assert "killing them" not in capsys.readouterr().err
    stuck = started(tmp_path, mark, "time.sleep(60)")
    launch.end_processes(mark)  # speedrun's exit: no stage, the grace is SPEEDRUN_KILL_WAIT
    assert stuck.wait(5) == -signal.SIGKILL and launch.marked(mark) == []
    assert "speedrun: stage processes still running after 1s: killing them (SIGKILL)" in capsys.readouterr().err


def start_run(tmp_path, **state):
    run = tmp_path / "run"
    (run / "logs").mkdir(parents=True)
    launch.write_state(run, {"mark": f"test-{os.getpid()}-{time.time_ns()}", "plan": "demo", "gpus": 0, "nproc": 1,
                             "on_cpu": False, "stages_before": 0, "nccl": {"safe": False, "fallback": False},
                             "transport": "gloo (cpu)", **state})
    return run


def test_a_stage_is_logged_recorded_resumed_and_skipped(tmp_path, capsys):
    run = start_run(tmp_path)
    echo = [sys.executable, "-c", "import os, sys; print('args', *sys.argv[1:]); print('mark', os.environ['SPEEDRUN_MARK'])"]
    assert launch.run_stage(str(run), "pretrain", [*echo, "--steps", "3"], train=True) == 0
    log = (run / "logs" / "pretrain.log").read_text()
    mark = json.loads((run / "logs" / "launch.json").read_text())["mark"]
    assert log == f"args --steps 3\nmark {mark}\n"  # no --resume: no checkpoint yet
    out = capsys.readouterr().out
    assert log in out and f"speedrun: stage pretrain done in {launch.stage_rows(run)[0][1]} s\n" in out
    (run / "pretrain" / "ckpt" / "step_000002").mkdir(parents=True)
    assert launch.run_stage(str(run), "pretrain", [*echo, "--steps", "3"], train=True) == 0
    out = capsys.readouterr().out
    assert "speedrun: stage pretrain was interrupted: resuming from its last checkpoint" in out
    assert "args --steps 3 --resume\n" in out and (run / "logs" / "pretrain.log").read_text().count("args") == 2
    (run / "pretrain" / "done.json").write_text("{}")
    assert launch.run_stage(str(run), "pretrain", ["false"], train=True) == 0
    assert f"speedrun: stage pretrain skipped: {run}/pretrain/done.json exists" in capsys.readouterr().out
    failing = [sys.executable, "-c", "import sys; print('stage output'); sys.exit(7)"]
    assert launch.run_stage(str(run), "core_eval", failing) == 7
    assert f"speedrun: stage core_eval failed (exit 7); log: {run}/logs/core_eval.log" in capsys.readouterr().err
    rows = launch.stage_rows(run)
    assert [(name, status) for name, _, status in rows] == [("pretrain", "0"), ("pretrain", "0"), ("core_eval", "7")]
    assert all(re.fullmatch(r"\d+\.\d", seconds) for _, seconds, _ in rows), rows
    assert launch.run_stage(str(run), "core_eval", failing, skip_if=str(run / "logs")) == 0  # skip_if exists
    assert launch.stage_rows(run) == rows  # a skip is not a run


def test_a_failed_stage_prints_each_ranks_last_record_and_its_age(tmp_path):
    progress = tmp_path / "pretrain" / "progress"
    progress.mkdir(parents=True)
    (progress / "rank001.txt").write_text("rank 1: stage pretrain step 2 forward/backward, process 7 on h, at "
                                          "1000.250 (10:00:00)\n")
    (progress / "rank000.txt").write_text("rank 0: stage pretrain step 3 optimizer, process 6 on h, at 1003.000 "
                                          "(10:00:03)\n")
    assert launch.progress_lines(tmp_path, "pretrain", 1010.0) == [
        f"speedrun: where each rank of stage pretrain was last ({tmp_path}/pretrain/progress/):",
        "speedrun:   rank 0: stage pretrain step 3 optimizer, process 6 on h, at 1003.000 (10:00:03) (7 s before this)",
        ("speedrun:   rank 1: stage pretrain step 2 forward/backward, process 7 on h, at 1000.250 (10:00:00) (10 s before "
        "this)")]
    assert launch.progress_lines(tmp_path, "sft", 1010.0) == []


def test_the_rehearsals_record_holds_this_invocations_stages(tmp_path, capsys):
    run = start_run(tmp_path, plan="gpu", nproc=2, on_cpu=True, stages_before=1)
    (run / "logs" / "stages.tsv").write_text("pretrain\t9.0\t1\npretrain\t12.5\t0\nchat_eval_pretrain\t3.0\t0\n")
    launch.rehearsed(str(run), 42)
    assert json.loads((run / "rehearsed.json").read_text()) == {
        "plan": "gpu", "processes": 2, "cpu": True, "seconds": 42,
        "stages": {"pretrain": 12.5, "chat_eval_pretrain": 3.0}, "resumed_after": []}
    out = capsys.readouterr().out
    assert "speedrun: rehearsal passed in 42 s; each stage's time (s):\n  pretrain            12.5\n" \
           "  chat_eval_pretrain      3.0\n" in out
    assert out.split("\n", 1)[1] in (run / "logs" / "speedrun.log").read_text()
    # a resumed rehearsal (a device call's time ran out): the stages that passed before it and were skipped in it
    # count, its own rows after them; a stage that failed before and passed now is counted once, as now
    run = start_run(tmp_path / "resumed", plan="gpu", nproc=1, on_cpu=False, stages_before=4)
    (run / "logs" / "stages.tsv").write_text("data\t1.5\t0\npretrain\t174.7\t0\nmidtrain\t90.8\t0\n"
                                             "rl\t80.0\t130\nrl\t61.0\t0\nchat\t45.0\t0\n")
    launch.rehearsed(str(run), 120)
    record = json.loads((run / "rehearsed.json").read_text())
    assert record["stages"] == {"data": 1.5, "pretrain": 174.7, "midtrain": 90.8, "rl": 61.0, "chat": 45.0}
    assert record["resumed_after"] == ["data", "pretrain", "midtrain"] and record["seconds"] == 120
    assert "speedrun: rehearsal passed in 120 s (resumed: data, pretrain, midtrain passed before it); each " \
           "stage's time (s):\n  data                 1.5\n  pretrain           174.7\n" in capsys.readouterr().out


def test_the_gpu_plan_rehearses_once_and_says_why_not(tmp_path, capsys):
    run = start_run(tmp_path)
    rehearsal = tmp_path / "run-rehearsal"
    assert launch.rehearsal_due(str(run), str(rehearsal), no_rehearse=False)
    assert not launch.rehearsal_due(str(run), str(rehearsal), no_rehearse=True)
    rehearsal.mkdir()
    (rehearsal / "rehearsed.json").write_text("{}")
    assert not launch.rehearsal_due(str(run), str(rehearsal), no_rehearse=False)
    (rehearsal / "rehearsed.json").unlink()
    (run / "pretrain").mkdir()
    assert not launch.rehearsal_due(str(run), str(rehearsal), no_rehearse=False)
    assert capsys.readouterr().out.splitlines() == [
        "speedrun: stage rehearsal skipped: --no_rehearse",
        f"speedrun: stage rehearsal skipped: it passed before ({rehearsal}/rehearsed.json)",
        "speedrun: stage rehearsal skipped: pretraining has started already"]


def test_chat_evals_result_is_copied_only_to_the_stage_whose_checkpoint_it_scored(tmp_path):
    run = start_run(tmp_path)
    (run / "chat_eval.json").write_text(json.dumps({"checkpoint": str(run / "sft" / "ckpt" / "step_000200")}))
    (run / "chat_eval_items.jsonl").write_text('{"task": "t"}\n')
    launch.reuse_chat_eval(str(run), "midtrain")
    assert not (run / "stage_evals").exists()
    launch.reuse_chat_eval(str(run), "sft")
    assert (run / "stage_evals" / "sft" / "chat_eval.json").read_text() == (run / "chat_eval.json").read_text()
    assert (run / "stage_evals" / "sft" / "chat_eval_items.jsonl").read_text() == '{"task": "t"}\n'


def test_a_listed_stage_with_a_model_is_evaluated_and_the_shards_are_the_data_plans(tmp_path, capsys,
                                                                                   monkeypatch):
    run = start_run(tmp_path)
    (run / "chat_eval.json").write_text(json.dumps({"checkpoint": str(run / "sft" / "ckpt" / "step_000200")}))
    (run / "chat_eval_items.jsonl").write_text("")
    for ckpt in ("midtrain/ckpt/step_000100", "sft/ckpt/step_000200"):
        (run / ckpt).mkdir(parents=True)
    assert [launch.stage_evals(str(run), name, "midtrain,sft,rl", "sft") for name in ("midtrain", "sft", "rl")] == [
        True, True, False]  # rl: no model
    assert not launch.stage_evals(str(run), "midtrain", "", "sft")  # --stage_evals none
    assert sorted(p.name for p in (run / "stage_evals").iterdir()) == ["sft"]  # chat_eval's result, copied for sft
    plan = {"shards": 12, "steps": 3, "tokens_per_step": 8192, "step_cap": 3, "ckpt_every": 3, "keep": 1,
            "params": 1000, "checkpoint_bytes": 12000, "data_dir": str(tmp_path), "runs_dir": str(run)}
    (run / "data_plan.json").write_text(json.dumps(plan))  # pretrain.py --data_plan's
    capsys.readouterr()
    launch.shards(str(run), "")
    launch.shards(str(run), "5")
    out, err = capsys.readouterr()
    assert out == "12\n5\n"  # what speedrun.sh reads; the disk plan and the warning go to stderr
    assert err.count("speedrun: data plan disk: 0.0 GB of shards still to fetch; checkpoints: pretraining keeps 1") == 2
    assert err.endswith("speedrun: --shards 5 is fewer than the 12 the budget needs: pretraining will repeat data (it "
                        "says so)\n")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: SimpleNamespace(free=1000))  # not one checkpoint
    with pytest.raises(launch.Refused, match="not enough disk: shards in .*, checkpoints in .* need 0.0 GB"):
        launch.shards(str(run), "")  # before any download: speedrun.sh stops


def test_a_signal_to_the_launcher_ends_its_stage_and_nothing_of_it_is_left(tmp_path):
    """`launch.py stage` with a stage whose child process lives in another session (as torchrun's workers do) and
    ignores SIGTERM: SIGTERM to the launcher ends both, within SPEEDRUN_KILL_WAIT, and it exits 143 recording
    nothing."""
    run = start_run(tmp_path)
    marker = f"sleep 66.{os.getpid()}"
    code = (f"import subprocess, sys, time; subprocess.Popen(['setsid', 'sh', '-c', 'trap \"\" TERM; {marker}']); "
            "print('started', flush=True); time.sleep(60)")
    launcher = subprocess.Popen([sys.executable, str(launch.ROOT / "launch.py"), "stage", "--run", str(run), "x",
                                 sys.executable, "-c", code], env={**os.environ, "SPEEDRUN_KILL_WAIT": "1"},
                                stdout=subprocess.PIPE, text=True)
    assert launcher.stdout.readline().startswith("speedrun: stage x: ")
    assert launcher.stdout.readline() == "started\n"
    launcher.send_signal(signal.SIGTERM)
    assert launcher.wait(20) == 143
    assert processes_mentioning(marker) == [] and not (run / "logs" / "stages.tsv").exists()


def test_a_stage_stopped_after_its_done_json_keeps_its_time_up_to_it(tmp_path):
    """A stop landing as a training stage ends (done.json written, the process not yet gone): its
    row in stages.tsv is kept, timed to done.json, so a resumed rehearsal still counts it."""
    run = start_run(tmp_path)
    code = (f"import pathlib, time; pathlib.Path({str(run / 'sft')!r}).mkdir(); time.sleep(1); "
            f"pathlib.Path({str(run / 'sft' / 'done.json')!r}).write_text('{{}}'); "
            "print('done', flush=True); time.sleep(60)")
    start = time.time()
    launcher = subprocess.Popen([sys.executable, str(launch.ROOT / "launch.py"), "stage", "--run", str(run),
                                 "sft", "--train", sys.executable, "-c", code],
                                env={**os.environ, "SPEEDRUN_KILL_WAIT": "1"}, stdout=subprocess.PIPE, text=True)
    assert launcher.stdout.readline().startswith("speedrun: stage sft: ")
    assert launcher.stdout.readline() == "done\n"
    finished = time.time() - start
    time.sleep(2)
    launcher.send_signal(signal.SIGTERM)
    assert launcher.wait(20) == 143
    name, took, status = (run / "logs" / "stages.tsv").read_text().split()
    assert (name, status) == ("sft", "0")
    assert 1 <= float(took) <= finished  # to done.json, not to the stop 2 s later


def test_pretrainings_step_lines_reach_the_terminal_and_its_log_unchanged_with_their_own_eta(tmp_path, capsys):
    """The expected time left is train_loop's, at the end of each step line: launch.py adds none of its own."""
    run = start_run(tmp_path)
    lines = [step_line(step, 400, step * 8192, 8_123) for step in (1, 19, 20, 21)]
    assert all(" ETA " in line for line in lines)
    printing = [sys.executable, "-c", f"print({chr(10).join(lines)!r})"]
    assert launch.run_stage(str(run), "pretrain", printing) == 0
    assert "\n".join(lines) + "\n" in capsys.readouterr().out
    assert (run / "logs" / "pretrain.log").read_text() == "\n".join(lines) + "\n"


def test_an_interpreter_without_a_required_package_stops_the_run_before_any_stage(tmp_path):
    """SPEEDRUN_PYTHON whose site lacks matplotlib (which only the report, the last stage, imports): speedrun.sh
    refuses at once, naming the package and the install command; the suite's own interpreter has them all."""
    (tmp_path / "sitecustomize.py").write_text(  # this interpreter, with a matplotlib that cannot be found
        "import importlib.util as u\nfind = u.find_spec\n"
        "u.find_spec = lambda name, *a, **k: None if name == 'matplotlib' else find(name, *a, **k)\n")
    stub = tmp_path / "python"
    stub.write_text(f'#!/bin/sh\nPYTHONPATH={tmp_path} exec {sys.executable} "$@"\n')
    stub.chmod(0o755)
    with pytest.raises(launch.Refused, match=r"cannot import matplotlib \(requirements.txt\): install them into it"):
        launch.check_packages(str(stub))
    launch.check_packages(sys.executable)
    done = subprocess.run(["bash", str(launch.ROOT / "speedrun.sh"), "--plan", "demo", "--no_chat", "--runs_dir",
                           str(tmp_path / "runs")], env={**os.environ, "SPEEDRUN_PYTHON": str(stub)},
                          capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 1 and "cannot import matplotlib" in done.stderr
    assert not (tmp_path / "runs" / "speedrun" / "demo").exists()  # no stage ran


def test_gpus_are_counted_by_torch_for_a_cuda_wheel_and_without_importing_it_for_a_cpu_one(tmp_path, monkeypatch):
    """--gpus auto: a torch built for CUDA (or ROCm) is asked torch.cuda.device_count(); one built for neither (its
    version.py says so) has no GPU, and is not imported (2-3 s of every CPU run). Stand-in torch packages: importing
    the CPU one fails, the CUDA one sees 3 GPUs."""
    monkeypatch.setenv("PATH", "/usr/bin:/bin")  # no nvidia-smi
    for build, init, gpus in (("None", "raise SystemExit('torch was imported')", "0"),
                              ("'12.8'", "class cuda:\n    device_count = staticmethod(lambda: 3)", "3")):
        site = tmp_path / build.strip("'") / "site"
        (site / "torch").mkdir(parents=True)
        (site / "torch" / "__init__.py").write_text(init + "\n")
        (site / "torch" / "version.py").write_text(f"__version__ = '2.13.0'\ncuda = {build}\nhip = None\n")
        stub = site.parent / "python"
        stub.write_text(f'#!/bin/sh\nPYTHONPATH={site} exec {sys.executable} "$@"\n')
        stub.chmod(0o755)
        monkeypatch.setenv("SPEEDRUN_PYTHON", str(stub))
        env_file = site.parent / "setup.env"
        launch.setup(str(env_file), ["--plan", "demo", "--stop_after", "data", "--runs_dir", str(site.parent)])
        assert f"\nGPUS={gpus}\n" in env_file.read_text(), build


def test_a_passed_rehearsal_hands_its_prediction_to_the_run_and_frees_its_checkpoints(tmp_path, capsys):
    """The gpu plan: the rehearsal's plan_cost.json becomes the real run's predicted.json (report.py reads it there),
    and the rehearsal's checkpoints are deleted, their size said."""
    run, rehearsal = tmp_path / "speedrun", tmp_path / "speedrun-rehearsal"
    (run / "logs").mkdir(parents=True)
    (run / "logs" / "stages.tsv").write_text("rehearsal\t61.5\t0\n")
    (rehearsal / "pretrain" / "ckpt" / "step_000003").mkdir(parents=True)
    (rehearsal / "pretrain" / "ckpt" / "step_000003" / "model.pt").write_bytes(b"x" * 2_000_000)
    (rehearsal / "plan_cost.json").write_text('{"hours": 3.5}')
    launch.rehearsal_passed(str(run), str(rehearsal))
    assert json.loads((run / "predicted.json").read_text()) == {"hours": 3.5}
    assert not (rehearsal / "pretrain" / "ckpt").exists()
    assert "the rehearsal cost 61.5 s before pretraining; every stage passed" in capsys.readouterr().out
    assert "its checkpoints deleted: 0.0 GB" in (run / "logs" / "speedrun.log").read_text()


def test_a_machine_without_namespaces_is_refused_in_one_line_before_any_download(tmp_path, monkeypatch):
    """A rented container without user namespaces, where `unshare` fails: the gpu plan (and its rehearsal) stops in
    setup with one line naming both fixes, before any stage or download, not at chat_eval's HumanEval hours later.
    The fixes are accepted: --sandbox process, or --tasks without HumanEval."""
    stub = tmp_path / "bin" / "unshare"
    stub.parent.mkdir()
    stub.write_text("#!/bin/sh\necho 'unshare: unshare failed: Operation not permitted' >&2\nexit 1\n")
    stub.chmod(0o755)
    env = {**os.environ, "PATH": f"{stub.parent}:{os.environ['PATH']}", "SPEEDRUN_PYTHON": sys.executable}
    done = subprocess.run(["bash", str(launch.ROOT / "speedrun.sh"), "--plan", "gpu", "--rehearse", "--gpus", "2",
                           "--no_chat", "--runs_dir", str(tmp_path / "runs")], env=env, capture_output=True,
                          text=True, timeout=120, check=False)
    errors = [line for line in done.stderr.splitlines() if line.startswith("speedrun.sh: error:")]
    refusal = ("speedrun.sh: error: chat_eval's HumanEval runs model-written programs, and this machine gives no "
               "namespaces to contain them (unshare failed (error: unshare: unshare failed: Operation not permitted)): "
               "rerun with CHAT_EVAL_ARGS=\"--sandbox process\" to run them uncontained, or CHAT_EVAL_ARGS=\"--tasks "
               "ARC-Easy,ARC-Challenge,MMLU,GSM8K\" to leave HumanEval out (docs/eval.md, the sandbox)")
    assert done.returncode == 1 and errors == [refusal], done.stderr
    logs = [path.name for path in (tmp_path / "runs").glob("*/logs/*")]
    assert logs == ["speedrun.log"] and "speedrun: stage" not in done.stdout, (logs, done.stdout)  # nothing ran
    assert "ARC-Easy,ARC-Challenge,MMLU,GSM8K" == ",".join(t for t in tasks.HUB_TASKS if t != "HumanEval")
    monkeypatch.setattr(sandbox, "_LEVEL", ("process", "unshare failed"))
    for accepted in (["--sandbox", "process"], ["--sandbox=process"], ["--tasks", "ARC-Easy,GSM8K"]):
        launch.check_sandbox(accepted)  # no refusal
    with pytest.raises(launch.Refused, match="--sandbox process"):
        launch.check_sandbox(["--tasks", "GSM8K,HumanEval", "--sandbox", "auto"])


def test_a_rehearsal_that_cannot_fit_this_machine_is_refused_before_any_stage(tmp_path):
    """The gpu plan's rehearsal on 3 CPU processes of a model no machine here holds (d64): refused in setup, with
    each rank's figure and a depth that fits, before any download or stage; nothing left running. Before, a d20
    rehearsal here was killed by the kernel at pretraining's step 1."""
    env = {**os.environ, "SPEEDRUN_PYTHON": sys.executable, "CHAT_EVAL_ARGS": "--sandbox process"}
    done = subprocess.run(["bash", str(launch.ROOT / "speedrun.sh"), "--plan", "gpu", "--rehearse", "--gpus", "3",
                           "--depth", "64", "--no_chat", "--runs_dir", str(tmp_path / "runs")], env=env,
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 1, done.stdout + done.stderr
    assert re.search(r"pretrain.py: error: 3 processes on this CPU x about [\d.]+ GiB each at its peak \(FSDP2, micro-batch "
                     r"1\) = [\d.]+ GiB, of [\d.]+ GiB available now: they would not fit with a tenth to "
                     r"spare, and the out-of-memory killer would end a rank. Rehearse with (--depth \d+|a machine with more memory)",
                     done.stderr), done.stderr  # the latter where what runs beside leaves little memory
    logs = [path.name for path in (tmp_path / "runs").glob("*/logs/*")]
    assert logs == ["speedrun.log"] and "speedrun: stage" not in done.stdout, (logs, done.stdout)  # nothing ran
    assert processes_mentioning(str(tmp_path)) == []
