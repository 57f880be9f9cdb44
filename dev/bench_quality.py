"""The quality benchmark (moved out of bench.py: the issue-16 ablation behind dev/LOG.md's model quality section).

    python dev/bench_quality.py                                       # every variant, 3 seeds, 2 runs at a time
    python dev/bench_quality.py --variants defaults without_issue16 --seeds 1

`python pretrain.py` at nanochat's tiny CPU shape (bench.py cpu's: 4 layers, width 256, T 256, vocab 8192 trained on
--corpus; compiled, bf16 where native) for 300 steps of 2,048 tokens (614,400 tokens) on the real-text corpus: the
final validation bpb over the validation shard's first 524,288 tokens, per row of QUALITY_VARIANTS (the defaults, and
the defaults with one issue-16 change undone) and per seed, --quality_jobs runs at a time (each on cores / jobs
threads); the median per row. Each run is bench.py's run_command; each bpb its done.json's.
"""
import argparse
import json
import statistics
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
import bench
from model import config_from_preset, flops_per_token, num_params

# At 2^11 tokens a step, AdamW lrs 8x smaller are the square-root rule's (2^-8)^(1/2) against (2^-8)^(1/8).
SQRT_RULE_LRS = "--embedding_lr 0.025 --head_lr 0.0005 --scalar_lr 0.005"
# pretrain.py's defaults, and each issue-16 change that has a flag undone; Polar Express + NorMuon have none (they
# replaced the old Muon), so "without_issue16" is the old defaults with the new Muon
QUALITY_VARIANTS = {"defaults": "", "no_value_embeds": "--value_embeds false", "no_resid_lambdas": "--resid_lambdas "
                    "false", "no_momentum_warmup": "--muon_momentum_warmup 0", "sqrt_rule_lrs": SQRT_RULE_LRS,
                    "without_issue16": "--value_embeds false --resid_lambdas false --muon_momentum_warmup 0 "
                    + SQRT_RULE_LRS}
QUALITY = bench.CPU_SHAPE.replace("--steps 40 --bpb_tokens 4096", "--steps 300 --total_batch_tokens 2048 "
                                  "--bpb_tokens 524288 --compile true --seed {seed}")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--corpus", default=str(ROOT.parent / "shared/corpus/realtext"), help="parquet shards, the "
                        "last one validation (default: %(default)s)")
    parser.add_argument("--variants", nargs="+", default=list(QUALITY_VARIANTS), choices=QUALITY_VARIANTS,
                        help="which rows (default: all)")
    parser.add_argument("--seeds", type=int, default=3, help="seeds per row (default: %(default)s)")
    parser.add_argument("--quality_jobs", type=int, default=2, help="runs at a time (default: %(default)s)")
    args = parser.parse_args(argv)
    if not Path(args.corpus).is_dir():
        parser.exit(1, f"bench_quality.py: error: no corpus at {args.corpus}: pass --corpus DIR\n")
    with tempfile.TemporaryDirectory() as tmp:
        run_args = argparse.Namespace(work=tmp, corpus=args.corpus, corpus_vocab=8192, dry_run=False)
        places = {"work": tmp, "corpus": args.corpus, "corpus_tokenizer": bench.corpus_tokenizer(run_args)}
        jobs = [(name, seed) for name in args.variants for seed in range(args.seeds)]

        def run(job):
            name, seed = job
            command = QUALITY + " " + QUALITY_VARIANTS[name]
            bench.run_command(run_args, command, {**places, "run": f"{name}_s{seed}", "seed": seed}, args.quality_jobs)
            return json.loads((Path(tmp) / "runs" / f"{name}_s{seed}" / "done.json").read_text())["val_bpb"]
        with ThreadPoolExecutor(args.quality_jobs) as pool:
            bpbs = list(pool.map(run, jobs))
    for name in args.variants:
        mine = [bpb for (n, _), bpb in zip(jobs, bpbs, strict=True) if n == name]
        print(f"quality {name:14s}: val bpb median {statistics.median(mine):.4f} over seeds {list(range(args.seeds))}"
              f" ({', '.join(f'{b:.4f}' for b in mine)}); flags: {QUALITY_VARIANTS[name] or '(none)'}")
    config = config_from_preset("tiny", {"vocab_size": 8192})
    print(f"quality: FLOPs/token {flops_per_token(config):.4e}, parameters {num_params(config):,} (defaults)")


if __name__ == "__main__":
    main()
