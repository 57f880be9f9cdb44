"""The report of a speedrun: runs/<run>/report.md and PNG curves, from the run's own files.

    python report.py runs/speedrun          # what speedrun.sh runs after the last stage

Reads each stage's config.json, metrics.jsonl, done.json and samples.jsonl; core_eval and chat_eval
results; transport.txt; logs/stages.tsv (wall times); stage_evals/<stage>/ (what each stage
taught); predicted.json (gpu_plan.py's). A missing figure is "unknown".
"""
import argparse
import itertools
import json
import re
import sys
from pathlib import Path

TRAIN_STAGES = ["pretrain", "midtrain", "sft"]
# the stages whose final models get a column in the per-stage table
MODEL_STAGES = [*TRAIN_STAGES, "rl"]
UNKNOWN = "unknown"
# per generated task in the per-stage table: its first item and first with a numeric answer
SAMPLE_QUESTIONS = 2


def read_json(path):
    return json.loads(Path(path).read_text()) if Path(path).is_file() else None


def stage_rows(run):
    """logs/stages.tsv's rows: [name, seconds, exit status] as strings."""
    path = Path(run, "logs", "stages.tsv")
    return [line.split("\t") for line in path.read_text().splitlines()] if path.is_file() else []


def stage_seconds(run):
    """{stage: wall seconds} of each stage's last successful run."""
    return {name: float(seconds) for name, seconds, rc in stage_rows(run) if rc == "0"}


def read_jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines()
            if line.strip()] if path.is_file() else []


def hardware(run, name):
    """The recorded world, e.g. 'world size 8 (nccl): rank 0 ...'."""
    files = {"core_eval": run / "core_eval" / "results.json", "chat_eval": run / "chat_eval.json"}
    return (read_json(files.get(name, run / name / "config.json")) or {}).get("hardware", UNKNOWN)


def data_of(config):
    """What a training stage trained on: corpus, shards, whether demo."""
    if config is None:
        return UNKNOWN
    if config["stage"] == "pretrain":
        paths = [(Path(config["data_dir"]), 1)]
    elif config["stage"] == "rl":
        return f"{config['tasks']}; {config['train_questions']:,} training questions"
    elif config.get("sources"):
        # defaults included (config["args"]["source"] is only what was passed)
        paths = [(Path(s["path"]), s.get("epochs", 1)) for s in config["sources"]]
    else:
        paths = [(Path(config["chat_dir"]), 1)]
    parts = []
    for path, passes in paths:
        shards = len(list(path.glob("*.parquet")))
        demo = (path.parent / "chat_eval").is_dir() and (path.parent / "eval_bundle").is_dir()
        parts.append(f"{path} ({shards} shards{', synthetic demo data' if demo else ''})"
                     + (f" x{passes}" if passes > 1 else ""))
    budget = config.get("data") if config["stage"] == "pretrain" else None
    if budget:  # pretrain.py's budget against the corpus
        repeated = " (this run REPEATED data)" if budget["epochs"] > 1 else ""
        parts.append(f"{budget['epochs']:.2f} epochs of it{repeated}")
    return "; ".join(parts)


def predicted_cell(predicted, name):
    seconds = predicted["stages"].get(name, {}).get("seconds")
    return UNKNOWN if seconds is None else f"{seconds:.1f}"


def stage_figures(run, name, times, predicted=None):
    """One training stage's figures as strings, the predicted wall time beside the actual."""
    run_dir = run / name
    config, done = read_json(run_dir / "config.json"), read_json(run_dir / "done.json")
    steps = [r for r in read_jsonl(run_dir / "metrics.jsonl") if "loss" in r]
    train_seconds = sum(r["step_time"] for r in steps)
    mfus = [r["mfu"] for r in steps if isinstance(r.get("mfu"), (int, float))]
    if done is None:
        validation = UNKNOWN
    elif "val_bpb" in done:
        validation = f"val bpb {done['val_bpb']:.4f}"
    elif "val_loss" in done:
        validation = f"val loss {done['val_loss']:.4f}"
    elif "held_out_pass@1_last" in done:  # rl
        validation = f"held-out pass@1 {done['held_out_pass@1_last']:.3f}"
    else:
        validation = UNKNOWN
    return {
        "stage": name,
        "data": data_of(config),
        "steps": str(done.get("step", UNKNOWN)) if done else UNKNOWN,
        "wall time (s)": f"{times[name]:.1f}" if name in times else UNKNOWN,
        **({"predicted (s)": predicted_cell(predicted, name)} if predicted else {}),
        "tokens": f"{steps[-1]['tokens']:,}" if steps else UNKNOWN,
        "tok/s": f"{steps[-1]['tokens'] / train_seconds:,.0f}" if steps and train_seconds
        else UNKNOWN,
        "MFU": f"{100 * sum(mfus) / len(mfus):.1f}%" if mfus and len(mfus) == len(steps)
        else UNKNOWN,
        "parameters": f"{config['params']:,}" if config and "params" in config else UNKNOWN,
        "validation": validation,
    }


