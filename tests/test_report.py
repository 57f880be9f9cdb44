"""report.py: the ChatCORE sample answers, each marked right or wrong, with what was given and what was expected; the
per-stage table, each cell equal to its stage model's own evaluation files."""
import itertools
import json
import re
import shutil
from pathlib import Path

from report import marked_answers, per_stage_table


def test_sample_answers_are_marked_right_or_wrong(tmp_path):
    items = [{"task": "demo-choice", "question": "Multiple Choice question: Pick\n- a=A", "answer": "A",
              "predicted": "A", "correct": True},
             {"task": "demo-answer", "question": "Reply with one word: X?", "answers": ["Pelmo"], "reply": "Tolvar",
              "correct": False},
             {"task": "GSM8K", "question": "q", "answer": "42", "predicted": "42", "reply": "So 42.\n#### 42",
              "correct": True}] + [{"task": "demo-choice", "question": f"q{i}", "answer": "B", "predicted": "C",
                                    "correct": False} for i in range(5)]
    path = tmp_path / "chat_eval_items.jsonl"
    path.write_text("".join(json.dumps(item) + "\n" for item in items))
    assert marked_answers(path, per_task=2) == [
        "- [x] demo-choice: 'Multiple Choice question: Pick - a=A' -> 'A' (expected 'A')",
        "- [ ] demo-answer: 'Reply with one word: X?' -> 'Tolvar' (expected 'Pelmo')",
        "- [x] GSM8K: 'q' -> '42' (expected '42')",
        "- [ ] demo-choice: 'q0' -> 'C' (expected 'B')"]


def stage_table(md):
    """{ability: {stage: cell}} of report.md's per-stage table."""
    lines = md.split("## What each stage taught", 1)[1].splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("| ability |"))
    stages = [c.strip() for c in lines[start].strip("|").split("|")][1:]
    rows = {}
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line.strip()[1:-1])]
        rows[cells[0]] = dict(zip(stages, cells[1:], strict=True))
    return stages, rows


