"""Run untrusted Python (a model's HumanEval program) in a separate, limited process.

    python sandbox.py --probe     # the level this machine gives, what it contains and cannot
    python sandbox.py program.py  # run a file in the sandbox: its status and output

Both levels: a fresh `python -I` reading the program from stdin in an empty directory; its own
session, killed at the end, the timeout, or when the evaluator dies; PATH and LANG only; setrlimit
limits (CPU, address space, processes, file size, no core dumps, 64 open files); socket.socket
raising (best effort).

Level "namespaces" (where `unshare` works) adds network, pid and mount namespaces: no interface
up, only SYSTEM_DIRS visible (read-only), as nobody when root. Level "process", the common part
alone, runs only when asked for (--sandbox process), never as a fallback. More: docs/eval.md.
"""
import argparse
import contextlib
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

# the top-level directories the namespaces level leaves visible
SYSTEM_DIRS = {"bin", "sbin", "lib", "lib32", "lib64", "libx32", "usr", "etc", "dev", "proc"}
NOBODY = 65534
ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8"}
# RLIMIT_FSIZE: stops a program printing forever
OUTPUT_BYTES = 1 << 20

# Runs first inside the sandbox, as trusted code: reads the program, builds the namespace level's
# file system view and gives up the power to change it, patches socket, runs the program.
BOOTSTRAP = r"""
import ctypes, json, os, sys
cfg = json.loads(sys.argv[1])
sys.argv = ["program"]
source = sys.stdin.read()
os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
libc = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None
if cfg["hide"]:
    RDONLY, NOSUID, NODEV, NOEXEC, REMOUNT, NOATIME, NODIRATIME, BIND, REC, RELATIME = (
        1, 2, 4, 8, 32, 1024, 2048, 4096, 16384, 1 << 21)  # mount(2)'s MS_* flags
    def mount(src, target, fstype, flags, data=None):
        args = [None if a is None else a.encode() for a in (src, target, fstype, data)]
        if libc.mount(args[0], args[1], args[2], ctypes.c_ulong(flags), args[3]) != 0:
            raise OSError(ctypes.get_errno(), "sandbox: cannot mount " + target)
    kept = [(os.open(path, os.O_PATH), path, os.statvfs(path).f_flag) for path in cfg["keep"]]
    for path in cfg["hide"]:
        if os.path.isdir(path):
            mode = "1777" if path == "/tmp" else "755"
            mount("tmpfs", path, "tmpfs", NOSUID | NODEV, "size=16m,nr_inodes=4096,mode=" + mode)
        else:  # a file at the top level: /dev/null bound over it reads as empty
            mount("/dev/null", path, None, BIND)
    # bound back from a descriptor opened before the hiding, then made read-only, with the flags a
    # user namespace may not drop (statvfs's ST_* are MS_* but one)
    for fd, path, st in kept:
        os.makedirs(path, exist_ok=True)
        mount("/proc/self/fd/%d" % fd, path, None, BIND | REC)
        kept_flags = st & (NOSUID | NODEV | NOEXEC | NOATIME | NODIRATIME)
        kept_flags |= RELATIME if st & 4096 else 0
        mount(None, path, None, REMOUNT | BIND | RDONLY | kept_flags)
        os.close(fd)
    os.chdir("/tmp")
if cfg["drop"]:  # real root: become nobody, with no capability (and RLIMIT_NPROC enforced)
    # the interpreter's own library, under a directory nobody may not enter (/root): reached through
    # a descriptor opened as root, from sys.path and the imported packages' (encodings finds its
    # codecs by its __path__)
    for prefix in cfg["reach"]:
        fd = os.open(prefix, os.O_PATH | os.O_DIRECTORY)
        def moved(paths):
            inside = lambda p: p == prefix or p.startswith(prefix + "/")
            return ["/proc/self/fd/%d" % fd + p[len(prefix):] if inside(p) else p for p in paths]
        sys.path[:] = moved(sys.path)
        for module in list(sys.modules.values()):
            if isinstance(getattr(module, "__path__", None), list):
                module.__path__[:] = moved(module.__path__)
    os.setgroups([])
    os.setgid(65534)
    os.setuid(65534)
    # PR_SET_DUMPABLE: setuid made /proc/self root's; those descriptors need it ours
    libc.prctl(4, 1, 0, 0, 0)
# CLONE_NEWUSER | CLONE_NEWNS: the mounts above become locked
elif cfg["hide"] and libc.unshare(0x10000000 | 0x00020000) != 0:
    raise OSError(ctypes.get_errno(), "sandbox: cannot lock the mounts")
if libc:
    libc.prctl(38, 1, 0, 0, 0)  # PR_SET_NO_NEW_PRIVS: no setuid program gives anything back
# the evaluator holds the pipe's other end: at its end, however it ended (a stage stopped, a
# SIGKILL), no one enforces the timeout, so the program and its group end here (at the namespaces
# level the pid namespace ends with its first process, this one, which SIGKILL from inside would
# not end)
def _watch(fd=cfg["watch"]):
    os.read(fd, 1)
    try:
        os.killpg(0, 9)
    finally:
        os._exit(137)
import threading
threading.Thread(target=_watch, daemon=True).start()
import socket, _socket
class _NoNetwork(socket.socket):
    def __init__(self, *args, **kwargs):
        raise OSError("network access is disabled in the sandbox")
socket.socket = _socket.socket = _NoNetwork
del cfg, json
exec(compile(source, "<program>", "exec"),
     {"__name__": "__sandbox__", "__builtins__": __builtins__})
"""


