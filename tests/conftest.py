"""Fixtures shared by test files: the demo world with its tokenizer, and the demo pipeline run on it once by
speedrun.sh at a reduced size (made once per session: training is the slowest thing the suite does)."""
import os
import signal
import subprocess
import sys

import pytest
import torch
from launch import ROOT

import checkpoint
import dataset as D
import distributed
from demo import write_demo
from tokenizer import train_tokenizer

distributed.keep_freed_memory()  # as the stages do on CPU: tests that train in this process get the same speed

# 1 layer of width 256, 150 steps of 32 x 128 tokens, Muon lr 0.04: about a minute on 2 CPU cores. Of the small
# configurations tried, the best CORE per second of training (measured 0.099; 2 layers of width 128, lr 0.05, same steps: 0.057)
MIDTRAIN_STEPS, SFT_STEPS = "150", "150"  # the chat chain on top of LEARN_ARGS (README: chat training)
LEARN_ARGS = ["--run_name", "learn", "--steps", "150", "--sequence_len", "128", "--n_layer", "1", "--n_embd", "256",
              "--n_head", "2", "--n_kv_head", "2", "--micro_batch", "32", "--matrix_lr", "0.04", "--eval_every", "0",
              "--eval_tokens", "20000", "--ckpt_every", "1000"]


@pytest.fixture(scope="session")
def demo_world(tmp_path_factory):
    """The demo world and a vocab-1024 tokenizer trained on it, in a directory runs can work in."""
    root = tmp_path_factory.mktemp("demo_world")
    write_demo(root / "demo")
    train_tokenizer(D.iter_texts(root / "demo" / "pretrain", "train"), 1024).save(root / "tokenizer")
    return root


# speedrun.sh's stage arguments for the suite's run: the same model, steps and flags as LEARN_ARGS and the chat chain
# (the last of a repeated flag wins), so the fixtures below mean what they meant when each stage ran alone
SPEEDRUN_ENV = {
    "PRETRAIN_ARGS": " ".join([*LEARN_ARGS[2:], "--compile", "false"]),
    "MIDTRAIN_ARGS": f"--steps {MIDTRAIN_STEPS} --micro_batch 16 --total_batch_tokens 2048 --eval_rows 32 "
                     "--ckpt_every 1000",
    "SFT_ARGS": f"--steps {SFT_STEPS} --eval_rows 32 --ckpt_every 1000",
    "CORE_ARGS": "--bpb_tokens 20000 --max_new_tokens 8",
    "CHAT_EVAL_ARGS": "--max_items 20 --max_new_tokens 16",
}


def run_speedrun(args, cwd, env=None, timeout=900):
    """`bash speedrun.sh ARGS` as a user runs it (with this interpreter instead of .venv), no chat at the end."""
    env = {**os.environ, "SPEEDRUN_PYTHON": sys.executable, "PYTHONPATH": str(ROOT), **(env or {})}
    return subprocess.run(["bash", str(ROOT / "speedrun.sh"), "--no_chat", *map(str, args)], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout, check=False)


# The suite's pipeline takes over two minutes on one core. It starts in the background with the first test, the tests
# that need it run last, and everything else runs meanwhile on the other core: each side gets one thread (two
# threads each on 2 cores made both several times slower).
PIPELINE_FIXTURES = {"speedrun", "learned", "chat_chain"}
os.environ.setdefault("OMP_NUM_THREADS", "1")  # for the scripts the tests start without setting it
torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))  # and the tests that compute in this process


# Order: one-process tests (beside the pipeline), then the tests that need the pipeline, then the tests that run 2
# processes at once, when the pipeline has ended: 3 busy processes on 2 cores made the 2-process ones 2-3x slower
# (gloo's waits), so they wait for free cores. Measured on 2 cores: 4:54 in this order, 5:48 with them before the
# pipeline's tests.
TWO_PROCESS_FIXTURES = {"killed", "worker_runs"}


def pytest_collection_modifyitems(items):
    def order(item):
        if TWO_PROCESS_FIXTURES & set(item.fixturenames) or item.get_closest_marker("two_processes"):
            return 2
        return 1 if PIPELINE_FIXTURES & set(item.fixturenames) else 0
    items.sort(key=order)  # stable: file order otherwise


@pytest.fixture(scope="session", autouse=True)
def pipeline_started(request, demo_world):
    """speedrun.sh on demo_world in the background, if a selected test needs it: the Popen, and its output files."""
    if not any(PIPELINE_FIXTURES & set(item.fixturenames) for item in request.session.items):
        yield None
        return
    args = ["--no_chat", "--plan", "demo", "--gpus", "0", "--runs_dir", demo_world, "--run_name", "chat_runs",
            "--data_dir", demo_world / "demo", "--tokenizer", demo_world / "tokenizer"]
    env = {**os.environ, "SPEEDRUN_PYTHON": sys.executable, "PYTHONPATH": str(ROOT), **SPEEDRUN_ENV}
    outputs = (demo_world / "speedrun.out", demo_world / "speedrun.err")
    with open(outputs[0], "w") as out, open(outputs[1], "w") as err:
        process = subprocess.Popen(["bash", str(ROOT / "speedrun.sh"), *map(str, args)], cwd=demo_world, env=env,
                                   stdout=out, stderr=err, start_new_session=True)
    yield process, outputs
    if process.poll() is None:  # the session ended first (an error, or Ctrl-C): nothing of it may survive
        os.killpg(process.pid, signal.SIGTERM)
        process.wait()


@pytest.fixture(scope="session")
def speedrun(demo_world, pipeline_started):
    """The suite's demo pipeline, run once by speedrun.sh itself (demo plan, demo_world's world and tokenizer) into
    demo_world/chat_runs: pretrain/, core_eval/, midtrain/, sft/, chat_eval.json, logs/, report.md. (run directory,
    the finished process)."""
    process, outputs = pipeline_started
    process.wait(timeout=900)
    result = subprocess.CompletedProcess(process.args, process.returncode, *(path.read_text() for path in outputs))
    if result.returncode != 0:
        raise AssertionError(f"exit {result.returncode}\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
    return demo_world / "chat_runs", result


@pytest.fixture(scope="session")
def learned(speedrun):
    """(run directory, pretrain.py's output) of LEARN_ARGS: the speedrun's pretraining stage."""
    run, _ = speedrun
    return run / "pretrain", (run / "logs" / "pretrain.log").read_text()


@pytest.fixture(scope="session")
def chat_chain(speedrun):
    """The demo chain as speedrun.sh runs it: pretrain -> midtrain.py -> sft.py. Checkpoint paths of each stage, and
    midtrain.py's output."""
    run, _ = speedrun
    return {"pretrain": checkpoint.list_checkpoints(run / "pretrain" / "ckpt")[-1],
            "midtrain": checkpoint.list_checkpoints(run / "midtrain" / "ckpt")[-1],
            "sft": checkpoint.list_checkpoints(run / "sft" / "ckpt")[-1],
            "midtrain_stdout": (run / "logs" / "midtrain.log").read_text()}
