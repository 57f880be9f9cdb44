"""dataset.py and loader.py: shards, ingest, the streaming loader (exact resume, rank disjointness, packing), the
chat loader."""
import io
import json
import random
import re
import subprocess
import sys
import threading
from collections import Counter
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from helpers import run_in_process, same, take

import dataset as D
import loader as L
import prepare as P
import pretrain
from prepare import train_tokenizer

ROOT = Path(__file__).resolve().parent.parent
WORDS = ["the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "while", "seven", "small", "birds",
         "sing", "about", "rivers", "mountains", "and", "bright", "green", "fields", "under", "the", "morning", "sun"]


def make_docs(n, seed=0, min_words=3, max_words=120):
    rng = random.Random(seed)
    return [f"doc{i:04d} " + " ".join(rng.choice(WORDS) for _ in range(rng.randint(min_words, max_words)))
            for i in range(n)]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A corpus of 1,100 documents: a training shard (one row group of 990) and a validation shard of 110."""
    out = tmp_path_factory.mktemp("corpus")
    docs = make_docs(1100)
    P.write_text_shards(docs, out, seed=0, shard_docs=2048, val_fraction=0.1)
    tok = train_tokenizer(docs, 400)
    return out, tok


# --- shards -----------------------------------------------------------------------------------------------------

def test_write_text_shards_layout(tmp_path):
    docs = make_docs(3000)
    paths = P.write_text_shards(docs, tmp_path, seed=1, shard_docs=2048, val_fraction=0.1)
    assert [p.name for p in paths] == ["shard_00000.parquet", "shard_00001.parquet", "shard_00002.parquet"]
    metas = [pq.ParquetFile(p).metadata for p in paths]
    assert [m.num_rows for m in metas] == [2048, 652, 300]
    assert [m.row_group(0).num_rows for m in metas] == [1024, 652, 300]
    assert pq.ParquetFile(paths[0]).schema_arrow.names == ["text"]
    assert metas[0].row_group(0).column(0).compression == "ZSTD"
    read = [t for split in ("train", "val") for t in P.iter_texts(tmp_path, split)]
    assert sorted(read) == sorted(docs) and read != docs  # every document once, shuffled
    assert D.split_shards(tmp_path, "val") == paths[-1:]


def test_a_budget_that_repeats_the_corpus_names_the_fix_that_applies_to_it(corpus, monkeypatch):
    """More shards is the fix only for FineWeb-Edu's directory, which prepare.py fills; for the demo world or your
    own corpus it is fewer steps or more text."""
    directory, tok = corpus
    budget = 3 * pretrain.corpus_budget(directory, tok, 1)["tokens"]
    mine = pretrain.corpus_budget(directory, tok, budget)
    assert mine["fineweb"] is False and mine["epochs"] == pytest.approx(3, rel=1e-3)
    assert pretrain.budget_line(mine, budget).endswith(f": {mine['epochs']:.2f} epochs. This run REPEATS data: "
                                                f"{mine['epochs']:.2f} passes over the corpus (fewer --steps, or more "
                                                "text in the corpus)")
    monkeypatch.setattr(pretrain, "default_data_dir", lambda dataset: directory if dataset == D.FINEWEB else None)
    fineweb = pretrain.corpus_budget(directory, tok, budget)
    shards = -(-budget // fineweb["tokens_per_shard"]) + 1
    assert fineweb["fineweb"] is True and pretrain.budget_line(fineweb, budget).endswith(
        f"(more shards: `python prepare.py shards --shards N`; N ~ {shards})")


def test_missing_or_corrupt_data_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist.*prepare.py shards"):
        D.list_shards(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match="no .parquet shards"):
        D.list_shards(tmp_path)
    P.write_text_shards(make_docs(10), tmp_path)
    bad = tmp_path / "shard_00000.parquet"
    bad.write_bytes(bad.read_bytes()[:-100])
    with pytest.raises(ValueError, match="shard_00000.parquet is not a readable parquet file.*fetch it again"):
        list(P.iter_texts(tmp_path, "train"))


# --- ingest -----------------------------------------------------------------------------------------------------

def test_ingest_txt_jsonl_parquet(tmp_path, capsys):
    (tmp_path / "a.txt").write_bytes(b"first doc\nstill first\n\n\n\nsecond doc caf\xc3\xa9 bad\xff\xfebyte\n\n  \n")
    (tmp_path / "b.jsonl").write_text('{"text": "from jsonl"}\n\n{"text": ""}\n{"text": "another"}\n')
    pq.write_table(pa.table({"text": ["from parquet", None]}), tmp_path / "c.parquet")
    files = [tmp_path / "a.txt", tmp_path / "b.jsonl", tmp_path / "c.parquet"]
    result = P.ingest(files, tmp_path / "out", seed=3)
    docs = sorted(t for split in ("train", "val") for t in P.iter_texts(tmp_path / "out", split))
    assert docs == sorted(["first doc\nstill first", "second doc café bad\ufffd\ufffdbyte", "from jsonl", "another",
                           "from parquet"])
    assert (result["documents"], result["empty"], result["replaced"]) == (5, 3, 2)  # \xff, \xfe: one each
    assert "empty documents skipped: 3" in capsys.readouterr().out
    (tmp_path / "d.txt").write_text("para one\n\npara two\n")
    whole = P.ingest([tmp_path / "a.txt", tmp_path / "d.txt"], tmp_path / "whole", one_per_file=True)
    docs = sorted(t for split in ("train", "val") for t in P.iter_texts(tmp_path / "whole", split))
    assert docs == ["first doc\nstill first\n\n\n\nsecond doc café bad\ufffd\ufffdbyte", "para one\n\npara two"]
    assert whole["documents"] == 2


def test_ingest_md_and_a_directory_and_a_smaller_reingest_leaves_no_stale_shard(tmp_path):
    (tmp_path / "in" / "sub").mkdir(parents=True)
    (tmp_path / "in" / "notes.md").write_text("# Title\n\nA paragraph.\n")
    (tmp_path / "in" / "sub" / "more.txt").write_text("one\n\ntwo\n")
    (tmp_path / "in" / "skip.csv").write_text("left out")
    result = P.ingest([tmp_path / "in"], tmp_path / "out", seed=1)
    docs = sorted(t for split in ("train", "val") for t in P.iter_texts(tmp_path / "out", split))
    assert docs == ["# Title", "A paragraph.", "one", "two"] and result["documents"] == 4
    assert json.loads((tmp_path / "out" / "ingest.json").read_text())["documents"] == 4
    big = P.write_text_shards([f"d{i}" for i in range(20)], tmp_path / "out", shard_docs=4)  # 5 + 1 shards
    assert len(big) == 6
    P.ingest([tmp_path / "in" / "notes.md"], tmp_path / "out")
    assert len(D.list_shards(tmp_path / "out")) == 2  # the earlier shards beyond the new ones are gone
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no .txt, .md, .jsonl, .parquet files"):
        P.ingest([tmp_path / "empty"], tmp_path / "o2")


def test_ingest_bad_jsonl_names_file_and_line(tmp_path, capsys):
    (tmp_path / "x.jsonl").write_text('{"text": "ok"}\n{"text": oops}\n')
    with pytest.raises(ValueError, match=r"x.jsonl:2: not valid JSON"):
        P.ingest([tmp_path / "x.jsonl"], tmp_path / "out")
    (tmp_path / "y.jsonl").write_text('{"text": "ok"}\n{"text": 5}\n')
    with pytest.raises(ValueError, match=r"y.jsonl:2: not a string field 'text': each line must be one JSON object "
                                         r"with a string 'text' field \(--column NAME reads another field\)"):
        P.ingest([tmp_path / "y.jsonl"], tmp_path / "out")
    (tmp_path / "z.jsonl").write_text('{"text": "ok"}\n\n{"body": "no text field"}\n')  # line 3: a missing field
    with pytest.raises(ValueError, match=r"z.jsonl:3: no field 'text': each line"):
        P.ingest([tmp_path / "z.jsonl"], tmp_path / "out")
    with pytest.raises(SystemExit) as exit_info:  # the command line: that one line, exit 1, nothing written
        P.main(["ingest", str(tmp_path / "z.jsonl"), "--out", str(tmp_path / "cli")])
    err = capsys.readouterr().err
    assert exit_info.value.code == 1 and err.startswith("prepare.py ingest: error: ") and "z.jsonl:3: " in err
    assert err.count("\n") == 1 and not (tmp_path / "cli").exists()
    for empty in ("e.txt", "e.md", "e.jsonl"):  # an empty file (or only blank lines) is named, not a silent nothing
        (tmp_path / empty).write_text("\n \n")
        with pytest.raises(ValueError, match=rf"{empty}: empty: it holds no text; leave it out of the corpus"):
            P.ingest([tmp_path / empty], tmp_path / "out")


# --- the text loader --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("world_size", [1, 2])
def test_resume_is_bit_identical(corpus, world_size, tmp_path):
    data, tok = corpus
    kw = {"batch_size": 4, "seq_len": 64, "world_size": world_size, "buffer_docs": 40}
    for rank in range(world_size):
        straight = take(L.text_loader(data, "train", tok, rank=rank, **kw), 50)
        first = L.text_loader(data, "train", tok, rank=rank, **kw)
        resumed = [next(first) for _ in range(20)]
        buf = io.BytesIO()
        torch.save(first.state_dict(), buf)  # through a real checkpoint round trip, weights_only
        first.close()
        second = L.text_loader(data, "train", tok, rank=rank, **kw)
        second.load_state_dict(torch.load(io.BytesIO(buf.getvalue()), weights_only=True))
        resumed += take(second, 30)
        assert same(straight, resumed)
        assert straight[0][0].shape == (4, 64) and straight[0][0].dtype == torch.int64


def test_a_checkpoint_one_batch_after_a_resume_is_exact(tmp_path, corpus):
    """Issue 9: a resumed loader whose restored buffer alone filled the next batch recorded the next row group as its
    position, so a checkpoint taken one batch after a resume skipped the rest of the current one. Long documents
    (cut into row-sized pieces, so the buffer holds more than buffer_docs pieces) and small rows make that common."""
    _, tok = corpus
    docs = make_docs(24, seed=1, max_words=90)
    pq.write_table(pa.table({"text": docs}), tmp_path / "long.parquet", row_group_size=4)  # 6 row groups

    def loader(state=None):
        loader = L.PackedLoader([tmp_path / "long.parquet"], tok, 2, 16, buffer_docs=4)
        if state is not None:
            loader.load_state_dict(state)
        return loader

    straight, batches, states = loader(), [], [None]  # states[k]: the state after k batches
    first_doc = re.match(r"doc\d{4}", docs[0]).group()
    while len(batches) < 2 or not any(first_doc in tok.decode(row) for row in batches[-1][0].tolist()):  # epoch 1
        batches.append(next(straight))
        states.append(straight.state_dict())
    straight.close()
    assert max(len(ids) for ids in tok.encode_batch(docs)) > 4 * 17 and states[-1]["epoch"] == 1
    diverged = []  # k: resumed after k batches, checkpointed one batch later, resumed from that
    for k in range(len(batches) - 1):
        once = loader(states[k])
        after_one = take(once, 1)
        if not same(after_one + take(loader(once.state_dict()), len(batches) - k - 1), batches[k:]):
            diverged.append(k)
    assert diverged == []


def test_a_thread_that_outlives_close_still_stops(tmp_path, corpus):
    """close() waits a while for the threads, then gives up: a thread still busy then (a slow read) must still find
    its pipeline stopped once it gets going again, not a fresh stop event that nobody will ever set."""
    _, tok = corpus
    pq.write_table(pa.table({"text": make_docs(32)}), tmp_path / "docs.parquet", row_group_size=8)
    loader = L.PackedLoader([tmp_path / "docs.parquet"], tok, 2, 16, buffer_docs=2)
    release, encode = threading.Event(), loader._encode

    def slow_encode(unit, skip, *order):
        if unit[1] > 0:  # row group 0 fills the first batch; the reader then stalls on row group 1
            release.wait()
        return encode(unit, skip, *order)
    loader._encode = slow_encode
    next(loader)
    threads = list(loader._threads)
    loader.close(timeout=0.2)
    assert threads[0].is_alive()  # the reader outlived the join
    release.set()
    for thread in threads:
        thread.join(timeout=5)
    assert not any(thread.is_alive() for thread in threads)


def test_epochs_roll_over_and_are_logged(corpus, capsys):
    data, tok = corpus
    loader = L.text_loader(data, "val", tok, batch_size=8, seq_len=64, buffer_docs=20)
    for _ in range(60):  # the 110 validation documents hold far fewer than 60 x 8 x 65 tokens
        next(loader)
    assert loader.epoch >= 2
    loader.close()
    out = capsys.readouterr().out
    assert "val loader, stream 0 of 1: epoch 2 starts (its data ran out" in out and ": epoch 3 starts" in out


def small_corpus(directory, docs, row_group_docs):
    """A training shard of `docs` in row groups of `row_group_docs`, a validation shard, and a tokenizer."""
    directory.mkdir()
    pq.write_table(pa.table({"text": docs}), directory / "shard_00000.parquet", row_group_size=row_group_docs)
    pq.write_table(pa.table({"text": docs[:5]}), directory / "shard_00001.parquet")
    return directory, train_tokenizer(docs, 300)


def test_the_epoch_is_that_of_the_rows_trained_not_of_the_reader_ahead(tmp_path, capsys):
    """30 short documents: the first batch's buffer reads the whole pass, so the reader is in epoch 1 (0-based) at
    step 1 while the rows so far hold a tenth of it. The epoch a run prints (loader.epoch) and the 'data ran out'
    line follow the rows: both turn with the batch whose tokens make the rows' total reach a pass's."""
    data, tok = small_corpus(tmp_path / "corpus", make_docs(30, min_words=3, max_words=8), 30)
    loader = L.text_loader(data, "train", tok, batch_size=2, seq_len=64)
    next(loader)
    assert (loader.state["epoch"], loader.epoch) == (1, 0) and capsys.readouterr().out == ""
    pass_tokens = sum(len(tok.encode(t)) + 1 for t in make_docs(30, min_words=3, max_words=8))
    while loader.epoch == 0:
        next(loader)
    trained = loader.state["stats"]["tokens"]
    loader.close()
    assert pass_tokens <= trained < pass_tokens + 2 * 65  # within the batch that took the last first-pass piece
    assert capsys.readouterr().out == "train loader, stream 0 of 1: epoch 2 starts (its data ran out: its rows repeat " \
                                      "documents from here on)\n"


def test_few_row_groups_are_dealt_so_no_stream_repeats_while_another_has_unread_data(tmp_path):
    """5 row groups of 40 documents over 4 streams (pretraining's streams, one per accumulation step): one whole row
    group each, the fifth dealt by document, 50 documents a stream, each document in one stream. Stepped together,
    no stream's rows repeat a document before every stream has trained nearly all of its own (documents of 10 words:
    streams differ by a few tokens). Before, stream 0 took 2 row groups (80 documents) and streams 1-3 one each: they
    repeated theirs with half of stream 0's untrained."""
    docs = make_docs(200, min_words=10, max_words=10)
    data, tok = small_corpus(tmp_path / "corpus", docs, 40)
    files = D.split_shards(data, "train")
    dealt = [[t for path, rg, first, step in L.assign_units(files, rank, 4) for t in D.read_row_group(path, rg)[first::step]]
             for rank in range(4)]
    assert [len(d) for d in dealt] == [50] * 4 and sorted(t for d in dealt for t in d) == sorted(docs)
    loaders = [L.text_loader(data, "train", tok, batch_size=1, seq_len=32, rank=r, world_size=4) for r in range(4)]
    while all(ld.epoch == 0 for ld in loaders):
        for ld in loaders:
            next(ld)
    done = [ld.state["stats"]["tokens"] / sum(len(tok.encode(t)) + 1 for t in d) for ld, d in zip(loaders, dealt)]
    assert min(done) > 0.9, done  # the share of its first pass each stream has trained
    for ld in loaders:
        ld.close()


