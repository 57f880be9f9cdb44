"""launch.py: what speedrun.sh asks of Python; it runs the recipe's stages.

    python launch.py setup ENV_FILE [speedrun.sh's flags]  # checks; shell variables: ENV_FILE
    python launch.py probe --run RUN TORCHRUN... distributed.py probe  # NCCL, safe flags on a hang
    python launch.py stage --run RUN NAME [--train] [--skip_if PATH] COMMAND...
    python launch.py end --run RUN                     # end the run's live processes
    python launch.py rehearsal_due --run RUN REHEARSAL_DIR 0|1  # exit 0: rehearse (--no_rehearse 1)
    python launch.py rehearsal_passed --run RUN REHEARSAL_DIR
    python launch.py stage_evals --run RUN STAGE LIST FINAL  # exit 0: --stage_evals has STAGE
    python launch.py rehearsed --run RUN SECONDS       # stage times: <run>/rehearsed.json
    python launch.py shards --run RUN [N]              # shards to download
    python launch.py --print COMMAND ...               # speedrun.sh --print: nothing runs

Standard library only: python3 runs it before .venv exists. State between calls:
<run>/logs/launch.json; each stage's wall time and exit status: <run>/logs/stages.tsv (report.py).
"""
import argparse
import contextlib
import functools
import hashlib
import json
import math
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import gpu_plan
from report import MODEL_STAGES, read_json, stage_rows

ROOT = Path(__file__).resolve().parent
SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)  # what stops a run
PRINT = False  # speedrun.sh --print: commands printed, nothing run

# --- speedrun.sh's flags

STOP_AFTER = ["data", "ingest", "tokenizer", "download", "pretrain", "core_eval", "midtrain", "sft",
              "rl", "chat_eval",
              "report"]
ENVIRONMENT = """environment:
  PRETRAIN_ARGS MIDTRAIN_ARGS SFT_ARGS RL_ARGS CORE_ARGS CHAT_EVAL_ARGS
                      flags appended to that stage's command line (the last of a repeated flag
                      wins), e.g. PRETRAIN_ARGS="--steps 100"
  NCCL_SAFE=1         skip the NCCL probe and run with the safe flags (P2P and InfiniBand off)
  SPEEDRUN_PYTHON     the interpreter (default: .venv/bin/python, requirements.txt installed)
  SPEEDRUN_PROBE_TIMEOUT  seconds before the NCCL probe counts as hung (default: 120)
  SPEEDRUN_PROBE_MB   size of the probe's timed all-reduce in MB (default: 64)
  SPEEDRUN_KILL_WAIT  seconds a stopped stage gets before SIGKILL, plus twice its last checkpoint
                      save, plus while one is written, and as much again once saved (default: 30)
"""


class Refused(Exception):
    """What stops speedrun.sh: exit status 2 for a flag, 1 for the machine, else the stage's."""

    def __init__(self, message, status):
        super().__init__(message)
        self.status = status


def flag_parser():
    """speedrun.sh's flags (fixed width: the same --help in every terminal)."""
    parser = argparse.ArgumentParser(
        usage="bash speedrun.sh [flags]", add_help=False, allow_abbrev=False, exit_on_error=False,
        epilog=ENVIRONMENT,
        formatter_class=lambda prog: argparse.RawDescriptionHelpFormatter(prog, width=118,
                                                                          max_help_position=22))
    add, switch = parser.add_argument, functools.partial(parser.add_argument, action="store_true")
    add("--plan", default="auto", choices=("auto", "gpu", "demo"), metavar="gpu|demo", help=
        "gpu: d20-class model on FineWeb-Edu, every stage; demo: the offline demo world, preset "
        "tiny, on the CPU (default: gpu when torch sees CUDA GPUs, else demo; GPUs that nvidia-smi "
        "lists but torch cannot use stop the run)")
    add("--depth", default="20", metavar="N", help="gpu plan: model depth, the d{N} preset "
        "(default: %(default)s)")
    add("--run_name", default="speedrun", metavar="NAME", help="everything goes to "
        "<runs_dir>/NAME/ (default: %(default)s)")
    add("--runs_dir", default="runs", metavar="DIR", help="(default: %(default)s)")
    add("--data_dir", default="", metavar="DIR", help="gpu: the FineWeb-Edu corpus directory "
        "(default: dataset.py's cache); demo: the demo world (default: <runs_dir>/<run_name>/demo, "
        "written by demo.py when missing)")
    add("--corpus", nargs="+", default=[], metavar="PATH", help="your own text instead of "
        "the plan's: .txt and .md (documents split on blank "
        "lines), .jsonl (a `text` field), .parquet (a `text` column), or directories of them; "
        "ingested once into <runs_dir>/<run_name>/corpus (its last shard held out) for the "
        "tokenizer, pretraining and midtraining (default: none)")
    add("--chat", default="", metavar="FILE", help="your own conversations, .jsonl in the OpenAI "
        "chat format (docs/own-data.md), added to the plan's: two passes in SFT's mixture, a 0.2 "
        "share of midtraining's; validation stays on the plan's "
        "held-out conversations (default: none)")
    add("--gpus", default="auto", metavar="N", help="processes per stage (default: all CUDA GPUs; "
        "0 = CPU, one)")
    add("--shards", default="", metavar="N", help="gpu plan: FineWeb-Edu training shards to "
        "download (default: the budget's tokens / the first shard's, plus one)")
    add("--vocab_size", default="", metavar="N", help="tokenizer vocabulary (default: 65536 gpu, "
        "1024 demo)")
    add("--tokenizer", default="", metavar="DIR", help="a trained tokenizer (default: train "
        "<run>/tokenizer)")
    add("--stop_after", default="", choices=("", *STOP_AFTER), metavar="STAGE", help=
        f"stop after this stage: {' '.join(STOP_AFTER)} (download: gpu plan, every shard and the "
        "chat and evaluation data fetched)")
    add("--rl", default="on", choices=("on", "off"), metavar="on|off", help=
        "rl.py after sft (default: on)")
    add("--stage_evals", default="pretrain,midtrain,sft,rl", metavar="LIST", help=
        "comma-separated stages whose final models get CORE and ChatCORE in the report's "
        "per-stage table, or none (default: %(default)s; pretrain's base model: core_eval's CORE "
        "only, as nanochat)")
    switch("--no_chat", help="do not start chat.py at the end (it starts only when stdin is a "
           "terminal)")
    switch("--rehearse", help="every stage of the plan as it will run, on a tiny budget, into "
           "<run_name>-rehearsal; ends with the report, one chat.py answer and each stage's "
           "time. Without CUDA, --gpus N rehearses "
           "the gpu plan on N CPU processes (gloo, 128-token sequences)")
    switch("--no_rehearse", help="gpu plan: skip the rehearsal before pretraining (default: "
           "rehearse once per run)")
    switch("--print", help="print every stage's command line and run nothing: no .venv, no "
           "machine check, nothing written")
    switch("--force", help="start although other processes hold the GPUs")
    switch("--probe_only", help="run the NCCL check, record the transport and its bandwidth, and "
           "exit")
    switch("-h", "--help", help="this text")
    return parser


