"""Benchmarks: figures printed with their targets. Not tests: tests/test_bench.py runs every row at its smallest size.

    python dev/bench.py                   # all but gpu
    python dev/bench.py pretrain decode   # a chosen few
    python dev/bench.py --dry_run         # each at its smallest size on the CPU, nothing compiled: that none is broken

The stage rows (STAGE_ROWS) run the real command in a fresh process, on the demo world (vocab-1024 tokenizer; a
--preset checkpoint one step from random weights: the work per item does not depend on them) or on --corpus (vocab
8192; skipped if absent), and read their figures back from its files: tok/s the median of metrics.jsonl's after the
first quarter of the steps, items/s the report's items / seconds.
pretrain   `pretrain.py` on the demo world (30 steps, micro-batch 16): eager fp32, compile fp32, compile + bf16; MFU
           where pretrain.py logs one (a rated GPU). Target: compile + bf16 >= 2x eager fp32.
sft        `sft.py` on the demo conversations (30 steps, micro-batch 16): tok/s, padding included, the shares of
           supervised and padding positions.
core_eval  `core_eval.py` on the demo world's 8 tasks (513 items; --bundle DIR: that bundle), batch_items 1 and 8.
chat_eval  `chat_eval.py --tasks demo-choice` (132 items), the letters alone at --batch_items 1 and 8, and with the
           option-text diagnostic at 8: items/s and their ratios.
generate   `chat_eval.py --tasks demo-answer` (--generate_items, --generate_tokens each) at --batch_items 1, 8 and 32
           (decode.py's batched generation): items/s, every item's record compared. Target: 8 >= 4x 1.
cpu        `pretrain.py` at nanochat's tiny CPU shape (4 layers, width 256, T 256, 8 x 256 tokens a step, vocab 8192),
           40 steps: Muon and AdamW, eager and compiled, in distributed.precision's dtype, and compiled Muon in the other:
           tok/s, the share of the step waiting for data; then the Muon step's share of the compiled Muon step.
           Targets (2 cores): compiled Muon >= 2x nanochat's tok/s (dev/LOG.md); the Muon step <= 15% of the step.
decode     (in this process, chat.py's dtype) greedy tok/s after a prompt filling the preset's sequence but
           --decode_tokens, --trials interleaved, tokens compared: recomputing the context every token, the model on a
           KV cache (kv_cache), chat.py's step (decode.py's decode_step) eager and compiled. Targets: kv_cache >= 5x
           recompute; chat.py's default path >= 1.5x kv_cache. chat.py's second turn after 2,000 tokens: the first
           token with the cache kept vs re-prefilling the history (>= 5x). RL's rollouts, 16 demo questions x 16
           replies (temperature 1, top_k 50, rl.py's threads): all questions in one batch vs one per batch (>= 3x).
tokenizer  seconds to train a vocab-8192 tokenizer on the corpus's training split, reading included; bytes/token on its
           validation split. Target: <= 10 s for 50 MB (projected from the measured MB/s).
loader     the streaming loader (read + tokenize + pack), one epoch of the corpus at T = 256, 1024, 2048: tok/s (target
           >= 1M), the share of document tokens cropped into a later row (target <= 20% at T = 2048; none discarded).
gpu        (not in "all") the GPU battery: bench_gpu.py says how to run it.
"""
import argparse
import functools
import json
import operator
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # the repository's modules
import bench_gpu
import distributed
import optim
from bench_gpu import sync
from demo import write_demo
from loader import text_loader
from model import KVCache, autocast_context, build_model, config_from_preset
from prepare import counting, iter_texts, text_stats, train_tokenizer
from tokenizer import Tokenizer

# The stage rows: (benchmark, row, command, figure); each {name} filled in by bench_stages, the figure stage_figure's
DEMO_PRETRAIN = ("pretrain.py --preset {preset} --data_dir {work}/demo/pretrain --tokenizer {work}/tokenizer_1024 "
                 "--runs_dir {work}/runs --run_name {run} --steps 30 --micro_batch 16 --eval_every 0 --bpb_tokens 4096 "
                 "--ckpt_every 1000")
