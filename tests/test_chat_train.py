"""midtrain.py and sft.py run as a user runs them on the demo world: the chain pretrain -> midtrain -> sft makes a
model that answers held-out questions better than its base, and ends its answers; checkpoints name their parent;
what a stage inherits is printed with its source; bad starting points fail before any training."""
import hashlib
import json

import pytest
import torch
from helpers import held_out_questions, run_in_process

import chat_stage
import checkpoint
import loader as L
import midtrain
import prepare as P
import sft
from decode import decode
from model import GPTConfig, build_model
from prepare import train_tokenizer
from tokenizer import Tokenizer


def score(path, tokenizer, questions, chat):
    """Share of questions whose greedy answer contains the expected word, and the share of answers that ended."""
    model, _ = checkpoint.load_model(path, torch.device("cpu"))
    if chat:
        answers = chat_stage.chat_answers(model, tokenizer, [q for q, _ in questions], "float32",
                                          max_tokens=24)
    else:  # a base model completes text: the question, then the start of an answer
        answers = []
        for question, _ in questions:
            prompt = [tokenizer.bos_id, *tokenizer.encode(question + " ")]
            ids = decode(model, [prompt], 16)[0][0]
            answers.append({"question": question, "answer": tokenizer.decode(ids), "ended": False})
    correct = sum(expected.lower() in a["answer"].lower() for (_, expected), a in zip(questions, answers, strict=True))
    return correct / len(questions), sum(a["ended"] for a in answers) / len(answers), answers


def test_the_chat_chain_answers_held_out_questions_better_than_its_base(chat_chain, demo_world):
    tokenizer = Tokenizer.load(demo_world / "tokenizer")
    questions = held_out_questions()
    sft_correct, sft_ended, answers = score(chat_chain["sft"], tokenizer, questions, chat=True)
    base_correct, _, _ = score(chat_chain["pretrain"], tokenizer, questions, chat=False)
    assert sft_correct >= 0.3, answers  # measured 0.48 (docs/training.md: chat training)
    assert sft_correct > base_correct + 0.1, (sft_correct, base_correct)
    assert sft_ended >= 0.9, answers  # answers end with <|assistant_end|>


def test_each_checkpoint_names_its_stage_and_parent_with_the_parents_weights_hash(chat_chain):
    sft_meta = json.loads((chat_chain["sft"] / "meta.json").read_text())
    mid_meta = json.loads((chat_chain["midtrain"] / "meta.json").read_text())
    assert (sft_meta["stage"], mid_meta["stage"]) == ("sft", "midtrain")
    assert sft_meta["parent"]["path"] == str(chat_chain["midtrain"])
    assert mid_meta["parent"]["path"] == str(chat_chain["pretrain"])
    weights = hashlib.sha256((chat_chain["pretrain"] / "model.pt").read_bytes()).hexdigest()
    assert mid_meta["parent"] == checkpoint.parent_record(chat_chain["pretrain"], json.loads(
        (chat_chain["pretrain"] / "meta.json").read_text()), weights)
    assert mid_meta["parent"]["stage"] == "pretrain" and len(mid_meta["parent"]["sha256"]) == 64


def test_midtraining_prints_what_it_inherits_and_the_realized_mixture_within_two_points(chat_chain):
    out = chat_chain["midtrain_stdout"]
    assert "  matrix_lr          0.04           parent (meta.json)" in out
    assert "  micro_batch        16             flag" in out
    done = json.loads((chat_chain["midtrain"].parent.parent / "done.json").read_text())
    shares = {name: m["share"] for name, m in done["mixture"].items()}
    targets = {name: m["target"] for name, m in done["mixture"].items()}
    assert targets == {"text:pretrain": 0.2, "chat:conversations": 0.4, "chat:choice": 0.1, "chat:answers": 0.1,
                       "chat:calc": 0.1, "chat:problems": 0.1}  # speedrun.sh's demo mixture
    for name, share in shares.items():
        assert abs(share - targets[name]) <= 0.02, (shares, targets)
    assert f"mixture realized: text:pretrain {done['mixture']['text:pretrain']['tokens']:,} tokens" in out


@pytest.mark.parametrize("stage", [midtrain, sft])
def test_a_parent_trained_with_another_tokenizer_is_refused_before_training(stage, chat_chain, demo_world, tmp_path,
                                                                             capsys):
    other = tmp_path / "other_tokenizer"  # the same size, trained on other text: other merges
    train_tokenizer(P.iter_texts(demo_world / "demo" / "pretrain", "val"), 1024).save(other)
    args = ["--checkpoint", chat_chain["pretrain"], "--tokenizer", other, "--runs_dir", tmp_path / "runs", "--steps", "1"]
    args += ["--source", f"chat:{demo_world / 'demo' / 'conversations'}:1"] if stage is midtrain else \
        ["--chat_dir", demo_world / "demo" / "conversations"]
    code, _, err = run_in_process(stage.main, args, capsys, stage=stage.__name__ + ".py")
    assert code == 1 and "is not the one" in err and "pass that one with --tokenizer" in err, err
    assert not (tmp_path / "runs").exists() or not list((tmp_path / "runs").glob("*/ckpt/step_*"))


def test_padding_inputs_change_neither_the_loss_nor_the_gradients(demo_world):
    """A padded row's filler (inputs BOS, targets -1) sits after every real token: with causal attention and masked
    targets, replacing it changes nothing."""
    tokenizer = Tokenizer.load(demo_world / "tokenizer")
    inputs, targets = next(L.chat_loader(demo_world / "demo" / "conversations", "train", tokenizer, 4, 128,
                                         max_epochs=1, threads=1, buffer_docs=2))  # little to fill rows with
    filler = (targets == -1) & (inputs == tokenizer.bos_id)
    padding = filler.flip(1).cumprod(1).flip(1).bool()  # the trailing run of filler in each row
    assert padding.any()

    def loss_and_grads(x):
        torch.manual_seed(0)
        model = build_model(GPTConfig(vocab_size=tokenizer.vocab_size, sequence_len=128, n_layer=1, n_embd=32,
                                      n_head=2, n_kv_head=2))
        loss = model(x, targets)
        loss.backward()
        return loss.item(), [p.grad.clone() for p in model.parameters()]

    changed = torch.where(padding, torch.randint_like(inputs, tokenizer.vocab_size), inputs)
    base, other = loss_and_grads(inputs), loss_and_grads(changed)
    assert base[0] == other[0]
    assert all(torch.equal(a, b) for a, b in zip(base[1], other[1], strict=True))

