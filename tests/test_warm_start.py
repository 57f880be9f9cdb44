"""The chat stages start warm: midtrain.py and sft.py continue from the parent's optimizer state with their own lrs,
so no training loss jumps when a stage starts; each reports the pretraining val bpb its model kept. A tied embedding
(the head reuses wte) gets a head's lr, so the first steps do not blow up the logits."""
import argparse
import json

import pytest
import torch

import chat_stage
import checkpoint
import dataset as D
import loader as L
import midtrain
import optim
import report
import sft
import train_loop
from model import PRESETS, GPTConfig, autocast_context, build_model
from tokenizer import Tokenizer

CPU = torch.device("cpu")
# measured on the suite's chain: SFT's steps with a fresh optimizer at the parent's full lrs reached 1.24x the parent's
# loss on the same batch
WORSE_BOUND = 1.15


def losses(run_dir):
    return [r["loss"] for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if "loss" in r]


def parent_losses(run_dir, n):
    """The parent model's loss on the first n batches of a stage's run (one process, no accumulation, as the suite
    runs it), replayed with the stage's own loader and seed: the losses the stage would log if it did not train."""
    config = json.loads((run_dir / "config.json").read_text())
    args = config["args"]
    assert (config["world_size"], config["accum"]) == (1, 1)
    model, _ = checkpoint.load_model(config["parent"]["path"], CPU)
    tokenizer = Tokenizer.load(config["tokenizer"])
    shape = (tokenizer, config["micro_batch"], args["sequence_len"])
    sources = [(s["path"], s["epochs"]) for s in config["sources"]] if config["stage"] == "sft" else None
    loader = L.chat_loader(None, "train", *shape, files=D.mixture_files(sources), seed=args["seed"], threads=1) \
        if config["stage"] == "sft" else \
        midtrain.MixtureLoader(config["sources"], *shape, seed=args["seed"], supervise=config["supervise"], threads=1)
    found = []
    with torch.no_grad():
        for _ in range(n):
            inputs, targets = next(loader)
            with autocast_context("cpu", args["dtype"]):
                found.append(model(inputs, targets).item())
    loader.close()
    return found


@pytest.mark.parametrize("stage", ["midtrain", "sft"])
def test_no_step_of_a_chat_stages_first_20_does_worse_on_its_batch_than_the_parent_did(chat_chain, stage):
    """The loss of a chat stage's step k against the parent model's loss on the same batch k. A loss against the
    first step's alone cannot tell a spike from a hard batch: here the parent's own losses on SFT's first 20 batches
    range over 1.38x the first one's."""
    trained, parent = losses(chat_chain["run"] / stage)[:20], parent_losses(chat_chain["run"] / stage, 20)
    assert len(trained) == 20
    assert trained[0] == pytest.approx(parent[0], rel=1e-4)  # step 1 trains the parent: the replay is the stage's data
    ratios = [t / p for t, p in zip(trained, parent, strict=True)]
    assert max(ratios) <= WORSE_BOUND, [round(r, 3) for r in ratios]


def stage_optimizers(stage, parent, extra=()):
    """A stage's optimizers as its main() builds them on `parent`, warm-started: (optimizers, the printed line, the
    same optimizers built fresh)."""
    model, meta = checkpoint.load_model(parent, CPU)
    model.train()
    _, args = stage.get_args(["--checkpoint", str(parent), "--steps", "1", *extra])
    checkpoint.inherit(args, meta, parent)
    optimizers, fresh = (optim.build_optimizers(model, args, model.config.n_embd, 2048, CPU, lr_scale=args.lr_scale)
                         for _ in range(2))
    line = checkpoint.warm_start(parent, meta, model, optimizers, args, CPU)
    return optimizers, line, fresh, model, args


@pytest.mark.parametrize("stage", [midtrain, sft])
def test_a_chat_stage_takes_over_the_parents_moments_and_keeps_its_own_lrs(stage, chat_chain):
    parent = chat_chain["pretrain"]
    optimizers, line, fresh, model, args = stage_optimizers(stage, parent)
    assert line.startswith(f"optimizer: warm start from {parent}'s state"), line
    saved = torch.load(parent / "optimizers.pt", weights_only=True)["state"]
    names = {id(p): name for name, p in model.named_parameters()}
    loaded = {names[id(p)]: s for opt in optimizers for p, s in opt.state.items()}
    assert set(loaded) == set(saved) == {name for name, _ in model.named_parameters()}
    for name, state in saved.items():
        assert state.keys() == loaded[name].keys()
        assert all(torch.equal(torch.as_tensor(state[k]), torch.as_tensor(loaded[name][k])) for k in state), name
    groups = [g for opt in optimizers for g in opt.param_groups]
    own = [g for opt in fresh for g in opt.param_groups]
    assert [(g["name"], g["lr"], g["base_lr"]) for g in groups] == [(g["name"], g["lr"], g["base_lr"]) for g in own]
    matrix = next(g for g in groups if g["name"] == "matrix")
    assert matrix["base_lr"] == 0.04 * args.lr_scale  # Muon's lr is not scaled by width or batch: the parent's x scale
    assert args.lr_scale == (midtrain.MID_LR_SCALE if stage is midtrain else sft.SFT_LR_SCALE)


def test_a_parent_state_that_does_not_fit_is_named_and_replaced_by_a_fresh_one(chat_chain):
    parent = chat_chain["pretrain"]
    optimizers, line, *_ = stage_optimizers(midtrain, parent, ["--optimizer", "adamw"])
    assert line.startswith("optimizer: fresh state: the parent's optimizers [['AdamW'"), line
    assert "another --optimizer" in line
    assert all(not opt.state for opt in optimizers)
    optimizers, line, *_ = stage_optimizers(sft, parent, ["--warm_start", "false"])
    assert line == "optimizer: fresh state (--warm_start false)"
    assert all(not opt.state for opt in optimizers)


