"""Your own conversations, JSON lines in the OpenAI chat format (docs/own-data.md), through sft.py's and
midtrain.py's loaders: rows as the same conversations in parquet make, an exact resume, and each bad line an error
naming the file, the line and the fix before any step, or with --skip_bad_rows skipped and counted."""
import io
import json
import random

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from helpers import run_in_process

import dataset as D
import loader as L
import midtrain
import pretrain
import sft
from tokenizer import Tokenizer

WORDS = ["the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "while", "seven", "small", "birds"]
TINY = ["--preset", "tiny", "--n_layer", "1", "--n_embd", "64", "--n_head", "1", "--n_kv_head", "1",
        "--sequence_len", "64", "--compile", "false", "--dtype", "float32"]
STAGE_ARGS = ["--steps", "2", "--micro_batch", "2", "--eval_every", "0", "--eval_rows", "4", "--bpb_tokens", "0",
              "--loader_threads", "1", "--sample_prompt", "hi", "--compile", "false", "--dtype", "float32"]


def conversations(n, seed=0):
    """n conversations, every third with a system message, some of two exchanges."""
    rng = random.Random(seed)

    def words(k):
        return " ".join(rng.choices(WORDS, k=rng.randint(1, k)))
    out = []
    for i in range(n):
        messages = [{"role": "system", "content": f"be brief {words(3)}"}] if i % 3 == 0 else []
        for _ in range(1 + (i % 4 == 0)):
            messages += [{"role": "user", "content": f"conv{i:04d} {words(6)}"},
                         {"role": "assistant", "content": words(8)}]
        out.append(messages)
    return out


def write_jsonl(path, rows):
    """rows: conversations (written as {"messages": ...}) or raw lines (str or bytes), one a line."""
    lines = [r if isinstance(r, bytes) else (r if isinstance(r, str) else json.dumps({"messages": r})).encode()
             for r in rows]
    path.write_bytes(b"".join(line + b"\n" for line in lines))
    return path


def write_parquet(path, rows):
    pq.write_table(pa.table({"messages": rows}), path, row_group_size=D.ROW_GROUP_DOCS)
    return path


@pytest.fixture(scope="module")
def tokenizer(demo_world):
    return Tokenizer.load(demo_world / "tokenizer")


def batches(loader, n=None):
    out = []
    for inputs, targets in loader:
        out.append((inputs.clone(), targets.clone()))
        if len(out) == n:
            break
    loader.close()
    return out


# --- the loader: the same rows as parquet, an exact resume ---------------------------------------------------------

@pytest.mark.parametrize("pack, supervise", [("pad", "assistant"), ("crop", "all")])
def test_a_jsonl_file_gives_the_rows_and_masks_its_conversations_in_parquet_give(tmp_path, tokenizer, pack,
                                                                                  supervise):
    """1,100 conversations (two row groups), a blank line among them: two shuffled epochs of a .jsonl file are the
    token ids and targets (the masks) of the same conversations in parquet, batch for batch."""
    rows = conversations(1100)
    jsonl = write_jsonl(tmp_path / "mine.jsonl", rows[:500] + [""] + rows[500:])
    parquet = write_parquet(tmp_path / "mine.parquet", rows)
    assert D.chat_rows(jsonl, 1) == D.chat_rows(parquet, 1) == rows[D.ROW_GROUP_DOCS:]
    got, stats = {}, {}
    for path in (jsonl, parquet):
        loader = L.chat_loader(path, "train", tokenizer, 4, 64, pack=pack, supervise=supervise, seed=3, max_epochs=2,
                               threads=1)
        got[path.suffix], stats[path.suffix] = batches(loader), loader.state["stats"]
    assert stats[".jsonl"] == stats[".parquet"] and stats[".jsonl"]["malformed"] == 0
    assert len(got[".jsonl"]) == len(got[".parquet"]) > 100
    for (x, y), (px, py) in zip(got[".jsonl"], got[".parquet"], strict=True):
        assert torch.equal(x, px) and torch.equal(y, py)


def test_a_jsonl_loader_resumes_bit_identically_from_its_saved_state(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "mine.jsonl", conversations(1100))

    def make():
        return L.chat_loader(path, "train", tokenizer, 4, 64, seed=1, buffer_docs=64, threads=1)
    straight = batches(make(), 40)
    first = make()
    batches(first, 25)
    buf = io.BytesIO()
    torch.save(first.state_dict(), buf)
    resumed = make()
    resumed.load_state_dict(torch.load(io.BytesIO(buf.getvalue()), weights_only=True))
    for (x, y), (rx, ry) in zip(straight[25:], batches(resumed, 15), strict=True):
        assert torch.equal(x, rx) and torch.equal(y, ry)


# --- bad lines -------------------------------------------------------------------------------------------------------

GOOD = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "hi there"}]
BAD_LINES = {  # case: (line 3 of the file, what the error says is wrong with it)
    "invalid JSON": ('{"messages": [{"role": "user", "content": "hi"}',
                     "not valid JSON (Expecting ',' delimiter at column 48)"),
    "no messages field": ('{"conversation": []}', 'no "messages" field (fields: conversation)'),
    "a message without a role": ('{"messages": [{"content": "hi"}, {"role": "assistant", "content": "yo"}]}',
                                 'message 0 has no role (each message is {"role": ..., "content": ...})'),
    "a message without content": ('{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant"}]}',
                                  'message 1 has no content (each message is {"role": ..., "content": ...})'),
    "a wrong role": ('{"messages": [{"role": "user", "content": "hi"}, {"role": "bot", "content": "yo"}]}',
                     'message 1 has role "bot": use system, user or assistant'),
    "non-UTF-8 bytes": (b'{"messages": [{"role": "user", "content": "caf\xe9"}]}',
                        "not UTF-8 (byte 0xe9 at byte 47 of the line): save the file as UTF-8"),
    "no assistant message": ('{"messages": [{"role": "system", "content": "x"}, {"role": "user", "content": "hi"}]}',
                             "no assistant message: nothing to train on"),
}
FIX = f"{D.LINE_FORMAT}; fix it, or pass --skip_bad_rows to skip bad lines (they are counted)"


