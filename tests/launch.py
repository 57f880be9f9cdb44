"""Run a stage as a user does, for the tests: `python X.py` or `torchrun --standalone --nproc_per_node=N X.py`."""
import os
import subprocess
import sys
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GLOO_ABORT = "terminate called without an active exception"


def run_script(script, args, cwd, nproc=1, threads=1, check=True):
    """The finished process, in its own process group (so a SIGKILL hits torchrun and all its workers, as a dying
    machine would). check: a non-zero exit fails the test with the output's tail."""
    launcher = [sys.executable] if nproc == 1 else [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                                     f"--nproc_per_node={nproc}"]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONPATH": str(ROOT)}
    def launch():
        return subprocess.run([*launcher, str(ROOT / script), *args], cwd=cwd, capture_output=True, text=True,
                              env=env, start_new_session=True, timeout=600, check=False)
    result = launch()
    if nproc > 1 and result.returncode != 0 and GLOO_ABORT in result.stderr:
        # an open defect (dev/LOG.md, 2026-11-23): a gloo worker of the suite, now and then, aborts this way; never
        # reproduced alone (21 runs). Once more, with a warning in the suite's summary, so it stays visible
        warnings.warn(f"{script}: a rank aborted with {GLOO_ABORT!r}; launched again", stacklevel=2)
        result = launch()
    if check and result.returncode != 0:
        raise AssertionError(f"exit {result.returncode}\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
    return result


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
