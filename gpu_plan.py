"""gpu_plan.py: the gpu plan's numbers in one place, and its rehearsal's. speedrun.sh runs the gpu plan's stages with
these flags (launch.py setup hands them to it as its arrays), its disk plan (check_disk, which launch.py shards runs
on pretrain.py --data_plan's data_plan.json) counts their checkpoints, plan_cost.py predicts their time and launch.py
prints the plan from them: a number changed here changes all four.
The standard library only: launch.py imports it before .venv exists. Not a stage: import it.

    python gpu_plan.py --depth 20        # the plan in words and each stage's flags, as speedrun.sh runs them
"""
import argparse
import json
import math
import shutil
from pathlib import Path

TOKENS_PER_STEP = 524_288  # a step's tokens over all GPUs (nanochat's); the chat stages inherit pretraining's
SEQUENCE_LEN = 2048  # the d-presets' (model.py): what midtraining's and SFT's --eval_rows are rows of
GSM8K_TRAIN = 7_473  # GSM8K's training questions, one epoch of rl.py's (rl.py counts them from the data itself)
# the conversation datasets the gpu plan's midtraining and SFT read (dataset.py download-chat names): checked and
# fetched at the start, with the CORE bundle and the ChatCORE tasks, so a gated or missing one fails in minutes
CHAT_SOURCES = ["smoltalk", "ultrachat", "mmlu", "arc-easy", "arc-challenge", "gsm8k", "identity"]

# each stage's flags on the gpu plan's command lines, ahead of its *_ARGS (the last of a repeated flag wins); those
# equal to a default too, so that a changed default cannot leave the prediction and disk plan on another plan
FLAGS = {
    "pretrain": {"tokens_per_param": 20, "total_batch_tokens": TOKENS_PER_STEP, "eval_every": 250,
                 "bpb_tokens": 2 ** 20, "ckpt_every": 1000},
    "midtrain": {"tokens": 500_000_000, "eval_every": 250, "eval_rows": 256, "ckpt_every": 1000},
    # sft.py's mixture: SmolTalk, MMLU x3, GSM8K x4, ARC, identity; its epoch's steps are counted from the data
    "sft": {"epochs": 1, "eval_every": 100, "eval_rows": 256, "ckpt_every": 1000},
    # GSM8K train, held out: GSM8K test (nanochat's chat_rl)
    "rl": {"demo": "none", "epochs": 1, "questions_per_step": 16, "samples": 16, "max_new_tokens": 256,
           "eval_every": 60, "eval_items": 400, "eval_samples": 8, "ckpt_every": 60},
    "core_eval": {"max_items": -1, "bpb_tokens": 2 ** 20},
    "chat_eval": {"demo": "none", "max_items": -1, "max_new_tokens": 512},
}
RL_STEPS = math.ceil(FLAGS["rl"]["epochs"] * GSM8K_TRAIN / FLAGS["rl"]["questions_per_step"])


def command_lines(depth):
    """speedrun.sh's arrays for the gpu plan at model depth `depth`: {"PRETRAIN": [words], ..., "CORE", "CHAT_EVAL"}."""
    arrays = {{"core_eval": "CORE"}.get(stage, stage.upper()): [w for flag, value in flags.items()
                                                                 for w in (f"--{flag}", value)]
              for stage, flags in FLAGS.items()}
    arrays["PRETRAIN"] = ["--preset", f"d{depth}", *arrays["PRETRAIN"]]
    return arrays


def plan_lines(depth, gpus, rehearsal=False, on_cpu=False):
    """The plan in words, from FLAGS, as launch.py prints it before any stage (a rehearsal: on `gpus` GPUs, or CPU
    processes, with its own budget)."""
    if rehearsal:
        where = "CPU processes" if on_cpu else "GPUs"
        return [f"plan: d{depth} on {gpus} {where}, the rehearsal's budget appended to each stage"]
    pre, rl = FLAGS["pretrain"], FLAGS["rl"]
    shape = [RL_STEPS, rl["questions_per_step"], rl["samples"], rl["max_new_tokens"]]
    model = (f"plan: d{depth} ('python model.py --preset d{depth}' for its parameters), {pre['tokens_per_param']} "
             f"tokens per parameter at {pre['total_batch_tokens']:,} tokens a step on {gpus} GPUs; pretrain.py prints "
             f"the parameters, tokens and steps before step 1, and each step line the expected time left (ETA), "
             f"measured after this process's first step")
    rl_line = (f"plan: rl: {rl['epochs']:g} epoch(s) of GSM8K's {GSM8K_TRAIN:,} training questions, {shape[1]} a "
               f"step, {shape[2]} replies each (up to {shape[3]} tokens): {RL_STEPS} steps, at most "
               f"{math.prod(shape) / 1e6:.1f}M tokens sampled ({' x '.join(map(str, shape))}). The rehearsal's "
               f"prediction (plan_cost.py, above) gives every stage's expected time; report.md sets each beside its "
               f"actual wall time")
    return [model, rl_line]