@pytest.fixture(scope="module")
def tiny_pretrained(demo_world, tmp_path_factory):
    """A 1-layer pretraining run of 2 steps on a small corpus (runs/text): a parent for sft.py and midtrain.py."""
    runs = tmp_path_factory.mktemp("own_chat_runs")
    text = runs / "text"
    text.mkdir()
    for shard in range(2):
        pq.write_table(pa.table({"text": [f"Document {i} of shard {shard} says hello." for i in range(64)]}),
                       text / f"shard_{shard:05d}.parquet", row_group_size=32)
    pretrain.main(["--data_dir", text, "--tokenizer", demo_world / "tokenizer", "--runs_dir", runs, "--run_name",
                   "base", *TINY, "--steps", "2", "--micro_batch", "2", "--bpb_tokens", "512", "--eval_every", "0",
                   "--sample_prompt", "A"])
    return runs / "base"


def stage_args(tiny_pretrained, demo_world, tmp_path):
    return ["--checkpoint", tiny_pretrained, "--tokenizer", demo_world / "tokenizer", "--runs_dir", tmp_path / "runs",
            "--run_name", "own", *STAGE_ARGS]


@pytest.mark.parametrize("case", BAD_LINES)
def test_each_bad_line_stops_sft_before_any_step_naming_file_line_and_fix(case, tiny_pretrained, demo_world, tmp_path,
                                                                          capsys):
    line, why = BAD_LINES[case]
    path = write_jsonl(tmp_path / "mine.jsonl", [GOOD, GOOD, line, GOOD])
    val = write_jsonl(tmp_path / "val.jsonl", [GOOD])
    code, out, err = run_in_process(sft.main, [*stage_args(tiny_pretrained, demo_world, tmp_path), "--source",
                                               f"{path}:1", "--val_chat_dir", val], capsys, stage="sft.py")
    assert code == 1, (out, err)
    assert err.strip().splitlines()[-1] == f"sft.py: error: {path}, line 3: {why}: {FIX}"
    assert "step 1" not in out and not list((tmp_path / "runs").glob("*/ckpt/step_*"))


def test_an_empty_file_stops_sft_naming_it(tiny_pretrained, demo_world, tmp_path, capsys):
    path = write_jsonl(tmp_path / "mine.jsonl", [""])
    code, _, err = run_in_process(sft.main, [*stage_args(tiny_pretrained, demo_world, tmp_path), "--source",
                                             f"{path}:1", "--val_chat_dir", path], capsys, stage="sft.py")
    assert code == 1 and err.strip().splitlines()[-1] == f"sft.py: error: {path}: the file is empty: {D.LINE_FORMAT}"