@dataclass
class Result:
    # "ok" (exit 0), "error" (exit != 0), "killed" (by a signal: a limit, or the timeout), "timeout"
    status: str
    returncode: int | None
    output: str  # the tail of stdout and stderr together
    seconds: float


_LEVEL = None  # (level, why), probed once


def interpreter():
    """The base interpreter (a venv's pyvenv.cfg is hidden at the namespace level), its prefix."""
    exe = os.path.realpath(getattr(sys, "_base_executable", None) or sys.executable)
    return exe, sorted({os.path.realpath(sys.base_prefix), os.path.realpath(sys.base_exec_prefix)})


def hidden_paths():
    """Every top-level directory but SYSTEM_DIRS, every top-level file, /dev/shm and /tmp."""
    hide = {"/tmp", "/dev/shm"}
    for name in os.listdir("/"):
        path = "/" + name
        if name not in SYSTEM_DIRS and not os.path.islink(path) and (os.path.isdir(path)
                                                                     or os.path.isfile(path)):
            hide.add(path)
    return sorted(p for p in hide if os.path.exists(p))


def world_reachable(path):
    """Whether every directory on the way to `path` is searchable by others."""
    path = Path(path)
    return all(os.stat(p).st_mode & 0o001 for p in [path, *path.parents])


def command(level):
    """(argv, config for BOOTSTRAP) of a run at `level`."""
    exe, prefixes = interpreter()
    run = [exe, "-I", "-c", BOOTSTRAP]
    root = os.geteuid() == 0 and sys.platform.startswith("linux")
    if level != "namespaces":
        # as root the program runs as nobody: the process limit holds, and so do file permissions
        return run, {"hide": [], "keep": [], "drop": root,
                     "reach": [p for p in prefixes if root and not world_reachable(p)]}
    hide = hidden_paths()
    keep = [p for p in prefixes if any(p == h or p.startswith(h + "/") for h in hide)]
    unshare = [shutil.which("unshare") or "unshare", *([] if root else ["--user",
                                                                        "--map-root-user"]),
               "--mount",
               "--net", "--pid", "--fork", "--kill-child", "--mount-proc", "--"]
    return unshare + run, {"hide": hide, "keep": keep, "drop": root, "reach": []}