def parse_flags(argv):
    try:
        flags, unknown = flag_parser().parse_known_args(argv)
    except argparse.ArgumentError as e:  # a flag without its value, or not one of its choices
        raise Refused(f"{e} (bash speedrun.sh --help)", 2) from None
    if (flags := vars(flags))["help"]:
        return flags
    if unknown:
        raise Refused(f"unknown flag {unknown[0]} (bash speedrun.sh --help lists them)", 2)
    for name in ("gpus", "shards", "depth", "vocab_size"):
        if flags[name] not in ("", "auto") and not flags[name].isdigit():
            raise Refused(f"--{name} {flags[name]}: use a whole number "
                          "(bash speedrun.sh --help)", 2)
    flags["stage_evals"] = "" if flags["stage_evals"] == "none" else flags["stage_evals"]
    listed = flags["stage_evals"].split(",") if flags["stage_evals"] else []
    if bad := [name for name in listed if name not in MODEL_STAGES]:
        raise Refused(f"--stage_evals {flags['stage_evals']}: {bad[0]} is not a stage with a model "
                      "(use pretrain, midtrain, sft, rl, comma-separated, or none)", 2)
    return flags


def run_dir(flags):
    return f"{flags['runs_dir']}/{flags['run_name']}{'-rehearsal' if flags['rehearse'] else ''}"


def shell_assignments(values):
    """name=value lines for bash, every value quoted."""
    def quoted(value):  # a list: a bash array
        if isinstance(value, list):
            return f"({' '.join(map(quoted, value))})"
        return shlex.quote(str(value))
    return "".join(f"{name}={quoted(value)}\n" for name, value in values.items())


# --- what speedrun.sh says, and the run's state

def say(run, text, prefix="speedrun: ", stream=None):
    """speedrun's own line, to the terminal and logs/speedrun.log (--print: a comment)."""
    if PRINT:
        return terminal(f"# {text}", stream)
    with open(f"{run}/logs/speedrun.log", "a") as log:
        log.write(f"{prefix}{text}\n")
    terminal(f"{prefix}{text}", stream)


def terminal(data, stream=None):
    """A line or stage output (bytes) to the terminal unless it is gone (SIGHUP)."""
    stream = stream or sys.stdout
    try:
        stream.flush()
        stream.buffer.write(data if isinstance(data, bytes) else f"{data}\n".encode())
        stream.buffer.flush()
    except OSError:
        # its buffer must not fail again at exit
        os.dup2(os.open(os.devnull, os.O_WRONLY), stream.fileno())


def read_state(run):
    return read_json(Path(run, "logs", "launch.json"))


def write_state(run, state):  # atomic: written beside, then renamed
    tmp = Path(run, "logs", "launch.tmp")
    tmp.write_text(json.dumps(state, indent=1))
    tmp.replace(Path(run, "logs", "launch.json"))


# --- the interpreter

def install_venv(run, venv=ROOT / ".venv", requirements=ROOT / "requirements.txt"):
    """.venv's python with requirements.txt installed. Only the sha256 of a completed pip install
    marks it done: an interrupted pip or a venv without pip is redone."""
    want = hashlib.sha256(requirements.read_bytes()).hexdigest()
    record, python = venv / "installed-requirements.sha256", venv / "bin" / "python"
    if (have := record.read_text().strip() if record.is_file() else "") == want:
        return str(python)
    pip = [python, "-m", "pip", "--version"]
    if not (os.access(python, os.X_OK)
            and subprocess.run(pip, capture_output=True, check=False).returncode == 0):
        say(run, f"{venv} has no working python or pip (an interrupted creation, or python3-venv "
                 "missing): recreating it" if venv.exists()
            else f"creating {venv} from requirements.txt")
        shutil.rmtree(venv, ignore_errors=True)
        if subprocess.run(["python3", "-m", "venv", venv], check=False).returncode != 0:
            shutil.rmtree(venv, ignore_errors=True)
            raise Refused(f"`python3 -m venv {venv}` failed: install the venv module "
                          "(Debian/Ubuntu: `apt-get install python3-venv`), or set SPEEDRUN_PYTHON "
                          "to one with requirements.txt installed", 1)
    else:
        say(run, f"requirements.txt changed since {venv} was installed: installing it again"
            if have else f"{venv} is a half install (no record that pip install -r "
            "requirements.txt completed): repairing it")
    if subprocess.run([python, "-m", "pip", "install", "-q", "-r", requirements],
                      check=False).returncode != 0:
        raise Refused(f"pip install -r {requirements} into {venv} failed (above); fix the cause "
                      f"and rerun: the install is repaired then (or delete {venv} to start it "
                      "afresh)", 1)
    record.write_text(want + "\n")
    say(run, f"{venv}: requirements.txt installed (sha256 {want[:12]}... recorded in {record})")
    return str(python)