def test_the_stages_midtrain_log_says_it_started_warm(chat_chain):
    assert f"optimizer: warm start from {chat_chain['pretrain']}'s state" in chat_chain["midtrain_stdout"]


def test_each_chat_stage_reports_the_pretraining_val_bpb_its_model_kept(speedrun, chat_chain, demo_world):
    run = speedrun[0]
    tokenizer = Tokenizer.load(demo_world / "tokenizer")
    pretrained = json.loads((run / "pretrain" / "done.json").read_text())["val_bpb"]
    meta = json.loads((chat_chain["pretrain"] / "meta.json").read_text())
    dtype = meta["hparams"]["dtype"]
    # the pretraining run's final evaluation: LEARN_ARGS' --bpb_tokens 20000 of the demo corpus in rows of 128
    rows = L.val_rows(demo_world / "demo" / "pretrain", tokenizer, 20000, 128)
    figures = {"pretrain": pretrained}
    for stage in ("midtrain", "sft"):
        kept = json.loads((run / stage / "done.json").read_text())["pretrain_val_bpb"]
        assert (kept["data_dir"], kept["sequence_len"]) == (str(demo_world / "demo" / "pretrain"), 128)
        model, _ = checkpoint.load_model(chat_chain[stage], CPU)
        again, scored = train_loop.val_bpb(model, rows, tokenizer.token_bytes, 8, dtype, 0, 1, CPU)
        assert kept["tokens"] == scored
        assert abs(kept["val_bpb"] - again) < 1e-6, (stage, kept, again)
        figures[stage] = kept["val_bpb"]
    # the same rows pretrain.py scored: its own figure, recomputed from its checkpoint by the stages' function
    model, _ = checkpoint.load_model(chat_chain["pretrain"], CPU)
    again = chat_stage.forgetting(model, tokenizer, chat_chain["pretrain"], meta,
                                  argparse.Namespace(bpb_tokens=None, dtype=dtype), 0, 1, CPU)
    assert abs(again["val_bpb"] - pretrained) < 1e-6, (again, pretrained)
    text = (run / "report.md").read_text()
    assert f"| pretrained | {pretrained:.4f} |  |" in text
    assert f"| midtrained | {figures['midtrain']:.4f} | {figures['midtrain'] - pretrained:+.4f} |" in text
    assert f"| SFT | {figures['sft']:.4f} | {figures['sft'] - pretrained:+.4f} |" in text


def test_the_report_prints_unknown_for_a_figure_no_stage_computed(tmp_path):
    (tmp_path / "pretrain").mkdir()
    (tmp_path / "pretrain" / "done.json").write_text(json.dumps({"step": 1, "val_bpb": 0.5}))
    (tmp_path / "sft").mkdir()
    note = "unknown: the pretraining corpus /gone is not here"
    (tmp_path / "sft" / "done.json").write_text(json.dumps({"step": 1, "val_loss": 1.0, "pretrain_val_bpb": {
        "val_bpb": None, "note": note}}))
    assert report.forgetting_lines(tmp_path)[2:] == ["| pretrained | 0.5000 |  |",
                                                     "| midtrained | unknown | unknown |",
                                                     f"| SFT | unknown ({note}) | unknown |"]


def tied_model_logits(steps, batch_tokens):
    """A small llama3-1b-shaped model (tied embeddings, no logit softcap) trained `steps` steps with the default lrs
    as they are at `batch_tokens` per step: (losses, logits' standard deviation after each step, its param groups)."""
    torch.manual_seed(0)
    shape = {**PRESETS["llama3-1b"], "vocab_size": 512, "sequence_len": 64, "n_layer": 2, "n_embd": 64, "n_head": 4,
             "n_kv_head": 2, "mlp_hidden": 128}
    model = build_model(GPTConfig(**shape))
    args = argparse.Namespace(optimizer="muon", matrix_lr=0.02, embedding_lr=0.2, head_lr=0.004, scalar_lr=0.04,
                              adam8bit=False)
    optimizers = optim.build_optimizers(model, args, 64, batch_tokens, CPU)
    columns = [torch.randint(0, 512, (16, 1), generator=torch.Generator().manual_seed(1))]
    for _ in range(64):  # a stream it can learn: each token t is followed by 5t + 1 mod 512
        columns.append((columns[-1] * 5 + 1) % 512)
    data = torch.cat(columns, 1)
    history, spreads = [], []
    for _ in range(steps):
        loss = model(data[:, :-1], data[:, 1:])
        loss.backward()
        for opt in optimizers:
            opt.step()
        model.zero_grad()
        with torch.no_grad():
            spreads.append(model(data[:, :-1]).float().std().item())
        history.append(loss.item())
    return history, spreads, {g["name"]: g for opt in optimizers for g in opt.param_groups}


def test_a_tied_embedding_trains_at_the_heads_lr_and_its_first_steps_keep_the_logits_small():
    history, spreads, groups = tied_model_logits(3, 2 ** 19)
    assert "embedding" not in groups and groups["head"]["params"][0].shape == (512, 64)
    assert groups["head"]["lr"] == pytest.approx(0.004 * (64 / 768) ** -0.5)  # the head's lr at 2^19 tokens
    # measured: logits' std 0.30, 0.37, 0.47 and the loss falling; at the embedding's lr (50x) 5.7, 7.5, 8.2 and the
    # loss 6.3 -> 24.6 at the second step
    assert max(spreads) < 1.0, spreads
    assert history == sorted(history, reverse=True), history
