"""loader.py's loaders for the stages after pretraining: SFT rows (pack="pad"), conversations packed like text
(pack="crop"), supervise="all"/"assistant", bad conversations skipped and reported, the per-epoch reshuffle (seed=)
with exact resume, and the token-share mixture of midtraining."""
import io
import itertools
import random
import re
from collections import Counter
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from helpers import same, take

import dataset as D
import loader as L
from midtrain import MixtureLoader
from tokenizer import Tokenizer

WORDS = ["the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "while", "seven", "small", "birds"]


@pytest.fixture(scope="module")
def world(demo_world):
    """(demo dir, tokenizer, the demo's training conversations)."""
    demo = demo_world / "demo"
    conversations = pq.read_table(demo / "conversations" / "train.parquet").column("messages").to_pylist()
    return demo, Tokenizer.load(demo_world / "tokenizer"), conversations


def through_checkpoint(state):
    buf = io.BytesIO()
    torch.save(state, buf)
    return torch.load(io.BytesIO(buf.getvalue()), weights_only=True)


def exchange(user, assistant):
    return [{"role": "user", "content": user}, {"role": "assistant", "content": assistant}]


def marked_conversations(n, seed=0):
    """Short conversations whose user turn starts with a marker conv0000, conv0001, ..."""
    rng = random.Random(seed)
    return [exchange(f"conv{i:04d} " + " ".join(rng.choices(WORDS, k=rng.randint(1, 6))),
                     " ".join(rng.choices(WORDS, k=rng.randint(1, 8)))) for i in range(n)]


def write_chat(directory, conversations, row_group_size=64):
    directory.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table({"messages": conversations}), directory / "train.parquet", row_group_size=row_group_size)
    return directory


def full_rows(batches):
    """The T+1 tokens of every row of batches whose targets are all known (supervise="all", pack="crop")."""
    return torch.cat([torch.cat([x[:, :1], y], 1) for x, y in batches]).tolist()


# --- SFT rows (pack="pad") ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("supervise", ["assistant", "all"])
def test_sft_rows_at_T64_always_have_a_target_and_hold_whole_rendered_conversations(world, tmp_path, supervise):
    """At T=64 with conversations far longer than a row: each is cut after its last assistant turn that fits (never
    inside a turn), one whose first exchange does not fit is skipped and counted, no row is without a supervised
    target, and the targets are exactly the render's mask (or every real token, supervise="all")."""
    _, tok, demo = world
    long_answer = exchange("a question", "word " * 300)
    cut = exchange("short", "fine") + exchange("then", "answer " * 200)  # keeps its first exchange only
    conversations = demo[:200] + [long_answer, cut] * 5 + [exchange("x " * 100, "y")] * 3
    T, B = 64, 8
    loader = L.chat_loader(write_chat(tmp_path / "chat", conversations), "train", tok, B, T, buffer_docs=16,
                           supervise=supervise, max_epochs=1)  # one pass: every conversation once
    batches = list(loader)
    loader.close()
    stats = loader.state["stats"]
    rendered, too_long = {}, 0
    for conv in conversations:
        ids, mask = tok.render_conversation(conv, max_tokens=T + 1)
        too_long += not ids
        if ids:
            rendered[tuple(ids)] = [1] * len(ids) if supervise == "all" else mask
    assert tok.render_conversation(cut, max_tokens=T + 1)[0] == tok.render_conversation(cut[:2])[0]
    assert stats["too_long"] == too_long >= 5 + 3  # the long answers and questions, and the demo's longest
    placed, targets, padding = Counter(), 0, 0
    for x, y in batches:
        for row_in, row_t in zip(x.tolist(), y.tolist()):
            assert any(t != -1 for t in row_t)  # never a row without a target: its loss would be 0/0
            targets += sum(t != -1 for t in row_t)
            # the row's T+1 tokens: its last is the last target, or padding (a conversation ends with a target)
            row = row_in + [row_t[-1] if row_t[-1] != -1 else tok.bos_id]
            starts = [i for i, t in enumerate(row) if t == tok.bos_id] + [T + 1]
            assert starts[0] == 0
            for a, b in itertools.pairwise(starts):
                if b - a == 1 and (a == T or row_t[a] == -1):  # padding: a BOS input whose target is -1
                    padding += 1
                    continue
                seg = tuple(row[a:b])
                assert seg in rendered  # a whole rendered conversation, never a piece
                assert row_t[a:b - 1] == [t if m else -1 for t, m in zip(seg[1:], rendered[seg][1:])]
                placed[seg] += 1
    assert targets == stats["supervised"] and padding == stats["padding"] > 0
    assert sum(placed.values()) == stats["docs"] == len(conversations) - too_long and len(placed) == len(rendered)