def ask_python(python, program, pythonpath=None):
    env = {**os.environ, "PYTHONPATH": str(pythonpath)} if pythonpath else None
    done = subprocess.run([python, "-c", program], capture_output=True, text=True, env=env,
                          check=False)
    if done.returncode != 0:
        raise Refused(f"`{python} -c '{program}'` failed (exit {done.returncode}): "
                      f"{done.stderr.strip()[-2000:]}", 1)
    return done.stdout.strip()


def check_packages(python):
    """With SPEEDRUN_PYTHON, a missing requirement (matplotlib: first imported by the last stage)
    stops the run now."""
    modules = ("torch numpy pyarrow tiktoken rustbpe requests huggingface_hub safetensors yaml "
               "matplotlib")
    if missing := ask_python(python, "import importlib.util as u; print(' '.join(m for m in "
                                     f"{modules!r}.split() if u.find_spec(m) is None))").split():
        raise Refused(f"{python} cannot import {', '.join(missing)} (requirements.txt): install "
                      f"them into it (`{python} -m pip install -r {ROOT / 'requirements.txt'}`), "
                      "or leave SPEEDRUN_PYTHON unset to use .venv", 1)


# --- setup: the GPUs, the driver, the plan

def nvidia_smi(*args):
    with contextlib.suppress(OSError, subprocess.CalledProcessError):
        done = subprocess.run(["nvidia-smi", *args], capture_output=True, text=True, check=True)
        return done.stdout
    return ""


def listed_gpus():
    return len(nvidia_smi("--query-gpu=name", "--format=csv,noheader").strip().splitlines())


def explain_driver(python):
    """GPUs that torch cannot see (driver older than the wheel's CUDA) are refused with the
    versions and the fix: never a silent CPU run on a GPU box."""
    if not (listed := listed_gpus()):
        return
    driver = nvidia_smi("--query-gpu=driver_version", "--format=csv,noheader")
    driver = driver.split("\n")[0].replace(" ", "")
    driver_cuda = (re.search(r"CUDA Version: *([0-9.]*)", nvidia_smi()) or [None, ""])[1]
    torch_version, torch_cuda = ask_python(
        python, "import torch; print(torch.__version__, torch.version.cuda)").split()
    raise Refused(
        f"nvidia-smi lists {listed} GPU(s) but torch {torch_version} sees none. The driver is "
        f"{driver or 'unknown'} (it supports CUDA {driver_cuda or 'unknown'}); this torch wheel "
        "was built for CUDA "
        f"{'none (a CPU-only wheel)' if torch_cuda == 'None' else torch_cuda}.\nInstall a torch "
        f"wheel built for a CUDA the driver supports, e.g. `{python} -m pip install "
        f"torch=={torch_version.split('+')[0]} --index-url https://download.pytorch.org/whl/cuXYZ` "
        f"with XYZ at most {driver_cuda or 'that of the driver'} without the dot (pytorch.org "
        "lists the builds), or update the driver; --gpus 0 runs on the CPU regardless.", 1)


def prepare(run, flags):
    """The run's directory (a passed rehearsal deleted) and the stages' interpreter (.venv
    installed or repaired); refuses if other processes use the GPUs."""
    if flags["rehearse"] and Path(run, "rehearsed.json").is_file():
        shutil.rmtree(run)
        Path(run, "logs").mkdir(parents=True)
        say(run, f"rehearsing again from the start: {run} held a rehearsal that passed (now "
            "deleted)")
    Path(run, "logs").mkdir(parents=True, exist_ok=True)
    python = os.environ.get("SPEEDRUN_PYTHON") or install_venv(run)
    check_packages(python)
    # zombie workers of an earlier run hold GPU memory
    holders = nvidia_smi("--query-compute-apps=pid,process_name", "--format=csv,noheader").strip()
    if holders and not flags["force"]:
        pids = " ".join(line.split(",")[0].strip() for line in holders.splitlines())
        raise Refused(f"processes hold the GPUs (pid, name):\n{holders}\nThey would leave this run "
                      "short of memory (a zombie worker of an earlier run?). Stop them with `kill "
                      f"{pids}` (`kill -9 {pids}` if they stay), or rerun with --force.", 1)
    return python


def torch_gpus_of(python):
    """torch's CUDA (or ROCm) GPU count, asked once if needed, without `import torch` (2-3 s).
    --print: nvidia-smi's."""
    if PRINT:
        return functools.cache(listed_gpus)
    version = "u.find_spec('torch').submodule_search_locations[0] + '/version.py'"
    program = (f"import importlib.util as u, runpy; v = runpy.run_path({version}); "
               "print(__import__('torch').cuda.device_count() if v['cuda'] or v['hip'] else 0)")
    return functools.cache(lambda: int(ask_python(python, program)))


def checked_gpus(run, flags, python, torch_gpus):
    """--gpus (auto: torch's), refused when torch sees fewer, except CPU processes on gloo."""
    gpus = torch_gpus() if flags["gpus"] == "auto" else int(flags["gpus"])
    stand_in_probe = flags["probe_only"] and os.environ.get("SPEEDRUN_PROBE_CMD")  # tests: no GPU
    # a CPU box may fetch the data
    nothing_trains = flags["stop_after"] in STOP_AFTER[:STOP_AFTER.index("download") + 1]
    if flags["gpus"] == "auto" and gpus == 0 and not PRINT:
        explain_driver(python)
    elif gpus > 0 and not (stand_in_probe or nothing_trains or PRINT) and torch_gpus() < gpus:
        if torch_gpus() > 0 or not (flags["plan"] == "demo" or flags["rehearse"]):
            if torch_gpus() == 0:
                explain_driver(python)
            cpu = " (the CPU)" if torch_gpus() == 0 else ""
            raise Refused(f"--gpus {gpus}, but torch sees {torch_gpus()} CUDA GPU(s): pass --gpus "
                          f"{torch_gpus()}{cpu}, or make the GPUs visible "
                          "(CUDA_VISIBLE_DEVICES)", 1)
        say(run, f"--gpus {gpus} and torch sees no CUDA GPU: {gpus} CPU processes on gloo (demo "
            "plan, rehearsal only)")
    return gpus


