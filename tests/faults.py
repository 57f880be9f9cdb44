"""The failure tests' faults, put into a training run from outside the product, which has no flag or hook for them:
what train_loop and checkpoint call is wrapped, so a run fails as real runs do. Steps count from 1, as logged:

    die_at_step     the last rank SIGKILLs itself just before the step's first collective (a machine gone)
    hang_at_step    the last rank stops taking part there (SIGTERM still ends it at once, not after torchrun's grace)
    stuck_at_step   the last rank hangs there deaf to SIGTERM, SIGINT and SIGHUP (a rank inside a C call)
    signal_at_step  each rank SIGTERMs itself as the step starts: it stops after the step (rl.py: in its rollouts)
    inject_nan_step the step's loss is NaN (times NaN before the backward: its gradients are NaN too)
    checkpoint_delay  seconds rank 0 waits before each checkpoint's meta.json, its last file: a slower save
    save_fails_at_step  the last rank's checkpoint write at that step fails as on a full disk (ENOSPC); the
                    others raise the save's error 2 s later, when the failing rank has most likely exited

The step is the one the run marks as starting its forward/backward (distributed.mark_progress), the fault coming
before the mark, so a hung rank's progress file still names the step before. A test's subprocess takes its faults
from the environment (helpers.faults_env): NANOCHAT_FAULTS, a JSON object of the faults above, and tests/faults_site/
on PYTHONPATH, whose sitecustomize.py calls from_environment() as the interpreter starts; the modules are wrapped as
they are imported. A test that trains in its own process calls install(faults, monkeypatch.setattr) instead."""
import errno
import importlib.abc
import importlib.machinery
import json
import os
import signal
import sys
import time

VARIABLE = "NANOCHAT_FAULTS"


def last_rank():
    return int(os.environ.get("RANK", "0")) == int(os.environ.get("WORLD_SIZE", "1")) - 1


def die_or_hang(die, stuck):
    """This rank dies by SIGKILL, or hangs until stopped; stuck: only SIGKILL stops it."""
    if die:
        os.kill(os.getpid(), signal.SIGKILL)
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP) if stuck else (signal.SIGTERM,):
        # hang: torchrun's SIGTERM ends it at once, not after its 30 s grace; stuck: nothing but SIGKILL ends it
        signal.signal(sig, signal.SIG_IGN if stuck else signal.SIG_DFL)
    while True:
        time.sleep(1)


class Poisoned:
    """A model whose loss is NaN: forward_backward's backward then gives NaN gradients, as a diverged step does."""

    def __init__(self, model):
        self.model = model

    def __getattr__(self, name):  # no_sync, for DDP's accumulation
        return getattr(self.model, name)

    def __call__(self, *args, **kwargs):
        return self.model(*args, **kwargs) * float("nan")


def wrappers(faults):
    """{(module, name): function(the original) -> its stand-in} for `faults`."""
    step = [0]  # the step whose forward/backward was marked last

    def marked(mark_progress):
        def mark(at, phase):
            if phase == "forward/backward":
                step[0] = at
                if at == faults.get("signal_at_step"):
                    os.kill(os.getpid(), signal.SIGTERM)
                due = {name for name in ("die_at_step", "hang_at_step", "stuck_at_step") if faults.get(name) == at}
                if due and last_rank():
                    die_or_hang("die_at_step" in due, "stuck_at_step" in due)
            return mark_progress(at, phase)
        return mark

    def poisoned(forward_backward):
        def run(train_model, *args, **kwargs):
            if step[0] == faults.get("inject_nan_step"):
                train_model = Poisoned(train_model)
            return forward_backward(train_model, *args, **kwargs)
        return run

    def slower(versions):  # called by rank 0 only, for meta.json
        def late():
            time.sleep(faults.get("checkpoint_delay", 0))
            return versions()
        return late

    def full_disk(write_files):
        def write(tmp, at, *args):
            if at == faults.get("save_fails_at_step") and last_rank():
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            return write_files(tmp, at, *args)
        return write

    def late_elsewhere(save_failed):
        def failed(*args):
            if not last_rank():
                time.sleep(2)
            return save_failed(*args)
        return failed

    return {("distributed", "mark_progress"): marked, ("train_loop", "forward_backward"): poisoned,
            ("checkpoint", "versions"): slower, ("checkpoint", "write_files"): full_disk,
            ("checkpoint", "save_failed"): late_elsewhere}


def install(faults, patch=setattr):
    """The faults in this process: each module imported already is wrapped now (every module holding the original
    under its name: `from distributed import mark_progress`), the others as they are imported."""
    pending = {}
    for (module, name), wrap in wrappers(faults).items():
        if module not in sys.modules:
            pending.setdefault(module, []).append((name, wrap))
            continue
        original = getattr(sys.modules[module], name)
        stand_in = wrap(original)
        for holder in [m for m in list(sys.modules.values()) if getattr(m, name, None) is original]:
            patch(holder, name, stand_in)
    if pending:
        patch(sys, "meta_path", [AfterImport(pending), *sys.meta_path])


class AfterImport(importlib.abc.MetaPathFinder):
    """Wraps names of a module of the project right after its first import, before any other module imports them."""

    def __init__(self, pending):
        self.pending = pending  # {module: [(name, wrap)]}

    def find_spec(self, fullname, path, target=None):
        if fullname not in self.pending:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None:
            return None
        execute, names = spec.loader.exec_module, self.pending.pop(fullname)

        def exec_module(module):
            execute(module)
            for name, wrap in names:
                setattr(module, name, wrap(getattr(module, name)))
        spec.loader.exec_module = exec_module
        return spec


def from_environment():
    if os.environ.get(VARIABLE):
        install(json.loads(os.environ[VARIABLE]))
