"""Fixtures shared by test files: the demo world with its tokenizer, and the demo pipeline run on it once by
speedrun.sh at a reduced size (made once per session: training is the slowest thing the suite does). Shared helper
functions are in helpers.py.

The pipeline's fixtures each need one stage of speedrun.sh (PIPELINE_FIXTURES):
  learned     pretrain: the pretraining run and its log (tests of pretrain.py, core_eval.py, chat.py on a base model)
  chat_chain  sft: pretrain -> midtrain -> sft checkpoints (tests of midtraining, SFT, chat.py, the warm start)
  speedrun    report: the whole run and speedrun.sh's output (tests of speedrun.sh and report.py)
At session start, when a selected test uses one of them, speedrun.sh starts in the background with --stop_after the
furthest stage any selected test needs (`pytest tests/test_core_eval.py` pretrains only); each fixture waits for its
own stage to finish, not for the whole run. Tests run in this order: one process (beside the pipeline), then the
pipeline's, by stage, then bench.py's dry run (test_bench: it runs in the background from the pipeline's end, on the
core the pipeline leaves), then those that run 2 processes at once (TWO_PROCESS_FIXTURES, or marked two_processes).

requirements_resolved: pip's resolutions of requirements.txt for other Pythons (test_repo.py), which wait on the
package registry rather than the CPU, start at session start too, in threads, when those tests are selected."""
import inspect
import os
import re
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from helpers import ROOT, RUNNING_PYTHON, resolve_requirements, run_script, start_bench_dry_run

import checkpoint
import distributed
import prepare as P
from demo import write_demo
from prepare import train_tokenizer

distributed.keep_freed_memory()  # as the stages do on CPU: tests that train in this process get the same speed

# 1 layer of width 256, 100 steps of 32 x 128 tokens, Muon lr 0.04: about a minute on one CPU core. The steps are what
# the assertions need with a margin (dev/LOG.md, 2026-11-27, fourth session): at 100 steps CORE 0.45 on all items
# (the test asks > 0.06; at 60 steps 0.105), and after 60 + 60 chat steps the SFT model answers 59 of the 60 held-out
# questions (the test asks 30%, and 10 points over the base model's 55%)
MIDTRAIN_STEPS, SFT_STEPS = "60", "60"  # the chat chain on top of LEARN_ARGS (docs/training.md: chat training)
LEARN_ARGS = ["--run_name", "learn", "--steps", "100", "--sequence_len", "128", "--n_layer", "1", "--n_embd", "256",
              "--n_head", "2", "--n_kv_head", "2", "--micro_batch", "32", "--matrix_lr", "0.04", "--eval_every", "0",
              "--bpb_tokens", "20000", "--ckpt_every", "1000"]


@pytest.fixture(scope="session")
def demo_world(tmp_path_factory):
    """The demo world and a vocab-1024 tokenizer trained on it, in a directory runs can work in."""
    root = tmp_path_factory.mktemp("demo_world")
    write_demo(root / "demo")
    train_tokenizer(P.iter_texts(root / "demo" / "pretrain", "train"), 1024).save(root / "tokenizer")
    return root


# speedrun.sh's stage arguments for the suite's run: the same model, steps and flags as LEARN_ARGS and the chat chain
# (the last of a repeated flag wins), so the fixtures below mean what they meant when each stage ran alone
SPEEDRUN_ENV = {
    "PRETRAIN_ARGS": " ".join([*LEARN_ARGS[2:], "--compile", "false"]),
    "MIDTRAIN_ARGS": f"--steps {MIDTRAIN_STEPS} --micro_batch 16 --total_batch_tokens 2048 --eval_rows 32 "
                     "--ckpt_every 1000",
    "SFT_ARGS": f"--steps {SFT_STEPS} --eval_rows 32 --ckpt_every 1000",
    "CORE_ARGS": "--bpb_tokens 20000 --max_new_tokens 8 --max_items 16",  # the report's figures; CORE itself: test_core_eval
    "CHAT_EVAL_ARGS": "--max_items 20 --max_new_tokens 16",
    "RL_ARGS": "--steps 2 --questions_per_step 2 --samples 2 --max_new_tokens 16 --eval_items 4 --eval_samples 1",
}


# The suite's pipeline takes over two minutes on one core. It starts in the background with the first test, the tests
# that need it run after the others, and everything else runs meanwhile on the other core: each side gets one thread
# (two threads each on 2 cores made both several times slower).
# speedrun.sh's stages in the order it runs them (the values of its --stop_after)
STAGES = ["data", "tokenizer", "download", "pretrain", "core_eval", "midtrain", "sft", "rl", "chat_eval", "report"]
PIPELINE_FIXTURES = {"learned": "pretrain", "chat_chain": "sft", "speedrun": "report"}  # fixture: the stage it needs
os.environ.setdefault("OMP_NUM_THREADS", "1")  # for the scripts the tests start without setting it
torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))  # and the tests that compute in this process


