"""gpu_plan.py: a rehearsal's rates measured from its files, each stage's wall time predicted at the plan's budgets
(exact seconds on hand-written files), report.py's predicted column, and a prediction from a 3-step pretraining
checked against a 9-step one of the same shape."""
import json
import math
import os
import time

import pytest
from helpers import run_in_process

import gpu_plan
import pretrain

FINAL_EVAL_AT = 1_700_000_000.0  # rank 0's progress mark of pretraining's final evaluation; done.json 4 s later


def write_jsonl(path, records):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def training_stage(run, stage, step_times, tokens_per_step, args, sequence_len=50, save_s="1.5"):
    write_jsonl(run / stage / "metrics.jsonl", [{"step": i + 1, "step_time": t, "tokens": (i + 1) * tokens_per_step}
                                                for i, t in enumerate(step_times)] + [{"step": 3, "chatcore": 0.1}])
    (run / stage / "config.json").write_text(json.dumps({"stage": stage, "tokens_per_step": tokens_per_step,
                                                         "model_config": {"sequence_len": sequence_len},
                                                         "args": args}))
    if save_s is not None:
        (run / stage / "ckpt").mkdir()
        (run / stage / "ckpt" / "save_seconds").write_text(save_s + "\n")


def rehearsal(tmp_path):
    """A rehearsal's files with round numbers: every rate below is exact."""
    run = tmp_path / "speedrun-rehearsal"
    (run / "logs").mkdir(parents=True)
    (run / "logs" / "stages.tsv").write_text(
        "data\t3.0\t0\npretrain\t30.0\t0\ncore_eval\t12.0\t0\nmidtrain\t20.0\t0\nsft\t15.0\t0\nrl\t20.0\t0\n"
        "chat_eval\t13.0\t0\nchat_eval_sft\t9.0\t1\nchat_eval_sft\t11.0\t0\nreport\t0.5\t0\n")
    training_stage(run, "pretrain", [10.0, 2.0, 2.0], 1000, {"ckpt_every": 2, "bpb_tokens": 100})
    (run / "pretrain" / "progress").mkdir()
    (run / "pretrain" / "progress" / "rank000.txt").write_text(
        f"rank 0: stage pretrain step 3 trained: final evaluation, process 1 on vm, at {FINAL_EVAL_AT:.3f} (00:00:00)\n")
    (run / "pretrain" / "done.json").write_text("{}")
    os.utime(run / "pretrain" / "done.json", (FINAL_EVAL_AT + 4, FINAL_EVAL_AT + 4))
    training_stage(run, "midtrain", [8.0, 3.0, 3.0], 1000, {"ckpt_every": 2, "eval_rows": 2})
    training_stage(run, "sft", [5.0, 4.0, 4.0], 1000, {"ckpt_every": 2, "eval_rows": 2})
    write_jsonl(run / "rl" / "metrics.jsonl", [
        {"step": 0, "held_out": {}},
        {"step": 1, "step_time": 5.0, "rollout_time": 4.0, "reply_tokens": 10.0, "sampled_tokens": 80},
        {"step": 2, "step_time": 3.0, "rollout_time": 2.0, "reply_tokens": 10.0, "sampled_tokens": 80},
        {"step": 2, "final": True, "held_out": {}}])
    (run / "rl" / "config.json").write_text(json.dumps({"stage": "rl", "world_size": 2, "args": {
        "questions_per_step": 4, "samples": 2, "max_new_tokens": 10, "ckpt_every": 1, "eval_every": 0,
        "eval_items": 4}}))
    (run / "rl" / "ckpt").mkdir()
    (run / "rl" / "ckpt" / "save_seconds").write_text("0.5\n")
    (run / "core_eval").mkdir()
    (run / "core_eval" / "results.json").write_text(json.dumps({"seconds": 2.0, "val_bpb_tokens": 100, "tasks": [
        {"task": "a", "type": "multiple_choice", "items": 4, "items_in_task": 40},
        {"task": "b", "type": "schema", "items": 4, "items_in_task": 20}]}))
    chat = {"seconds": 3.0, "max_new_tokens": 16, "tasks": [
        {"task": "ARC-Easy", "kind": "categorical", "items": 2, "items_in_task": 10, "seconds": 0.5},
        {"task": "GSM8K", "kind": "gsm8k", "items": 2, "items_in_task": 6, "seconds": 2.5}]}
    (run / "chat_eval.json").write_text(json.dumps(chat))
    (run / "stage_evals" / "sft").mkdir(parents=True)
    for task in chat["tasks"]:  # results without each task's seconds: the mean rate
        del task["seconds"]
    (run / "stage_evals" / "sft" / "chat_eval.json").write_text(json.dumps(chat))
    return run