def test_sft_trains_on_a_jsonl_file_skipping_and_counting_its_bad_lines(tiny_pretrained, demo_world, tmp_path,
                                                                       capsys):
    """--skip_bad_rows: a short sft.py run on a .jsonl file with 3 bad lines trains, says at the start how many lines
    it skips (and the first ones), and counts them in its summary."""
    bad = [BAD_LINES[case][0] for case in ("invalid JSON", "a wrong role", "non-UTF-8 bytes")]
    rows = conversations(9)
    path = write_jsonl(tmp_path / "mine.jsonl", rows[:2] + bad[:1] + rows[2:6] + bad[1:] + rows[6:])
    val = write_jsonl(tmp_path / "val.jsonl", conversations(4, seed=1))
    code, out, err = run_in_process(sft.main, [*stage_args(tiny_pretrained, demo_world, tmp_path), "--source",
                                               f"{path}:1", "--val_chat_dir", val, "--skip_bad_rows"], capsys,
                                    stage="sft.py")
    assert code == 0, err
    whys = [BAD_LINES[case][1] for case in ("invalid JSON", "a wrong role", "non-UTF-8 bytes")]
    assert (f"--skip_bad_rows: skipping 3 bad lines of 12 in {path} (line 3: {whys[0]}; line 8: {whys[1]}; "
            f"line 9: {whys[2]})") in out
    assert "done: 2 steps" in out
    done = json.loads((tmp_path / "runs" / "own" / "done.json").read_text())
    assert done["rows"]["skipped"]["malformed"] >= 3  # every pass over the file meets them


def test_a_jsonl_source_without_held_out_conversations_is_refused_before_the_model_loads(tmp_path, capsys):
    path = write_jsonl(tmp_path / "mine.jsonl", [GOOD])
    code, _, err = run_in_process(sft.main, ["--source", f"{path}:2", "--checkpoint", tmp_path / "none"], capsys,
                                  stage="sft.py")
    assert code == 1 and f"sft.py: error: {path} is one file of training conversations" in err
    assert "pass --val_chat_dir VAL.jsonl" in err


def test_midtraining_reads_a_jsonl_chat_source_and_its_bad_lines_the_same_way(tiny_pretrained, demo_world, tmp_path,
                                                                              capsys):
    line, why = BAD_LINES["a wrong role"]
    path = write_jsonl(tmp_path / "mine.jsonl", [*conversations(2), line, *conversations(5, seed=2)])
    val = write_jsonl(tmp_path / "val.jsonl", conversations(4, seed=1))
    text = tiny_pretrained.parent / "text"
    args = [*stage_args(tiny_pretrained, demo_world, tmp_path), "--source", f"text:{text}:0.5", "--source",
            f"chat:{path}:0.5", "--val_chat_dir", val]
    code, _, err = run_in_process(midtrain.main, args, capsys, stage="midtrain.py")
    assert code == 1 and err.strip().splitlines()[-1] == f"midtrain.py: error: {path}, line 3: {why}: {FIX}"
    code, out, err = run_in_process(midtrain.main, [*args, "--skip_bad_rows"], capsys, stage="midtrain.py")
    assert code == 0, err
    assert f"--skip_bad_rows: skipping 1 bad line of 8 in {path} (line 3: {why})" in out
    assert "done: 2 steps" in out
    done = json.loads((tmp_path / "runs" / "own" / "done.json").read_text())
    assert done["mixture"]["chat:mine.jsonl"]["docs"] > 0


def test_skip_bad_rows_is_one_flag_with_one_help_in_sft_and_midtrain():
    helps = [stage.get_args(["--steps", "1"])[0]._option_string_actions["--skip_bad_rows"].help
             for stage in (sft, midtrain)]
    assert helps[0] == helps[1] == D.SKIP_BAD_ROWS_HELP


def test_add_source_scales_the_plans_shares_to_make_room():
    """speedrun.sh --chat FILE: midtrain.py --add_source chat:FILE:0.2 beside the plan's sources (or the defaults)."""
    given = midtrain.parse_sources(["text:c:0.5", "chat:d:0.5"], None, ["chat:mine.jsonl:0.2"])
    assert [(s["path"], round(s["share"], 9)) for s in given] == [("c", 0.4), ("d", 0.4), ("mine.jsonl", 0.2)]
    defaults = midtrain.parse_sources(None, "corpus", ["chat:mine.jsonl:0.2"])
    assert defaults[0]["path"] == "corpus" and abs(sum(s["share"] for s in defaults) - 1) < 1e-9
