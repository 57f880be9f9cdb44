"""rl.py: the reward and advantage arithmetic, the update on the sampled tokens only (2 gloo processes, a hand-made
policy whose gradient is known in closed form), sampling that is chat_eval's generation, and a resumed run that
repeats the uninterrupted run's rewards exactly."""
import json
import os
import signal
from argparse import Namespace

import faults
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from helpers import run_in_process
from rl_worker import hand_made_policy, scored_step, tokenizer

import chat
import export
import optim
import rl


def test_the_reward_is_the_number_after_the_marker_and_advantages_are_reward_minus_the_groups_mean(tmp_path):
    gsm8k = {"answer": "18"}
    assert [rl.reward(gsm8k, r) for r in ["so 18.\n#### 18", "#### 18.00", "#### 1,8", "18", "#### 17"]] == \
        [1.0, 1.0, 1.0, 0.0, 0.0]  # no '####': wrong (nanochat's rule); 18.00 is 18; commas are dropped
    assert rl.advantages([1, 0, 0, 1, 1, 1, 1, 1, 0, 0, 0, 1], 4).tolist() == \
        [0.5, -0.5, -0.5, 0.5, 0.0, 0.0, 0.0, 0.0, -0.25, -0.25, -0.25, 0.75]
    problems = tmp_path / "problems"
    problems.mkdir()
    pq.write_table(pa.Table.from_pylist([{"question": "Bo has 2 bags of 3 plums. How many plums?",
                                          "answer": "2 * 3 = <<2*3=6>>6.\n#### 6"},
                                         {"question": "Ada had 9 and ate 4. How many are left?",
                                          "answer": "9 - 4 = <<9-4=5>>5.\n#### 5"}]), problems / "train.parquet")
    items = rl.gsm8k_items(problems)  # the demo's word problems, checked by the number after '####' as GSM8K's
    assert items == [{"prompt": "Bo has 2 bags of 3 plums. How many plums?", "answer": "6"},
                     {"prompt": "Ada had 9 and ate 4. How many are left?", "answer": "5"}]
    assert [rl.reward(items[1], r) for r in ["<<9-4=5>>5.\n#### 5", "5", "#### 6"]] == [1.0, 0.0, 0.0]


def test_a_question_whose_replies_all_scored_alike_is_left_out_and_the_update_is_unchanged_but_its_count():
    rows = [([1, 2, 3], [-1, 3, 4]), ([1, 2], [-1, 5]), ([1, 6], [-1, 7]), ([1, 8, 9], [-1, 9, 2])]
    kept, weights = rl.teaching_rows(rows, rl.advantages([1, 1, 1, 0], 2))
    assert kept == rows[2:] and weights.tolist() == [0.5, -0.5]
    kept, weights = rl.teaching_rows(rows[:2], rl.advantages([0, 0], 2))
    assert kept == rows[:1] and weights.tolist() == [0.0]  # one row at 0, so that each rank's backward syncs
    model, _ = hand_made_policy(tokenizer())
    gradients = []
    for part, part_weights in [(rows, rl.advantages([1, 1, 1, 0], 2)),
                               rl.teaching_rows(rows, rl.advantages([1, 1, 1, 0], 2))]:
        model.zero_grad()
        _, count = rl.policy_gradient(model, part, part_weights, 2, "float32", torch.device("cpu"), 1)
        gradients.append((model.lm_head.weight.grad.clone(), count))
    (all_rows, all_count), (taught, taught_count) = gradients
    assert (all_count, taught_count) == (6, 3)  # sampled tokens: every row's, then the two taught rows'
    assert taught.abs().sum() > 0
    torch.testing.assert_close(all_rows * all_count, taught * taught_count)


def test_a_steps_lrs_are_the_schedules_times_the_share_of_its_questions_that_teach(monkeypatch):
    """Muon and Adam normalize a step's size: rl_step scales every lr by the share of its questions whose replies
    scored differently. Of three questions, the first's four replies all right, the second's differ, the third's all
    wrong: a third of the schedule's lrs."""
    scores = iter([1.0] * 4 + [0.0, 1.0, 0.0, 1.0] + [0.0] * 4)
    monkeypatch.setattr(rl, "reward", lambda item, text: next(scores))
    record, base, args = scored_step(tokenizer(), 4, 0, 1)
    schedule = optim.lr_multiplier(4, 10, args)  # linear decay to 0: 1 - 4 / 10
    assert schedule == pytest.approx(0.6) and record["teaching"] == pytest.approx(1 / 3)
    assert record["lr_mult"] == pytest.approx(schedule / 3)
    assert record["lr"] == pytest.approx({name: lr * schedule / 3 for name, lr in base.items()})


