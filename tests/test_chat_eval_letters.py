"""chat_eval.py's multiple choice: batched prompts give what one prompt at a time gives, each option's text scored as
the reply equals a direct log-softmax, the diagnostics that tell "does not know" from "cannot pick the letter", and
the progress lines."""
import json
from types import SimpleNamespace

import pytest
import torch
from helpers import run_in_process

import chat_eval as E
import checkpoint
from dataset import render_mc
from model import build_model, config_from_preset
from tokenizer import SPLIT_PATTERN, Tokenizer

BYTES = Tokenizer({bytes([b]): b for b in range(256)}, SPLIT_PATTERN)  # one token per byte
CPU = torch.device("cpu")
QUESTIONS = [("Which is red?", ["apple", "sky", "grass", "snow"], 0),
             ("Pick the city that serves as the seat of Aldora, the old kingdom by the sea.", ["Pelmo", "Vask",
                                                                                                "Orrin", "Tule"], 2),
             ("Two plus two?", ["3", "4", "5", "22"], 1),
             ("Which one barks?", ["a cat", "a dog", "a fish"], 1),
             ("A long question about the banner of a land far away, mostly of which colour? " * 2,
              ["blue", "green", "gold", "white"], 3)]


@pytest.fixture(scope="module")
def model():
    """A random tiny model whose letters differ clearly: a unit-scale head gives logits of std ~8, so no two letters
    are within float noise of a tie (seed 3: not the same letter for every prompt)."""
    torch.manual_seed(3)
    config = config_from_preset("tiny", {"vocab_size": BYTES.vocab_size, "n_layer": 2, "n_embd": 64, "n_head": 2,
                                         "n_kv_head": 2, "sequence_len": 512})
    m = build_model(config)
    with torch.no_grad():
        m.head_weight().normal_(0, 1)
    return m.eval()


def items():
    return [{"prompt": render_mc(q, list("ABCD"[:len(opts)]), opts), "letters": list("ABCD"[:len(opts)]),
             "answer": "ABCD"[gold], "options": opts, "question": q, "row": i}
            for i, (q, opts, gold) in enumerate(QUESTIONS)]


def args(**kw):
    return SimpleNamespace(**{"dtype": "float32", "batch_items": 8, "option_text": "on", "max_new_tokens": 4, **kw})


def test_batched_letters_equal_one_prompt_at_a_time(model):
    """One forward over the right-padded prompts (nanochat's batching) against each prompt alone through the model's
    own last-position forward: the same letters, the same letter probabilities and mass within float tolerance."""
    batch = E.letter_scores(model, BYTES, items(), "float32", CPU)
    assert len({len(BYTES.render_for_completion([{"role": "user", "content": i["prompt"]}])) for i in items()}) == 5
    for item, (letter, cut, record) in zip(items(), batch):
        ids = BYTES.render_for_completion([{"role": "user", "content": item["prompt"]}])
        with torch.no_grad():
            logits = model(torch.tensor([ids]), last_only=True)[0, -1]
        letter_ids = [BYTES.encode(x)[0] for x in item["letters"]]
        probs = torch.softmax(logits[letter_ids], 0)
        assert letter == item["letters"][int(probs.argmax())] and not cut
        assert list(record["letter_probs"]) == item["letters"]
        assert list(record["letter_probs"].values()) == pytest.approx(probs.tolist(), abs=1e-5)
        assert record["letter_mass"] == pytest.approx(torch.softmax(logits, 0)[letter_ids].sum().item(), abs=1e-6)
    assert len({letter for letter, _, _ in batch}) > 1  # not one letter for every prompt
    one, many = (E.evaluate_task("demo-choice", items(), model, BYTES, args(batch_items=n), 0, 1, CPU, "M", None)
                 for n in (1, 3))
    assert one[0] == many[0]
    for a, b in zip(one[1], many[1]):
        assert a["predicted"] == b["predicted"] and a["option_text"]["predicted"] == b["option_text"]["predicted"]
        assert a["option_text"]["predicted_mean"] == b["option_text"]["predicted_mean"]
        assert list(a["letter_probs"].values()) == pytest.approx(list(b["letter_probs"].values()), abs=1e-5)
        assert [s for s, _ in a["option_text"]["scores"]] == pytest.approx([s for s, _ in b["option_text"]["scores"]],
                                                                         abs=1e-4)


def test_each_options_text_is_scored_as_the_reply_by_a_direct_log_softmax(model):
    """The sum of the option tokens' log-probabilities right after <|assistant_start|>, the question alone as the
    user message, computed here from the full logits of each prompt + option alone; picks by the sum and the mean."""
    for item, (picked, by_mean, scores) in zip(items(), E.option_text_scores(model, BYTES, items(), "float32", CPU)):
        prompt = BYTES.render_for_completion([{"role": "user", "content": item["question"]}])
        direct = []
        for text in item["options"]:
            option = BYTES.encode(text)
            with torch.no_grad():
                logp = torch.log_softmax(model(torch.tensor([prompt + option[:-1]]))[0], -1)
            direct.append(sum(logp[len(prompt) - 1 + k, t].item() for k, t in enumerate(option)))
        assert [c for _, c in scores] == [len(BYTES.encode(t)) for t in item["options"]]
        assert [s for s, _ in scores] == pytest.approx(direct, abs=1e-3)
        means = [s / len(BYTES.encode(t)) for s, t in zip(direct, item["options"])]
        assert picked == item["letters"][direct.index(max(direct))]
        assert by_mean == item["letters"][means.index(max(means))]