SAMPLES_PER_TASK = 4


def contained_answers(items_path):
    """{task: (replies containing an accepted answer as a whole word, replies)}: a reply in a
    sentence ("It's Pelmo.") counts here."""
    counts = {}
    for item in read_jsonl(items_path):
        if "answers" in item and "reply" in item:
            reply = item["reply"].lower()
            hit = any(re.search(rf"\b{re.escape(a.lower())}\b", reply) for a in item["answers"])
            hits, n = counts.get(item["task"], (0, 0))
            counts[item["task"]] = (hits + hit, n + 1)
    return counts


def marked_answers(items_path, per_task=SAMPLES_PER_TASK):
    """A line per first few items of each task: right or wrong, question, answer, expected."""
    lines, shown = [], {}
    for item in read_jsonl(items_path):
        if shown.get(item["task"], 0) >= per_task:
            continue
        shown[item["task"]] = shown.get(item["task"], 0) + 1
        given = item.get("predicted")
        if "reply" in item and item["task"] != "GSM8K":
            given = item["reply"]
        expected = item.get("answer", " | ".join(item.get("answers", [])) or UNKNOWN)
        question = " ".join(str(item.get("question", UNKNOWN)).split())[:120]
        lines.append(f"- [{'x' if item['correct'] else ' '}] {item['task']}: {question!r} -> "
                     f"{given!r} (expected {expected!r})")
    return lines


def stage_eval_files(run, name):
    """(core_eval results.json, chat_eval.json, its items) of a stage's final model; pretrain's
    CORE is core_eval/'s (the same checkpoint)."""
    where = run / "stage_evals" / name
    core = (run if name == "pretrain" else where) / "core_eval" / "results.json"
    return core, where / "chat_eval.json", where / "chat_eval_items.jsonl"


def cell(text):
    """A markdown table cell: one line, no column breaks."""
    return " ".join(str(text).split()).replace("|", "\\|")


def sample_reply(item):
    """A greedy reply with its calculator calls shown as <<expr=result>>."""
    calls = "".join(f"<<{expr}={result}>>" for expr, result in item.get("calculator", []))
    return calls + item.get("reply", item.get("predicted", ""))


def sample_items(items):
    """[(task, question)] for the sample answers (SAMPLE_QUESTIONS)."""
    chosen = {}
    for item in items:
        if "reply" not in item:
            continue
        task_items = chosen.setdefault(item["task"], [])
        numeric = any(re.fullmatch(r"-?\d+", a) for a in item.get("answers", [item.get("answer",
                                                                                       "")]))
        if not task_items or (numeric and len(task_items) < SAMPLE_QUESTIONS and not any(
                n for _, n in task_items)):
            task_items.append((item["question"], numeric))
    return [(task, q) for task, qs in chosen.items() for q, _ in qs]