@pytest.mark.two_processes
def test_the_share_of_questions_that_teach_is_counted_over_every_rank(two_rank_results):
    """Rank 0's two questions teach nothing, rank 1's one does: both ranks scale their lrs by 1/3 (step 1 of 10's
    schedule is 1), not by their own share (0 and 1)."""
    for teaching, lr_mult, lrs, base in two_rank_results["rl"]["teaching"]:
        assert teaching == pytest.approx(1 / 3) and lr_mult == pytest.approx(1 / 3)
        assert lrs == pytest.approx({name: lr / 3 for name, lr in base.items()})


def test_questions_are_a_function_of_the_step_and_each_epoch_takes_every_question_once():
    steps = [rl.step_items(step, 4, 10, seed=3) for step in range(5)]  # 20 questions: two epochs of 10
    stream = [i for items in steps for i in items]
    assert sorted(stream[:10]) == list(range(10)) == sorted(stream[10:])
    assert stream[:10] != stream[10:]  # a new order every epoch
    assert rl.step_items(3, 4, 10, seed=3) == steps[3]


def test_sampling_runs_the_calculator_for_each_row_at_temperature_zero():
    """Greedy rows of one question's group: the hand-made policy's call, the calculator's output fed (marked as not
    sampled), then the answer and <|assistant_end|>, the same in every row."""
    tok = tokenizer()
    model, prompt = hand_made_policy(tok)
    replies, sampled = rl.sample_groups(model, tok, [prompt], 3, 20, 0.0, 0, 0, "float32")
    sid, stop = tok.special_id, tok.special_id("<|assistant_end|>")
    output = [sid("<|output_start|>"), *tok.encode("7"), sid("<|output_end|>")]
    expected = [sid("<|python_start|>"), *tok.encode("3+4"), sid("<|python_end|>"), *output, *tok.encode("7"), stop]
    assert replies == [expected] * 3
    first = 2 + len(tok.encode("3+4"))  # where the calculator's output starts
    assert sampled == [[not first <= i < first + 3 for i in range(len(expected))]] * 3


def test_several_questions_decoded_together_give_each_questions_greedy_replies_and_seeded_samples():
    """sample_groups: prompts of different lengths in one batch, 3 rows each; at temperature 0 every row is what
    its prompt decoded alone gives, the calculator's output marked as not sampled; sampling with a seed gives
    the same rows again, another seed other rows."""
    tok = tokenizer()
    model, prompt = hand_made_policy(tok)
    prompts = [prompt, tok.render_for_completion([{"role": "user", "content": "four"}]),
               tok.render_for_completion([{"role": "user", "content": "what is three plus four " * 3}])]
    assert len({len(p) for p in prompts}) == 3
    replies, sampled = rl.sample_groups(model, tok, prompts, 3, 20, 0.0, 0, 0, "float32")
    stop = tok.special_id("<|assistant_end|>")
    expected = [rl.sample_groups(model, tok, [p], 1, 20, 0.0, 0, 0, "float32")[0][0] for p in prompts]
    assert replies == [e for e in expected for _ in range(3)] and expected[0][-1] == stop
    first = 2 + len(tok.encode("3+4"))  # where the calculator's output starts
    assert sampled[0] == [not first <= i < first + 3 for i in range(len(expected[0]))]
    a = rl.sample_groups(model, tok, prompts, 4, 12, 1.0, 0, 5, "float32")
    assert a == rl.sample_groups(model, tok, prompts, 4, 12, 1.0, 0, 5, "float32")
    assert a != rl.sample_groups(model, tok, prompts, 4, 12, 1.0, 0, 6, "float32")


def closed_form_gradient(result, include_unsampled=False):
    """d/d(head) of -sum(advantage x log p(token)) / count over the sampled tokens of every reply, for the bigram
    policy: logits = head @ h(previous token), h = rms_norm(embedding row), so the gradient of a token is
    (softmax(logits) - onehot(token)) h^T. include_unsampled: the calculator's output too (what must not happen)."""
    head, wte, grad = result["head"].double(), result["wte"].double(), torch.zeros_like(result["head"]).double()
    count = 0
    for rollout in result["rollouts"]:
        sequence = result["prompt"] + rollout["reply"]
        for k, (token, own) in enumerate(zip(rollout["reply"], rollout["sampled"], strict=True)):
            if not (own or include_unsampled):
                continue
            x = wte[sequence[len(result["prompt"]) + k - 1]]
            h = x / (x.pow(2).mean() + result["eps"]).sqrt()
            probs = torch.softmax(head @ h, 0)
            probs[token] -= 1
            grad += rollout["advantage"] * torch.outer(probs, h)
            count += 1
    return grad / count, count