CPU_SHAPE = ("pretrain.py --preset tiny --data_dir {corpus} --tokenizer {corpus_tokenizer} --runs_dir {work}/runs "
             "--run_name {run} --micro_batch 8 --eval_every 0 --ckpt_every 1000 --steps 40 --bpb_tokens 4096")
SFT = ("sft.py --checkpoint {work}/runs/bench --runs_dir {work}/runs --run_name {run} --chat_dir "
       "{work}/demo/conversations --steps 30 --eval_every 0 --eval_rows 16")
CORE_EVAL = ("core_eval.py --checkpoint {work}/runs/bench --bundle {bundle} --bpb_tokens 0 --max_new_tokens 1 "
             "--out {out}")
# the evaluation rows' checkpoint and sft's parent: one step from random weights (the work per item does not depend
# on the weights), micro-batch 16, which sft inherits
PARENT = DEMO_PRETRAIN.replace("{run} --steps 30", "bench --steps 1")
CHAT_EVAL = "chat_eval.py --checkpoint {work}/runs/bench --out {out}.json"
CHOICE = CHAT_EVAL + " --tasks demo-choice"
GENERATE = (CHAT_EVAL + " --tasks demo-answer --max_items {generate_items} --max_new_tokens {generate_tokens} "
            "--dtype float32")
STAGE_ROWS = [
    *[("pretrain", label, f"{DEMO_PRETRAIN} --dtype {dtype} --compile {on}", "tok/s") for label, dtype, on in
      (("eager fp32", "float32", "false"), ("compile fp32", "float32", "true"),
       ("compile + bf16", "bfloat16", "true"))],
    ("sft", "demo conversations", SFT, "tok/s"),
    *[("core_eval", f"batch_items {b}", f"{CORE_EVAL} --batch_items {b}", "items/s") for b in (1, 8)],
    *[("chat_eval", f"{label}, batch_items {b}", f"{CHOICE} --option_text {on} --batch_items {b}", "items/s")
      for label, on, b in (("letters", "off", 1), ("letters", "off", 8), ("option text", "on", 8))],
    *[("generate", f"batch_items {b}", f"{GENERATE} --batch_items {b}", "items/s") for b in (1, 8, 32)],
    # every optimizer and compile setting in the chosen precision, the other at the defaults only: where bf16 is
    # emulated (20-100x slower on an AVX2-only CPU) four runs in it would dominate the row
    *[("cpu", f"{opt} {{dtype}} {mode}", f"{CPU_SHAPE} --optimizer {opt} --dtype {{dtype}} --compile {on}", "tok/s")
      for opt in ("muon", "adamw") for mode, on in (("eager", "false"), ("compiled", "true"))],
    ("cpu", "muon {other_dtype} compiled", f"{CPU_SHAPE} --optimizer muon --dtype {{other_dtype}} --compile true",
     "tok/s"),
]
# the ratios printed after a benchmark's rows: (benchmark, row, / row, target or None)
STAGE_RATIOS = [("pretrain", "compile + bf16", "eager fp32", 2), ("chat_eval", "letters, batch_items 8",
                 "letters, batch_items 1", None), ("chat_eval", "letters, batch_items 8", "option text, batch_items 8",
                 None), ("generate", "batch_items 8", "batch_items 1", 4), ("generate", "batch_items 32",
                 "batch_items 1", None)]
# --dry_run: appended to a row's command (the last of a flag given twice is in force)
DRY_FLAGS = {"pretrain.py": "--steps 3 --micro_batch 2 --bpb_tokens 4096 --compile false --n_layer 1 --n_embd 64 "
             "--n_head 1 --n_kv_head 1", "sft.py": "--steps 3 --micro_batch 2 --eval_rows 4",
             "core_eval.py": "--max_items 2", "chat_eval.py": "--max_items 2 --max_new_tokens 4"}


def versus(value, target, unit="x", digits=2, most=False, sep=""):
    """'1.497x (target >= 1.5x: MISSED)': the figure with digits enough that, as printed, it is on the side of the
    target its verdict says (1.497 is not "1.50x ... MISSED")."""
    meets = operator.le if most else operator.ge
    while digits < 9 and meets(float(f"{value:.{digits}f}"), target) != meets(value, target):
        digits += 1
    return (f"{value:{sep}.{digits}f}{unit} (target {'<=' if most else '>='} {target:{sep}}{unit}: "
            f"{'met' if meets(value, target) else 'MISSED'})")