def per_stage_table(run):
    """What each stage taught: a row per ability, a column per stage's final model."""
    stages = [name for name in MODEL_STAGES if any((run / name / "ckpt").glob("step_*"))]
    if not stages:
        return [f"No stage has a checkpoint under {run}/<stage>/ckpt/: nothing to tabulate."]
    core = {s: read_json(stage_eval_files(run, s)[0]) or {} for s in stages}
    chat = {s: read_json(stage_eval_files(run, s)[1]) for s in stages}
    items = {s: read_jsonl(stage_eval_files(run, s)[2]) for s in stages}
    core_tasks = {s: {t["task"]: t for t in core[s].get("tasks", [])} for s in stages}
    chat_tasks = {s: {t["task"]: t for t in (chat[s] or {}).get("tasks", [])} for s in stages}
    rows = []

    def row(label, value_of):
        rows.append([label] + [value_of(s) for s in stages])

    def figure(value):
        return UNKNOWN if value is None else f"{value:.4f}"

    row("pretraining val bpb", lambda s: figure(core[s].get("val_bpb")))
    row("CORE", lambda s: figure(core[s].get("core")))
    for task in dict.fromkeys(task for s in stages for task in core_tasks[s]):
        row(f"CORE: {task} (accuracy)",
            lambda s, task=task: figure(core_tasks[s].get(task, {}).get("accuracy")))

    # pretrain's: CORE only, as nanochat
    def chat_cell(s, value):
        return "not asked (a base model)" if s == "pretrain" and chat[s] is None else value

    row("ChatCORE", lambda s: chat_cell(s, figure((chat[s] or {}).get("chatcore"))))
    for task in dict.fromkeys(task for s in stages for task in chat_tasks[s]):
        def task_cell(s, task=task):
            found = chat_tasks[s].get(task)
            return chat_cell(s, f"{found['correct']}/{found['items']}" if found else UNKNOWN)
        centered = [chat_tasks[s][task]["centered"] for s in stages if task in chat_tasks[s]]
        extra = " (not in ChatCORE)" if None in centered else ""
        row(f"{task}{extra}", task_cell)
    for task, question in dict.fromkeys(q for s in stages for q in sample_items(items[s])):
        row(f"sample, {task}: {question}", lambda s, task=task, question=question: chat_cell(
            s, next((repr(sample_reply(i)) for i in items[s]
                     if i["task"] == task and i["question"] == question), UNKNOWN)))
    lines = ["| ability | " + " | ".join(stages) + " |", "|---|" + "---|" * len(stages)]
    lines += ["| " + " | ".join(cell(c) for c in r) + " |" for r in rows]
    return lines + ["", *stage_changes(stages, chat)]


def stage_changes(stages, chat):
    """Whether each chat stage added to or lost from the one before: ChatCORE, items right."""
    asked = [s for s in stages if (chat[s] or {}).get("chatcore") is not None]
    lines = []
    for before, after in itertools.pairwise(asked):
        change = chat[after]["chatcore"] - chat[before]["chatcore"]
        verdict = "added" if change > 0 else "lost" if change < 0 else "held"
        right = {t["task"]: t["correct"] for t in chat[before]["tasks"]}
        tasks = [f"{t['task']} {t['correct'] - right[t['task']]:+d}"
                 for t in chat[after]["tasks"] if t["task"] in right]
        lines.append(f"- {after} against {before}: ChatCORE {change:+.4f} ({verdict}); items "
                     f"right: {', '.join(tasks)}")
    return lines


def forgetting_lines(run):
    """Pretraining val bpb of the pretrained, midtrained and SFT models, on the same rows."""
    lines = ["| model | pretraining val bpb | change from the pretrained |", "|---|---|---|"]
    pretrained = (read_json(run / "pretrain" / "done.json") or {}).get("val_bpb")
    for name, label in [("pretrain", "pretrained"), ("midtrain", "midtrained"), ("sft", "SFT")]:
        done = read_json(run / name / "done.json") or {}
        kept = done.get("pretrain_val_bpb") or {}
        if name == "pretrain":
            kept = {"val_bpb": done.get("val_bpb")}
        bpb = kept.get("val_bpb")
        change = UNKNOWN if bpb is None or pretrained is None else f"{bpb - pretrained:+.4f}"
        note = f" ({kept['note']})" if "note" in kept else ""
        figure = f"{UNKNOWN}{note}" if bpb is None else f"{bpb:.4f}"
        lines.append(f"| {label} | {figure} | {change if name != 'pretrain' else ''} |")
    return lines


def reward_panel(ax, records):
    steps = [r for r in records if "reward" in r]
    evals = [(r["step"], r["held_out"]["all"]["pass@1"]) for r in records if "held_out" in r]
    ax.plot([r["step"] for r in steps], [r["reward"] for r in steps], lw=1, label=
            "mean reward (training)")
    ax.plot([s for s, _ in evals], [v for _, v in evals], marker="o", label="held-out pass@1")
    ax.set_title("rl: reward")
    ax.set_xlabel("step")
    ax.legend(fontsize=7)