def test_a_set_whose_every_first_exchange_is_too_long_is_an_error_not_a_hang(world, tmp_path):
    _, tok, _ = world
    loader = L.chat_loader(write_chat(tmp_path, [exchange("x " * 100, "y")] * 4), "train", tok, 2, 64)
    with pytest.raises(ValueError, match="found no usable document"):
        next(loader)


# --- conversations packed like text (pack="crop") ---------------------------------------------------------------

def test_crop_packs_conversations_like_text_and_every_token_keeps_its_mask(world, tmp_path):
    """pack="crop": no padding, BOS-led rows, long conversations cut into BOS-led pieces and crops put back, and every
    token of every conversation read comes out once (in a row or still buffered) with its own render-mask value. The
    packing does not depend on the mask, so supervise="all" shows the tokens whose targets "assistant" hides."""
    _, tok, demo = world
    conversations = demo[:150] + [exchange("q " * 30, "answer " * 150)] * 3  # some are several rows long
    chat_dir = write_chat(tmp_path / "chat", conversations)
    T, runs = 64, {}
    for supervise in ("all", "assistant"):
        loader = L.chat_loader(chat_dir, "train", tok, 4, T, pack="crop", supervise=supervise, buffer_docs=20)
        runs[supervise] = [next(loader) for _ in range(30)], loader.state_dict()
        loader.close()
    (everything, _), (assistant, state) = runs["all"], runs["assistant"]
    assert all(torch.equal(a[0], b[0]) for a, b in zip(everything, assistant))  # the same rows either way
    rows = full_rows(everything)
    masks = [[0] + [int(t != -1) for t in row] for row in torch.cat([y for _, y in assistant]).tolist()]
    stats = state["stats"]
    assert all(row[0] == tok.bos_id for row in rows) and stats["padding"] == 0 and stats["cropped"] > 0
    assert all((y != -1).all() for _, y in everything)  # supervise="all": every token is a target, no padding
    assert stats["supervised"] == sum(sum(m) for m in masks) and 0 < stats["supervised"] < stats["tokens"]
    assert all(m == 0 for row, mask in zip(rows, masks) for t, m in zip(row, mask) if t == tok.bos_id)
    went_in = Counter()
    for conv in conversations[:stats["docs"]]:  # all usable, read in file order (seed=None)
        ids, mask = tok.render_conversation(conv)
        went_in.update(zip(ids[1:], mask[1:]))
    came_out = Counter((t, m) for row, mask in zip(rows, masks) for t, m in zip(row, mask) if t != tok.bos_id)
    came_out.update((t, m) for t, m in zip(state["buffer_ids"].tolist(), state["buffer_masks"].tolist())
                    if t != tok.bos_id)
    assert came_out == went_in


# --- bad input ----------------------------------------------------------------------------------------------------

