"""The suite's shared helpers: every function or constant that more than one test file (or conftest.py, or a
worker script) uses lives here, with what it needs, and test files import them from here, never from one another:
any test file runs alone (`pytest tests/test_X.py`). Fixtures live in conftest.py.

- launching stages as users do: run_script (`python X.py`, or torchrun with N processes), run_in_process (a script's
  main() in this process, for command lines that end at once), run_speedrun (`bash speedrun.sh`), and
  processes_mentioning (what is left running afterwards); start_bench_dry_run (test_bench's, started by conftest);
- pip's dry-run resolution of requirements.txt for other Pythons (resolve_requirements: test_repo's, which conftest
  starts at session start);
- a tiny model and a masked global batch whose step is exact however it is split (test_train, test_distributed,
  fsdp_worker.py), and loader batches compared (take, same);
- the held-out demo questions the chat chain is scored on;
- a local server in the Hugging Face hub's protocol (tree_entry, resolve_headers, serve, hub_handler: dev/
  hub_stand_in.py's, re-exported), the real layouts of the ChatCORE tasks with hand-written rows (LAYOUTS), and a
  small CORE bundle in the real format (bundle_zip; the stand-in's has nanochat's 22 tasks)."""
import io
import json
import os
import shutil
import subprocess
import sys
import urllib.request
import zipfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "dev"))  # workers run without pytest.ini
import demo
import train_loop
from hub_stand_in import (  # noqa: F401
    COMMIT,
    STALL_S,
    git_blob_id,
    hub_handler,
    resolve_headers,
    serve,
    tree_entry,
)
from model import GPTConfig, build_model

ROOT = Path(__file__).resolve().parent.parent
RUNNING_PYTHON = f"{sys.version_info.major}.{sys.version_info.minor}"  # the Python running the suite, as "3.11"


def faults_env(**faults):
    """The environment that puts tests/faults.py's `faults` (die_at_step=3, ...) into a subprocess and every Python
    process it starts."""
    return {"PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests" / "faults_site")]),
            "NANOCHAT_FAULTS": json.dumps(faults)}


