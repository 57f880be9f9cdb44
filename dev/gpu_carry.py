"""The offline GPU machine's carry tooling for bench.py's GPU battery (bench_gpu.py), kept out of the product.

    python dev/gpu_carry.py prepare --nanochat_mirror DIR --corpus DIR   # on a machine with both: .bench/ and .whl/
    python dev/gpu_carry.py merge A/gpu_bench.json B/gpu_bench.json      # the device calls' files into one table

prepare: a lent GPU machine has no network, so what the battery's nanochat side needs travels with the working tree in
.bench/ (ignored by git; the device tool's `carry`): nanochat's tree at a pinned commit, the corpus shards, both
tokenizers trained on the corpus's training split, a wandb stub and wheels of nanochat's pure dependencies; and .whl/,
the wheels of this repository's packages the machine's image lacks, which dev/gpu_session.sh installs. Then, on
the GPU machine, one call per row group: `bash dev/gpu_session.sh bench ROWS...` (or `python3 dev/bench.py gpu --rows
ROWS... --out $OUT`). merge: each call brings back its own gpu_bench.json; this writes them as one gpu_bench.json +
gpu_bench.md to --out.
"""
import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import distributed  # the repository root, put on the path above
from bench_gpu import GPU_CALLS, GPU_VOCAB, gpu_markdown, nanochat_data, nanochat_env
from prepare import iter_texts, train_tokenizer

NANOCHAT_COMMIT = "92d63d4e8bb4df75c3b71618f31ddde2378b2bcd"  # the commit the CPU side-by-side measured
NANOCHAT_PIP = ["tiktoken", "rustbpe", "regex", "filelock", "jinja2", "markupsafe", "pyyaml", "requests", "urllib3",
                "idna", "certifi", "charset-normalizer"]
# this repository's packages the GPU machine's image lacks (rustbpe) or has at another version (huggingface_hub
# 1.33.0), with their needs; the image's own filelock, fsspec, packaging, pyyaml and tqdm serve (2026-11-27's run)
DEVICE_WHEELS = ["huggingface_hub==2.4.0", "rustbpe==0.1.0"]
DEVICE_HAS = ("filelock", "fsspec", "packaging", "pyyaml", "tqdm")
WHEEL_PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64"]
WANDB_STUB = '''"""Stand-in for wandb (dev/gpu_carry.py prepare): nanochat's base_train imports it unconditionally and, with
--run dummy, never calls it."""


def init(*args, **kwargs):
    raise RuntimeError("wandb stub: run nanochat with --run dummy")
'''
SITECUSTOMIZE = '''"""dev/gpu_carry.py prepare: packages this machine lacks come from ../pylib (appended: its own
come first)."""
import sys
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parent.parent / "pylib"))
'''


def gpu_prepare(args):
    """Fill --bench_dir (default .bench, ignored by git) with what the battery carries to a GPU machine that has no
    network: nanochat's tree at a pinned commit (from a local mirror, no .git), the corpus shards, both tokenizers
    trained on the corpus's training split, a wandb stub, and wheels of nanochat's pure dependencies for the GPU
    machine's Python (--wheels_python; skipped with --wheels_python none)."""
    bench, corpus = Path(args.bench_dir).resolve(), Path(args.corpus)
    mirror = Path(args.nanochat_mirror)
    if not sorted(corpus.glob("shard_*.parquet")):
        raise FileNotFoundError(f"prepare: no shard_*.parquet in {corpus}: pass --corpus DIR (the last shard is "
                                "the validation split)")
    if not (mirror / "HEAD").is_file() and not (mirror / ".git").exists():
        raise FileNotFoundError(f"prepare: {mirror} is not a git directory: fetch github:karpathy/nanochat and "
                                "pass --nanochat_mirror <its git dir>")
    bench.mkdir(parents=True, exist_ok=True)
    tree = bench / "nanochat"
    shutil.rmtree(tree, ignore_errors=True)
    tree.mkdir()
    archive = subprocess.run(["git", f"--git-dir={mirror / '.git' if (mirror / '.git').exists() else mirror}",
                              "archive", args.nanochat_commit], capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(tree)], input=archive, check=True)
    (tree / "COMMIT").write_text(args.nanochat_commit + "\n")
    shutil.rmtree(bench / "corpus", ignore_errors=True)
    (bench / "corpus").mkdir()
    for shard in sorted(corpus.glob("shard_*.parquet")):
        shutil.copy(shard, bench / "corpus" / shard.name)
    vocab = args.gpu_vocab
    start = time.perf_counter()
    train_tokenizer(iter_texts(bench / "corpus", "train"), vocab).save(bench / "tokenizer_ours")
    print(f"prepare: this repository's tokenizer, vocab {vocab}: {time.perf_counter() - start:.1f} s")
    nc_base = bench / "nc_base_prepare"
    shutil.rmtree(nc_base, ignore_errors=True)
    nanochat_data(nc_base, bench / "corpus")
    start = time.perf_counter()
    result = subprocess.run([sys.executable, "-m", "scripts.tok_train", f"--vocab-size={vocab}",
                             "--max-chars=1000000000"], cwd=tree, env=nanochat_env(bench, nc_base),
                            capture_output=True, text=True, check=False)
    if result.returncode:
        raise RuntimeError(f"prepare: nanochat's tok_train failed:\n{result.stdout[-2000:]}\n"
                           f"{result.stderr[-2000:]}")
    shutil.rmtree(bench / "tokenizer_nanochat", ignore_errors=True)
    shutil.copytree(nc_base / "tokenizer", bench / "tokenizer_nanochat")
    shutil.rmtree(nc_base)
    print(f"prepare: nanochat's tokenizer (scripts.tok_train), vocab {vocab}: {time.perf_counter() - start:.1f} s")
    (bench / "stub").mkdir(exist_ok=True)
    (bench / "stub" / "wandb.py").write_text(WANDB_STUB)
    (bench / "stub" / "sitecustomize.py").write_text(SITECUSTOMIZE)
    if args.wheels_python != "none":
        shutil.rmtree(bench / "pylib", ignore_errors=True)
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--target", str(bench / "pylib"), "--no-deps",
                        "--only-binary=:all:", "--platform", "manylinux2014_x86_64", "--python-version",
                        args.wheels_python, *NANOCHAT_PIP], check=True)
    if args.whl_dir != "none":
        device_wheels(Path(args.whl_dir), args.wheels_python)
    size = sum(f.stat().st_size for f in bench.rglob("*") if f.is_file())
    record = {"nanochat_commit": args.nanochat_commit, "vocab": vocab, "corpus": str(corpus),
              "wheels_python": args.wheels_python, "bytes": size, "code": distributed.code_version(),
              "prepared": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}
    (bench / "PREPARED.json").write_text(json.dumps(record, indent=1) + "\n")
    print(f"prepare: {bench} holds {size / 2**20:.1f} MiB (the device tool carries at most 64 MiB)")
    print("then, on the GPU machine, one call each (carry: [\"" + os.path.relpath(bench) + "\"]):")
    for rows in GPU_CALLS:
        print(f"    python3 dev/bench.py gpu --rows {' '.join(rows)} --out $OUT")