def test_bad_conversations_are_skipped_counted_and_the_first_few_printed_once(world, tmp_path, capsys):
    _, tok, _ = world
    good = marked_conversations(40)
    bad = {3: [{"role": "robot", "content": "hi"}, {"role": "assistant", "content": "x"}],  # unknown role
           7: exchange("question", ""),  # empty answer
           11: exchange("   ", "answer"),  # blank question
           20: [{"role": "user", "content": "a"}, {"role": "user", "content": "b"},
                {"role": "assistant", "content": "c"}],  # two user turns in a row
           26: [{"role": "user", "content": "no answer"}],
           33: [],  # no messages at all
           37: [{"role": "user", "content": "a"}, {"role": "assistant", "content": None}]}  # content not a string
    conversations = [bad.get(i, conv) for i, conv in enumerate(good)]
    chat_dir = write_chat(tmp_path / "chat", conversations, row_group_size=16)  # row numbers run across row groups
    loader = L.chat_loader(chat_dir, "train", tok, 2, 64, buffer_docs=4, max_epochs=2)
    assert all((y != -1).any(dim=1).all() for _, y in loader)  # two passes
    loader.close()
    stats = loader.state["stats"]
    assert (stats["malformed"], stats["empty_content"], stats["no_assistant"], stats["empty"]) == (6, 4, 2, 2)
    assert stats["docs"] == 2 * 33
    out = capsys.readouterr().out
    printed = re.findall(r"chat train loader: skipping (\S+) row (\d+): (.*)", out)
    assert [(Path(p), int(r)) for p, r, _ in printed] == [(chat_dir / "train.parquet", r) for r in (3, 7, 11, 20, 26)]
    assert "message 0: must be" in printed[0][2] and "message 1 (assistant) has empty content" in printed[1][2]
    assert "expected role 'assistant', got 'user'" in printed[3][2] and printed[4][2].startswith("no assistant turn")
    assert "only the first 5 are printed" in printed[4][2]  # and only once: not again in the second pass
    assert "no assistant turn 2, malformed 6, first exchange longer than a row 0, empty content 4" in loader.log_line()
    rank1 = L.chat_loader(chat_dir, "train", tok, 2, 64, buffer_docs=4, rank=1, world_size=2)
    take(rank1, 3)
    assert "skipping" not in capsys.readouterr().out  # rank 0 reports for everyone


# --- the per-epoch reshuffle ------------------------------------------------------------------------------------

def visit_order(loader, tok, epochs):
    """Markers of the conversations in the order the loader read them: with buffer_docs=1 and short conversations,
    each pad row holds exactly the next one read."""
    orders = [[] for _ in range(epochs)]
    while loader.state["epoch"] < epochs:
        epoch = loader.state["epoch"]
        x, _ = next(loader)
        for row in x.tolist():
            orders[epoch].extend(re.findall(r"conv\d{4}", tok.decode(row)))
    loader.close()
    return orders


def test_seeded_epochs_visit_every_conversation_in_a_new_order_unit_by_unit(world, tmp_path):
    _, tok, _ = world
    chat_dir = write_chat(tmp_path / "chat", marked_conversations(32), row_group_size=8)  # 4 units of 8

    def orders(seed, epochs=3):
        return visit_order(L.chat_loader(chat_dir, "train", tok, 4, 64, buffer_docs=1, seed=seed), tok, epochs)
    file_order = [f"conv{i:04d}" for i in range(32)]
    plain, shuffled = orders(None, 2), orders(7)
    assert plain == [file_order, file_order]  # seed=None: today's order, every epoch
    assert all(sorted(epoch) == file_order for epoch in shuffled)  # each epoch: every conversation once
    assert len({tuple(epoch) for epoch in shuffled + [file_order]}) == 4  # a new order every epoch
    file_units = [file_order[k:k + 8] for k in range(0, 32, 8)]
    unit_orders = []
    for epoch in shuffled:  # one unit after the other, the units in a shuffled order, each unit's documents too
        units = [epoch[k:k + 8] for k in range(0, 32, 8)]
        assert sorted(map(sorted, units)) == file_units and all(unit != sorted(unit) for unit in units)
        unit_orders.append([file_units.index(sorted(unit)) for unit in units])
    assert unit_orders == [[2, 1, 0, 3], [3, 2, 1, 0], [0, 3, 1, 2]]  # from (seed, epoch): pinned, runs repeat
    assert orders(7) == shuffled and orders(8) != shuffled  # from the seed alone


def text_files(directory, n=96, row_group_size=12):
    directory.mkdir(parents=True, exist_ok=True)
    rng = random.Random(1)
    docs = [f"doc{i:04d} " + " ".join(rng.choices(WORDS, k=rng.randint(3, 60))) for i in range(n)]
    pq.write_table(pa.table({"text": docs}), directory / "docs.parquet", row_group_size=row_group_size)
    return [directory / "docs.parquet"]