def checked_plan(flags, gpus, torch_gpus):
    """(plan, on CPU processes?): only a rehearsal runs the gpu plan on the CPU (--gpus N: N CPU
    processes on gloo)."""
    plan, rehearse = flags["plan"], flags["rehearse"]
    plan = ("gpu" if gpus > 0 else "demo") if plan == "auto" else plan
    on_cpu = plan == "gpu" and rehearse and (gpus == 0 or torch_gpus() == 0)
    if plan == "gpu" and gpus < 1 and not flags["probe_only"] and not rehearse:
        raise Refused("--plan gpu --print: no GPU here; add --gpus N to print the plan for N GPUs"
                      if PRINT else
                      "--plan gpu needs CUDA GPUs and torch sees none; use --plan demo on the CPU "
                      "(or --rehearse --gpus N: the gpu plan's rehearsal on N CPU processes)", 2)
    if plan == "demo" and flags["stop_after"] == "download":
        raise Refused("--stop_after download: the demo plan has no download stage (use data)", 2)
    return plan, on_cpu


def say_plan(run, flags, plan, gpus, on_cpu):
    nproc, rehearsal = max(gpus, 1), " (rehearsal)" if flags["rehearse"] else ""
    where = f"{gpus} GPUs" if gpus > 0 and not on_cpu else "CPU"
    if PRINT:
        tail = "each stage's command line follows, in order; nothing runs (--print)"
    else:
        commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
                                capture_output=True, text=True, check=False).stdout.strip()
        tail = f"commit {commit or 'unknown'}"
    say(run, f"plan {plan}{rehearsal}, run {run}, {nproc} process(es) per stage ({where}), {tail}")
    if plan == "gpu" and not flags["probe_only"]:
        for line in gpu_plan.plan_lines(flags["depth"], nproc, flags["rehearse"], on_cpu):
            say(run, line)


def data_dir_of(run, flags, plan, python, own):
    """The demo world, --corpus's ingested corpus, or FineWeb-Edu's directory."""
    named = [("corpus", path) for path in flags["corpus"]]
    named += [("chat", flags["chat"])] if flags["chat"] else []
    for flag, path in [] if PRINT else named:  # --print: the flags alone
        if not Path(path).exists():
            raise Refused(f"--{flag} {path}: no such file or directory", 2)
    if plan == "demo":
        return flags["data_dir"] or f"{run}/demo"
    if flags["corpus"]:
        return own
    if flags["data_dir"] or flags["probe_only"]:
        return flags["data_dir"]
    if PRINT and not os.access(python, os.X_OK):
        return "<dataset.py's cache>"  # --print before .venv exists
    return ask_python(python, "from dataset import default_data_dir as d; "
                      "print(d('karpathy/fineweb-edu-100b-shuffle'))", pythonpath=ROOT)


def check_batch(run, python, nproc, words):
    """A step's tokens must split over the processes (for 3 GPUs, the nearest batch that does),
    else the run is refused now."""
    batch = [python, ROOT / "pretrain.py", "--check_batch", nproc, *words]
    if PRINT:
        return show("check_batch", batch, "before any stage; its output is speedrun's own lines")
    done = subprocess.run(list(map(str, batch)), stdout=subprocess.PIPE, text=True, check=False)
    for line in done.stdout.splitlines():
        say(run, line)
    return done.returncode