def plot(run, out):
    """loss.png: each stage's training loss and RL's reward; val_bpb.png: pretraining's."""
    import matplotlib
    matplotlib.use("Agg")  # no display
    import matplotlib.pyplot as plt
    rl_records = read_jsonl(run / "rl" / "metrics.jsonl")
    panels = len(TRAIN_STAGES) + bool(rl_records)
    fig, axes = plt.subplots(1, panels, figsize=(4 * panels, 3.2))
    for ax, name in zip(axes, TRAIN_STAGES, strict=False):
        steps = [r for r in read_jsonl(run / name / "metrics.jsonl") if "loss" in r]
        ax.plot([r["step"] for r in steps], [r["loss"] for r in steps], lw=1)
        ax.set_title(f"{name}: training loss")
        ax.set_xlabel("step")
    if rl_records:
        reward_panel(axes[-1], rl_records)
    fig.tight_layout()
    fig.savefig(out / "loss.png", dpi=90)
    plt.close(fig)
    records = read_jsonl(run / "pretrain" / "metrics.jsonl")
    points = [(r["step"], r.get("val_bpb", r.get("final_val_bpb"))) for r in records
              if "val_bpb" in r or "final_val_bpb" in r]
    fig, ax = plt.subplots(figsize=(4.5, 3.2))
    ax.plot([s for s, _ in points], [v for _, v in points], marker="o")
    ax.set_title("pretrain: validation bits per byte")
    ax.set_xlabel("step")
    fig.tight_layout()
    fig.savefig(out / "val_bpb.png", dpi=90)
    plt.close(fig)
    return ["loss.png", "val_bpb.png"]


def header_lines(run):
    code = (read_json(run / "pretrain" / "config.json") or {}).get("code", {})
    has = (run / "transport.txt").is_file()
    transport = (run / "transport.txt").read_text().strip() if has else UNKNOWN
    lines = [f"# Speedrun report: {run}", "",
             (f"- code: commit {code.get('commit', UNKNOWN)}, uncommitted changes: "
              f"{code.get('dirty', UNKNOWN)}"),
             f"- transport: {transport}"]
    names = ["pretrain", "core_eval", "midtrain", "sft"] + ["rl"] * (run / "rl").is_dir()
    return lines + [f"- hardware, {name}: {hardware(run, name)}" for name in names + ["chat_eval"]]


def stages_lines(run):
    times = stage_seconds(run)
    predicted = read_json(run / "predicted.json")  # gpu_plan.py's, written before the run
    names = TRAIN_STAGES + ["rl"] * (run / "rl").is_dir()
    rows = [stage_figures(run, name, times, predicted) for name in names]
    lines = ["", "## Stages", "", "| " + " | ".join(rows[0]) + " |", "|" + "---|" * len(rows[0])]
    lines += ["| " + " | ".join(row.values()) + " |" for row in rows]
    others = [f"{k} {v:.1f}" + (f" (predicted {predicted_cell(predicted, k)})" if predicted else "")
              for k, v in times.items() if k not in MODEL_STAGES]
    lines += ["", ("Wall time: speedrun.sh's clock around the stage (logs/stages.tsv), start-up "
                   "and evaluation included. tok/s: tokens / the summed step times in "
                   "metrics.jsonl. MFU: the mean of the per-step MFU; unknown where the device has "
                   "no rated peak (any CPU) or the compute is fp32."), "",
              "Other stages' wall time (s): " + ", ".join(others), ""]
    if predicted:
        actual = sum(times[k] for k in predicted["stages"] if k in times)
        unknown = f", unknown: {', '.join(predicted['unknown'])}" if predicted["unknown"] else ""
        lines += [(f"Predicted before the run from its rehearsal ({predicted['rehearsal']}; "
                   f"predicted.json, gpu_plan.py): {predicted['hours']:.2f} h, "
                   f"{predicted['gpu_hours']:.1f} GPU-hours{unknown}"
                   f"; actual, the same stages: {actual / 3600:.2f} h."), ""]
    return lines