@pytest.mark.two_processes
def test_the_update_on_two_ranks_is_the_gradient_of_the_sampled_tokens_only(two_rank_results):
    result = two_rank_results["rl"]  # tests/rl_worker.py's, on 2 gloo processes
    tok = tokenizer()
    sid, rollouts = tok.special_id, result["rollouts"]
    assert len(rollouts) == 8 * 3  # rank 0: one question, rank 1: two
    for r in rollouts:  # what the model did not write: the calculator's output, right after <|python_end|>
        reply, unsampled = r["reply"], set()
        for i in range(1, len(reply)):
            if reply[i - 1] == sid("<|python_end|>") and reply[i] == sid("<|output_start|>"):
                end = reply.index(sid("<|output_end|>"), i)  # <|output_start|> the result <|output_end|>
                unsampled |= set(range(i, end + 1))
        assert r["sampled"] == [i not in unsampled for i in range(len(reply))]
    assert any(not all(r["sampled"]) for r in rollouts)  # the calculator answered in some replies
    assert 0 < sum(r["reward"] for r in rollouts) < len(rollouts)  # and the rewards differ
    expected, count = closed_form_gradient(result)
    assert count == result["count"]
    torch.testing.assert_close(result["grad"].double(), expected, rtol=1e-4, atol=1e-7)
    wrong, _ = closed_form_gradient(result, include_unsampled=True)
    assert (wrong - expected).abs().max() > 100 * (result["grad"].double() - expected).abs().max()


def test_a_resumed_run_repeats_the_uninterrupted_runs_rewards_exactly(chat_chain, demo_world, tmp_path, capsys,
                                                                       monkeypatch):
    """Stopped by SIGTERM during step 2's rollouts (a step can take minutes): step 2 is dropped at once and step 1
    checkpointed; resumed, steps 2 to 4 have the uninterrupted run's rewards and losses, bitwise (the questions and the
    sampling seeds are functions of the step)."""
    args = ["--checkpoint", chat_chain["sft"], "--tokenizer", demo_world / "tokenizer", "--demo", demo_world / "demo",
            "--runs_dir", tmp_path, "--steps", "4", "--questions_per_step", "2", "--samples", "4",
            "--max_new_tokens", "24", "--eval_items", "4", "--eval_samples", "2", "--eval_every", "0"]
    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
    try:
        code, out, err = run_in_process(rl.main, [*args, "--run_name", "straight"], capsys, stage="rl.py")
        assert code == 0, err
        with monkeypatch.context() as patch:  # a SIGTERM as step 2 starts: during its rollouts
            faults.install({"signal_at_step": 2}, patch.setattr)
            code, out, err = run_in_process(rl.main, [*args, "--run_name", "stopped"], capsys, stage="rl.py")
        assert code == 128 + signal.SIGTERM, err
        assert f"stopped by signal during step 2's rollouts; checkpoint {tmp_path / 'stopped' / 'ckpt' / 'step_000001'}" \
            in out, out
        assert [json.loads(line)["step"] for line in (tmp_path / "stopped" / "metrics.jsonl").read_text().splitlines()
                if "reward" in line] == [1]
        code, out, err = run_in_process(rl.main, [*args, "--run_name", "stopped", "--resume"], capsys, stage="rl.py")
        assert code == 0 and "resume: from" in out, err
    finally:
        for s, handler in handlers.items():
            signal.signal(s, handler)

    def steps(run):
        records = [json.loads(line) for line in (tmp_path / run / "metrics.jsonl").read_text().splitlines()]
        return [(r["step"], r["reward"], r["loss"], r["sampled_tokens"]) for r in records if "reward" in r]
    straight = steps("straight")
    assert [s for s, *_ in straight] == [1, 2, 3, 4]
    assert steps("stopped") == straight
    # the suite's 1-layer model solves no word problem (reward 0, so no update): what is compared is the rollouts,
    # which differ from step to step; the update after a resume is rl_worker's closed-form test's
    assert len({tokens for *_, tokens in straight}) > 1
    done = json.loads((tmp_path / "stopped" / "done.json").read_text())
    assert done == json.loads((tmp_path / "straight" / "done.json").read_text())


