"""gpu_plan.py: the gpu plan's numbers, and its rehearsal's: speedrun.sh's flags (launch.py
setup), the disk plan (check_disk), the time prediction (predict_plan) and the printed plan (`bash
speedrun.sh --print --plan gpu`). Standard library only: launch.py imports it before .venv.

Predict the gpu plan's cost from its rehearsal, before hours of pretraining:

    python gpu_plan.py runs/speedrun-rehearsal   # the gpu plan's budgets at the rehearsal's depth
    python gpu_plan.py runs/speedrun-rehearsal --plan_json plan.json --out runs/NAME/predicted.json

A stage's time = start-up + steps x step time + saves x save time + evaluations x evaluation
time: rates from the rehearsal (docs/speedrun.md), counts from the plan. Prints per stage and
total hours and GPU-hours, with the assumptions; writes predicted.json (report.py).
"""
import argparse
import json
import math
import re
import shutil
import sys
from pathlib import Path

from report import TRAIN_STAGES, read_json, stage_seconds

# a step's tokens over all GPUs (nanochat's), every training stage's
TOKENS_PER_STEP = 524_288
# model.py's d-presets' sequence length: --eval_rows counts rows of it
SEQUENCE_LEN = 2048
# GSM8K's training questions (rl.py counts them from the data)
GSM8K_TRAIN = 7_473
# midtraining's and SFT's datasets (prepare.py chat names), fetched at the start: a gated or
# missing one fails in minutes
CHAT_SOURCES = ["smoltalk", "ultrachat", "mmlu", "arc-easy", "arc-challenge", "gsm8k", "identity"]

# each stage's flags, before its *_ARGS (the last repeated flag wins); defaults included, so that
# a changed default cannot leave the prediction and disk plan on another plan
FLAGS = {
    "pretrain": {"tokens_per_param": 20, "total_batch_tokens": TOKENS_PER_STEP, "eval_every": 250,
                 "bpb_tokens": 2 ** 20, "ckpt_every": 1000},
    "midtrain": {"tokens": 500_000_000, "eval_every": 250, "eval_rows": 256, "ckpt_every": 1000},
    # sft.py's mixture: SmolTalk, MMLU x3, GSM8K x4, ARC, identity
    "sft": {"epochs": 1, "eval_every": 100, "eval_rows": 256, "ckpt_every": 1000},
    # GSM8K train, held out: GSM8K test (nanochat's chat_rl)
    "rl": {"demo": "none", "epochs": 1, "questions_per_step": 16, "samples": 16,
           "max_new_tokens": 256,
           "eval_every": 60, "eval_items": 400, "eval_samples": 8, "ckpt_every": 60},
    "core_eval": {"max_items": -1, "bpb_tokens": 2 ** 20},
    "chat_eval": {"demo": "none", "max_items": -1, "max_new_tokens": 512},
}
RL_STEPS = math.ceil(FLAGS["rl"]["epochs"] * GSM8K_TRAIN / FLAGS["rl"]["questions_per_step"])


def command_lines(depth):
    """speedrun.sh's arrays for the gpu plan at `depth`: {"PRETRAIN": [words], ...}."""
    arrays = {{"core_eval": "CORE"}.get(stage, stage.upper()): [w for flag, value in flags.items()
                                                                 for w in (f"--{flag}", value)]
              for stage, flags in FLAGS.items()}
    arrays["PRETRAIN"] = ["--preset", f"d{depth}", *arrays["PRETRAIN"]]
    return arrays