def setup(env_file, argv):
    """`setup`: check flags, interpreter, machine and plan; write the shell variables to env_file
    (which removes itself) and the state to launch.json. --print: flags and plan only."""
    global PRINT
    flags = parse_flags(argv)
    remove = f"rm -f -- {shlex.quote(env_file)}\n"
    if flags.pop("help"):
        print(flag_parser().format_help(), end="")
        Path(env_file).write_text(remove + "exit 0\n")
        return
    run, rehearse, PRINT = run_dir(flags), flags["rehearse"], flags["print"]
    # --print: the stages' interpreter's path, nothing installed
    python = os.environ.get("SPEEDRUN_PYTHON") or str(ROOT / ".venv" / "bin" / "python")
    python = python if PRINT else prepare(run, flags)
    torch_gpus = torch_gpus_of(python)
    gpus = checked_gpus(run, flags, python, torch_gpus)
    plan, on_cpu = checked_plan(flags, gpus, torch_gpus)
    nproc, gpu_run = max(gpus, 1), plan == "gpu" and not flags["probe_only"]
    say_plan(run, flags, plan, gpus, on_cpu)
    own = f"{flags['runs_dir']}/{flags['run_name']}/corpus"  # --corpus's, shared with the rehearsal
    data_dir = data_dir_of(run, flags, plan, python, own)
    if gpu_run and not PRINT:
        check_sandbox(os.environ.get("CHAT_EVAL_ARGS", "").split())
    budgets = {name: words if rehearse else []
               for name, words in gpu_plan.rehearsal_budgets(nproc, on_cpu).items()}
    if rehearse:
        say(run, gpu_plan.rehearsal_line(budgets))
    extras = {f"{stage}_EXTRA": os.environ.get(f"{stage}_ARGS", "").split()  # no glob, no eval
              for stage in ("PRETRAIN", "MIDTRAIN", "SFT", "RL", "CORE", "CHAT_EVAL")}
    stage_flags = gpu_plan.command_lines(flags["depth"]) if plan == "gpu" else {}
    # a rehearsal on CPU processes has its own shape (R_SHAPE)
    words = [*stage_flags.get("PRETRAIN", []), *extras["PRETRAIN_EXTRA"], *budgets["R_SHAPE"]]
    if gpu_run and (status := check_batch(run, python, nproc, words)):
        return status
    mark = f"speedrun-{os.getppid()}-{time.time_ns()}"  # carried by every process of this run
    if not PRINT:
        write_state(run, {"mark": mark, "plan": plan, "gpus": gpus, "nproc": nproc,
                          "on_cpu": on_cpu, "transport": "", "stages_before": len(stage_rows(run)),
                          "nccl": {"safe": False, "fallback": False}})
    renamed = {"vocab_size": "VOCAB", "rl": "RL_STAGE", "corpus": "INGEST"}
    values = {renamed.get(name, name.upper()): int(value) if isinstance(value, bool) else value
              for name, value in flags.items()}
    corpus = own if flags["corpus"] else f"{data_dir}/pretrain" if plan == "demo" else data_dir
    # the gpu plan's rehearsal: the same data
    data = ["--corpus", *flags["corpus"]] if flags["corpus"] else ["--data_dir", data_dir]
    chat = ["--chat", flags["chat"]] if flags["chat"] else []
    # one CPU process: no torchrun (its start costs ~1.4 s per stage)
    launch = [python, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    vocab = flags["vocab_size"] or ("1024" if plan == "demo" else "65536")
    Path(env_file).write_text(remove + shell_assignments({
        **values, "RUN": run, "LOGS": f"{run}/logs", "PY": python, "PLAN": plan, "GPUS": gpus,
        "NPROC": nproc, "ON_CPU": int(on_cpu), "DATA_DIR": data_dir,
        "OWN_TEXT": int(bool(flags["corpus"])), "CORPUS": corpus, "REHEARSAL_DATA": [*data, *chat],
        "LAUNCH": launch if gpus else [python], "VOCAB": vocab, "MARK": mark,
        "CHAT_SOURCES": gpu_plan.CHAT_SOURCES, **extras, **budgets,
        "REHEARSAL_PROMPT": gpu_plan.REHEARSAL_PROMPT, **stage_flags}))


def last_value(words, flag):
    """The last `--flag value` or `--flag=value` among words: its value, or None."""
    value = None
    for i, word in enumerate(words):
        if word == flag and i + 1 < len(words):
            value = words[i + 1]
        elif word.startswith(flag + "="):
            value = word.split("=", 1)[1]
    return value


def check_sandbox(chat_eval_words):
    """A machine without namespaces to contain HumanEval's model-written programs is refused
    here with the fix, before any download."""
    import sandbox  # the standard library only, like this file
    asked = last_value(chat_eval_words, "--tasks")
    if last_value(chat_eval_words,
                  "--sandbox") == "process" or (asked and "HumanEval" not in asked.split(",")):
        return
    level, why = sandbox.sandbox_level()
    if level != "namespaces":
        # tasks.HUB_TASKS but HumanEval (tasks.py imports torch)
        others = "ARC-Easy,ARC-Challenge,MMLU,GSM8K"
        raise Refused("chat_eval's HumanEval runs model-written programs, and this machine gives "
                      f"no namespaces to contain them ({why}): rerun with "
                      "CHAT_EVAL_ARGS=\"--sandbox process\" to run them uncontained, or "
                      f"CHAT_EVAL_ARGS=\"--tasks {others}\" to leave HumanEval out (docs/eval.md, "
                      "the sandbox)", 1)


# --- the processes of a run: found by the mark in their environment

def marked(mark, workers=False):
    """Live processes carrying this mark (SPEEDRUN_MARK) or its probe's, not zombies; workers: only
    torchrun's workers (LOCAL_RANK set, in their own sessions)."""
    wanted, found = {f"SPEEDRUN_MARK={mark}".encode(), f"SPEEDRUN_MARK={mark}.probe".encode()}, []
    for entry in os.scandir("/proc"):
        with contextlib.suppress(OSError):
            environ = Path(entry.path,
                           "environ").read_bytes().split(b"\0") if entry.name.isdigit() else []
            if wanted.intersection(environ) and (not workers or any(e.startswith(b"LOCAL_RANK=")
                                                                    for e in environ)):
                found.append(int(entry.name))
    return found


def signal_all(pids=(), groups=(), signum=signal.SIGTERM):
    """signum to each process and group: how many it reached (signal 0: how many live)."""
    reached = 0
    for send, target in [(os.kill, pid) for pid in pids] + [(os.killpg, group) for group in groups]:
        with contextlib.suppress(OSError):
            reached += send(target, signum) is None
    return reached


def group_of(pid):
    with contextlib.suppress(OSError):
        return os.getpgid(pid)


def kill_marked(mark, groups=()):
    """SIGKILL the groups and every marked process (torchrun's workers have no group)."""
    signal_all(groups=groups, signum=signal.SIGKILL)
    for _ in range(100):
        if not signal_all(marked(mark), signum=signal.SIGKILL):  # none left
            return
        time.sleep(0.1)


def checkpoint_grace(wait, ckpt):
    with contextlib.suppress(OSError, ValueError, TypeError):
        return math.ceil(wait + 2 * float(Path(ckpt, "save_seconds").read_text()[:32]))
    return wait


def writing_checkpoint(ckpt):
    """A file of a checkpoint in progress (.tmp_step_*) changed in the last 5 seconds."""
    for item in [p for tmp in Path(ckpt).glob(".tmp_step_*") for p in (
            tmp, *tmp.rglob("*"))] if ckpt else []:
        with contextlib.suppress(OSError):
            if item.stat().st_mtime > time.time() - 5:
                return True
    return False


def saved_since(ckpt, since):
    with contextlib.suppress(OSError):
        return bool(ckpt) and Path(ckpt, "save_seconds").stat().st_mtime > since
    return False


def end_processes(mark, stage=None, ckpt=None, wait=None):
    """End every process of the run: SIGTERM to torchrun's workers (not torchrun, whose own grace
    would start while rank 0 checkpoints) and other marked groups; SIGKILL after the grace (see
    ENVIRONMENT's SPEEDRUN_KILL_WAIT). stage: its Popen."""
    since, wait = time.time(), wait or int(os.environ.get("SPEEDRUN_KILL_WAIT", "30"))
    workers = marked(mark, workers=True)
    # the download's group
    others = {group_of(pid) for pid in marked(mark)} - {group_of(pid) for pid in workers}
    # never speedrun.sh's own group
    others -= {None, os.getpgrp(), stage.pid if stage is not None else None}
    groups = others | ({stage.pid} if stage is not None else set())
    # the stage's group ends when its workers have
    signal_all(workers, others if workers else groups)
    deadline, exiting = time.monotonic() + (grace := checkpoint_grace(wait, ckpt)), False
    while True:
        if stage is not None:
            stage.poll()  # reaped: a zombie leader would count as a live group
        if not (alive := marked(mark) or signal_all(groups=groups, signum=0)):
            break
        if time.monotonic() >= deadline:
            if writing_checkpoint(ckpt):
                deadline = time.monotonic() + 5
            # checkpointed: SPEEDRUN_KILL_WAIT more to exit
            elif not exiting and saved_since(ckpt, since):
                exiting, deadline, grace = True, time.monotonic() + wait, grace + wait
            else:
                break
        time.sleep(0.1)
    if alive:
        terminal(f"speedrun: stage processes still running after {grace}s: killing them (SIGKILL)",
                 sys.stderr)
    kill_marked(mark, groups)
    if stage is not None:
        stage.poll()


# --- the NCCL probe

SAFE_FLAGS = {"NCCL_P2P_DISABLE": "1", "NCCL_IB_DISABLE": "1", "NCCL_SOCKET_IFNAME": "lo",
              "NCCL_NET": "Socket",
              # P2P and InfiniBand off, sockets over loopback: what stopped runs hanging
              "NCCL_NET_PLUGIN": "none"}
SAFE_TEXT = " ".join(f"{name}={value}" for name, value in SAFE_FLAGS.items())


def probe_settings():
    return int(os.environ.get("SPEEDRUN_PROBE_TIMEOUT", "120")), os.environ.get("SPEEDRUN_PROBE_MB",
                                                                                "64")


def run_probe(run, mark, command, safe, timeout, mbytes):
    """(exit status, bus bandwidth or None) of the probe (tests: SPEEDRUN_PROBE_CMD, JSON path as
    $1); hung: 124 (137 past SIGTERM too). Nothing survives it."""
    result = Path(run, "logs", "probe.json")
    result.unlink(missing_ok=True)
    stand_in = os.environ.get("SPEEDRUN_PROBE_CMD")
    command = ["bash", "-c", stand_in, "probe", result] if stand_in else [
        *command, "--timeout", str(timeout), "--mbytes", mbytes, "--out", result]
    with open(Path(run, "logs", "probe.log"), "ab") as log:
        probe = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                 start_new_session=True,
                                 env={**os.environ, "SPEEDRUN_MARK": f"{mark}.probe",
                                      **(SAFE_FLAGS if safe else {})})
    try:
        status = probe.wait(timeout)
    except subprocess.TimeoutExpired:  # stopped as a stage is, with 5 s to end
        end_processes(f"{mark}.probe", probe, wait=5)
        status = 137 if probe.wait() == -signal.SIGKILL else 124
    finally:  # a timeout, or a signal (main's handler raises SystemExit here)
        kill_marked(f"{mark}.probe", [probe.pid])
        probe.wait()
    return status, (read_json(result) or {}).get("bus_bandwidth")


