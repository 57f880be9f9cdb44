"""The code's layout: moving code between files changes no number of a training run (a short pretraining gives
bitwise the losses of the reference commit), the project's modules import one another without a cycle, and the failure
tests' faults come from outside the product (tests/faults.py), which has no flag for them."""
import ast
import json
import os
import subprocess
import sys

import pytest
from helpers import ROOT, faults_env, run_in_process

import chat_stage
import midtrain
import optim
import pretrain
import sft
import train_loop

# the last commit that changed a training number on purpose: the clip's norm as an fp64 sum of per-row fp32 norms,
# which can move the logged grad_norm's last bit (dev/LOG.md); on a CPU whose Newton-Schulz runs in fp32 no bit of
# these 6 steps moved, on one that runs it in bf16 step 3's did. Before it, 07d0148 (fused AdamW on the CPU); from
# b032caf (the last with the whole of common.py) on, the split and every later move gave bitwise the same losses
REFERENCE = "b463dff"
FAULTS = ["inject_nan_step", "signal_at_step", "die_at_step", "hang_at_step", "stuck_at_step", "checkpoint_delay"]
# the demo world's tiny model in fp32, uncompiled, one process: a few seconds of training
SHORT_RUN = ["--steps", "6", "--sequence_len", "64", "--n_layer", "2", "--n_embd", "64", "--n_head", "2", "--n_kv_head",
             "2", "--micro_batch", "4", "--eval_every", "0", "--bpb_tokens", "4096", "--log_every", "1000",
             "--ckpt_every", "1000", "--dtype", "float32", "--compile", "false"]


@pytest.fixture(scope="module")
def short_runs(demo_world, tmp_path_factory):
    """The runs directory of SHORT_RUN by pretrain.py of this tree (run "after") and, when this clone has it, of the
    reference commit ("before"), on the same data and tokenizer, run side by side."""
    tmp_path = tmp_path_factory.mktemp("split")
    trees = {"after": ROOT}
    known = subprocess.run(["git", "-C", str(ROOT), "cat-file", "-e", f"{REFERENCE}^{{commit}}"],
                           capture_output=True, check=False)
    if known.returncode == 0:
        trees["before"] = tmp_path / "reference"
        trees["before"].mkdir()
        archive = subprocess.run(["git", "-C", str(ROOT), "archive", REFERENCE], capture_output=True, check=True)
        subprocess.run(["tar", "-x", "-C", str(trees["before"])], input=archive.stdout, check=True)
    # each tree's own modules: the script's directory comes first on sys.path, and nothing else is added
    env = {**{k: v for k, v in os.environ.items() if k != "PYTHONPATH"}, "OMP_NUM_THREADS": "1"}
    runs = {name: subprocess.Popen(
        [sys.executable, str(tree / "pretrain.py"), "--data_dir", str(demo_world / "demo" / "pretrain"), "--tokenizer",
         str(demo_world / "tokenizer"), "--runs_dir", str(tmp_path / "runs"), "--run_name", name,
         *SHORT_RUN],
        cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for name, tree in trees.items()}
    for name, process in runs.items():
        out, err = process.communicate(timeout=300)
        assert process.returncode == 0, f"{name}: exit {process.returncode}\n{out[-2000:]}\n{err[-2000:]}"
    return tmp_path / "runs"


def records(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_the_code_since_the_reference_changed_no_loss_of_a_short_pretraining(short_runs):
    """pretrain.py of the reference commit and of this tree, on the same data and tokenizer: every step's loss and
    gradient norm, and the final val bpb, are bitwise equal."""
    if not (short_runs / "before").is_dir():
        pytest.skip(f"commit {REFERENCE} (the reference for training numbers) is not in this clone: a shallow "
                    f"clone? `git fetch --unshallow` brings it")
    figures = {}
    for name in ("before", "after"):
        records_ = records(short_runs / name)
        figures[name] = ([(r["step"], r["loss"], r["grad_norm"]) for r in records_ if "loss" in r],
                         [r["final_val_bpb"] for r in records_ if "final_val_bpb" in r])
    assert [step for step, _, _ in figures["after"][0]] == [1, 2, 3, 4, 5, 6] and len(figures["after"][1]) == 1
    assert figures["after"] == figures["before"]  # floats compared with ==: bitwise


def test_the_modules_import_one_another_without_a_cycle():
    """Every import between the project's top-level modules, at module level or inside a function, follows one order
    (common before distributed before optim before checkpoint ...): a module can be read knowing only those before."""
    ours = {path.stem for path in ROOT.glob("*.py")}
    imports = {}
    for name in ours:
        tree = ast.parse((ROOT / f"{name}.py").read_text())
        found = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import)
                 for alias in node.names}
        found |= {node.module.split(".")[0] for node in ast.walk(tree)
                  if isinstance(node, ast.ImportFrom) and node.module and not node.level}
        imports[name] = (found & ours) - {name}
    order, left = [], dict(imports)
    while left:
        ready = sorted(name for name, needs in left.items() if needs <= set(order))
        assert ready, f"an import cycle among {sorted(left)}: {({n: sorted(left[n] - set(order)) for n in left})}"
        order += ready
        for name in ready:
            del left[name]
    chain = ["distributed", "optim", "checkpoint", "train_loop"]
    assert {name: sorted(imports[name] & set(chain)) for name in chain} == {
        name: sorted(imports[name] & set(chain[:i])) for i, name in enumerate(chain)}  # each only those before it