def plan_lines(depth, gpus, rehearsal=False, on_cpu=False):
    """The plan's lines, as launch.py prints them."""
    if rehearsal:
        where = "CPU processes" if on_cpu else "GPUs"
        return [f"plan: d{depth} on {gpus} {where}, the rehearsal's budget appended to each stage"]
    pre, rl = FLAGS["pretrain"], FLAGS["rl"]
    shape = [RL_STEPS, rl["questions_per_step"], rl["samples"], rl["max_new_tokens"]]
    model = (f"plan: d{depth} ('python model.py --preset d{depth}' for its parameters), "
             f"{pre['tokens_per_param']} tokens per parameter at {pre['total_batch_tokens']:,} "
             f"tokens a step on {gpus} GPUs; pretrain.py prints the parameters, tokens and steps "
             "before step 1, and each step line the expected time left (ETA), measured after this "
             "process's first step")
    rl_line = (f"plan: rl: {rl['epochs']:g} epoch(s) of GSM8K's {GSM8K_TRAIN:,} training "
               f"questions, {shape[1]} a step, {shape[2]} replies each (up to {shape[3]} tokens): "
               f"{RL_STEPS} steps, at most {math.prod(shape) / 1e6:.1f}M tokens sampled "
               f"({' x '.join(map(str, shape))}). The rehearsal's prediction (gpu_plan.py's, "
               "above) gives every stage's expected time; report.md sets each beside its actual "
               "wall time")
    return [model, rl_line]


# --- the rehearsal

REHEARSAL_STEPS = (3, 3, 3)  # pretrain, midtrain, sft: one checkpoint each, at the last step
REHEARSAL_PROMPT = "Why do plants need light?"


def rehearsal_budgets(nproc, on_cpu):
    """A rehearsal's flags per stage, appended last: a bug in any stage shows in minutes."""
    questions = max(nproc, 2)  # rl.py needs at least one question per rank

    def training(steps, middle, last):
        return ["--steps", steps, "--eval_every", 0, *middle, "--ckpt_every", steps, "--keep", 1,
                *last]
    return {
        # the first shard (the tokenizer's and the data plan's) and one more
        "R_DATA": ["--shards", "2"],
        "R_TOK": ["--max_chars", "20000000"],
        # one short sample prompt: samples are most of a tiny evaluation
        "R_PRETRAIN": training(REHEARSAL_STEPS[0], [], ["--bpb_tokens", 32768, "--sample_prompt",
                                                        "The capital of France is"]),
        "R_MIDTRAIN": training(REHEARSAL_STEPS[1], ["--eval_rows", 16],
                               ["--sample_prompt", REHEARSAL_PROMPT]),
        "R_SFT": training(REHEARSAL_STEPS[2], ["--eval_rows", 16],
                          ["--sample_prompt", REHEARSAL_PROMPT]),
        "R_RL": ["--steps", 2, "--questions_per_step", questions, "--samples", 2,
                 "--max_new_tokens", 16,
                 "--eval_every", 0, "--eval_items", questions, "--eval_samples", 2, "--ckpt_every",
                 2,
                 "--keep", 1],
        "R_CORE": ["--max_items", 4, "--bpb_tokens", 32768, "--max_new_tokens", 8],
        "R_CHAT_EVAL": ["--max_items", 2, "--max_new_tokens", 32],
        # on CPU: the plan's 256 sequences a step (data streams per rank), 128 tokens each
        "R_SHAPE": ["--sequence_len", 128, "--total_batch_tokens", 32768] if on_cpu else [],
    }


def rehearsal_line(budgets):
    shape = f"; on the CPU: {' '.join(map(str, budgets['R_SHAPE']))}" if budgets["R_SHAPE"] else ""
    return (f"rehearsal: pretrain {REHEARSAL_STEPS[0]} steps, midtrain {REHEARSAL_STEPS[1]}, sft "
            f"{REHEARSAL_STEPS[2]} (each saving once, at its last step), CORE "
            f"{budgets['R_CORE'][1]} items a task, ChatCORE {budgets['R_CHAT_EVAL'][1]}{shape}")


# --- the disk plan, before any download

def kept_checkpoints(steps, ckpt_every, keep):
    """(checkpoints kept at the end, the most held at once): a save writes the new one, then
    deletes all but the newest `keep`."""
    saves = math.ceil(steps / ckpt_every) if steps else 0
    return min(keep, saves), min(keep, saves) + (saves > keep)