def probe(run, command, stage=None):
    """`probe`: the stages' transport (<run>/transport.txt): NCCL's defaults, or on a hang or
    failure the safe flags, their cost said. After a fallback, each torchrun stage retries the
    defaults: one failed probe (a slow cold start) must not pin the safe flags for hours."""
    state, log = read_state(run), f"log: {run}/logs/probe.log"
    nccl = state["nccl"] if stage else {"safe": False, "fallback": False, "probe": command}
    timeout, mbytes = probe_settings()
    transport = state["transport"]
    if not stage and (state["gpus"] == 0 or state["on_cpu"]):
        transport = "gloo (cpu)" if state["gpus"] else "none (one CPU process)"
    elif not stage and os.environ.get("NCCL_SAFE", "0") == "1":
        nccl["safe"], transport = True, f"nccl safe flags (NCCL_SAFE=1: {SAFE_TEXT})"
    else:
        start = time.time()
        status, bandwidth = run_probe(run, state["mark"], nccl["probe"], False, timeout, mbytes)
        took, hung = int(time.time()) - int(start), status in (124, 137)
        failure = f"exit {status}{f', hung past {timeout}s' if hung else ''}"
        default_bw = bandwidth or ("unknown" if status == 0 else "none: it "
                                   f"{'hung' if hung else 'failed'}")
        if stage and status == 0:
            nccl.update(safe=False, fallback=False)
            transport += (f"; from stage {stage} on: nccl default, all-reduce bus bandwidth "
                          f"{default_bw}")
            say(run, f"NCCL probe before stage {stage} ({took}s): the default flags pass now, "
                     f"all-reduce bus bandwidth {default_bw} against {nccl['safe_bw']} with the "
                     f"safe flags (what the fallback cost each stage since): stage {stage} and the "
                     "later ones use the defaults")
        elif stage:
            say(run, f"NCCL probe before stage {stage} ({took}s): the default flags fail again "
                     f"({failure}): stage {stage} keeps the safe flags, all-reduce bus bandwidth "
                     f"{nccl['safe_bw']} (default flags at the start: {nccl['default_bw']}); {log}")
        elif status == 0:
            transport = f"nccl default, all-reduce bus bandwidth {default_bw} ({mbytes} MB message)"
        else:
            say(run, f"NCCL probe failed ({failure}): retrying with the safe flags {SAFE_TEXT}; "
                f"{log}")
            status, safe_bw = run_probe(run, state["mark"], command, True, timeout, mbytes)
            if status != 0:
                raise Refused(f"stage nccl_probe failed (exit {status}) even with the safe flags; "
                              f"{log}", status)
            nccl.update(safe=True, fallback=True, safe_bw=safe_bw or "unknown",
                        default_bw=default_bw)
            transport = (f"nccl safe flags ({SAFE_TEXT}), all-reduce bus bandwidth "
                         f"{nccl['safe_bw']} ({mbytes} MB message; default flags: {default_bw})")
            say(run, f"the safe flags cost: all-reduce bus bandwidth {nccl['safe_bw']} with them "
                     "(P2P and InfiniBand off: gradients go through host memory and sockets); with "
                     f"the default flags: {default_bw}")
    Path(run, "transport.txt").write_text(transport + "\n")
    if not stage:
        say(run, f"transport: {transport}")
    write_state(run, {**state, "nccl": nccl, "transport": transport})
    return 0