def doc_markers(texts):
    return {m for text in texts for m in re.findall(r"doc\d{4}", text)}


@pytest.mark.parametrize("split,world_size", [("train", 2), ("train", 3), ("val", 2)])
def test_ranks_never_share_a_document(corpus, split, world_size):
    data, tok = corpus
    files = D.split_shards(data, split)
    assigned, seen = [], []
    for rank in range(world_size):
        units = L.assign_units(files, rank, world_size)
        assigned.append(doc_markers(t for path, rg, first, step in units
                                    for t in D.read_row_group(path, rg)[first::step]))
        loader = L.text_loader(data, split, tok, batch_size=4, seq_len=64, rank=rank, world_size=world_size,
                               buffer_docs=10)
        batches = []
        while loader.state["epoch"] < 2:  # past the first epoch, so its buffered documents are out too
            batches.append(next(loader))
        loader.close()
        seen.append(doc_markers(tok.decode(row) for x, _ in batches for row in x.tolist()))
    for i in range(world_size):
        for j in range(i + 1, world_size):
            assert not assigned[i] & assigned[j] and not seen[i] & seen[j]
        assert seen[i] <= assigned[i] and len(seen[i]) > 0.9 * len(assigned[i])  # a crop can split a marker
    assert set().union(*assigned) == doc_markers(P.iter_texts(data, split))