def stage_needed(item):
    """The furthest stage of the pipeline the test uses (its index in STAGES), or -1 for none."""
    return max((STAGES.index(stage) for name, stage in PIPELINE_FIXTURES.items() if name in item.fixturenames),
               default=-1)


# Order: one-process tests (beside the pipeline), then the tests that need the pipeline, by stage (those of pretraining
# run while the chat stages train), then the tests that run 2 processes at once, when the pipeline has ended: 3 busy
# processes on 2 cores made the 2-process ones 2-3x slower (gloo's waits), so they wait for free cores. Measured on 2
# cores: 4:54 in this order, 5:48 with them before the pipeline's tests.
TWO_PROCESS_FIXTURES = {"killed", "two_rank_results", "worker_runs"}


# The quick tier (`pytest -m "not slow"`, the loop while working): every test that needs none of these fixtures (the
# pipeline's, two processes', the benchmarks' dry run), is not marked two_processes, and starts no other process:
# neither its code nor that of its fixtures, nor of a function of their module they call (PROCESS_CALLS)
SLOW_FIXTURES = {*PIPELINE_FIXTURES, *TWO_PROCESS_FIXTURES, "bench_dry_run", "rehearsal"}
STARTED_IF_NEEDED = {"pipeline_started", "bench_started", "requirements_resolved"}  # autouse: for the slow tests
PROCESS_CALLS = re.compile(r"\b(subprocess|Popen|pty\.fork|os\.fork|run_script|run_speedrun|run_chat|"
                           r"chat_in_a_terminal|start_bench_dry_run)\b")


def starts_a_process(function, seen):
    """Whether `function`'s code, or that of a function of its module it names, starts another process."""
    function = inspect.unwrap(function)
    if function in seen or not inspect.isfunction(function):
        return False
    seen.add(function)
    try:
        source = inspect.getsource(function)
    except (OSError, TypeError):
        return False
    if PROCESS_CALLS.search(source):
        return True
    module = inspect.getmodule(function)
    named = [getattr(module, name, None) for name in set(re.findall(r"\b\w+\b", source))]
    return any(starts_a_process(f, seen) for f in named if inspect.isfunction(f) and f.__module__ == module.__name__)


def is_slow(item):
    if SLOW_FIXTURES & set(item.fixturenames) or item.get_closest_marker("two_processes"):
        return True
    fixtures = [d.func for name, defs in item._fixtureinfo.name2fixturedefs.items() for d in defs
                if name not in STARTED_IF_NEEDED]
    seen = set()
    return any(starts_a_process(function, seen) for function in [item.function, *fixtures])


def pytest_collection_modifyitems(items):
    for item in items:
        if is_slow(item):
            item.add_marker(pytest.mark.slow)

    def order(item):
        if TWO_PROCESS_FIXTURES & set(item.fixturenames) or item.get_closest_marker("two_processes"):
            return 2, 0
        if "bench_dry_run" in item.fixturenames:  # after the pipeline's tests: its run starts when the pipeline ends
            return 1, len(STAGES)
        stage = stage_needed(item)
        return (0, 0) if stage < 0 else (1, stage)
    items.sort(key=order)  # stable: file order otherwise


@pytest.fixture(scope="session", autouse=True)
def pipeline_started(request):
    """speedrun.sh on demo_world in the background up to the furthest stage a selected test needs, if any does: the
    Popen, its output files, and its run directory."""
    furthest = max((stage_needed(item) for item in request.session.items), default=-1)
    if furthest < 0:
        yield None
        return
    demo_world = request.getfixturevalue("demo_world")  # only here: a file of other tests needs no tokenizer trained
    # the last stage runs without --stop_after: it ends as a user's run ends (the "done. Chat with it" line)
    stop_after = [] if STAGES[furthest] == STAGES[-1] else ["--stop_after", STAGES[furthest]]
    args = ["--no_chat", "--plan", "demo", "--gpus", "0", "--runs_dir", demo_world, "--run_name", "chat_runs",
            "--data_dir", demo_world / "demo", "--tokenizer", demo_world / "tokenizer", "--stage_evals", "pretrain,sft",
            *stop_after]
    env = {**os.environ, "SPEEDRUN_PYTHON": sys.executable, "PYTHONPATH": str(ROOT), **SPEEDRUN_ENV}
    outputs = (demo_world / "speedrun.out", demo_world / "speedrun.err")
    with open(outputs[0], "w") as out, open(outputs[1], "w") as err:
        process = subprocess.Popen(["bash", str(ROOT / "speedrun.sh"), *map(str, args)], cwd=demo_world, env=env,
                                   stdout=out, stderr=err, start_new_session=True)
    yield process, outputs, demo_world / "chat_runs"
    if process.poll() is None:  # the session ended first (an error, or Ctrl-C): nothing of it may survive
        os.killpg(process.pid, signal.SIGTERM)
        process.wait()


def pipeline_output(process, outputs):
    return subprocess.CompletedProcess(process.args, process.returncode, *(path.read_text() for path in outputs))