@pytest.mark.parametrize("kind,pack", [("text", None), ("chat", "pad"), ("chat", "crop")])
def test_a_seeded_resume_mid_epoch_is_bit_identical(world, tmp_path, kind, pack):
    _, tok, demo = world
    files = text_files(tmp_path) if kind == "text" else [write_chat(tmp_path, demo[:120], row_group_size=16) /
                                                         "train.parquet"]

    def loader(seed=5):
        return L.PackedLoader(files, tok, 4, 64, kind=kind, pack=pack, seed=seed, buffer_docs=6)
    straight, first = loader(), loader()
    expected = [next(straight) for _ in range(40)]
    assert straight.state["epoch"] >= 1  # the run crosses into a reshuffled epoch
    straight.close()
    resumed = [next(first) for _ in range(13)]
    state = through_checkpoint(first.state_dict())
    first.close()
    assert state["epoch"] == 0 and 0 < state["unit"] and state["doc"] > 0  # mid-epoch, mid-unit
    second = loader()
    second.load_state_dict(state)
    assert same(expected, resumed + take(second, 27))
    assert not same(expected[:5], take(loader(seed=6), 5))
    with pytest.raises(ValueError, match="seed=5, this loader has seed=6"):
        loader(seed=6).load_state_dict(state)


@pytest.mark.parametrize("kind,pack", [("text", None), ("chat", "pad"), ("chat", "crop")])
def test_a_small_streams_kept_passes_are_the_passes_read_anew(world, tmp_path, kind, pack):
    """A training stream whose pass is shorter than buffer_docs (here 13 documents: a row group whole, and a share of
    the last) reads and encodes each unit once and keeps it: its later, reshuffled passes, and a resume in one, give
    the batches of a stream that reads every pass anew."""
    _, tok, demo = world
    files = text_files(tmp_path, n=40) if kind == "text" else [write_chat(tmp_path, demo[:40], row_group_size=12) /
                                                                 "train.parquet"]

    def loader(keep=True):
        stream = L.PackedLoader(files, tok, 4, 64, kind=kind, pack=pack, seed=5, rank=1, world_size=3, threads=1)
        stream._encoded = stream._encoded if keep else None  # None: every pass reads its files
        return stream
    expected, kept, reads = take(loader(keep=False), 30), loader(), []
    read_unit = kept._read_unit
    kept._read_unit = lambda *unit: reads.append(unit) or read_unit(*unit)
    resumed = [next(kept) for _ in range(11)]
    state = through_checkpoint(kept.state_dict())
    kept.close()
    assert kept.state["epoch"] >= 2 and len(reads) == len(kept.units) == 2  # passes after the first: no reads
    second = loader()
    second.load_state_dict(state)
    assert same(expected, resumed + take(second, 19))


# --- the mixture --------------------------------------------------------------------------------------------------

def three_sources(world, tmp_path):
    demo, _, conversations = world
    smol = write_chat(tmp_path / "smol", conversations[:400], row_group_size=100)
    extra = write_chat(tmp_path / "extra", marked_conversations(60), row_group_size=16)
    return [{"name": "pretrain", "kind": "text", "path": str(demo / "pretrain"), "share": 0.3},
            {"name": "smol", "kind": "chat", "path": str(smol), "share": 0.5},
            {"name": "extra", "kind": "chat", "path": str(extra), "share": 0.2}]


def test_mixture_shares_hold_from_the_first_batches(world, tmp_path):
    """Each row goes to the source furthest below its share, so every source stays within a row of its target after
    every batch: within 2 points after 20 batches of 4 x 64, with 2 sources and with 3."""
    _, tok, _ = world
    sources = three_sources(world, tmp_path)
    two = [{**sources[0], "share": 0.3}, {**sources[1], "share": 0.7}]
    for mix in (two, sources):
        loader = MixtureLoader(mix, tok, 4, 64, buffer_docs=20, threads=1)
        for n in range(1, 21):
            x, y = next(loader)
            assert x.shape == y.shape == (4, 64) and x.dtype == torch.int64
            mixture = loader.mixture()
            total = sum(m["tokens"] for m in mixture.values())
            assert total == n * 4 * 64 == loader.state["stats"]["tokens"]
            assert all(abs(m["tokens"] - m["target"] * total) < 64 for m in mixture.values())  # within a row
        loader.close()
        assert all(abs(m["share"] - m["target"]) <= 0.02 for m in mixture.values())
        assert all(m["docs"] > 0 for m in mixture.values())
        assert all(f"{name}: {m['tokens']:,} tokens, {m['docs']:,} docs" in loader.log_line()
                   for name, m in mixture.items())
    assert "share 30.0% (target 30.0%)" in loader.log_line()
    first = MixtureLoader(two, tok, 1, 64, buffer_docs=20)
    take(first, 1)
    assert first.mixture()["smol"]["tokens"] == 64  # the first row goes to the largest share, not the first listed