def tasks_of(uid):
    """Processes and threads uid runs now, machine-wide (RLIMIT_NPROC counts them); 0 without
    /proc."""
    count = 0
    for pid in filter(str.isdigit, os.listdir("/proc") if os.path.isdir("/proc") else []):
        with contextlib.suppress(OSError, KeyError, ValueError):  # a process gone meanwhile
            fields = dict(line.split(
                    ":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines()
                          if ":" in line)
            count += int(fields["Threads"]) if int(fields["Uid"].split()[0]) == uid else 0
    return count


def set_limits(cpu_s, memory_bytes, nproc, fsize):
    """preexec_fn, between fork and exec. CPU soft limit = hard: the first process of a pid
    namespace ignores SIGXCPU, not SIGKILL."""
    for limit, value in ((resource.RLIMIT_CPU, cpu_s), (resource.RLIMIT_AS, memory_bytes),
                         (resource.RLIMIT_NPROC, nproc),
                         (resource.RLIMIT_FSIZE, fsize), (resource.RLIMIT_CORE, 0),
                         (resource.RLIMIT_NOFILE, 64)):
        resource.setrlimit(limit, (value, value))


def run(program, timeout_s=5.0, cpu_s=None, memory_mb=512, nproc=16, level=None):
    """Run `program` (Python source) in the sandbox: a Result, never raising for what the program
    does. nproc: processes (and threads) it may add. level: None = choose("auto")."""
    level = level or choose("auto")[0]
    argv, cfg = command(level)
    cpu_s = max(1, int(cpu_s if cpu_s is not None else timeout_s + 0.999))
    # root is not limited by RLIMIT_NPROC: the program runs as nobody
    uid = NOBODY if cfg["drop"] else os.getuid()
    limits = (cpu_s, memory_mb << 20, tasks_of(uid) + nproc, OUTPUT_BYTES)
    with tempfile.TemporaryDirectory(prefix="sandbox_") as private, \
            tempfile.TemporaryDirectory(prefix="work_") as work:
        # apart from its (empty) working directory
        (Path(private) / "program.py").write_text(program)
        if cfg["drop"]:
            # the process level's working directory, nobody's to list and write
            os.chown(work, NOBODY, NOBODY)
        start = time.perf_counter()
        # the program sees EOF when this process ends
        watch, alive = os.pipe()
        with open(Path(private) / "program.py") as stdin, open(Path(private) / "output",
                                                               "wb") as out:
            # preexec_fn in a threaded parent (torch's) is safe: it only calls setrlimit, which
            # takes no lock another thread could hold
            try:
                proc = subprocess.Popen([*argv, json.dumps({**cfg, "watch": watch})], stdin=stdin,
                                        stdout=out,
                                        stderr=subprocess.STDOUT, cwd=work, env=ENV,
                                        start_new_session=True,
                                        close_fds=True, pass_fds=(watch,),
                                        preexec_fn=lambda: set_limits(*limits))  # noqa: PLW1509
            finally:
                os.close(watch)
            try:
                code = proc.wait(timeout=timeout_s)
                status = "ok" if code == 0 else "killed" if code < 0 else "error"
            except subprocess.TimeoutExpired:
                code, status = None, "timeout"
            finally:
                # everything left in its group (the pid namespace dies with it)
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                os.close(alive)
        seconds = time.perf_counter() - start
        data = (Path(private) / "output").read_bytes()
    return Result(status, code, data[-4000:].decode("utf-8", "replace"), seconds)


def sandbox_level():
    """("namespaces" or "process", why), probed once with a trivial program."""
    global _LEVEL
    if _LEVEL is None:
        if not sys.platform.startswith("linux") or not shutil.which("unshare"):
            _LEVEL = ("process", "no namespaces: not Linux or no unshare command")
        else:
            r = run("print('sandbox-probe-ok')", timeout_s=20, level="namespaces")
            ok = r.status == "ok" and r.output.strip() == "sandbox-probe-ok"
            made = "mount, network and pid namespaces" + ("" if os.geteuid() == 0 else " in a user "
                                                          "namespace")
            last = (r.output.strip().splitlines() or ["no output"])[-1][:200]
            why = f"unshare created {made}" if ok else f"unshare failed ({r.status}: {last})"
            _LEVEL = ("namespaces" if ok else "process", why)
    return _LEVEL


def choose(requested="auto"):
    """(level, why): "auto"/"namespaces" gives namespaces or a RuntimeError naming the choices
    (never uncontained unless asked); "process" where the caller accepted it."""
    if requested == "process":
        return "process", "--sandbox process: the user accepted what it does not contain"
    level, why = sandbox_level()
    if level != "namespaces":
        raise RuntimeError(f"--sandbox {requested}: this machine gives no namespaces to contain "
                           f"model-written code ({why}); at the process level it could "
                           f"{uncontained()}. Allow namespaces (docs/eval.md, the sandbox), accept "
                           "that with --sandbox process, or leave HumanEval out (--tasks)")
    return level, why


def uncontained():
    """What the process level does not contain here."""
    files = "read and write every file this user can"
    if os.geteuid() == 0 and sys.platform.startswith("linux"):
        files = "read any world-readable file and write any world-writable one (it runs as nobody)"
    return (f"{files}, by absolute path, and reach the network through the original socket class "
            "or ctypes")


def describe(level=None, why=None):
    """One line: the level (default: probed) and what it does and does not contain."""
    level, why = (level, why) if level else sandbox_level()
    if level == "namespaces":
        who = "nobody (uid 65534)" if os.geteuid() == 0 else "this user, in a nested user namespace"
        return (f"sandbox: namespaces ({why}); runs as {who}; no network; hidden: "
                f"{', '.join(hidden_paths())}; readable: the system directories")
    return f"sandbox: process only ({why}); NOT contained: it can {uncontained()}"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("program", nargs="?", help="a Python file to run in the sandbox")
    parser.add_argument("--probe", action="store_true", help="print the level this machine gives "
                        "and exit")
    parser.add_argument("--timeout", type=float, default=5.0, help="wall-clock seconds (default: "
                        "%(default)s)")
    parser.add_argument("--memory_mb", type=int, default=512, help="address space limit (default: "
                        "%(default)s)")
    parser.add_argument("--sandbox", default="auto", choices=["auto", "namespaces", "process"],
                        help=
                        "auto or namespaces: the namespaces level, refused where this machine "
                        "gives none; process: the process level, with its gaps "
                        "(default: %(default)s)")
    args = parser.parse_args(argv)
    if not args.probe and not args.program:
        parser.error("give a program to run, or --probe")
    if args.probe:
        print(describe())
        return 0
    try:
        level, why = choose(args.sandbox)
    except RuntimeError as e:
        print(f"sandbox.py: error: {e}", file=sys.stderr)
        return 1
    print(describe(level, why))
    result = run(Path(args.program).read_text(), args.timeout, memory_mb=args.memory_mb,
                 level=level)
    print(f"status: {result.status} (exit code {result.returncode}), {result.seconds:.2f} s; "
          "output:")
    print(result.output)
    return 0


if __name__ == "__main__":
    sys.exit(main())