def test_packing_conserves_every_token_and_starts_rows_with_bos(corpus):
    data, tok = corpus
    loader = L.text_loader(data, "train", tok, batch_size=4, seq_len=100, buffer_docs=30)
    batches = [next(loader) for _ in range(40)]
    state = loader.state_dict()
    loader.close()
    for x, y in batches:
        assert (x[:, 0] == tok.bos_id).all() and torch.equal(x[:, 1:], y[:, :-1]) and (y >= 0).all()
    # what went in: the first `docs` documents of the split, in order, each BOS + tokens
    texts = list(P.iter_texts(data, "train"))[:state["stats"]["docs"]]
    went_in = Counter(t for ids in tok.encode_batch(texts) for t in ids)
    # what came out: every row (its T+1 tokens) plus what is still buffered; BOS excluded (pieces add their own)
    came_out = Counter(t for x, y in batches for row in torch.cat([x, y[:, -1:]], 1).tolist() for t in row)
    came_out.update(state["buffer_ids"].tolist())
    del came_out[tok.bos_id]
    assert came_out == went_in
    assert 0 < state["stats"]["cropped"] < state["stats"]["doc_tokens"]


def test_one_pass_yields_every_token_once_then_stops(corpus):
    """max_epochs=1 (validation): the split's tokens come out exactly once, BOS-led rows as in training, the last
    row padded with -1 targets, then StopIteration; the rows do not depend on the batch size."""
    data, tok = corpus
    passes = {}
    for batch_size in (1, 7):
        loader = L.text_loader(data, "val", tok, batch_size=batch_size, seq_len=64, max_epochs=1)
        passes[batch_size] = torch.cat([torch.cat([x[:, :1], y], 1) for x, y in loader])
        with pytest.raises(StopIteration):
            next(loader)
        loader.close()
    rows = passes[1]
    assert torch.equal(rows, passes[7]) and (rows[:, 0] == tok.bos_id).all()
    went_in = Counter(t for ids in tok.encode_batch(list(P.iter_texts(data, "val"))) for t in ids)
    came_out = Counter(t for row in rows.tolist() for t in row if t not in (-1, tok.bos_id))
    assert came_out == went_in
    assert (rows[:-1] != -1).all() and (rows[-1] == -1).any()  # only the last row is padded