def test_mixture_rows_supervise_as_asked(world, tmp_path):
    _, tok, _ = world
    sources = three_sources(world, tmp_path)[:2]
    for supervise in ("all", "assistant"):
        loader = MixtureLoader([{**sources[0], "share": 0.5}, {**sources[1], "share": 0.5}], tok, 4, 64,
                                 supervise=supervise, buffer_docs=20)
        batches = take(loader, 5)
        text, chat = (source.state["stats"] for source in loader.loaders)
        masked = sum((y == -1).sum().item() for _, y in batches)
        assert text["supervised"] == text["tokens"] > 0  # text: every token, whatever supervise says
        assert masked == chat["tokens"] - chat["supervised"] and (masked == 0) == (supervise == "all")
        assert loader.state["stats"]["supervised"] == 5 * 4 * 64 - masked


def test_mixture_resume_is_bit_identical_and_refuses_another_mixture(world, tmp_path):
    _, tok, _ = world
    sources = three_sources(world, tmp_path)

    def loader(mix=sources):  # as one accumulation micro-step of rank 0: rank = rank * accum + j
        return MixtureLoader(mix, tok, 4, 64, rank=1, world_size=2, buffer_docs=10, seed=3)
    expected = take(loader(), 12)
    first = loader()
    resumed = [next(first) for _ in range(5)]
    state = through_checkpoint(first.state_dict())
    first.close()
    second = loader()
    second.load_state_dict(state)
    assert same(expected, resumed + take(second, 7))
    assert second.state["stats"]["batches"] == 12 and second.state["stats"]["tokens"] == 12 * 4 * 64
    other = [{**sources[0], "share": 0.4}, {**sources[1], "share": 0.4}, sources[2]]
    with pytest.raises(ValueError, match="an exact resume needs the same sources and shares"):
        loader(other).load_state_dict(state)


def test_mixture_shares_must_sum_to_one(world, tmp_path):
    _, tok, _ = world
    sources = three_sources(world, tmp_path)
    with pytest.raises(ValueError, match=r"mixture shares \{'pretrain': 0.3, 'smol': 0.5, 'extra': 0.3\} sum to 1.1"):
        MixtureLoader([*sources[:2], {**sources[2], "share": 0.3}], tok, 4, 64)
    with pytest.raises(ValueError, match="kind='image': choose text or chat"):
        MixtureLoader([{**sources[0], "kind": "image", "share": 1.0}], tok, 4, 64)


def test_one_pass_of_an_sft_mixture_sees_each_source_its_number_of_epochs(world, tmp_path):
    """--source A:1 --source B:3: one pass (max_epochs=1) holds every conversation of A once and of B three times,
    their row groups shuffled together (not read in file order), and a bad spec names the fix."""
    _, tok, _ = world
    a = marked_conversations(120, seed=1)
    b = [exchange(f"other{i:04d} x", "y") for i in range(80)]
    sources = D.parse_chat_sources([f"{write_chat(tmp_path / 'a', a)}:1", f"{write_chat(tmp_path / 'b', b, 16)}:3"])
    assert [epochs for _, epochs in sources] == [1, 3]
    loader = L.chat_loader(None, "train", tok, 4, 128, files=D.mixture_files(sources), seed=0, max_epochs=1,
                           threads=1)
    text = "".join(tok.decode(x[x != tok.bos_id].tolist()) for inputs, _ in loader for x in inputs)
    seen = re.findall(r"(conv|other)(\d{4})", text)
    counts = Counter(seen)
    assert {k: v for k, v in counts.items() if k[0] == "conv"} == {("conv", f"{i:04d}"): 1 for i in range(120)}
    assert {k: v for k, v in counts.items() if k[0] == "other"} == {("other", f"{i:04d}"): 3 for i in range(80)}
    kinds = [k for k, _ in seen]
    assert kinds.index("other") < len(kinds) - 1 - kinds[::-1].index("conv")  # row groups shuffled, not file order
    for bad in ["dir", "dir:0", "dir:1.5", ":2"]:
        with pytest.raises(ValueError, match="write DIR:EPOCHS"):
            D.parse_chat_sources([bad])