# --- one stage

def progress_lines(run, name, now):
    """Where each rank of a failed stage was last, and when: a hung NCCL collective aborts in C++
    and no rank can say which one was stuck."""
    files = sorted(Path(run, name, "progress").glob("rank*.txt"))
    if not files:
        return []
    lines = [f"speedrun: where each rank of stage {name} was last ({run}/{name}/progress/):"]
    for path in files:
        for line in path.read_text().splitlines():  # "... at <time.time()> (<clock time>)"
            at = re.findall(r"\bat (\d+\.?\d*)", line)
            lines.append(f"speedrun:   {line}" + (f" ({now - float(at[-1]):.0f} s before this)"
                                                  if at else ""))
    return lines


def copy_output(stage, log):
    while stage and (chunk := os.read(stage.stdout.fileno(), 1 << 16)):
        log.write(chunk)
        terminal(chunk)


def run_stage(run, name, command, train=False, skip_if=None):
    """`stage`: COMMAND in its own session with the run's mark, output to the terminal and
    logs/<name>.log, time to logs/stages.tsv."""
    state, stopped = read_state(run), None

    # a Python handler, not SIG_IGN: the stage starts with the signals' defaults
    def on_signal(signum, _frame):
        nonlocal stopped
        stopped = stopped or signum
    if (done := f"{run}/{name}/done.json" if train else skip_if) and Path(done).exists():
        say(run, f"stage {name} skipped: {done} exists")
        return 0
    ckpt = f"{run}/{name}/ckpt" if train else None
    if train and any(Path(ckpt).glob("step_[0-9]*")):
        command = [*command, "--resume"]
        say(run, f"stage {name} was interrupted: resuming from its last checkpoint")
    if command[1:3] == ["-m", "torch.distributed.run"] and state["nccl"]["fallback"]:
        probe(run, None, stage=name)
        state = read_state(run)
    say(run, f"stage {name}: {' '.join(command)}")
    grace = checkpoint_grace(int(os.environ.get("SPEEDRUN_KILL_WAIT", "30")), ckpt)
    env = {**os.environ, "SPEEDRUN_MARK": state["mark"],
           **(SAFE_FLAGS if state["nccl"]["safe"] else {}),
           "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": str(grace)}
    log_path, start = f"{run}/logs/{name}.log", time.time()
    with open(log_path, "ab", buffering=0) as log:
        for signum in SIGNALS:
            signal.signal(signum, on_signal)
        try:
            stage = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, env=env, start_new_session=True)
        except OSError as e:
            message, stage = f"speedrun: cannot run {command[0]}: {e}", None
            log.write(f"{message}\n".encode())
            terminal(message, sys.stderr)
        copier = threading.Thread(target=copy_output, args=(stage, log), daemon=True)
        copier.start()
        while not stopped and (copier.is_alive() or (stage is not None and stage.poll() is None)):
            copier.join(0.1)
        if stopped:
            end_processes(state["mark"], stage, ckpt)
            copier.join(10)
            if train and Path(done).exists():  # done before the stop
                with open(f"{run}/logs/stages.tsv", "a") as tsv:
                    tsv.write(f"{name}\t{Path(done).stat().st_mtime - start:.1f}\t0\n")
            return 128 + stopped
        status = 127 if stage is None else stage.wait()
    # signal N: the shell's 128 + N
    status, took = 128 - status if status < 0 else status, f"{time.time() - start:.1f}"
    with open(f"{run}/logs/stages.tsv", "a") as tsv:  # report.py reads it
        tsv.write(f"{name}\t{took}\t{status}\n")
    if status != 0:
        terminal("\n".join([f"speedrun: stage {name} failed (exit {status}); log: {log_path}",
                            *progress_lines(run, name, time.time())]), sys.stderr)
        return status
    say(run, f"stage {name} done in {took} s")
    return 0


# --- around the stages

def reuse_chat_eval(run, name):
    """chat_eval's result into stage_evals/<name>/ when it scored this checkpoint."""
    where, result = Path(run, "stage_evals", name), Path(run, "chat_eval.json")
    if (where / "chat_eval.json").is_file() or not result.is_file():
        return
    if Path(read_json(result)["checkpoint"]).resolve().parent.parent != Path(run, name).resolve():
        return
    where.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(Path(run, "chat_eval_items.jsonl"), where / "chat_eval_items.jsonl")
    shutil.copyfile(result, where / "chat_eval.json")  # last: its presence says the pair is whole
    say(run, f"stage_evals/{name}/chat_eval.json: chat_eval's, of the same checkpoint")


def stage_evals(run, name, listed, final):
    """--stage_evals: whether NAME is listed and has a checkpoint (--print: listed and runs, FINAL
    being the last that does)."""
    if name not in listed.split(","):
        return False
    if PRINT:
        if name == final:
            say(run, f"stage_evals/{name}/chat_eval.json: chat_eval's, of the same checkpoint "
                     f"(copied: chat_eval_{name} below is skipped)")
        return MODEL_STAGES.index(name) <= MODEL_STAGES.index(final)
    if not any(Path(run, name, "ckpt").glob("step_*")):
        return False
    reuse_chat_eval(run, name)
    return True


def rehearsal_due(run, rehearsal, no_rehearse):
    """The gpu plan rehearses once before pretraining. --print: the flag decides."""
    for skip, why in ((no_rehearse, "--no_rehearse"),
                      (not PRINT and Path(rehearsal, "rehearsed.json").is_file(),
                       f"it passed before ({rehearsal}/rehearsed.json)"),
                      (not PRINT and Path(run, "pretrain").is_dir(),
                       "pretraining has started already")):
        if skip:
            say(run, f"stage rehearsal skipped: {why}")
            return False
    return True