def run_script(script, args, cwd, nproc=1, threads=1, check=True, faults=None):
    """The finished process, in its own process group (so a SIGKILL hits torchrun and all its workers, as a dying
    machine would). check: a non-zero exit fails the test with the output's tail. faults: tests/faults.py's, a dict."""
    launcher = [sys.executable] if nproc == 1 else [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                                     f"--nproc_per_node={nproc}"]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONPATH": str(ROOT),
           **(faults_env(**faults) if faults else {})}
    result = subprocess.run([*launcher, str(ROOT / script), *args], cwd=cwd, capture_output=True, text=True, env=env,
                            start_new_session=True, timeout=600, check=False)
    if check and result.returncode != 0:
        raise AssertionError(f"exit {result.returncode}\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
    return result


def start_bench_dry_run(tmp):
    """`bench.py --dry_run` of every benchmark, the battery's training rows and chat_decode (which runs bench.py decode;
    without a nanochat tree: its rows say why they did not run), in the background: the Popen. Its output goes to
    tmp/bench.out and tmp/bench.err, its runs to tmp/work, the battery's files to tmp/out (test_bench's; conftest
    starts it)."""
    import bench
    empty = tmp / "no_bench"
    empty.mkdir()
    (empty / "PREPARED.json").write_text(json.dumps({"code": {"commit": "f00dcafe"}}))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TMPDIR": str(tmp), "PYTHONPATH": str(ROOT)}
    which = [*bench.STAGES, *bench.BENCHES]
    which.remove("decode")  # the battery's chat_decode row runs it
    command = [sys.executable, str(ROOT / "dev" / "bench.py"), *which, "--dry_run", "--work", str(tmp / "work"),
               "--decode_tokens", "4", "--trials", "1", "--generate_items", "2", "--generate_tokens", "4", "--rows",
               "mfu_d20", "bpb_d12_b17", "chat_decode", "--bench_dir", str(empty), "--out", str(tmp / "out")]
    with open(tmp / "bench.out", "w") as out, open(tmp / "bench.err", "w") as err:
        return subprocess.Popen(command, cwd=tmp, env=env, stdout=out, stderr=err, start_new_session=True)


def threads_named(text):
    """The names of this process's threads (Linux: /proc/self/task) that contain `text`, e.g. gloo's."""
    names = []
    for task in Path("/proc/self/task").iterdir():
        try:
            names.append((task / "comm").read_text().strip())
        except OSError:  # it ended meanwhile
            pass
    return sorted(n for n in names if text in n)


def run_in_process(main, args, capsys, stage=None):
    """A script's main(args) in this process, ended as `python X.py args` would end: (exit code, stdout, stderr). For
    command lines that finish at once (bad input, --help): a new interpreter costs ~3 s of imports. stage: the script
    name of a stage (pretrain.py, core_eval.py), whose __main__ ends it through distributed.run_main."""
    args, argv = [str(a) for a in args], sys.argv
    try:
        if stage:
            import distributed  # here: the data and model command lines need none of torch's distributed machinery
            sys.argv = [stage, *args]
            code = distributed.run_main(lambda: main(args))
        else:
            code = main(args) or 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else int(e.code is not None)
        if isinstance(e.code, str):
            print(e.code, file=sys.stderr)
    finally:
        sys.argv = argv
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def run_speedrun(args, cwd, env=None, timeout=900):
    """`bash speedrun.sh ARGS` as a user runs it (with this interpreter instead of .venv), no chat at the end."""
    env = {**os.environ, "SPEEDRUN_PYTHON": sys.executable, "PYTHONPATH": str(ROOT), **(env or {})}
    return subprocess.run(["bash", str(ROOT / "speedrun.sh"), "--no_chat", *map(str, args)], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout, check=False)


def processes_mentioning(text):
    found = []
    for proc in Path("/proc").iterdir():
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if proc.name.isdigit() and text in cmdline and int(proc.name) != os.getpid():
            found.append((proc.name, cmdline))
    return found


# --- requirements.txt resolved by pip for other Pythons (test_repo; started at session start by conftest)

def pyenv_python(version):
    """The interpreter of a pyenv-installed Python `version` (e.g. "3.10"), or None."""
    pyenv = shutil.which("pyenv")
    if pyenv is None:
        return None
    for installed in subprocess.run([pyenv, "versions", "--bare"], capture_output=True, text=True, check=False).stdout.split():
        if installed == version or installed.startswith(version + "."):
            path = subprocess.run([pyenv, "which", "python"], capture_output=True, text=True, check=False,
                                  env={**os.environ, "PYENV_VERSION": installed}).stdout.strip()
            return path or None
    return None


def registry_reachable(python):
    """The index pip would use (PIP_INDEX_URL, pip config, else PyPI) answers for torch within 20 s."""
    config = subprocess.run([python, "-m", "pip", "config", "list"], capture_output=True, text=True, check=False).stdout
    index = os.environ.get("PIP_INDEX_URL") or next(
        (line.split("=", 1)[1].strip("'\"") for line in config.splitlines() if line.split("=")[0].endswith(
            ".index-url") and "extra" not in line.split("=")[0]), "https://pypi.org/simple")
    try:
        urllib.request.urlopen(index.rstrip("/") + "/torch/", timeout=20).close()
        return True, index
    except OSError as e:
        return False, f"{index}: {e}"


def resolve_requirements(version, report, processes):
    """pip's dry-run resolution of requirements.txt for Python `version` (pyenv's), its install report written to
    `report`: (reason to skip, None, None) when there is no such Python or no reachable registry, else (None, the
    finished process, report). The pip process is appended to `processes` (the caller ends it if it must)."""
    python = pyenv_python(version)
    if python is None:
        return f"no Python {version} installed with pyenv here to resolve requirements.txt with", None, None
    reachable, why = registry_reachable(python)
    if not reachable:
        return f"the package registry is unreachable ({why}): cannot resolve requirements.txt", None, None
    command = [python, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet", "--report", str(report),
               "-r", str(ROOT / "requirements.txt")]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env={**os.environ, "PIP_NO_INPUT": "1"})
    processes.append(process)
    stdout, stderr = process.communicate(timeout=900)
    return None, subprocess.CompletedProcess(command, process.returncode, stdout, stderr), report

# --- a tiny model and a global batch with masked targets: one step's loss and gradients are exact however the
# batch is split (into micro-batches: test_train; into processes: test_distributed, fsdp_worker.py)

def tiny_model():
    torch.manual_seed(0)
    return build_model(GPTConfig(vocab_size=128, sequence_len=16, n_layer=1, n_embd=32, n_head=2, n_kv_head=2))


def global_batch():
    """8 rows whose share of masked targets (-1) ranges from none to nearly all, as in chat data: a per-micro-batch
    mean would weigh a token of a nearly empty row 15 times more than one of a full row."""
    generator = torch.Generator().manual_seed(1)
    inputs = torch.randint(0, 128, (8, 16), generator=generator)
    targets = torch.randint(0, 128, (8, 16), generator=generator)
    for row in range(8):
        targets[row, : 2 * row] = -1
    return inputs, targets


def step(micro_batch):
    """(loss, gradients) of one step over the global batch cut into micro-batches of micro_batch rows, one process."""
    model = tiny_model()
    inputs, targets = global_batch()
    batches = [(inputs[s:s + micro_batch], targets[s:s + micro_batch]) for s in range(0, 8, micro_batch)]
    loss_sum, count = train_loop.forward_backward(model, batches, "float32", torch.device("cpu"), 1)
    return (loss_sum / count).item(), {n: p.grad.clone() for n, p in model.named_parameters()}


def assert_same(a, b):
    assert abs(a[0] - b[0]) < 1e-6, (a[0], b[0])
    for name in a[1]:
        assert torch.allclose(a[1][name], b[1][name], rtol=0, atol=1e-6), name