def test_diagnostics_tell_not_knowing_from_not_finding_the_letter():
    """Exact summaries from hand-made records: letter accuracy stays ChatCORE's; mean p(gold) is over the item's
    letters; option text right with the letter wrong is 'knows but cannot pick the letter'."""
    def record(answer, predicted, probs, mass, text, by_mean="B"):
        return {"answer": answer, "predicted": predicted, "correct": predicted == answer, "letter_mass": mass,
                "letter_probs": dict(zip("ABCD", probs)), "option_text": {
                    "predicted": text, "correct": text == answer, "predicted_mean": by_mean,
                    "correct_mean": by_mean == answer}}
    records = [record("A", "C", [0.2, 0.2, 0.4, 0.2], 0.9, "A"), record("B", "C", [0.1, 0.3, 0.5, 0.1], 0.5, "B"),
               record("C", "C", [0.1, 0.1, 0.7, 0.1], 0.7, "D"), record("D", "C", [0.25] * 4, 0.1, "A")]
    d = E.task_diagnostics("categorical", records)
    assert d["mean_p_gold"] == pytest.approx((0.2 + 0.3 + 0.7 + 0.25) / 4)
    assert d["mean_letter_mass"] == pytest.approx(0.55) and d["predicted_letters"] == {"C": 4}
    assert d["option_text"] == {"rule": E.OPTION_TEXT_RULE, "correct": 2, "items": 4, "accuracy": 0.5,
                                "right_text_wrong_letter": 2, "correct_by_mean": 1, "accuracy_by_mean": 0.25}
    (line,) = E.diagnostic_lines([{"task": "demo-choice", "diagnostics": d}])
    assert "mean p(gold) 0.3625" in line and "predicted C 4;" in line and "option text 2/4 = 0.5000" in line
    assert E.task_diagnostics("exact", records) is None


def test_the_report_keeps_chatcore_and_writes_the_diagnostics_per_task(model, tmp_path, capsys, demo_world):
    """End to end on a saved checkpoint: chat_eval.json's tasks[i]["diagnostics"] equal those recomputed from the
    items file, the printed lines show them, and ChatCORE is the same with the option text off."""
    meta = {"stage": "sft", "model_config": model.config.__dict__, "world_size": 1, "tokenizer": str(tmp_path / "tok"),
            "tokenizer_sha256": BYTES.fingerprint()}
    BYTES.save(tmp_path / "tok")
    checkpoint.save_checkpoint(tmp_path / "run" / "ckpt", 3, model, [], [], meta, 0, 1)
    reports = {}
    for text in ("on", "off"):
        out = tmp_path / f"{text}.json"
        code, stdout, err = run_in_process(E.main, ["--checkpoint", tmp_path / "run", "--demo", demo_world / "demo",
                                                    "--tasks", "demo-choice", "--max_items", 6, "--batch_items", 4,
                                                    "--option_text", text, "--dtype", "float32", "--out", out],
                                           capsys, stage="chat_eval.py")
        assert code == 0, err
        reports[text] = json.loads(out.read_text())
        records = [json.loads(line) for line in out.with_name(f"{text}_items.jsonl").read_text().splitlines()]
        (row,) = reports[text]["tasks"]
        assert row["diagnostics"] == E.task_diagnostics("categorical", records)
        assert f"mean p(gold) {row['diagnostics']['mean_p_gold']:.4f}" in stdout
    assert reports["on"]["chatcore"] == reports["off"]["chatcore"]
    assert reports["off"]["tasks"][0]["diagnostics"]["option_text"] is None
    assert reports["on"]["tasks"][0]["diagnostics"]["option_text"]["items"] == 6


def test_progress_lines_count_items_with_an_eta_and_end_each_task(model, capsys, monkeypatch):
    monkeypatch.setattr(E, "PROGRESS_SECONDS", 0.0)  # a line after every batch
    verdicts, _ = E.evaluate_task("demo-choice", items(), model, BYTES, args(batch_items=2), 0, 1, CPU, "M",
                                  None)
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(" items")[0] for line in lines[:-1]] == ["demo-choice: 2/5", "demo-choice: 4/5"]
    assert all(" items/s, ETA 0:00:" in line for line in lines[:-1])
    right = sum(c for c, _ in verdicts)
    assert lines[-1].startswith(f"demo-choice: done, {right}/5 right ({right / 5:.4f}) in ")


def test_a_runtime_error_exits_1_and_only_a_bad_flag_exits_2(tmp_path, capsys):
    """README's rule for chat_eval.py and core_eval.py (tokenizer.py: test_tokenizer.py's test_cli_bad_input)."""
    import core_eval
    for main, script in ((E.main, "chat_eval.py"), (core_eval.main, "core_eval.py")):
        code, _, err = run_in_process(main, ["--checkpoint", tmp_path / "none"], capsys, stage=script)
        assert code == 1 and err.startswith(f"{script}: error: --checkpoint {tmp_path / 'none'}: neither a checkpoint")
        code, _, err = run_in_process(main, ["--batch_items", "0"], capsys, stage=script)
        assert code == 2 and ("--batch_items must be" in err or "--batch_items >= 1" in err)