def demo_files(args):
    """--work's demo world and its vocab-1024 tokenizer, made on first use."""
    work = Path(args.work)
    if not (work / "tokenizer_1024").is_dir():  # corpus_tokenizer's too in the dry run: the demo world is its corpus
        write_demo(work / "demo")
        train_tokenizer(iter_texts(work / "demo" / "pretrain", "train"), 1024).save(work / "tokenizer_1024")
    return work


def corpus_tokenizer(args):
    """A tokenizer of --corpus_vocab trained on --corpus's training split, in --work, made on first use."""
    path = Path(args.work) / f"tokenizer_{args.corpus_vocab}"
    if not path.is_dir():
        train_tokenizer(iter_texts(args.corpus, "train"), args.corpus_vocab).save(path)
    return path


def stage_figure(figure, run, out):
    """A stage row's figure, read from the files its command wrote, and a note of what else they say."""
    if figure == "items/s":
        report = json.loads((out / "results.json" if out.is_dir() else out.with_name(out.name + ".json")).read_text())
        items = sum(task["items"] for task in report["tasks"])
        return items / report["seconds"], (f"{items} items in {len(report['tasks'])} tasks, {report['seconds']:.1f} s,"
                                           f" {report['dtype']}, {report['device']}")
    steps = [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "loss" in r]
    timed = steps[len(steps) // 4:]  # the first quarter: compilation and warm-up
    note = (f"median of steps {timed[0]['step']}-{timed[-1]['step']}, waiting for data "
            f"{100 * statistics.mean(r['data_wait'] for r in timed):.1f}% of the step")
    mfu = [r["mfu"] for r in timed if isinstance(r.get("mfu"), float)]
    note += f", MFU {100 * statistics.median(mfu):.1f}% (pretrain.py's)" if mfu else ""
    rows = json.loads((run / "done.json").read_text()).get("rows")  # sft's
    note += f"; {rows['supervised']:.1%} of positions supervised, {rows['padding']:.1%} padding" if rows else ""
    return statistics.median(r["tok_per_s"] for r in timed), note


def run_command(args, command, places, jobs=1):
    """A stage command of the table in a fresh process: its {names} filled from places, --dry_run's flags appended,
    OMP_NUM_THREADS the cores / jobs when jobs run at once."""
    words = command.split() + (DRY_FLAGS.get(command.split()[0], "").split() if args.dry_run else [])
    argv = [word.format(**places) for word in words]
    env = {**os.environ, "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // jobs))} if jobs > 1 else None
    result = subprocess.run([sys.executable, str(ROOT / argv[0]), *argv[1:]], capture_output=True,
                            text=True, env=env, check=False)
    if result.returncode:
        raise RuntimeError(f"`{' '.join(argv)}` failed (exit {result.returncode}):\n{result.stderr[-3000:]}")


def stage_plan(args, device, name):
    """(rows, places, dtype, why) of stage benchmark `name`, its files made; None when its corpus is absent."""
    rows = [row for row in STAGE_ROWS if row[0] == name]
    corpus = any("{corpus" in row[2] for row in rows)
    if corpus and not Path(args.corpus).is_dir():
        return None
    dtype, why = distributed.precision(device)
    places = {"work": Path(args.work) if corpus else demo_files(args), "preset": args.preset, "bundle": args.bundle or
              f"{args.work}/demo/eval_bundle", "generate_items": args.generate_items, "generate_tokens":
              args.generate_tokens, "corpus": args.corpus, "corpus_tokenizer": corpus_tokenizer(args) if corpus else "",
              "dtype": dtype, "other_dtype": "bfloat16" if dtype == "float32" else "float32"}
    return rows, places, dtype, why


def start_stage_rows(args, device, names, pool, jobs):
    """{name: [future of (label, figure, note)]}: every stage row of `names` submitted to `pool` at once (the dry run's
    two at a time: no core waits for a benchmark's last row), those reading runs/bench after it is made."""
    started, parent = {}, None
    for name in names:
        if (plan := stage_plan(args, device, name)) is None:
            continue
        rows, places, _, _ = plan
        needs = any("runs/bench" in row[2] for row in rows) and not (Path(args.work) / "runs" / "bench").is_dir()
        if needs and parent is None:
            parent = pool.submit(run_command, args, PARENT, places)

        def job(row, places=places, name=name, wait=parent if needs else None):
            if wait is not None:
                wait.result()  # the checkpoint's command failed: so does this row
            label = row[1].format(**places)
            slug = re.sub(r"\W+", "_", f"{name} {label}")
            run_command(args, row[2], {**places, "run": slug, "out": f"{args.work}/out/{slug}"}, jobs)
            return label, *stage_figure(row[3], Path(args.work) / "runs" / slug, Path(args.work) / "out" / slug)
        started[name] = [pool.submit(job, row) for row in rows]
    return started


def bench_stages(args, device, name, started):
    """Each stage row's figure of benchmark `name` (from `started`, start_stage_rows's futures), then its ratios."""
    plan = stage_plan(args, device, name)
    if plan is None:
        return print(f"{name}: skipped, no corpus at {args.corpus} (--corpus DIR: parquet shards, the last validation)")
    rows, _, dtype, why = plan
    figures = {}
    for row, (label, value, note) in zip(rows, [future.result() for future in started[name]], strict=True):
        figures[label] = value
        print(f"{name} {label}: {value:,.{0 if row[3] == 'tok/s' else 2}f} {row[3]} ({note})")
    for bench, top, bottom, target in STAGE_RATIOS:
        if bench == name:
            ratio = figures[top] / figures[bottom]
            print(f"{name}: {top} / {bottom} = " + (versus(ratio, target) if target else f"{ratio:.2f}x"))
    if name == "generate":
        records = {(Path(args.work) / "out" / f"generate_batch_items_{b}_items.jsonl").read_text() for b in (1, 8, 32)}
        print(f"generate: every item's record identical at batch_items 1, 8 and 32: {len(records) == 1}")
    if name == "cpu":
        print(f"cpu precision: {dtype} ({why})")
        muon_share(device, 2048 / figures[f"muon {dtype} compiled"], args.corpus_vocab, args.dry_run)


def muon_share(device, step_seconds, vocab, dry_run):
    """Median seconds of the Muon step for the cpu shape (and of forward+backward in the default compute dtype, and
    the AdamW step beside it), and its share of step_seconds, pretrain.py's median step in the same configuration."""
    config = config_from_preset("tiny", {"vocab_size": vocab})
    model = build_model(config, device)
    train_model, dtype = model if dry_run else torch.compile(model, dynamic=False), distributed.matmul_dtype(device)
    steps, untimed = (1, 0) if dry_run else (10, 3)  # the dry run times its one step: no figure of it is a measurement
    adam, muon = optim.build_optimizers(model, bench_gpu.MUON_RUN, config.n_embd, 2048, device)
    idx = torch.randint(0, vocab, (8, 256), device=device)

    def forward_backward():
        with autocast_context(device.type, dtype):
            loss = train_model(idx, idx)
        loss.backward()
    works = {"forward+backward": forward_backward, "AdamW step": adam.step, "Muon step": muon.step}
    times = {label: [] for label in works}
    for _ in range(steps + untimed):
        for label, work in works.items():
            start = time.perf_counter()
            work()
            sync(device)
            times[label].append(time.perf_counter() - start)
        model.zero_grad(set_to_none=True)
    median = {label: statistics.median(t[untimed:]) for label, t in times.items()}
    alone = ", ".join(f"{label} {1000 * t:.1f} ms" for label, t in median.items())
    print(f"cpu Muon step (Newton-Schulz in {muon.param_groups[0]['ns_dtype']}): {1000 * median['Muon step']:.1f} ms, "
          f"{versus(100 * median['Muon step'] / step_seconds, 15, '%', 1, most=True)} of pretrain.py's compiled "
          f"{dtype} Muon step ({1000 * step_seconds:.0f} ms); alone: {alone}")


def chat_decode_paths(device):
    """(dtype, decode path, the paths to time) as chat.py chooses them here by default: dtype matmul_dtype on CUDA
    (bf16 where native) else fp32, decode "auto" = compiled on CUDA else eager."""
    dtype = distributed.matmul_dtype(device) if device.type == "cuda" else "float32"
    return dtype, "compiled" if device.type == "cuda" else "eager", ("eager", "compiled")


def bench_decode(args, device):
    """The module docstring's decode, printed; returns its figures (bench_gpu's chat_decode row records them)."""
    import chat  # here: the other benchmarks do not need them
    import rl
    torch.manual_seed(0)
    config = config_from_preset(args.preset)
    model = build_model(config, device).eval()
    dtype, chat_default, decodes = chat_decode_paths(device)
    decodes = [d for d in decodes if d != "compiled" or not args.dry_run]  # the dry run compiles nothing
    tok, n, trials = Tokenizer.load(demo_files(args) / "tokenizer_1024"), args.decode_tokens, args.trials
    prompt = torch.randint(0, config.vocab_size, (config.sequence_len - n - 1,)).tolist()

    def greedy(prefill, step):
        """(tok/s of the n forwards after the prefill, the n + 1 greedy tokens)."""
        with torch.inference_mode(), autocast_context(device.type, dtype):
            logits, out = prefill(), []
            start = time.perf_counter()
            for _ in range(n + 1):
                token = logits.argmax(-1)  # (1,)
                out.append(token.item())  # waits for the device
                if len(out) <= n:
                    logits = step(token)
        return n / (time.perf_counter() - start), out

    def recompute():
        seq = torch.tensor([prompt], device=device)

        def step(token):
            nonlocal seq
            seq = torch.cat([seq, token.view(1, 1)], 1)
            return model(seq, last_only=True)[:, -1]
        return greedy(lambda: model(seq, last_only=True)[:, -1], step)

    def kv_cache():
        cache = KVCache(config, 1, config.sequence_len)
        step = lambda token: model(token.view(1, 1), kv_cache=cache)[:, -1]
        return greedy(lambda: model(torch.tensor([prompt], device=device), kv_cache=cache)[:, -1], step)

    def with_chat(conv):  # chat.py's Conversation, emptied
        conv.ids, conv.cache.pos = [], 0
        return greedy(lambda: conv.forward(prompt), conv.step)
    paths = {"recompute": recompute, "kv_cache": kv_cache}
    for decode in decodes:
        start = time.perf_counter()
        paths[decode] = functools.partial(with_chat, chat.Conversation(model, tok, True, decode, dtype))
        paths[decode]()  # warm up; compiles the compiled one
        if decode == "compiled":
            print(f"decode compiled: first call (compilation) {time.perf_counter() - start:.1f} s")
    interleaved = [{name: run() for name, run in paths.items()} for _ in range(trials)]  # drifts hit every path
    results = {name: [trial[name] for trial in interleaved] for name in paths}
    rates = {name: statistics.median(r[0] for r in runs) for name, runs in results.items()}
    for name, runs in results.items():
        print(f"decode {args.preset} {dtype} {name:9s}: {rates[name]:7,.0f} tok/s median of {trials} "
              f"({rates[name] / rates['kv_cache']:.2f}x the KV cache; context {len(prompt)} -> {len(prompt) + n}; "
              f"greedy tokens identical: {all(r[1] == results['kv_cache'][0][1] for r in runs)})")
    for top, bottom, target in (("kv_cache", "recompute", 5), (chat_default, "kv_cache", 1.5)):
        if top in rates:
            print(f"decode: {top} / {bottom} = {versus(rates[top] / rates[bottom], target)}")
    figures = {"dtype": dtype, **{f"decode_tok_per_s_{name}": rate for name, rate in rates.items()}}

    long_model = build_model(config_from_preset(args.preset, {"sequence_len": 2304}), device).eval()
    history = torch.randint(0, 1000, (200 if args.dry_run else 2000,)).tolist()
    turn = torch.randint(0, 1000, (20,)).tolist()

    def first_token(kept):
        """Seconds from a 20-token turn to its first token, the cache kept or (as nanochat's CLI) all re-prefilled."""
        conv = chat.Conversation(long_model, tok, True, "eager", dtype)
        if kept:
            conv.forward(history)
        sync(device)
        start = time.perf_counter()
        conv.forward(turn if kept else history + turn).argmax(-1).item()
        return time.perf_counter() - start
    times = [(first_token(True), first_token(False)) for _ in range(trials + 1)][1:]  # the first: warm-up
    kept, again = map(statistics.median, zip(*times, strict=True))
    print(f"decode chat second turn (20 tokens after {len(history):,}): first token {1000 * kept:.1f} ms with the "
          f"cache kept, {1000 * again:.1f} ms re-prefilling the history: {versus(again / kept, 5, digits=1)}")
    figures.update(first_token_s_kept=kept, first_token_s_reprefill=again)

    rl_model = build_model(config_from_preset(args.preset, {"vocab_size": tok.vocab_size}), device).eval()
    items = rl.gsm8k_items(Path(args.work) / "demo" / "problems")[::187][:16]
    prompts = [rl.prompt_ids(tok, item["prompt"], rl_model.config.sequence_len, 1)[0] for item in items]
    threads = torch.get_num_threads()
    torch.set_num_threads(rl.CPU_ROLLOUT_THREADS if device.type == "cpu" else threads)
    budget = (16, args.generate_tokens, 1.0, 50, 0, dtype)  # replies per question, tokens, temperature, top_k, seed
    rollouts = {"per_question": lambda: [s for p in prompts for s in rl.sample_groups(rl_model, tok, [p], *budget)[1]],
                "all_questions": lambda: rl.sample_groups(rl_model, tok, prompts, *budget)[1]}
    for name, sample in rollouts.items():
        start = time.perf_counter()
        sampled = sample()
        seconds, tokens = time.perf_counter() - start, sum(map(sum, sampled))
        figures[f"rollout_tok_per_s_{name}"] = tokens / seconds
        print(f"decode rl {name:13s}: {tokens / seconds:7,.0f} sampled tok/s ({tokens:,} tokens, {len(sampled)} "
              f"replies of {len(prompts)} questions in {seconds:.1f} s, {torch.get_num_threads()} thread(s))")
    torch.set_num_threads(threads)
    ratio = figures["rollout_tok_per_s_all_questions"] / figures["rollout_tok_per_s_per_question"]
    print(f"decode rl: all questions per batch / one question per batch = {versus(ratio, 3)}")
    return figures


def bench_tokenizer(args, device):
    corpus = Path(args.corpus)
    if not corpus.is_dir():
        return print(f"tokenizer: skipped, no corpus at {corpus}")
    stats = {"docs": 0, "chars": 0, "bytes": 0}
    start = time.perf_counter()  # streaming the shards is part of training, as in `python prepare.py tokenizer`
    tokenizer = train_tokenizer(counting(iter_texts(corpus, "train"), stats), args.corpus_vocab)
    seconds, mb = time.perf_counter() - start, stats["bytes"] / 1e6
    print(f"tokenizer: trained vocab {tokenizer.vocab_size} on {stats['docs']:,} documents, {stats['chars']:,} "
          f"characters, {mb:.1f} MB in {seconds:.2f} s: {mb / seconds:.1f} MB/s; projected for 50 MB: "
          f"{versus(50 * seconds / mb, 10, ' s', 1, most=True)}")
    _, n_bytes, n_tokens = text_stats(tokenizer, iter_texts(corpus, "val"))
    per_token = n_bytes / n_tokens
    print(f"tokenizer: bytes/token on the validation split: {per_token:.3f}")


def bench_loader(args, device):
    if not Path(args.corpus).is_dir():
        return print(f"loader: skipped, no corpus at {args.corpus}")
    tokenizer = Tokenizer.load(corpus_tokenizer(args))
    for seq_len in (2048,) if args.dry_run else (256, 1024, 2048):
        loader = text_loader(args.corpus, "train", tokenizer, 16, seq_len, device=device)
        next(loader)  # the first batch waits for the first row group: count from the steady state
        tokens, start = 0, time.perf_counter()
        while loader.state["epoch"] == 0:
            inputs, _ = next(loader)
            tokens += inputs.numel()
        rate = tokens / (time.perf_counter() - start)
        stats = loader.state["stats"]
        loader.close()
        cropped = stats["cropped"] / stats["doc_tokens"]
        crop = versus(100 * cropped, 20, "%", 1, most=True) if seq_len == 2048 else f"{100 * cropped:.1f}%"
        print(f"loader T={seq_len:4d}: {versus(rate, 1_000_000, ' tok/s', 0, sep=',')}, cropped {crop} of document "
              f"tokens, none discarded; one epoch of {stats['docs']:,} documents, batch 16")


STAGES = list(dict.fromkeys(row[0] for row in STAGE_ROWS))
# gpu last: not part of "all"
BENCHES = {"decode": bench_decode, "tokenizer": bench_tokenizer, "loader": bench_loader,
           "gpu": lambda args, device: bench_gpu.bench_gpu(args, device, demo_files, bench_decode)}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    everything = [*STAGES, *BENCHES]
    parser.add_argument("which", nargs="*", default=everything[:-1], help=f"any of {', '.join(everything)} (default: "
                        "all but gpu)")
    parser.add_argument("--preset", default="tiny", help="model of the demo-world rows and decode (default: tiny)")
    parser.add_argument("--dry_run", action="store_true", help="every row at its smallest size on the CPU, nothing "
                        "compiled, the demo world as --corpus; gpu: the battery's rows at toy size (depth 2, sequence "
                        "64), nanochat's where --bench_dir holds its tree")
    parser.add_argument("--work", help="where the rows' files go, kept (default: a temporary folder, removed)")
    parser.add_argument("--decode_tokens", type=int, default=64, help="decode: tokens generated (default: 64)")
    parser.add_argument("--trials", type=int, default=5, help="decode: interleaved trials, their median reported "
                        "(default: 5)")
    parser.add_argument("--corpus", default=str(ROOT.parent / "shared/corpus/realtext"),
                        help="text corpus of tokenizer, loader and cpu (default: %(default)s)")
    parser.add_argument("--bundle", help="core_eval: eval bundle directory (default: the demo world's)")
    parser.add_argument("--generate_items", type=int, default=64, help="generate: demo-answer items (default: 64)")
    parser.add_argument("--generate_tokens", type=int, default=64, help="generate: max_new_tokens per reply, and "
                        "decode's per rollout (default: 64)")
    bench_gpu.add_gpu_args(parser)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        help="device (default: %(default)s)")
    args = parser.parse_args(argv)
    device = torch.device("cpu" if args.dry_run else args.device)
    if device.type == "cpu":
        distributed.keep_freed_memory()  # as every stage does on CPU
    print(f"device: {distributed.device_name(device)}; bf16 native: {distributed.native_bf16(device)}; torch "
          f"{torch.__version__}, {torch.get_num_threads()} CPU threads, {os.cpu_count()} cores")
    if args.which == ["gpu_probe"]:  # the battery's micro-batch probe, in a process of its own
        return bench_gpu.gpu_probe(args, device)
    if set(args.which) - set(everything):
        parser.error(f"unknown benchmarks {sorted(set(args.which) - set(everything))}: choose from {everything}")
    with tempfile.TemporaryDirectory() as tmp:
        args.work = args.work or tmp
        # the demo world supports at most ~1,690 BPE tokens
        args.corpus, args.corpus_vocab = (demo_files(args) / "demo" / "pretrain", 1024) if args.dry_run else (
            args.corpus, 8192)
        # the dry run: every stage row started at once, two at a time; timed rows run one at a time, each in its turn
        pool = ThreadPoolExecutor(2 if args.dry_run else 1)
        try:
            started = start_stage_rows(args, device, [n for n in args.which if n in STAGES], pool, 2) if args.dry_run \
                else None
            for name in args.which:
                if name in STAGES and not args.dry_run:  # timed: this benchmark's rows now, alone on the cores
                    started = start_stage_rows(args, device, [name], pool, 1)
                bench_stages(args, device, name, started) if name in STAGES else BENCHES[name](args, device)
        except (FileNotFoundError, ValueError) as e:  # ours, each naming its fix: one line, not a traceback
            parser.exit(1, f"bench.py: error: {e}\n")
        finally:  # a failed row: the rows not started yet never start
            pool.shutdown(cancel_futures=True)


if __name__ == "__main__":
    # a SIGTERM (a device call's limit) unwinds like Ctrl-C: run_logged's finally ends the phase's processes with it
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    # started in the background (nohup ... &), a process inherits SIGINT ignored: timeout --signal=INT must still stop it
    signal.signal(signal.SIGINT, signal.default_int_handler)
    main()