def test_chat_and_export_pick_the_newer_of_the_rl_and_sft_checkpoints_unless_told(tmp_path):
    def made(run, stage, mtime):
        ckpt = tmp_path / run / "ckpt" / "step_000001"
        ckpt.mkdir(parents=True)
        (ckpt / "meta.json").write_text(json.dumps({"stage": stage}))
        os.utime(ckpt / "meta.json", (mtime, mtime))
        return ckpt
    sft, rl_ckpt = made("sft", "sft", 1000), made("rl", "rl", 2000)
    made("mid", "midtrain", 3000)  # newer, but a chat stage's checkpoint comes first
    assert export.pick_checkpoint is chat.pick_checkpoint
    assert chat.pick_checkpoint(Namespace(checkpoint=None, runs_dir=tmp_path)) == \
        (rl_ckpt, f"newest rl checkpoint under {tmp_path}")
    os.utime(sft / "meta.json", (4000, 4000))  # SFT trained again after RL: its checkpoint is the newer
    assert chat.pick_checkpoint(Namespace(checkpoint=None, runs_dir=tmp_path))[0] == sft
    assert chat.pick_checkpoint(Namespace(checkpoint=str(tmp_path / "rl"), runs_dir=tmp_path))[0] == rl_ckpt


def test_a_reward_that_rose_while_held_out_accuracy_fell_is_said_so_and_the_report_draws_it(tmp_path):
    def held_out(step, pass1, items=100):
        return {"step": step, "held_out": {"k": 4, "all": {"pass@1": pass1, "pass@4": 1.0, "items": items}}}
    evals = [held_out(0, 0.5), held_out(10, 0.25)]
    records = [evals[0], *({"step": s, "reward": 0.1 * (s > 5)} for s in range(1, 11)), evals[1]]
    summary = rl.verdict(records)
    assert (summary["reward_first_fifth"], summary["reward_last_fifth"]) == (0.0, 0.1)  # steps 1-2 and 9-10
    assert (summary["held_out_pass@1_first"], summary["held_out_pass@1_last"]) == (0.5, 0.25)
    assert summary["note"].startswith("the reward ROSE while held-out accuracy FELL")
    # one evaluation: 2 * sqrt(2 * 0.25 / 100)
    assert rl.verdict(records[:-1])["note"] == \
        "the reward rose, held-out accuracy did not change beyond its noise (0.141 over 100 questions)"
    assert rl.verdict([*records, held_out(20, 0.75)])["note"] == "the reward rose, held-out accuracy rose"
    # the demo's RL: 0.812 -> 0.800 over 40 questions is noise, not forgetting
    fewer = [held_out(0, 0.8125, 40), *records[1:-1], held_out(10, 0.8, 40)]
    assert rl.verdict(fewer)["note"] == \
        "the reward rose, held-out accuracy did not change beyond its noise (0.177 over 40 questions)"
    import report
    (tmp_path / "rl").mkdir()
    (tmp_path / "rl" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (tmp_path / "rl" / "done.json").write_text(json.dumps(summary))
    report.write_report(tmp_path)
    md = (tmp_path / "report.md").read_text()
    assert "RL: mean reward 0.000 -> 0.100 (first and last fifth of its steps), held-out pass@1 0.500 -> 0.250: the " \
           "reward ROSE while held-out accuracy FELL" in md
    assert (tmp_path / "loss.png").read_bytes()[:4] == b"\x89PNG"


def test_the_eta_counts_the_held_out_evaluations_still_to_come():
    """The gpu plan's rl (468 steps, held-out evaluations every 60 and at the end): after step 1 the ETA holds 467
    steps and 8 evaluations (60, 120, ... 420, and the final one), after step 60 it holds 7, after 420 only the final."""
    assert rl.eta_seconds(1, 468, 60, 2.0, 30.0) == 467 * 2.0 + 8 * 30.0
    assert rl.eta_seconds(60, 468, 60, 2.0, 30.0) == 408 * 2.0 + 7 * 30.0
    assert rl.eta_seconds(420, 468, 60, 2.0, 30.0) == 48 * 2.0 + 1 * 30.0
    assert rl.eta_seconds(3, 10, 0, 1.0, 5.0) == 7 * 1.0 + 5.0  # --eval_every 0: the final evaluation only