def device_wheels(whl_dir, python):
    """The wheels dev/gpu_session.sh installs on the GPU machine (no network there): DEVICE_WHEELS and their needs
    for its Python, less what its image has, one version of each, into whl_dir (the device tool's carry: .whl)."""
    shutil.rmtree(whl_dir, ignore_errors=True)
    platforms = [flag for platform in WHEEL_PLATFORMS for flag in ("--platform", platform)]
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--only-binary=:all:", "--python-version",
                    python, "--implementation", "cp", *platforms, "-d", str(whl_dir), *DEVICE_WHEELS], check=True)
    for wheel in whl_dir.glob("*.whl"):
        if wheel.name.split("-")[0].lower() in DEVICE_HAS:
            wheel.unlink()
    wheels = sorted(w.name for w in whl_dir.glob("*.whl"))
    size = sum(w.stat().st_size for w in whl_dir.glob("*.whl"))
    print(f"prepare: {len(wheels)} wheels in {whl_dir} ({size / 2**20:.1f} MiB): {', '.join(wheels)}")


def merge_gpu_results(results):
    """One battery result from several calls' gpu_bench.json: their rows in call order; the first call's environment
    heads the table, and every call's environment is kept (a later call may have got another machine)."""
    environments = [r["environment"] for r in results]
    return {"dry_run": any(r["dry_run"] for r in results), "environment": environments[0],
            "environments": environments, "rows": [row for r in results for row in r["rows"]],
            "calls": results[0]["calls"]}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=["prepare", "merge"], help="prepare: fill --bench_dir; merge: the JSON files")
    parser.add_argument("json", nargs="*", help="merge: the calls' gpu_bench.json files, in call order")
    parser.add_argument("--bench_dir", default=str(Path(__file__).resolve().parent.parent / ".bench"), help="the "
                        "carry folder the battery reads (default: %(default)s)")
    parser.add_argument("--corpus", default=str(Path(__file__).resolve().parent.parent.parent / "shared/corpus/"
                        "realtext"), help="prepare: parquet shards, the last one validation (default: %(default)s)")
    parser.add_argument("--nanochat_mirror", default=os.environ.get("NANOCHAT_MIRROR"), help="prepare: git directory "
                        "of a karpathy/nanochat clone or mirror (default: $NANOCHAT_MIRROR)")
    parser.add_argument("--nanochat_commit", default=NANOCHAT_COMMIT, help="prepare: nanochat commit (default: "
                        "%(default)s)")
    parser.add_argument("--gpu_vocab", type=int, default=GPU_VOCAB, help="prepare: vocabulary of both tokenizers "
                        "(default: %(default)s, nanochat's)")
    parser.add_argument("--wheels_python", default="3.12", help="prepare: Python version of the GPU machine, for the "
                        "wheels of nanochat's dependencies it may lack; none = no wheels (default: %(default)s)")
    parser.add_argument("--whl_dir", default=str(Path(__file__).resolve().parent.parent / ".whl"), help="prepare: "
                        "where the wheels of this repository's packages the GPU machine lacks go (DEVICE_WHEELS); "
                        "none = skip (default: %(default)s)")
    parser.add_argument("--out", default=os.environ.get("OUT") or "runs/gpu_bench", help="merge: where gpu_bench.json "
                        "and gpu_bench.md go (default: $OUT when set, else runs/gpu_bench; now: %(default)s)")
    args = parser.parse_args(argv)
    if args.what == "merge":  # no device needed: the calls' files, fetched from the GPU machine
        if not args.json:
            parser.error("merge needs the calls' gpu_bench.json files")
        result = merge_gpu_results([json.loads(Path(path).read_text()) for path in args.json])
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "gpu_bench.json").write_text(json.dumps(result, indent=1) + "\n")
        (Path(args.out) / "gpu_bench.md").write_text(gpu_markdown(result))
        return print(gpu_markdown(result))
    if not args.nanochat_mirror:
        parser.error("prepare needs --nanochat_mirror (the git directory `fetch github:karpathy/nanochat` gives) or "
                     "$NANOCHAT_MIRROR")
    try:
        gpu_prepare(args)
    except FileNotFoundError as e:  # ours, naming the fix: one line, not a traceback
        parser.exit(1, f"gpu_carry.py: error: {e}\n")


if __name__ == "__main__":
    main()
