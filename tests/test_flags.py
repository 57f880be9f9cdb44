"""One vocabulary of flags: each concept has one name in every script's --help; the names it had before are
refused."""
import importlib

import pytest

# concept: (its one name, the scripts that take it, the old names no --help may show)
VOCABULARY = {
    "the checkpoint a stage reads": ("--checkpoint", ["midtrain", "sft", "rl", "core_eval", "chat_eval", "chat",
                                                      "export"],
                                     ["--init"]),
    "validation tokens for bits per byte": ("--bpb_tokens", ["pretrain", "midtrain", "sft", "core_eval"],
                                            ["--eval_tokens"]),
    "the longest reply": ("--max_new_tokens", ["core_eval", "chat_eval", "chat", "rl"], ["--max_tokens"]),
    "prompts a training stage answers": ("--sample_prompt", ["pretrain", "midtrain", "sft"], ["--question"]),
    "items per task": ("--max_items", ["core_eval", "chat_eval"], ["--max_per_task"]),
    "bad lines of a conversation file skipped, not an error": ("--skip_bad_rows", ["midtrain", "sft"], []),
}
SCRIPTS = sorted({s for _, scripts, _ in VOCABULARY.values() for s in scripts})


def help_text(script, capsys):
    module = importlib.import_module(script)
    with pytest.raises(SystemExit) as stop:
        module.get_args(["--help"])
    assert stop.value.code == 0
    return capsys.readouterr().out


def test_every_script_names_each_concept_the_same_way_in_its_help(capsys):
    helps = {script: help_text(script, capsys) for script in SCRIPTS}
    for concept, (name, scripts, old_names) in VOCABULARY.items():
        for script in scripts:
            assert f"{name} " in helps[script], (concept, script)
        for script, text in helps.items():
            assert not any(f"{old} " in text or f"{old}\n" in text for old in old_names), (concept, script)
    assert "--prompt " not in helps["pretrain"]  # chat.py's --prompt (one prompt, then exit) is another concept


@pytest.mark.parametrize("script, old", [("pretrain", "--eval_tokens"), ("pretrain", "--prompt"),
                                         ("midtrain", "--init"), ("sft", "--question"), ("chat", "--max_tokens"),
                                         ("core_eval", "--max_per_task")])
def test_an_old_flag_name_is_refused_naming_it(script, old, capsys):
    """The names a concept had before the one vocabulary are gone, not quietly taken for another flag (argparse
    would take an unambiguous prefix of a longer name)."""
    module = importlib.import_module(script)
    with pytest.raises(SystemExit) as stop:
        module.get_args([old, "1"])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and ("unrecognized arguments" in err or "unknown option" in err) and f"{old} 1" in err


def test_micro_batch_has_one_help_text_in_every_training_stage(capsys):
    texts = set()
    for script in ("pretrain", "midtrain", "sft", "rl"):
        after = help_text(script, capsys).split("\n  --micro_batch MICRO_BATCH", 1)[1]
        texts.add(" ".join(after.split("\n  -", 1)[0].split()))
    assert len(texts) == 1 and next(iter(texts)).startswith("sequences per rank per forward (rl.py: replies); 0 = the "
                                                            "checkpoint's when resuming (--resume), else the parent")


def test_micro_batch_is_read_in_one_place_one_meaning_per_value(tmp_path, capsys):
    """train_loop.plan_batch: N is N; 0 takes the resumed checkpoint's, else the parent's, else (on the CPU) the whole
    per-rank batch; the source goes into a chat stage's inherited table."""
    import json
    from argparse import Namespace
    from types import SimpleNamespace

    import torch

    import train_loop
    config, cpu = SimpleNamespace(sequence_len=64), torch.device("cpu")
    (tmp_path / "meta.json").write_text(json.dumps({"micro_batch": 2, "model_config": {}, "world_size": 1, "accum": 4}))
    parent = {"hparams": {"micro_batch": 4}}
    plan = lambda micro, **kw: train_loop.plan_batch(Namespace(micro_batch=micro, total_batch_tokens=1024), config, 1,
                                                     None, cpu, **kw)
    assert plan(8, resume_from=tmp_path, parent_meta=parent) == (8, 2, "flag")
    assert plan(0, resume_from=tmp_path, parent_meta=parent) == (2, 8, "the checkpoint's (--resume)")
    assert capsys.readouterr().out == "batch: micro_batch 2, the checkpoint's (--micro_batch 0 and --resume)\n"
    assert plan(0, parent_meta=parent) == (4, 4, "parent (meta.json)")
    assert plan(0) == (16, 1, "the CPU's choice")
    assert plan(0, parent_meta=parent, accumulate=False) == (4, 1, "parent (meta.json)")