BUDGETS = {
    "pretrain": {"steps": 100, "tokens_per_step": 1000, "eval_every": 25, "ckpt_every": 40, "val_tokens": 1600},
    "midtrain": {"tokens": 10_000, "tokens_per_step": 2000, "eval_every": 0, "ckpt_every": 1000, "val_tokens": 100},
    "sft": {"steps": None, "why_unknown": "one epoch, counted when sft.py starts"},
    "rl": {"steps": 10, "questions_per_step": 8, "samples": 4, "max_new_tokens": 20, "eval_every": 4,
           "ckpt_every": 5, "eval_items": 6, "eval_samples": 4},
    "core_eval": {"max_items": -1, "bpb_tokens": 1600},
    "chat_eval": {"max_items": -1, "max_new_tokens": 64},
}
# pretrain: start 30 - 3 steps x 2 s - 2 saves x 1.5 s - 4 s final evaluation = 17; 100 steps x 2 s; 3 saves;
#   3 evaluations + the final, each 4 s + 1,500 more validation tokens / (3 x 500 tok/s) = 5 s
# midtrain: start 20 - 9 - 3 = 8 (its final evaluation not measurable: no progress file); 5 steps of 2000 tokens at
#   2 x 3 s; 1 save; the final evaluation in its start-up, no more validation tokens
# rl: 2 groups of 10 tokens in 2 s: 0.1 s a decode forward; update 1 s on 80 tokens; held out (2 evaluations): 2 groups
#   x 10 forwards = 2 s; start 20 - 2 x 3 - 2 x 0.5 - 2 x 2 = 9. Plan: 4 groups x 20 forwards = 8 s of rollout; update
#   1 + (8 x 4 x 20 - 80) / 500 = 2.12 s; 2 saves; 2 + 9 // 4 = 4 evaluations of 3 groups x 20 forwards = 6 s
# core_eval: start 12 - 2 = 10; 60 items x 0.25 s; 1,500 more validation tokens / (3 x 500) = 1 s
# chat_eval: start 13 - 3 = 10; ARC-Easy 10 x 0.25 s; GSM8K 6 x 1.25 s x 64 / 16
# chat_eval_sft: start 11 - 3 = 8 (the failed try of 9 s not counted); no task seconds: 0.75 s an item, GSM8K x 4 as above
EXPECTED = {"pretrain": 17 + 100 * 2 + 3 * 1.5 + 4 * 5, "core_eval": 10 + 60 * 0.25 + 1,
            "midtrain": 8 + 5 * 6 + 1 * 1.5, "sft": None, "rl": 9 + 10 * (8 + 2.12) + 2 * 0.5 + 4 * 6,
            "chat_eval": 10 + 10 * 0.25 + 6 * 1.25 * 4, "chat_eval_sft": 8 + 10 * 0.75 + 6 * 0.75 * 4, "report": 0.5}


def test_each_stage_is_predicted_from_the_rehearsal_rates_at_the_plan_budgets(tmp_path):
    prediction = gpu_plan.predict_plan(rehearsal(tmp_path), BUDGETS, gpus=2)
    stages = prediction["stages"]
    assert list(stages) == list(EXPECTED)  # the stages.tsv order; data ran before the prediction
    for name, seconds in EXPECTED.items():
        assert stages[name]["seconds"] == (None if seconds is None else pytest.approx(seconds, abs=1e-9)), name
    total = sum(s for s in EXPECTED.values() if s is not None)
    assert prediction["seconds"] == pytest.approx(total, abs=1e-9)
    assert prediction["hours"] == pytest.approx(total / 3600) and prediction["gpu_hours"] == pytest.approx(total / 1800)
    assert prediction["unknown"] == ["sft"] and stages["sft"]["assumption"] == "one epoch, counted when sft.py starts"
    assert stages["pretrain"]["parts"] == {"start_s": 17.0, "steps": 100, "step_s": 2.0, "saves": 3, "save_s": 1.5,
                                           "evaluations": 4, "eval_s": 5.0}
    assert stages["pretrain"]["budget"] == "100 steps x 1,000 tokens; 3 saves; 3 + 1 evaluations"
    assert stages["rl"]["budget"] == ("10 steps x 8 questions x 4 samples x up to 20 tokens (at most 6,400 sampled); 2 "
                                      "saves; 4 held-out evaluations of 6 questions")
    assert "steps of 2,000 tokens cost the rehearsal's (1,000) x their ratio: 6.000 s" in \
        stages["midtrain"]["assumption"]
    assert "every reply run to 20 tokens (the ceiling" in stages["rl"]["assumption"]
    assert stages["chat_eval"]["assumption"] == ("each task at the rehearsal's seconds per item, its 2 items a task "
                                                 "batched together: the plan's fuller batches run faster, an upper "
                                                 "bound; generated answers up to 64 tokens cost the rehearsal's (up "
                                                 "to 16) x 4: an upper bound, answers end sooner")
    assert stages["chat_eval_sft"]["assumption"].startswith("each task at the rehearsal's seconds per item (the mean: "
                                                            "its results have no per-task seconds), its 2 items")
    lines = gpu_plan.format_prediction(prediction)
    assert lines[-1] == f"total: at least {total / 3600:.2f} h, {total / 1800:.1f} GPU-hours (2 GPUs); unknown: sft"
    assert any(line.startswith("pretrain") and line.split()[1] == "242" for line in lines)  # 241.5 s, rounded