def test_the_per_stage_table_cells_equal_each_stage_models_own_evaluations(speedrun):
    """A column per stage's final model; every cell equals what core_eval.py and chat_eval.py wrote for that model
    (counts recomputed from the items files), and each file was computed from that stage's checkpoint. The suite runs
    --stage_evals pretrain,sft: midtrain, left out, says unknown in every cell, and rl's column (the demo plan runs rl) holds chat_eval's."""
    run, _ = speedrun
    stages, rows = stage_table((run / "report.md").read_text())
    assert stages == ["pretrain", "midtrain", "sft", "rl"]
    assert not (run / "stage_evals" / "midtrain").exists()
    for ability, cells in rows.items():
        assert cells["midtrain"] == "unknown", ability
    # the pretrained model is a base model: CORE only; each ChatCORE cell says it was not asked
    assert not (run / "stage_evals" / "pretrain" / "chat_eval.json").exists()
    for ability, cells in rows.items():
        if not ability.startswith(("pretraining val bpb", "CORE")):
            assert cells["pretrain"] == "not asked (a base model)", ability
    for stage in ("pretrain", "sft"):
        where = run / "stage_evals" / stage
        core = json.loads(((run / "core_eval") if stage == "pretrain" else where / "core_eval")
                          .joinpath("results.json").read_text())
        assert Path(core["checkpoint"]).parent.parent == run / stage
        assert rows["pretraining val bpb"][stage] == f"{core['val_bpb']:.4f}"
        assert rows["CORE"][stage] == f"{core['core']:.4f}"
        core_items = [json.loads(line) for line in
                      (Path(core["checkpoint"]).parent.parent.parent / ("core_eval" if stage == "pretrain" else
                       f"stage_evals/{stage}/core_eval") / "items.jsonl").read_text().splitlines()]
        for task in core["tasks"]:
            right = [i["correct"] for i in core_items if i["task"] == task["task"]]
            assert rows[f"CORE: {task['task']} (accuracy)"][stage] == f"{sum(right) / len(right):.4f}"
        if stage == "pretrain":
            continue
        chat = json.loads((where / "chat_eval.json").read_text())
        assert Path(chat["checkpoint"]).parent.parent == run / stage
        assert rows["ChatCORE"][stage] == f"{chat['chatcore']:.4f}"
        items = [json.loads(line) for line in (where / "chat_eval_items.jsonl").read_text().splitlines()]
        assert {t["task"] for t in chat["tasks"]} == {"demo-choice", "demo-answer", "demo-problems", "demo-words"}
        for task in ("demo-choice", "demo-answer", "demo-problems"):
            assert rows[task][stage] == f"{sum(i['correct'] for i in items if i['task'] == task)}/" \
                                        f"{sum(i['task'] == task for i in items)}"
        assert rows["demo-words (not in ChatCORE)"][stage] == \
            f"{sum(i['correct'] for i in items if i['task'] == 'demo-words')}/" \
            f"{sum(i['task'] == 'demo-words' for i in items)}"
        samples = {k: v for k, v in rows.items() if k.startswith("sample, ")}
        assert len(samples) >= 3
        for ability, cells in samples.items():
            task, question = ability[len("sample, "):].split(": ", 1)
            item = next(i for i in items if i["task"] == task and " ".join(i["question"].split()) == question)
            calls = "".join(f"<<{e}={r}>>" for e, r in item.get("calculator", []))
            assert cells[stage] == " ".join(repr(calls + item["reply"]).split()).replace("|", "\\|")
    # under the table, from the stages whose ChatCORE the report found, in order, by those files' figures
    files = [run / "stage_evals" / s / "chat_eval.json" for s in ("midtrain", "sft", "rl")]
    found = [(f.parent.name, json.loads(f.read_text())) for f in files if f.is_file()]
    expected = []
    for (before, a), (after, b) in itertools.pairwise(found):
        change, right = b["chatcore"] - a["chatcore"], {t["task"]: t["correct"] for t in a["tasks"]}
        expected.append(f"- {after} against {before}: ChatCORE {change:+.4f} ("
                        f"{'added' if change > 0 else 'lost' if change < 0 else 'held'}); items right: "
                        + ", ".join(f"{t['task']} {t['correct'] - right[t['task']]:+d}" for t in b["tasks"]))
    assert [line for line in (run / "report.md").read_text().splitlines() if " against " in line] == expected

def test_a_later_stage_gets_its_column_by_itself(tmp_path):
    """The table's columns are the stages that left a checkpoint: an rl/ run appears without a code change, and a
    figure a stage's files lack is unknown."""
    run = tmp_path / "run"
    for stage in ("pretrain", "midtrain", "sft", "rl"):
        (run / stage / "ckpt" / "step_000001").mkdir(parents=True)
    core = {"core": 0.25, "val_bpb": 0.5, "tasks": [{"task": "t", "accuracy": 0.75, "centered": 0.5}]}
    (run / "core_eval").mkdir()
    (run / "core_eval" / "results.json").write_text(json.dumps(core))
    (run / "stage_evals" / "rl" / "core_eval").mkdir(parents=True)
    (run / "stage_evals" / "rl" / "core_eval" / "results.json").write_text(json.dumps({**core, "val_bpb": 0.625}))
    chat = {"chatcore": 0.125, "tasks": [{"task": "demo-answer", "correct": 3, "items": 4, "centered": 0.75}]}
    (run / "stage_evals" / "rl" / "chat_eval.json").write_text(json.dumps(chat))
    (run / "stage_evals" / "rl" / "chat_eval_items.jsonl").write_text(json.dumps(
        {"task": "demo-answer", "question": "What is 17 plus 25?", "answers": ["42"], "reply": "42",
         "calculator": [["17+25", "42"]], "correct": True}) + "\n")
    lines = per_stage_table(run)
    assert lines[0] == "| ability | pretrain | midtrain | sft | rl |"
    assert "| pretraining val bpb | 0.5000 | unknown | unknown | 0.6250 |" in lines
    assert "| CORE: t (accuracy) | 0.7500 | unknown | unknown | 0.7500 |" in lines
    assert "| demo-answer | not asked (a base model) | unknown | unknown | 3/4 |" in lines
    assert "| sample, demo-answer: What is 17 plus 25? | not asked (a base model) | unknown | unknown | " \
        "'<<17+25=42>>42' |" in lines
    shutil.rmtree(run / "rl")
    assert per_stage_table(run)[0] == "| ability | pretrain | midtrain | sft |"