@pytest.mark.parametrize("stage", [pretrain, midtrain, sft], ids=lambda stage: stage.__name__)
def test_no_stage_has_a_flag_for_the_failure_tests(stage, capsys):
    """The failure tests put their faults in from outside (tests/faults.py): no stage takes a flag for them, shown in
    --help or hidden."""
    for fault in FAULTS:
        with pytest.raises(SystemExit) as exit_:
            stage.get_args(["--steps", "10", f"--{fault}", "3"])
        assert exit_.value.code == 2 and f"unknown option --{fault} 3" in capsys.readouterr().err


def test_the_faults_reach_a_subprocess_through_its_environment():
    """With helpers.faults_env, a Python process has train_loop's progress mark, forward_backward and checkpoint's
    meta.json versions wrapped by tests/faults.py as they are imported, before other modules import them by name;
    without it, nothing is."""
    probe = ("import checkpoint, distributed, train_loop; print(distributed.mark_progress is train_loop.mark_progress,"
             " train_loop.mark_progress.__module__, train_loop.forward_backward.__module__,"
             " checkpoint.versions.__module__)")
    cases = (({}, "True distributed train_loop distributed"), (faults_env(die_at_step=3), "True faults faults faults"))
    for env, seen in cases:
        done = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, check=False,
                              env={**os.environ, "PYTHONPATH": str(ROOT), **env})
        assert done.returncode == 0 and done.stdout.split() == seen.split(), done.stderr[-2000:]


def test_the_library_command_lines_report_what_the_stages_report(short_runs, capsys):
    """chat_stage.py on a run gives the val bpb its pretraining ended with; train_loop.py status
    prints what pretrain.py --status prints; optim.py prints a schedule's values at the steps it
    names."""
    run_dir = short_runs / "after"
    final = next(r["final_val_bpb"] for r in records(run_dir) if "final_val_bpb" in r)
    code, out, _ = run_in_process(chat_stage.main, [run_dir], capsys)
    assert code == 0 and f"pretraining val bpb: {final:.4f} over " in out
    status = run_in_process(train_loop.main, ["status", run_dir], capsys)
    assert status[0] == 0 and "step 6/6" in status[1]
    assert status == run_in_process(pretrain.main, ["--status", run_dir], capsys)
    code, out, _ = run_in_process(optim.main, ["--steps", "10", "--points", "3", "--warmdown_frac", "0.5",
                                              "--muon_momentum_warmup", "20"], capsys)
    assert code == 0 and out == ("step 1: lr x1.0000, weight decay 0, Muon momentum 0.8500\n"
                                 "step 5: lr x1.0000, weight decay 0, Muon momentum 0.8700\n"
                                 "step 10: lr x0.2000, weight decay 0, Muon momentum 0.8950\n")