def test_a_stage_without_its_save_time_or_its_timed_steps_says_so(tmp_path):
    run = rehearsal(tmp_path)
    (run / "pretrain" / "ckpt" / "save_seconds").unlink()
    stage = gpu_plan.predict_plan(run, BUDGETS, gpus=1)["stages"]["pretrain"]
    assert stage["seconds"] is None and stage["assumption"].startswith("save time unknown: ckpt/save_seconds is gone")
    write_jsonl(run / "midtrain" / "metrics.jsonl", [{"step": 1, "step_time": 8.0}])
    with pytest.raises(ValueError, match="1 step\\(s\\) timed; midtrain's rate is measured on the steps after the "
                                         "first \\(which holds compilation\\): rehearse it for at least 2 steps"):
        gpu_plan.predict_plan(run, BUDGETS, gpus=1)
    budgets = {k: v for k, v in BUDGETS.items() if k != "rl"}
    write_jsonl(run / "midtrain" / "metrics.jsonl", [{"step": 1, "step_time": 8.0}, {"step": 2, "step_time": 3.0}])
    assert gpu_plan.predict_plan(run, budgets, gpus=1)["stages"]["rl"]["seconds"] is None


def test_a_stage_that_ran_without_a_time_in_stages_tsv_is_unknown_not_left_out(tmp_path):
    run = rehearsal(tmp_path)  # a timeout stopped the rehearsal as sft finished: its row was never written
    rows = (run / "logs" / "stages.tsv").read_text().splitlines()
    (run / "logs" / "stages.tsv").write_text("".join(f"{r}\n" for r in rows if not r.startswith("midtrain\t")))
    prediction = gpu_plan.predict_plan(run, BUDGETS, gpus=2)
    assert prediction["stages"]["midtrain"]["seconds"] is None
    assert prediction["stages"]["midtrain"]["assumption"] == \
        "midtrain/ is there but logs/stages.tsv has no time for it: rehearse again"
    assert prediction["unknown"] == ["sft", "midtrain"]
    assert gpu_plan.format_prediction(prediction)[-1].endswith("GPU-hours (2 GPUs); unknown: sft, midtrain")