def core_lines(run, core):
    if core:
        bpb = f"{core['val_bpb']:.4f}" if core.get("val_bpb") is not None else UNKNOWN
        lines = [(f"CORE {core['core']:.4f} ({len(core['tasks'])} tasks, protocol "
                  f"{core['protocol']}); val bpb {bpb} (core_eval/results.json)"), "",
                 "| task | accuracy | centered |", "|---|---|---|"]
        lines += [f"| {t['task']} | {t['accuracy']:.4f} | {t['centered']:.4f} |"
                  for t in core["tasks"]]
    else:
        lines = [f"CORE {UNKNOWN} (no core_eval/results.json)"]
    if rl := read_json(run / "rl" / "done.json"):
        lines += [(f"RL: mean reward {rl['reward_first_fifth']:.3f} -> "
                  f"{rl['reward_last_fifth']:.3f} (first and last fifth of its steps), "
                  f"held-out pass@1 {rl['held_out_pass@1_first']:.3f} -> "
                  f"{rl['held_out_pass@1_last']:.3f}: {rl['note']} (rl/done.json)"), ""]
    return lines + ["", ("How much each chat stage forgets: the pretraining val bpb of each "
                         "stage's final model, on the rows of pretraining's final evaluation "
                         "(pretrain/done.json; midtrain/ and sft/done.json: pretrain_val_bpb)."),
                    "", *forgetting_lines(run), ""]


def chat_lines(run, chat):
    if not chat:
        return [f"ChatCORE {UNKNOWN} (no chat_eval.json)"]
    lines = [f"ChatCORE {chat['chatcore']:.4f} (tasks from {chat['tasks_from']}; chat_eval.json)",
             "", "| task | correct | accuracy | centered |", "|---|---|---|---|"]
    for t in chat["tasks"]:
        centered = "not in ChatCORE" if t["centered"] is None else format(t["centered"], ".4f")
        lines.append(f"| {t['task']} | {t['correct']}/{t['items']} | {t['accuracy']:.4f} | "
                     f"{centered} |")
    for task, (hits, n) in contained_answers(run / "chat_eval_items.jsonl").items():
        lines += ["", (f"{task}: {hits}/{n} replies contain an accepted answer as a word "
                       "(chat_eval_items.jsonl; not ChatCORE's rule, under which the reply must "
                       "be the answer)")]
    lines += ["", "ChatCORE sample answers (the first items of each task; [x] right, [ ] wrong):",
              ""]
    return lines + marked_answers(run / "chat_eval_items.jsonl")


def write_report(run):
    run = Path(run)
    if not run.is_dir():
        raise FileNotFoundError(f"{run}: no such speedrun directory (runs/<run>/)")
    core, chat = read_json(run / "core_eval" / "results.json"), read_json(run / "chat_eval.json")
    lines = header_lines(run) + stages_lines(run)
    lines += ["## What each stage taught", "", (
        "Each column is a stage's final model, each cell computed from that model by the same "
        "command (core_eval.py, chat_eval.py; runs/<run>/stage_evals/<stage>/, the pretrained "
        "model's CORE in core_eval/; a base model is asked CORE only, as nanochat asks it: it "
        "never ends a reply, so ChatCORE's generated answers would run to their token cap on "
        "every item). Sample answers are greedy, with the calculator's calls shown as "
        "<<expr=result>>."), "", *per_stage_table(run), ""]
    lines += ["## Evaluation", "", *core_lines(run, core), *chat_lines(run, chat)]
    lines += ["", "## Sample answers", ""]
    samples = read_jsonl(run / "sft" / "samples.jsonl")
    last = [s for s in samples if s["step"] == samples[-1]["step"]] if samples else []
    lines += [f"- {s['question']!r} -> {s['answer']!r}" for s in last] or \
        [f"- {UNKNOWN} (no sft/samples.jsonl)"]
    if core:
        lines += [f"- (pretrain) {s['prompt']!r} -> {s['completion']!r}"
                  for s in core.get("samples", [])[:6] if isinstance(s, dict) and "prompt" in s]
    written = plot(run, run)
    lines += ["", "## Curves", ""] + [f"![{name}]({name})" for name in written] + [""]
    (run / "report.md").write_text("\n".join(lines))
    print(f"report: {run / 'report.md'}, " + ", ".join(str(run / n) for n in written))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run", help="the speedrun directory, runs/<run>")
    args = parser.parse_args(argv)
    try:
        write_report(args.run)
    except (FileNotFoundError, ValueError, KeyError) as e:
        print(f"report.py: error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