# --- the rehearsal: every stage of the plan on a tiny budget, before the hours of pretraining ----------------------

REHEARSAL_STEPS = (3, 3, 3)  # pretrain, midtrain, sft: each saves one checkpoint, at its last step
REHEARSAL_PROMPT = "Why do plants need light?"


def rehearsal_budgets(nproc, on_cpu):
    """A rehearsal's flags per stage, appended last (the last of a repeated flag wins): a bug in any stage shows in
    minutes instead of after hours of pretraining."""
    questions = max(nproc, 2)  # rl.py deals each step's questions over the ranks: at least one each
    return {
        "R_DATA": ["--shards", "2"],  # the first shard (the tokenizer's and the data plan's) and one more
        "R_TOK": ["--max_chars", "20000000"],
        # one sample prompt per evaluation, and short samples: generating them is most of a tiny evaluation
        "R_PRETRAIN": ["--steps", REHEARSAL_STEPS[0], "--eval_every", 0, "--ckpt_every", REHEARSAL_STEPS[0], "--keep", 1,
                       "--bpb_tokens", 32768, "--sample_prompt", "The capital of France is"],
        "R_MIDTRAIN": ["--steps", REHEARSAL_STEPS[1], "--eval_every", 0, "--eval_rows", 16, "--ckpt_every",
                       REHEARSAL_STEPS[1], "--keep", 1, "--sample_prompt", REHEARSAL_PROMPT],
        "R_SFT": ["--steps", REHEARSAL_STEPS[2], "--eval_every", 0, "--eval_rows", 16, "--ckpt_every",
                  REHEARSAL_STEPS[2], "--keep", 1, "--sample_prompt", REHEARSAL_PROMPT],
        "R_RL": ["--steps", 2, "--questions_per_step", questions, "--samples", 2, "--max_new_tokens", 16,
                 "--eval_every", 0, "--eval_items", questions, "--eval_samples", 2, "--ckpt_every", 2, "--keep", 1],
        "R_CORE": ["--max_items", 4, "--bpb_tokens", 32768, "--max_new_tokens", 8],
        "R_CHAT_EVAL": ["--max_items", 2, "--max_new_tokens", 32],
        # on CPU processes: the plan's 256 sequences a step (its data streams per rank), 128 tokens each (inherited)
        "R_SHAPE": ["--sequence_len", 128, "--total_batch_tokens", 32768] if on_cpu else [],
    }


def rehearsal_line(budgets):
    shape = f"; on the CPU: {' '.join(map(str, budgets['R_SHAPE']))}" if budgets["R_SHAPE"] else ""
    return (f"rehearsal: pretrain {REHEARSAL_STEPS[0]} steps, midtrain {REHEARSAL_STEPS[1]}, sft {REHEARSAL_STEPS[2]} "
            f"(each saving once, at its last step), CORE {budgets['R_CORE'][1]} items a task, ChatCORE "
            f"{budgets['R_CHAT_EVAL'][1]}{shape}")


# --- the disk plan: before any download, free disk against the shards and the checkpoints the plan's stages hold --

def kept_checkpoints(steps, ckpt_every, keep):
    """(checkpoints a stage keeps at its end, the most it holds at once): it saves every ckpt_every steps and at its
    last; a save writes the new one before deleting all but the newest `keep`, so one more exists while it is
    written."""
    saves = math.ceil(steps / ckpt_every) if steps else 0
    return min(keep, saves), min(keep, saves) + (saves > keep)