def wait_for_stage(pipeline, stage, timeout=900):
    """The pipeline's run directory once speedrun.sh has finished `stage` (its line in logs/stages.tsv, exit 0); the
    run's output in the failure when it ended without it."""
    process, outputs, run = pipeline
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        finished = process.poll() is not None  # read before stages.tsv: a stage listed after the exit is not missed
        stages = run / "logs" / "stages.tsv"
        done = [line.split("\t") for line in stages.read_text().splitlines()] if stages.exists() else []
        if [stage, "0"] in [[name, rc] for name, _, rc in done]:
            return run
        if finished:
            result = pipeline_output(process, outputs)
            raise AssertionError(f"speedrun.sh ended (exit {result.returncode}) without stage {stage}\n"
                                 f"{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
        time.sleep(0.5)
    raise AssertionError(f"speedrun.sh did not finish stage {stage} in {timeout} s: see {outputs[0]}")


@pytest.fixture(scope="session")
def speedrun(pipeline_started):
    """The suite's demo pipeline, run once by speedrun.sh itself (demo plan, demo_world's world and tokenizer) into
    demo_world/chat_runs: pretrain/, core_eval/, midtrain/, sft/, chat_eval.json, logs/, report.md. (run directory,
    the finished process)."""
    process, outputs, run = pipeline_started
    process.wait(timeout=900)
    result = pipeline_output(process, outputs)
    if result.returncode != 0:
        raise AssertionError(f"exit {result.returncode}\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
    return run, result


@pytest.fixture(scope="session")
def learned(pipeline_started):
    """(run directory, pretrain.py's output) of LEARN_ARGS: the speedrun's pretraining stage."""
    run = wait_for_stage(pipeline_started, "pretrain")
    return run / "pretrain", (run / "logs" / "pretrain.log").read_text()


@pytest.fixture(scope="session")
def chat_chain(pipeline_started):
    """The demo chain as speedrun.sh runs it: pretrain -> midtrain.py -> sft.py. Its run directory, the checkpoint
    paths of each stage, and midtrain.py's output."""
    run = wait_for_stage(pipeline_started, "sft")
    return {"run": run,
            "pretrain": checkpoint.list_checkpoints(run / "pretrain" / "ckpt")[-1],
            "midtrain": checkpoint.list_checkpoints(run / "midtrain" / "ckpt")[-1],
            "sft": checkpoint.list_checkpoints(run / "sft" / "ckpt")[-1],
            "midtrain_stdout": (run / "logs" / "midtrain.log").read_text()}


@pytest.fixture(scope="session", autouse=True)
def bench_started(request, pipeline_started, tmp_path_factory):
    """test_bench's dry run of every benchmark (helpers.start_bench_dry_run), when that test is selected: started once
    the pipeline has ended (at once without one), so that its one-process rows take the core the pipeline leaves while
    the one-process tests go on (it took 65 s at the suite's end; what the move gains is within the run-to-run spread,
    dev/LOG.md). (a future of its exit code, its directory)"""
    if not any("bench_dry_run" in item.fixturenames for item in request.session.items):
        yield None
        return
    tmp, stop, processes = tmp_path_factory.mktemp("bench_dry_run"), threading.Event(), []

    def run():
        while pipeline_started is not None and pipeline_started[0].poll() is None and not stop.is_set():
            time.sleep(0.5)
        if stop.is_set():
            return None
        processes.append(start_bench_dry_run(tmp))
        return processes[0].wait()
    with ThreadPoolExecutor(1) as pool:
        yield pool.submit(run), tmp
        stop.set()
        for process in processes:  # the session ended before the test collected it (-x, Ctrl-C)
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)


@pytest.fixture(scope="session")
def bench_dry_run(bench_started):
    """(bench.py's exit code, its directory): tmp/bench.out, bench.err, work/, out/."""
    finished, tmp = bench_started
    return finished.result(timeout=900), tmp


@pytest.fixture(scope="session")
def two_rank_results(tmp_path_factory):
    """tests/two_rank_worker.py's results (rl_worker's and muon_worker's): one torchrun launch for the tests of
    test_rl and test_train that read them."""
    out = tmp_path_factory.mktemp("two_ranks") / "results.pt"
    run_script("tests/two_rank_worker.py", [str(out)], ROOT, nproc=2)
    return torch.load(out, weights_only=True)


@pytest.fixture(scope="session", autouse=True)
def requirements_resolved(request, tmp_path_factory):
    """{Python version: a future of helpers.resolve_requirements} for each selected test_requirements_resolve_on_python,
    started now: the test only collects the result."""
    versions = [item.callspec.params["version"] for item in request.session.items
                if getattr(item, "originalname", None) == "test_requirements_resolve_on_python"
                and item.callspec.params["version"] != RUNNING_PYTHON]  # its install is checked instead
    if not versions:
        yield {}
        return
    processes = []
    with ThreadPoolExecutor(len(versions)) as pool:
        yield {version: pool.submit(resolve_requirements, version,
                                    tmp_path_factory.mktemp(f"resolve_{version}") / "report.json", processes)
               for version in versions}
        for process in processes:  # the session ended before the test collected it (-x, Ctrl-C): stop pip now
            if process.poll() is None:
                process.kill()