def test_rl_has_its_row_in_the_stages_table_and_its_hardware_line(tmp_path):
    """An rl/ run is a training stage like the others: its steps, wall time, sampled tokens, tok/s and held-out pass@1
    in the stages table, and its hardware line; a run without rl/ has neither."""
    from report import write_report
    run = tmp_path / "run"
    (run / "logs").mkdir(parents=True)
    (run / "rl").mkdir()
    (run / "rl" / "config.json").write_text(json.dumps({"stage": "rl", "tasks": "GSM8K /c/gsm8k (held out: GSM8K test)",
                                                        "train_questions": 7473, "params": 4194408,
                                                        "hardware": "single process, device cpu (test)"}))
    (run / "rl" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in [
        {"step": 1, "loss": 0.5, "tokens": 300, "step_time": 2.0, "mfu": "unknown"},
        {"step": 2, "loss": 0.25, "tokens": 900, "step_time": 4.0, "mfu": "unknown"}]))
    (run / "rl" / "done.json").write_text(json.dumps({"step": 2, "reward_first_fifth": 0.25, "reward_last_fifth": 0.5,
                                                      "held_out_pass@1_first": 0.125, "held_out_pass@1_last": 0.375,
                                                      "note": "n", "held_out": {}}))
    (run / "logs" / "stages.tsv").write_text("rl\t12.5\t0\nreport\t1.0\t0\n")
    write_report(run)
    md = (run / "report.md").read_text()
    assert "- hardware, rl: single process, device cpu (test)" in md
    row = next(line for line in md.splitlines() if line.startswith("| rl |"))
    assert row.split(" | ")[1:] == ["GSM8K /c/gsm8k (held out: GSM8K test); 7,473 training questions", "2", "12.5",
                                    "900", "150", "unknown", "4,194,408", "held-out pass@1 0.375 |"]
    assert "Other stages' wall time (s): report 1.0" in md
    shutil.rmtree(run / "rl")
    write_report(run)
    md = (run / "report.md").read_text()
    assert "| rl |" not in md and "hardware, rl" not in md


def test_under_the_table_each_chat_stage_is_said_to_add_lose_or_hold():
    """From the stages ChatCORE asked, in order: the change and each task's change in items right."""
    from report import stage_changes

    def figures(chatcore, x, y):
        return {"chatcore": chatcore, "tasks": [{"task": "x", "correct": x}, {"task": "y", "correct": y}]}
    chat = {"pretrain": None, "midtrain": figures(0.25, 3, 5), "sft": figures(0.5, 7, 4), "rl": figures(0.375, 6, 4)}
    assert stage_changes(list(chat), chat) == [
        "- sft against midtrain: ChatCORE +0.2500 (added); items right: x +4, y -1",
        "- rl against sft: ChatCORE -0.1250 (lost); items right: x -1, y +0"]
    chat["rl"] = figures(0.5, 6, 5)
    assert stage_changes(list(chat), chat)[1] == "- rl against sft: ChatCORE +0.0000 (held); items right: x -1, y +1"
    assert stage_changes(["pretrain", "sft"], {"pretrain": None, "sft": figures(0.5, 1, 1)}) == []