def test_short_documents_never_leave_a_row_nothing_to_crop(tmp_path, corpus):
    """buffer_docs pieces can hold fewer tokens than a row: the packer reads on rather than crop from an empty buffer
    (an IndexError before)."""
    _, tok = corpus
    pq.write_table(pa.table({"text": ["x y"] * 40}), tmp_path / "short.parquet")
    (x, y), = take(L.PackedLoader([tmp_path / "short.parquet"], tok, 2, 32, buffer_docs=3), 1)
    doc = [tok.bos_id, *tok.encode("x y")]
    assert x[0].tolist() + y[0, -1:].tolist() == (doc * 33)[:33] and (x[:, 0] == tok.bos_id).all()


def test_empty_documents_are_skipped_and_counted(tmp_path, corpus):
    _, tok = corpus
    pq.write_table(pa.table({"text": ["a b c", "", None, "d e f g"] * 10}), tmp_path / "shard_00000.parquet")
    pq.write_table(pa.table({"text": ["x"]}), tmp_path / "shard_00001.parquet")
    loader = L.text_loader(tmp_path, "train", tok, batch_size=2, seq_len=16, buffer_docs=5)
    while loader.state["epoch"] == 0:
        next(loader)
    loader.close()
    assert loader.state["stats"]["empty"] >= 20 and "empty skipped" in loader.log_line()