def test_the_command_line_writes_the_prediction_beside_the_run_and_report_shows_it(tmp_path, capsys):
    from report import write_report
    run = rehearsal(tmp_path)
    (tmp_path / "plan.json").write_text(json.dumps(BUDGETS))
    assert gpu_plan.main([str(run), "--plan_json", str(tmp_path / "plan.json"), "--gpus", "2"]) == 0
    out = capsys.readouterr().out
    written = json.loads((tmp_path / "speedrun" / "predicted.json").read_text())
    assert written == json.loads(json.dumps(gpu_plan.predict_plan(run, BUDGETS, gpus=2)))
    assert f"written: {tmp_path / 'speedrun' / 'predicted.json'}" in out and "total: at least 0.14 h" in out
    # report.py on the real run: the predicted beside the actual wall time, "unknown" where none
    real = tmp_path / "speedrun"
    (real / "logs").mkdir()
    (real / "logs" / "stages.tsv").write_text("pretrain\t250.0\t0\nsft\t99.0\t0\ncore_eval\t20.0\t0\nreport\t1.0\t0\n")
    for stage in ("pretrain", "sft"):
        write_jsonl(real / stage / "metrics.jsonl", [{"step": 1, "loss": 1.0, "tokens": 10, "step_time": 1.0,
                                                      "mfu": "unknown"}])
    write_report(real)
    md = (real / "report.md").read_text()
    header = next(line for line in md.splitlines() if line.startswith("| stage |"))
    assert header.split(" | ")[3:5] == ["wall time (s)", "predicted (s)"]
    cells = {line.split(" | ")[0]: line.split(" | ")[3:5] for line in md.splitlines() if line.startswith("| ")}
    assert cells["| pretrain"] == ["250.0", "241.5"] and cells["| sft"] == ["99.0", "unknown"]
    assert cells["| midtrain"] == ["unknown", "39.5"]
    assert "Other stages' wall time (s): core_eval 20.0 (predicted 26.0), report 1.0 (predicted 0.5)" in md
    assert (f"gpu_plan.py): {written['hours']:.2f} h, {written['gpu_hours']:.1f} GPU-hours, unknown: sft; actual, "
            f"the same stages: {(250 + 99 + 20 + 1) / 3600:.2f} h.") in md


def test_a_prediction_from_3_pretraining_steps_predicts_9(demo_world, tmp_path, capsys):
    """pretrain.py for 3 steps (the rehearsal), its 9-step run predicted, then run: the steps after the first and the
    stage's wall time each within 50% of the prediction. Measured on the 2-core machine this suite runs on, shared with
    other work: steps -25% to +44%, wall -27% to +29% over a dozen runs (one more, under a load that changed between its two
    runs: steps +72%); a 2-step rate moves by tens of percent when another process takes the core for part of a step.
    Both runs in this process (a new interpreter's imports would be most of the time), timed as speedrun.sh times a
    stage, after a 1-step warm-up that pays the process's one-time imports."""
    common = ["--data_dir", str(demo_world / "demo" / "pretrain"), "--tokenizer", str(demo_world / "tokenizer"),
              "--sequence_len", "128", "--n_layer", "2", "--n_embd", "128", "--n_head", "2", "--n_kv_head", "2",
              "--micro_batch", "8", "--total_batch_tokens", "1024", "--eval_every", "0", "--bpb_tokens", "4096",
              "--compile", "false", "--ckpt_every", "2", "--run_name", "pretrain"]
    walls = {}
    for steps in (1, 3, 9):  # the first: the warm-up
        started = time.perf_counter()
        code, _, err = run_in_process(pretrain.main, [*common, "--steps", steps, "--runs_dir", tmp_path / f"r{steps}"],
                                      capsys, stage="pretrain.py")
        assert code == 0, err[-3000:]
        walls[steps] = time.perf_counter() - started
        (tmp_path / f"r{steps}" / "logs").mkdir()
        (tmp_path / f"r{steps}" / "logs" / "stages.tsv").write_text(f"pretrain\t{walls[steps]:.1f}\t0\n")
    budgets = {"pretrain": {"steps": 9, "eval_every": 0, "ckpt_every": 2, "val_tokens": 4096}}
    predicted = gpu_plan.predict_plan(tmp_path / "r3", budgets, gpus=1)["stages"]["pretrain"]
    measured = gpu_plan.measure_training(tmp_path / "r9", "pretrain", walls[9])
    predicted_steps, measured_steps = 8 * predicted["parts"]["step_s"], 8 * measured["step_s"]
    print(f"steps 2-9: predicted {predicted_steps:.2f} s, measured {measured_steps:.2f} s "
          f"({predicted_steps / measured_steps - 1:+.1%}); wall: predicted {predicted['seconds']:.2f} s, measured "
          f"{walls[9]:.2f} s ({predicted['seconds'] / walls[9] - 1:+.1%})")
    assert predicted["parts"]["saves"] == 5 == math.ceil(9 / 2)
    # the step time is the 3-step run's own, read back from its metrics (steps after the first): exact, not timed; how
    # near it comes to the 9-step run on a CPU is a measurement (dev/LOG.md: -25%..+61%), not a test
    times = [json.loads(line)["step_time"] for line in (tmp_path / "r3" / "pretrain" / "metrics.jsonl").read_text()
             .splitlines() if "step_time" in line]
    assert predicted["parts"]["step_s"] == pytest.approx(sum(times[1:]) / len(times[1:]), rel=1e-9)