def plan_checkpoints(keep, ckpt_every, steps, tokens_per_step, step_cap=None):
    """(the most checkpoints held at once, the line saying how); SFT (steps unknown): --keep + 1."""
    # --steps (step_cap: a rehearsal, a short run) caps the later stages too
    cap = (lambda n: min(n, step_cap)) if step_cap else (lambda n: n)
    pre_end, pre_peak = kept_checkpoints(steps, ckpt_every, keep)
    mid_steps = math.ceil(FLAGS["midtrain"]["tokens"] / tokens_per_step)
    mid_end, mid_peak = kept_checkpoints(cap(mid_steps), ckpt_every, keep)
    rl_end, rl_peak = kept_checkpoints(cap(RL_STEPS), FLAGS["rl"]["ckpt_every"], keep)
    most = max(pre_peak, pre_end + mid_peak, pre_end + mid_end + keep + 1,
               pre_end + mid_end + keep + rl_peak)
    return most, (f"pretraining keeps {pre_end} (holding {pre_peak} while it saves), midtraining "
                  f"{mid_end} (holding {mid_peak}), SFT up to --keep {keep} (one more while it "
                  f"saves), RL {rl_end} (holding {rl_peak}): at most {most} at once")


def check_disk(plan):
    """Free disk against data_plan.json: missing shards on data_dir's disk, plan_checkpoints x
    checkpoint_bytes (less those saved) on runs_dir's. Returns the line saying so; ValueError with
    the fixes if too small."""
    data_dir, runs_dir, shards = Path(plan["data_dir"]), Path(plan["runs_dir"]), plan["shards"]
    have = {p.name: p.stat().st_size for p in data_dir.glob("*.parquet")}
    listing = data_dir / ".hub_listing.json"
    files = json.loads(listing.read_text())["files"] if listing.is_file() else []
    listed = sorted((f for f in files if f["path"].endswith(".parquet")), key=lambda f: f["path"])
    if (data_dir / "ingest.json").is_file():  # your corpus (--corpus): all of it is here
        shard_bytes = 0
    elif listed:
        wanted = listed[:shards] + listed[-1:]
        shard_bytes = sum(f["size"] for f in wanted if have.get(Path(f["path"]).name) != f["size"])
    else:
        shard_bytes = max(0, shards + 1 - len(have)) * (sum(have.values()) // max(1, len(have)))
    ckpt = plan["checkpoint_bytes"]
    count, how = plan_checkpoints(plan["keep"], plan["ckpt_every"], plan["steps"],
                                  plan["tokens_per_step"], plan["step_cap"])
    runs_dir.mkdir(parents=True, exist_ok=True)
    # a resumed run: finished stages' checkpoints are already on disk
    saved = sum(f.stat().st_size for f in runs_dir.glob("*/ckpt/step_*/**/*") if f.is_file())
    ckpt_bytes = max(0, count * ckpt - saved)
    needs = {}  # device: [bytes, free, where]
    for path, size, what in ((data_dir, shard_bytes, "shards"),
                             (runs_dir, ckpt_bytes, "checkpoints")):
        dev = path.stat().st_dev
        needs.setdefault(dev, [0, shutil.disk_usage(path).free, []])
        needs[dev][0] += size
        needs[dev][2].append(f"{what} in {path}")
    for need, free, where in needs.values():
        if need > free:
            raise ValueError(f"not enough disk: {', '.join(where)} need {need / 1e9:.1f} GB, "
                             f"{free / 1e9:.1f} GB are free there: free space, keep fewer "
                             "checkpoints (--keep 1 in PRETRAIN_ARGS, MIDTRAIN_ARGS, SFT_ARGS and "
                             "RL_ARGS), or put --data_dir / --runs_dir on a larger disk")
    return (f"data plan disk: {shard_bytes / 1e9:.1f} GB of shards still to fetch; checkpoints: "
            f"{how} x {ckpt / 1e9:.2f} GB ({plan['params']:,} parameters: fp32 weights and "
            f"optimizer state) = {count * ckpt / 1e9:.1f} "
            "GB" + (f", {saved / 1e9:.1f} GB of them saved already in {runs_dir}: "
                                             f"{ckpt_bytes / 1e9:.1f} GB to come" if saved else ""))


# validation tokens at 3x the training tok/s: a forward is a third of a step
FORWARD_SPEEDUP = 3
SAVE_UNKNOWN = ("save time unknown: ckpt/save_seconds is gone (predict before the rehearsal's "
                "checkpoints are deleted)")
# stages that ran before the prediction, or only in a rehearsal
NOT_PREDICTED = ("nccl_probe", "preflight", "chatcore_tasks", "data", "tokenizer", "data_plan",
                 "download", "chat", "rehearsal")


def gpu_plan_budgets(pretrain_steps, sft_steps=None):
    """The gpu plan's budgets; sft_steps: one epoch of the mixture (None: unknown until sft.py
    starts)."""
    flags, step = FLAGS, {"tokens_per_step": TOKENS_PER_STEP}
    return {
        "pretrain": {**flags["pretrain"], "steps": pretrain_steps, **step,
                     "val_tokens": flags["pretrain"]["bpb_tokens"]},
        "midtrain": {**flags["midtrain"], **step,
                     "val_tokens": flags["midtrain"]["eval_rows"] * SEQUENCE_LEN},
        "sft": {**flags["sft"], "steps": sft_steps, **step,
                "val_tokens": flags["sft"]["eval_rows"] * SEQUENCE_LEN,
                "why_unknown": "one epoch of sft.py's mixture: sft.py estimates its steps from the "
                               "chat data when it starts (give --sft_steps, or sft_steps)"},
        "rl": {**flags["rl"], "steps": RL_STEPS},
        "core_eval": dict(flags["core_eval"]),
        "chat_eval": dict(flags["chat_eval"]),
    }


def pretrain_steps_for(model_config):
    """pretrain.py's steps for model_config; imports model.py (torch) when called."""
    from model import GPTConfig, budget_params
    tokens = FLAGS["pretrain"]["tokens_per_param"] * budget_params(GPTConfig(**model_config))
    return math.ceil(tokens / TOKENS_PER_STEP)


def rehearsed_steps(run, stage):
    """A stage's (step records, at least 2 as the first holds compilation; config.json; saves; the
    last save's seconds or None)."""
    stage_dir = Path(run) / stage
    path, saved = stage_dir / "metrics.jsonl", stage_dir / "ckpt" / "save_seconds"
    records = [r for r in map(
            json.loads,
            path.read_text().splitlines()) if "step_time" in r] if path.is_file() else []
    if len(records) < 2:
        raise ValueError(f"{path}: {len(records)} step(s) timed; {stage}'s rate is measured on the "
                         "steps after the first (which holds compilation): rehearse it for at "
                         "least 2 steps")
    config = json.loads((stage_dir / "config.json").read_text())
    saves = math.ceil(len(records) / config["args"]["ckpt_every"])
    return records, config, saves, float(saved.read_text()) if saved.is_file() else None


def final_evaluation_seconds(stage_dir, wall):
    """The final evaluation's seconds, from rank 0's 'trained: final evaluation' mark to done.json's
    mtime, else None."""
    progress, done = stage_dir / "progress" / "rank000.txt", stage_dir / "done.json"
    mark = re.search(r"trained: final evaluation.* at ([\d.]+)",
                     progress.read_text()) if progress.is_file() else None
    if not mark or not done.is_file():
        return None
    seconds = done.stat().st_mtime - float(mark.group(1))
    return seconds if 0 <= seconds <= wall else None


def measure_training(run, stage, wall):
    """A training stage's rehearsal rates; start-up: what is left of the wall time."""
    records, config, saves, save_s = rehearsed_steps(run, stage)
    args = config["args"]
    step_s = sum(r["step_time"] for r in records[1:]) / (len(records) - 1)
    final_eval_s = final_evaluation_seconds(Path(run) / stage, wall)
    val_tokens = args["bpb_tokens"] if stage == "pretrain" else \
        args["eval_rows"] * config["model_config"]["sequence_len"]
    start_s = wall - len(records) * step_s - saves * (save_s or 0.0) - (final_eval_s or 0.0)
    return {"kind": "training", "wall_s": wall, "steps": len(records), "step_s": step_s,
            "first_step_s": records[0]["step_time"], "tokens_per_step": config["tokens_per_step"],
            "saves": saves,
            "save_s": save_s, "final_eval_s": final_eval_s, "val_tokens": val_tokens,
            "start_s": start_s}


def measure_rl(run, wall):
    """rl's rehearsal rates: seconds per decode forward, update seconds per step, saves,
    evaluations."""
    records, config, saves, save_s = rehearsed_steps(run, "rl")
    args, world = config["args"], config["world_size"]
    timed = records[1:]
    # each rank's questions, sampled one group at a time
    groups = math.ceil(args["questions_per_step"] / world)
    forwards = groups * sum(r["reply_tokens"] for r in timed) / len(timed)
    rollout_s = sum(r["rollout_time"] for r in timed) / len(timed)
    step_s = sum(r["step_time"] for r in timed) / len(timed)
    forward_s = rollout_s / forwards
    # held out before step 1, every --eval_every steps and after the last
    evals = 2 + evaluations(len(records), args["eval_every"])
    eval_s = math.ceil(args["eval_items"] / world) * args["max_new_tokens"] * forward_s
    start_s = wall - len(records) * step_s - saves * (save_s or 0.0) - evals * eval_s
    return {"kind": "rl", "wall_s": wall, "steps": len(records), "step_s": step_s,
            "rollout_s": rollout_s,
            "forward_s": forward_s, "update_s": step_s - rollout_s,
            "update_tokens": sum(r["sampled_tokens"] for r in timed) / len(timed), "world": world,
            "saves": saves,
            "save_s": save_s, "evals": evals, "eval_s": eval_s, "start_s": start_s}


def measure_evaluation(run, name, wall):
    """core_eval's or chat_eval's rehearsal rates, per item (per task for chat_eval)."""
    run = Path(run)
    core = name.startswith("core_eval")
    # core_eval_midtrain: midtrain's final model
    owner = name.split("_", 2)[2] if name.count("_") >= 2 else None
    where = run / "stage_evals" / owner if owner else run
    path = where / "core_eval" / "results.json" if core else where / "chat_eval.json"
    results = read_json(path)
    if results is None:
        raise FileNotFoundError(f"{path}: missing; stage {name} ran in the rehearsal "
                                "(logs/stages.tsv) but left no results: rehearse again")
    items = sum(t["items"] for t in results["tasks"])
    per_item = results["seconds"] / items
    tasks = [{"task": t["task"], "kind": t.get("kind", t.get("type")), "items": t["items"],
              "items_in_task": t["items_in_task"],
              "item_s": t["seconds"] / t["items"] if t.get("seconds") else per_item}
             for t in results["tasks"]]
    return {"kind": "core_eval" if core else "chat_eval", "wall_s": wall, "items": items,
            "seconds": results["seconds"], "item_s": per_item, "tasks": tasks,
            "per_task": all(t.get("seconds") for t in results["tasks"]),
            "val_tokens": results.get("val_bpb_tokens") or 0,
            "max_new_tokens": results.get("max_new_tokens"), "start_s": wall - results["seconds"]}


def evaluation_kind(name):
    return name[:9] if re.fullmatch(r"(core|chat)_eval(_\w+)?", name) else None


def measure_rehearsal(rehearsal_dir):
    run = Path(rehearsal_dir)
    measured, times = {}, stage_seconds(run)
    if not times:
        raise FileNotFoundError(f"{run / 'logs' / 'stages.tsv'}: no stage times; give the "
                                "directory of a finished rehearsal (runs/<run>-rehearsal, whose "
                                "logs/stages.tsv has a `report` line)")
    for name, wall in times.items():
        if name in TRAIN_STAGES:
            measured[name] = measure_training(run, name, wall)
        elif name == "rl":
            measured[name] = measure_rl(run, wall)
        elif evaluation_kind(name):
            measured[name] = measure_evaluation(run, name, wall)
        elif name not in NOT_PREDICTED:  # report: the same work at any budget
            measured[name] = {"kind": "as_rehearsed", "wall_s": wall}
    return measured


def evaluations(steps, every):
    """Evaluations every `every` steps, never after the last."""
    return (steps - 1) // every if every else 0


def predict_training(m, budget):
    tokens_per_step = budget.get("tokens_per_step", m["tokens_per_step"])
    steps = budget.get("steps")
    if steps is None and budget.get("tokens") is not None:
        steps = math.ceil(budget["tokens"] / tokens_per_step)
    step_s = m["step_s"] * tokens_per_step / m["tokens_per_step"]
    tok_s = m["tokens_per_step"] / m["step_s"]
    rate = (f"{m['step_s']:.3f} s/step after step 1 ({tok_s:,.0f} tok/s; step 1 "
            f"{m['first_step_s']:.1f} s); start-up {m['start_s']:.1f} s")
    notes = []
    if tokens_per_step != m["tokens_per_step"]:
        notes.append(f"steps of {tokens_per_step:,} tokens cost the rehearsal's "
                     f"({m['tokens_per_step']:,}) x their ratio: {step_s:.3f} s")
    if steps is None:
        return {"budget": "unknown", "rate": rate, "seconds": None,
                "assumption": budget.get("why_unknown", "no steps or tokens in its budget")}
    if m["save_s"] is None:
        return {"budget": f"{steps:,} steps", "rate": rate, "seconds": None,
                "assumption": SAVE_UNKNOWN}
    saves = math.ceil(steps / budget["ckpt_every"])
    evals = evaluations(steps, budget.get("eval_every", 0))
    extra_val = max(0, budget.get("val_tokens", m["val_tokens"]) - m["val_tokens"])
    eval_s = (m["final_eval_s"] or 0.0) + extra_val / (FORWARD_SPEEDUP * tok_s)
    if extra_val:
        notes.append(f"each evaluation's {extra_val:,} more validation tokens at "
                     f"{FORWARD_SPEEDUP}x "
                     "the training tok/s (a forward only)")
    if m["final_eval_s"] is None:
        notes.append("the evaluations' samples: only the final one's, as in the rehearsal (its "
                     "span was not measurable: progress/rank000.txt or done.json's time missing)")
    seconds = m["start_s"] + steps * step_s + saves * m["save_s"] + (evals + 1) * eval_s
    rate += f"; save {m['save_s']:.1f} s; evaluation {eval_s:.1f} s"
    return {"budget": (f"{steps:,} steps x {tokens_per_step:,} tokens; {saves} "
                       f"save{'s' * (saves != 1)}; {evals} + 1 evaluations"),
            "rate": rate, "seconds": seconds, "assumption": "; ".join(notes) or None,
            "parts": {"start_s": m["start_s"], "steps": steps, "step_s": step_s, "saves": saves,
                      "save_s": m["save_s"], "evaluations": evals + 1, "eval_s": eval_s}}


def predict_rl(m, budget, train_tok_s):
    steps = budget["steps"]
    groups = math.ceil(budget["questions_per_step"] / m["world"])
    rollout_s = groups * budget["max_new_tokens"] * m["forward_s"]
    tokens = budget["questions_per_step"] * budget["samples"] * budget["max_new_tokens"]
    if train_tok_s:
        update_s = m["update_s"] + max(0.0, tokens - m["update_tokens"]) / train_tok_s
        how = (f"the update: the rehearsal's {m['update_s']:.3f} s + the tokens beyond its own at "
               "pretraining's tok/s")
    else:
        update_s = m["update_s"] * tokens / m["update_tokens"]
        how = (f"the update: the rehearsal's {m['update_s']:.3f} s x the tokens' ratio (no "
               "pretraining rate measured)")
    step_s = rollout_s + update_s
    saves = math.ceil(steps / budget["ckpt_every"])
    evals = 2 + evaluations(steps, budget.get("eval_every", 0))
    eval_s = math.ceil(budget["eval_items"] / m["world"]) * budget["max_new_tokens"] \
        * m["forward_s"]
    rate = (f"{m['forward_s'] * 1000:.2f} ms per decode forward, update {m['update_s']:.3f} s/step "
            f"after step 1; start-up {m['start_s']:.1f} s")
    budget_text = (f"{steps:,} steps x {budget['questions_per_step']} questions x "
                   f"{budget['samples']} samples x up to {budget['max_new_tokens']} tokens (at "
                   f"most {steps * tokens:,} sampled); {saves} save{'s' * (saves != 1)}; {evals} "
                   f"held-out evaluations of {budget['eval_items']} questions")
    assumption = (f"decode is latency-bound: a forward for a question's {budget['samples']} "
                  f"replies costs what one for the rehearsal's did, and each rank's {groups} "
                  f"question(s) a step and every reply run to {budget['max_new_tokens']} tokens "
                  f"(the ceiling; GSM8K replies end sooner): an upper bound; {how}")
    if m["save_s"] is None:
        return {"budget": budget_text, "rate": rate, "seconds": None, "assumption": SAVE_UNKNOWN}
    seconds = m["start_s"] + steps * step_s + saves * m["save_s"] + evals * eval_s
    return {"budget": budget_text, "rate": rate + f"; save {m['save_s']:.1f} s; evaluation "
            f"{eval_s:.1f} s",
            "seconds": seconds, "assumption": assumption,
            "parts": {"start_s": m["start_s"], "steps": steps, "step_s": step_s,
                      "rollout_s": rollout_s,
                      "update_s": update_s, "saves": saves, "save_s": m["save_s"],
                      "evaluations": evals,
                      "eval_s": eval_s}}


def predict_evaluation(m, budget, train_tok_s):
    limit = budget.get("max_items", -1)
    notes, item_seconds, items = [], 0.0, 0
    scale = 1.0
    if m["kind"] == "chat_eval" and budget.get("max_new_tokens") and m["max_new_tokens"]:
        scale = budget["max_new_tokens"] / m["max_new_tokens"]
    for t in m["tasks"]:
        n = t["items_in_task"] if limit < 0 else min(limit, t["items_in_task"])
        generated = m["kind"] == "chat_eval" and t["kind"] != "categorical"
        item_seconds += n * t["item_s"] * (scale if generated else 1.0)
        items += n
    if m["kind"] == "core_eval":
        notes.append("every task's items cost the rehearsal's mean per item (its tasks ran equally "
                     "many items, in batches no larger than that: the plan's fuller batches run "
                     "faster, an upper bound)")
        extra_val = max(0, budget.get("bpb_tokens", m["val_tokens"]) - m["val_tokens"])
        if extra_val and train_tok_s:
            item_seconds += extra_val / (FORWARD_SPEEDUP * train_tok_s)
            notes.append(f"{extra_val:,} more validation tokens at {FORWARD_SPEEDUP}x "
                         "pretraining's tok/s")
        elif extra_val:
            notes.append(f"{extra_val:,} more validation tokens: not counted (no pretraining rate "
                         "measured)")
    else:
        notes.append("each task at the rehearsal's seconds per item" + ("" if m["per_task"] else " "
                     "(the mean: its results have no per-task "
                     "seconds)") + f", its {m['items'] // max(1, len(m['tasks']))} items a task "
                     f"batched together: the plan's fuller batches run faster, an upper bound")
        if scale != 1.0:
            notes.append(f"generated answers up to {budget['max_new_tokens']} tokens cost the "
                         f"rehearsal's (up to {m['max_new_tokens']}) x {scale:g}: an upper bound, "
                         "answers end sooner")
    rate = (f"{m['items'] / m['seconds']:,.1f} items/s ({m['items']} items in "
            f"{m['seconds']:.1f} s); start-up {m['start_s']:.1f} s")
    return {"budget": f"{items:,} items", "rate": rate, "seconds": m["start_s"] + item_seconds,
            "assumption": "; ".join(notes), "parts": {"start_s": m["start_s"], "items": items,
                                                      "items_s": item_seconds}}


def predict_plan(rehearsal_dir, budgets, gpus):
    """Each stage's predicted wall time at the budgets (gpu_plan_budgets' keys; a missing stage is
    unknown) from a rehearsal's rates. Returns {"rehearsal", "gpus", "stages": {name: {"budget",
    "rate", "seconds", "assumption", "parts"}}, "seconds", "unknown", "hours", "gpu_hours"}."""
    measured = measure_rehearsal(rehearsal_dir)
    pretrain = measured.get("pretrain")
    train_tok_s = pretrain["tokens_per_step"] / pretrain["step_s"] if pretrain else None
    stages = {}
    for name, m in measured.items():
        budget = budgets.get(evaluation_kind(name) or name)
        if m["kind"] == "as_rehearsed":
            stages[name] = {"budget": "as rehearsed", "rate": "", "seconds": m["wall_s"],
                            "assumption": "the same work at any budget: the rehearsal's wall time"}
        elif budget is None:
            stages[name] = {"budget": "unknown", "rate": "", "seconds": None,
                            "assumption": f"no budget for {name} given"}
        elif m["kind"] == "training":
            stages[name] = predict_training(m, budget)
        elif m["kind"] == "rl":
            stages[name] = predict_rl(m, budget, train_tok_s)
        else:
            stages[name] = predict_evaluation(m, budget, train_tok_s)
        stages[name]["rehearsal_s"] = m["wall_s"]
    timed = {evaluation_kind(name) or name for name in measured}
    for name in budgets:
        # it ran (its directory is there) but a stop ended the run before its time was written
        if name not in timed and Path(rehearsal_dir, name).is_dir():
            stages[name] = {"budget": "unknown", "rate": "", "seconds": None,
                            "assumption": f"{name}/ is there but logs/stages.tsv has no time for "
                                          "it: rehearse again"}
    seconds = sum(s["seconds"] for s in stages.values() if s["seconds"] is not None)
    return {"rehearsal": str(rehearsal_dir), "gpus": gpus, "stages": stages, "seconds": seconds,
            "unknown": [n for n, s in stages.items() if s["seconds"] is None],
            "hours": seconds / 3600,
            "gpu_hours": seconds / 3600 * gpus}


def format_prediction(prediction):
    lines = [f"plan cost predicted from {prediction['rehearsal']} ({prediction['gpus']} GPUs):",
             f"{'stage':<20} {'predicted':>12}  budget | measured rate"]
    for name, s in prediction["stages"].items():
        when = "unknown" if s["seconds"] is None else f"{s['seconds']:,.0f} s"
        lines.append(f"{name:<20} {when:>12}  {s['budget']}" + (f" | {s['rate']}" if s["rate"]
                                                                else ""))
        if s.get("assumption"):
            lines.append(f"{'':<34}assumed: {s['assumption']}")
    unknown = prediction["unknown"]
    lines.append(f"total: {'at least ' if unknown else ''}{prediction['hours']:.2f} h, "
                 f"{prediction['gpu_hours']:.1f} GPU-hours ({prediction['gpus']} GPUs)"
                 + (f"; unknown: {', '.join(unknown)}" if unknown else ""))
    return lines


def write_prediction(rehearsal_dir, budgets, gpus, out=None):
    """predict_plan, printed and written to out, before the rehearsal's checkpoints are deleted
    (their save_seconds are the save times)."""
    prediction = predict_plan(rehearsal_dir, budgets, gpus)
    print("\n".join(format_prediction(prediction)), flush=True)
    out = Path(out) if out else default_out(rehearsal_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(prediction, indent=1))
    print(f"written: {out}", flush=True)
    return prediction


def default_out(rehearsal_dir):
    path = Path(rehearsal_dir).resolve()
    return path.with_name(path.name.removesuffix("-rehearsal")) / "predicted.json"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("rehearsal", help="a finished rehearsal's directory, runs/<run>-rehearsal")
    p.add_argument("--plan_json", default=None, help="the budgets as JSON (gpu_plan_budgets' "
                   "keys); default: the gpu plan's, pretraining's steps from the rehearsal's model")
    p.add_argument("--gpus", type=int, default=0, help="GPUs of the run, for the GPU-hours; 0 = "
                   "the rehearsal's world size (default: %(default)s)")
    p.add_argument("--sft_steps", type=int, default=None, help="SFT's steps (sft.py prints its "
                   "estimate when it starts); default: unknown")
    p.add_argument("--out", default=None, help="the JSON written; default: "
                   "runs/<run>/predicted.json")
    args = p.parse_args(argv)
    rehearsal = Path(args.rehearsal)
    try:
        config = read_json(rehearsal / "pretrain" / "config.json")
        if args.plan_json:
            budgets = json.loads(Path(args.plan_json).read_text())
        elif config is None:
            raise FileNotFoundError(f"{rehearsal / 'pretrain' / 'config.json'}: missing; give "
                                    "--plan_json")
        else:
            budgets = gpu_plan_budgets(pretrain_steps_for(config["model_config"]),
                                       sft_steps=args.sft_steps)
        if args.sft_steps is not None:
            budgets.setdefault("sft", {})["steps"] = args.sft_steps
        gpus = args.gpus or (config or {}).get("world_size", 1)
        write_prediction(rehearsal, budgets, gpus, args.out)
    except (FileNotFoundError, ValueError, KeyError) as e:
        print(f"gpu_plan.py: error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