# --- loader batches

def take(loader, n):
    batches = [next(loader) for _ in range(n)]
    loader.close()
    return batches


def same(a, b):
    return len(a) == len(b) and all(torch.equal(x[0], y[0]) and torch.equal(x[1], y[1]) for x, y in zip(a, b))


# --- the demo world's chat

def held_out_questions():
    """(question, expected word) in phrasings that none of the demo conversations use (demo.QA has others)."""
    capitals = [(f"Which city is the capital of {row[0]}?", row[1]) for row in demo.COUNTRIES]
    languages = [(f"In {row[0]}, which language do people speak?", row[2]) for row in demo.COUNTRIES]
    return capitals + languages


# --- a hub on localhost (test_prepare, test_chat_eval, test_speedrun): the protocol is dev/hub_stand_in.py's, the
# stand-in a user starts alone; here, the ChatCORE tasks' real layouts with hand-written rows

def arc(q, answer, labels="ABCD"):
    return {"id": q, "question": q, "choices": {"text": [f"t{x}" for x in labels], "label": list(labels)},
            "answerKey": answer}


ADD_TEST = "def check(candidate):\n    assert candidate(2, 3) == 5\n    assert candidate(-1, 1) == 0\n"
ADD = {"task_id": "HumanEval/0", "prompt": "import math\n\ndef add(a, b):\n    \"\"\"Add.\"\"\"\n",
       "canonical_solution": "    return a + b\n", "test": ADD_TEST, "entry_point": "add"}


ARC_ROWS = [arc(f"arc question {i}?", "ABCD"[i % 4]) for i in range(6)] + [arc("digits?", "3", labels="1234")]
LAYOUTS = {  # repo: {path: rows}; files in other configs and splits are there too, and must not be fetched
    "allenai/ai2_arc": {"ARC-Easy/test-00000-of-00001.parquet": ARC_ROWS,
                        "ARC-Easy/train-00000-of-00001.parquet": ARC_ROWS[:2],
                        "ARC-Challenge/test-00000-of-00001.parquet": ARC_ROWS[3:]},
    "cais/mmlu": {"all/test-00000-of-00001.parquet": [{"question": f"mmlu {i}?", "subject": "anatomy",
                                                       "choices": ["w", "x", "y", "z"], "answer": i % 4}
                                                      for i in range(5)],
                  "anatomy/test-00000-of-00001.parquet": [{"question": "a?", "subject": "anatomy",
                                                           "choices": ["w", "x", "y", "z"], "answer": 0}]},
    "openai/gsm8k": {"main/test-00000-of-00001.parquet": [{"question": f"How many {i}?",
                                                           "answer": f"{i} + 1 = <<{i}+1={i + 1}>>{i + 1}\n#### {i + 1}"}
                                                          for i in range(4)],
                     "socratic/test-00000-of-00001.parquet": [{"question": "s?", "answer": "#### 1"}]},
    "openai/openai_humaneval": {"openai_humaneval/test-00000-of-00001.parquet": [ADD, {**ADD,
                                                                                     "task_id": "HumanEval/1"}]},
}


# --- a CORE bundle in the real format (test_core_eval, test_speedrun)

CORE_YAML = """icl_tasks:
- label: quiz_mc
  dataset_uri: world_knowledge/quiz.jsonl
  num_fewshot: [2]
  icl_task_type: multiple_choice
  continuation_delimiter: "\\nAnswer: " # separates question and answer, as in the real core.yaml
- label: pick_schema
  dataset_uri: language_understanding/pick.jsonl
  num_fewshot: [0]
  icl_task_type: schema
- label: echo_lm
  dataset_uri: symbolic/echo.jsonl
  num_fewshot: [1]
  icl_task_type: language_modeling
"""
META_CSV = "Eval Task,Task Category,Task Type,Random baseline\nquiz_mc,wk,multiple choice,25\n" \
           "pick_schema,lu,schema,50\necho_lm,sym,language modeling,0\n"


def jsonl(items):
    return "".join(json.dumps(i) + "\n" for i in items)


QUIZ = [{"query": f"Q{i}?", "choices": ["a", "b", "c", "d"], "gold": i % 4} for i in range(8)]
PICK = [{"context_options": ["one 1", "two 2"], "continuation": "x", "gold": i % 2} for i in range(6)]
ECHO = [{"context": f" say {w}:", "continuation": w} for w in ["yes", "no", "yes", "yes", "no"]]


def bundle_zip():
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as z:
        z.writestr("eval_bundle/core.yaml", CORE_YAML)
        z.writestr("eval_bundle/eval_meta_data.csv", META_CSV)
        z.writestr("eval_bundle/eval_data/world_knowledge/quiz.jsonl", jsonl(QUIZ))
        z.writestr("eval_bundle/eval_data/language_understanding/pick.jsonl", jsonl(PICK))
        z.writestr("eval_bundle/eval_data/symbolic/echo.jsonl", jsonl(ECHO))
    return buf.getvalue()