def test_no_usable_document_is_an_error_not_a_hang(tmp_path, corpus):
    _, tok = corpus
    pq.write_table(pa.table({"text": ["", None]}), tmp_path / "shard_00000.parquet")
    pq.write_table(pa.table({"text": ["x"]}), tmp_path / "shard_00001.parquet")
    with pytest.raises(ValueError, match="found no usable document"):
        next(L.text_loader(tmp_path, "train", tok, batch_size=1, seq_len=8))


def test_state_for_another_world_size_is_refused(corpus):
    data, tok = corpus
    loader = L.text_loader(data, "train", tok, batch_size=2, seq_len=32, world_size=2)
    next(loader)
    state = loader.state_dict()
    loader.close()
    with pytest.raises(ValueError, match="world_size=2, this loader has world_size=1"):
        L.text_loader(data, "train", tok, batch_size=2, seq_len=32).load_state_dict(state)


# --- the chat loader --------------------------------------------------------------------------------------------

def write_conversations(path, conversations):
    pq.write_table(pa.table({"messages": conversations}), path, row_group_size=64)


def test_chat_rows_mask_pad_and_never_crop(tmp_path, corpus):
    _, tok = corpus
    rng = random.Random(0)
    conversations = []
    for i in range(300):
        turns = [{"role": "user", "content": f"doc{i:04d} " + " ".join(rng.choices(WORDS, k=rng.randint(1, 12)))},
                 {"role": "assistant", "content": " ".join(rng.choices(WORDS, k=rng.randint(1, 25)))}]
        if i % 7 == 0:
            turns += [{"role": "user", "content": "and then"}, {"role": "assistant", "content": "more words here"}]
        conversations.append(turns)
    conversations[5] = [{"role": "user", "content": "doc0005 no answer"}]
    conversations[6] = [{"role": "user", "content": "doc0006 " + "long " * 400}, {"role": "assistant", "content": "x"}]
    conversations[7] = [{"role": "assistant", "content": "doc0007 starts wrong"}, {"role": "user", "content": "y"}]
    conversations[8] = conversations[0] + [{"role": "user", "content": "z " * 300},
                                           {"role": "assistant", "content": "cut here"}]
    write_conversations(tmp_path / "train.parquet", conversations)
    T = 96
    loader = L.PackedLoader([tmp_path / "train.parquet"], tok, 4, T, kind="chat", buffer_docs=16, name="sft")
    batches = []
    # past the first epoch (its buffered conversations are out too) and past item 8 of the third pass
    while (loader.state["epoch"], loader.state["unit"], loader.state["doc"]) < (2, 0, 9):
        batches.append(next(loader))
    loader.close()
    stats = loader.state["stats"]
    passes = 3
    assert stats["no_assistant"] == stats["too_long"] == stats["malformed"] == passes  # counted once per pass
    assert f"no assistant turn {passes}, malformed {passes}, first exchange longer than a row {passes}" in \
        loader.log_line()
    rendered = {}
    for conv in conversations[:7] + conversations[8:]:  # [7] is the malformed one
        ids, mask = tok.render_conversation(conv, max_tokens=T + 1)
        if ids and any(mask[1:]):
            rendered[re.search(r"doc\d{4}", tok.decode(ids)).group()] = (ids, mask)
    placed = set()
    for x, y in batches:
        for row_in, row_t in zip(x.tolist(), y.tolist()):
            assert any(t != -1 for t in row_t)  # never a row without a trainable target (NaN losses otherwise)
            starts = [i for i, t in enumerate(row_in) if t == tok.bos_id]
            assert starts[0] == 0
            for a, b in zip(starts, starts[1:] + [T]):
                seg = row_in[a:b]
                marker = re.search(r"doc\d{4}", tok.decode(seg))
                if marker is None:  # padding: a BOS input whose target is -1
                    assert seg == [tok.bos_id] and row_t[a] == -1
                    continue
                ids, mask = rendered[marker.group()]
                # a whole conversation; only one that ends exactly at the row's last token loses it to the targets
                assert seg == ids or (b == T and seg == ids[:-1])
                expected = [t if m else -1 for t, m in zip(ids[1:], mask[1:])]
                assert row_t[a:a + len(expected)] == expected[:T - a]
                placed.add(marker.group())
    assert placed == set(rendered) and len(placed) == 296  # 297 usable; [8] shares [0]'s marker
    cut = tok.render_conversation(conversations[8], max_tokens=T + 1)[0]
    assert cut == tok.render_conversation(conversations[0])[0]  # cut at the turn boundary


def test_cli_ingest_then_bad_input_is_one_line(tmp_path, capsys):
    (tmp_path / "a.txt").write_text("one\n\ntwo\n\nthree\n")
    run = [sys.executable, str(ROOT / "prepare.py")]
    out = subprocess.run([*run, "ingest", "--out", str(tmp_path / "c"), str(tmp_path / "a.txt")], capture_output=True,
                         text=True, check=True).stdout
    assert "1 files -> 3 documents" in out and len(D.list_shards(tmp_path / "c")) == 2
    for args, message in ((["ingest", "--out", str(tmp_path / "d"), str(tmp_path / "missing.txt")], "no such file"),
                          (["ingest", "--out", str(tmp_path / "d"), str(tmp_path / "a.csv")], "unsupported file")):
        if args[-1].endswith(".csv"):
            (tmp_path / "a.csv").write_text("x")
        code, _, err = run_in_process(P.main, args, capsys)  # in-process: a new interpreter costs ~3 s
        assert code == 1 and err.count("\n") == 1 and message in err