def plan_checkpoints(keep, ckpt_every, steps, tokens_per_step, step_cap=None):
    """(the most full checkpoints the plan's four stages hold at once, the line that says how), from pretraining's
    steps, --ckpt_every and --keep: each stage's peak beside the earlier ones' kept; SFT's steps are unknown before
    its data: --keep, one more while it saves."""
    # --steps (step_cap: a rehearsal, a short run): the later stages run no more steps than pretraining either
    cap = (lambda n: min(n, step_cap)) if step_cap else (lambda n: n)
    pre_end, pre_peak = kept_checkpoints(steps, ckpt_every, keep)
    mid_steps = math.ceil(FLAGS["midtrain"]["tokens"] / tokens_per_step)
    mid_end, mid_peak = kept_checkpoints(cap(mid_steps), ckpt_every, keep)
    rl_end, rl_peak = kept_checkpoints(cap(RL_STEPS), FLAGS["rl"]["ckpt_every"], keep)
    most = max(pre_peak, pre_end + mid_peak, pre_end + mid_end + keep + 1, pre_end + mid_end + keep + rl_peak)
    return most, (f"pretraining keeps {pre_end} (holding {pre_peak} while it saves), midtraining {mid_end} (holding "
                  f"{mid_peak}), SFT up to --keep {keep} (one more while it saves), RL {rl_end} (holding "
                  f"{rl_peak}): at most {most} at once")


def check_disk(plan):
    """Free disk against pretrain.py --data_plan's plan (data_plan.json, read), before any is spent: the missing
    shards (listed sizes, else the mean of those on disk) on its data_dir's disk, and plan_checkpoints x its
    checkpoint_bytes, less those already saved, on its runs_dir's. Returns the line that says so; a ValueError
    naming the need and the fixes when a disk cannot hold it."""
    data_dir, runs_dir, shards = Path(plan["data_dir"]), Path(plan["runs_dir"]), plan["shards"]
    have = {p.name: p.stat().st_size for p in data_dir.glob("*.parquet")}
    listing = data_dir / ".hub_listing.json"
    listed = sorted((f for f in json.loads(listing.read_text())["files"] if f["path"].endswith(".parquet")),
                    key=lambda f: f["path"]) if listing.is_file() else []
    if listed:
        wanted = listed[:shards] + listed[-1:]
        shard_bytes = sum(f["size"] for f in wanted if have.get(Path(f["path"]).name) != f["size"])
    else:
        shard_bytes = max(0, shards + 1 - len(have)) * (sum(have.values()) // max(1, len(have)))
    ckpt = plan["checkpoint_bytes"]
    count, how = plan_checkpoints(plan["keep"], plan["ckpt_every"], plan["steps"], plan["tokens_per_step"],
                                  plan["step_cap"])
    runs_dir.mkdir(parents=True, exist_ok=True)
    # a rerun that resumes: the checkpoints its finished stages saved are among those counted, and already on disk
    saved = sum(f.stat().st_size for f in runs_dir.glob("*/ckpt/step_*/**/*") if f.is_file())
    ckpt_bytes = max(0, count * ckpt - saved)
    needs = {}  # device: [bytes, free, where]
    for path, size, what in ((data_dir, shard_bytes, "shards"), (runs_dir, ckpt_bytes, "checkpoints")):
        dev = path.stat().st_dev
        needs.setdefault(dev, [0, shutil.disk_usage(path).free, []])
        needs[dev][0] += size
        needs[dev][2].append(f"{what} in {path}")
    for need, free, where in needs.values():
        if need > free:
            raise ValueError(f"not enough disk: {', '.join(where)} need {need / 1e9:.1f} GB, {free / 1e9:.1f} GB are "
                             f"free there: free space, keep fewer checkpoints (--keep 1 in PRETRAIN_ARGS, "
                             f"MIDTRAIN_ARGS, SFT_ARGS and RL_ARGS), or put --data_dir / --runs_dir on a larger disk")
    return (f"data plan disk: {shard_bytes / 1e9:.1f} GB of shards still to fetch; checkpoints: {how} x "
            f"{ckpt / 1e9:.2f} GB ({plan['params']:,} parameters: fp32 weights and optimizer state) = "
            f"{count * ckpt / 1e9:.1f} GB" + (f", {saved / 1e9:.1f} GB of them saved already in {runs_dir}: "
                                             f"{ckpt_bytes / 1e9:.1f} GB to come" if saved else ""))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--depth", type=int, default=20, help="model depth, the d{N} preset (default: %(default)s)")
    p.add_argument("--gpus", type=int, default=8, help="GPUs, as the plan says them (default: %(default)s)")
    args = p.parse_args(argv)
    print("\n".join([*plan_lines(args.depth, args.gpus), *(f"{name}: {' '.join(map(str, words))}" for name, words in
                                                           command_lines(args.depth).items())]))


if __name__ == "__main__":
    main()