def rehearsal_passed(run, rehearsal):
    """plan_cost.json becomes predicted.json; the rehearsal's checkpoints are deleted."""
    if Path(rehearsal, "plan_cost.json").is_file():
        shutil.copy(Path(rehearsal, "plan_cost.json"), Path(run, "predicted.json"))
    ckpts = sorted(Path(rehearsal).glob("*/ckpt"))
    freed = sum(f.stat().st_size for ckpt in ckpts for f in ckpt.rglob("*") if f.is_file())
    for ckpt in ckpts:
        shutil.rmtree(ckpt)
    say(run, f"the rehearsal cost {stage_rows(run)[-1][1]} s before pretraining; every stage "
             f"passed ({rehearsal}/report.md; its checkpoints deleted: {freed / 1e9:.1f} GB)")


def rehearsed(run, seconds):
    """A passed rehearsal's stage times: printed, and rehearsed.json."""
    state, rows = read_state(run), stage_rows(run)
    now = {name: took for name, took, _ in rows[state["stages_before"]:]}
    earlier = {name: took for name, took, status in rows[:state["stages_before"]]
               if status == "0" and name not in now}
    resumed = f" (resumed: {', '.join(earlier)} passed before it)" if earlier else ""
    say(run, f"rehearsal passed in {seconds} s{resumed}; each stage's time (s):")
    times = {**earlier, **now}
    for name, took in times.items():
        say(run, f"  {name:<15} {took:>8}", prefix="")
    record = {"plan": state["plan"], "processes": state["nproc"], "cpu": state["on_cpu"],
              "seconds": seconds, "stages": {name: float(took) for name, took in times.items()},
              "resumed_after": [*earlier]}
    Path(run, "rehearsed.json").write_text(json.dumps(record) + "\n")


# --- speedrun.sh's calls

def shards(run, given):
    """`shards`: --shards, else data_plan.json's count; too little disk stops the run first."""
    plan = read_json(Path(run, "data_plan.json"))
    try:
        say(run, gpu_plan.check_disk(plan), stream=sys.stderr)
    except ValueError as e:
        raise Refused(str(e), 1) from None
    needed = plan["shards"]
    if given and int(given) < needed:
        say(run, f"--shards {given} is fewer than the {needed} the budget needs: pretraining will "
                 "repeat data (it says so)", stream=sys.stderr)
    print(given or needed)


def stage_command(run, words, do=run_stage):
    """NAME [--train] [--skip_if PATH] COMMAND..."""
    name, words, options = words[0], words[1:], {}
    while words[:1] in (["--train"], ["--skip_if"]):
        if words[0] == "--train":
            options["train"], words = True, words[1:]
        else:
            options["skip_if"], words = words[1], words[2:]
    return do(run, name, words, **options)


# (RUN of `--run RUN` or None, the words after it) -> exit status (None: 0)
COMMANDS = {
    "setup": lambda run, words: setup(words[0], words[1:]),  # ENV_FILE [flags]
    "probe": probe,
    "stage": stage_command,
    "end": lambda run, words: end_processes(read_state(run)["mark"]) if read_state(run) else None,
    "shards": lambda run, words: shards(run, words[0]),
    "rehearsal_due": lambda run, words: 0 if rehearsal_due(run, words[0], words[1] == "1") else 1,
    "rehearsal_passed": lambda run, words: rehearsal_passed(run, words[0]),
    "stage_evals": lambda run, words: 0 if stage_evals(run, *words) else 1,  # STAGE LIST FINAL
    "rehearsed": lambda run, words: rehearsed(run, int(words[0])),
}


# --- --print: what would run, printed

def show(name, command, note=""):
    print(f"# {name}{f' ({note})' if note else ''}\n{shlex.join(map(str, command))}", flush=True)


def show_stage(run, name, command, train=False, skip_if=None):
    show(name, command, f"skipped once {run}/{name}/done.json exists; --resume added when it has a "
         "checkpoint" if train
         else f"skipped when {skip_if} exists" if skip_if else "")


def show_probe(run, command):
    if "torch.distributed.run" in command:
        timeout, mbytes = probe_settings()
        show("probe", [*command, "--timeout", timeout, "--mbytes", mbytes, "--out",
                       f"{run}/logs/probe.json"],
             "NCCL over CUDA GPUs, not on CPU processes; on a hang or a failure, again with the "
             "safe flags")


# --print stand-ins; a command missing here does nothing
PRINTS = {
    "probe": show_probe,
    "stage": lambda run, words: stage_command(run, words, show_stage),
    "shards": lambda run, words: print(words[0] or "<shards from data_plan.json>"),
    "rehearsal_due": COMMANDS["rehearsal_due"],
    "stage_evals": COMMANDS["stage_evals"],
}


def main(argv):
    global PRINT
    if argv[:1] == ["--print"]:  # speedrun.sh --print: every command below only prints
        PRINT, argv = True, argv[1:]
    command, words = (argv[0], argv[1:]) if argv else ("", [])
    if command in ("", "-h", "--help"):
        print(__doc__)
        return 0
    run, words = (words[1], words[2:]) if words[:1] == ["--run"] else (None, words)
    for signum in SIGNALS:
        # end must not be cut short by a second Ctrl-C; others exit at once (a probe ends in
        # run_probe's finally, a stage in run_stage's handler)
        exit_now = lambda s, _: sys.exit(128 + s)
        signal.signal(signum, signal.SIG_IGN if command == "end" else exit_now)
    try:
        if command not in COMMANDS:
            raise Refused(f"launch.py: unknown command {command!r} (see its docstring)", 2)
        if PRINT:
            return PRINTS[command](run, words) or 0 if command in PRINTS else 0
        return COMMANDS[command](run, words) or 0
    except Refused as e:
        terminal(f"speedrun.sh: error: {e}", sys.stderr)
        return e.status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
