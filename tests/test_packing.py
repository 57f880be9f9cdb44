"""loader.py's packing functions on small hand-made documents, without threads or files: which piece fills a row
(the oldest first, then the largest that fits), cropping and its BOS-led remainders, padding in pad mode, masks cut
with their documents, targets -1 where nothing is supervised; and the threaded loader giving exactly their rows."""
import numpy as np
import torch

import dataset as D
import loader as L
import prepare
from tokenizer import Tokenizer

BOS = 0


def doc(*ids):
    """A text document as the reader hands it over: int32 ids, led by BOS."""
    return np.array([BOS, *ids], dtype=np.int32)


def conv(ids, mask):
    """A rendered conversation: ids and its loss mask (1: a target)."""
    return np.array(ids, dtype=np.int32), np.array(mask, dtype=np.int8)


def pack_all(documents, batch_size, row_len, *, crop, buffer_docs=100, masked=True, bos=BOS):
    """Every batch pack_batch() makes from `documents` until it returns no rows: ([(rows, masks)], stats)."""
    buffer, stats = L.PieceBuffer([]), dict.fromkeys(L.STAT_KEYS, 0)
    documents, batches = iter(documents), []
    while True:
        rows, masks = L.pack_batch(buffer, documents, batch_size, row_len, bos, crop=crop, buffer_docs=buffer_docs,
                                   masked=masked, stats=stats)
        if not len(rows):
            return batches, stats
        batches.append((rows, masks))


def test_each_row_opens_with_the_oldest_piece_then_takes_the_largest_that_fits_and_pad_mode_pads_with_bos():
    """Pieces of 4, 3, 5, 2, 3 tokens into rows of 8 (pad mode): the oldest (4) opens row 1 and the largest that fits
    the 4 left is a 3, the later of the two (E); 1 token is left that nothing fits: padded with BOS, mask 0. B (3)
    opens row 2 and C (5) fills it exactly; D (2) opens row 3, alone. A short last batch: 3 rows of 4."""
    a, b, c, d, e = doc(1, 1, 1), doc(2, 2), doc(3, 3, 3, 3), doc(4), doc(5, 5)
    [(rows, masks)], stats = pack_all([a, b, c, d, e], 4, 8, crop=False)
    assert rows.tolist() == [[0, 1, 1, 1, 0, 5, 5, 0],
                             [0, 2, 2, 0, 3, 3, 3, 3],
                             [0, 4, 0, 0, 0, 0, 0, 0]]
    assert masks.tolist() == [[1, 1, 1, 1, 1, 1, 1, 0],
                              [1, 1, 1, 1, 1, 1, 1, 1],
                              [1, 1, 0, 0, 0, 0, 0, 0]]
    assert rows.dtype == np.int32 and masks.dtype == np.int8
    assert {k: v for k, v in stats.items() if v} == {"batches": 1, "tokens": 3 * 7, "supervised": 6 + 7 + 1,
                                                     "docs": 5, "doc_tokens": 17, "pieces": 5, "padding": 7}


def test_crop_fills_a_row_with_the_smallest_piece_and_keeps_its_rest_as_a_bos_led_piece_for_a_later_row():
    """Crop mode, rows of 8, a buffer of 3 pieces. Row 1: A (6) leaves 2 that no piece fits, so the smallest, C (4),
    is cropped: its first 2 tokens end the row, [BOS, 3, 3] goes back. Row 2: D (10 tokens) arrives as two pieces
    (8, and [BOS, 4, 4]); B opens the row, [BOS, 4, 4] fills it. Row 3: C's rest opens it, D's first piece is cropped
    into the 5 left. Row 4: D's rest, then padding: the documents have run out (as at the end of max_epochs). No
    token is lost: every document token is in a row, the only additions are BOS and padding."""
    a, b, c = doc(1, 1, 1, 1, 1), doc(2, 2, 2, 2), doc(3, 3, 3)
    d = doc(4, 4, 4, 4, 4, 4, 4, 4, 4)
    batches, stats = pack_all([a, b, c, d], 2, 8, crop=True, buffer_docs=3)
    assert [rows.tolist() for rows, _ in batches] == [[[0, 1, 1, 1, 1, 1, 0, 3],
                                                       [0, 2, 2, 2, 2, 0, 4, 4]],
                                                      [[0, 3, 3, 0, 4, 4, 4, 4],
                                                       [0, 4, 4, 4, 0, 0, 0, 0]]]
    assert batches[1][1].tolist() == [[1] * 8, [1, 1, 1, 1, 0, 0, 0, 0]]
    assert stats["cropped"] == 2 + 2 + 3  # C's rest, D's second piece, D's first piece's rest
    assert (stats["docs"], stats["doc_tokens"], stats["pieces"], stats["padding"]) == (4, 25, 5, 4)
    assert (stats["batches"], stats["tokens"], stats["supervised"]) == (2, 4 * 7, 4 * 7 - 4)
    every = np.concatenate([rows.ravel() for rows, _ in batches])
    assert sorted(every[every != BOS].tolist()) == sorted(np.concatenate([a, b, c, d])[
        np.concatenate([a, b, c, d]) != BOS].tolist())


def test_a_conversation_longer_than_a_row_is_cut_with_its_mask_and_its_targets_follow_the_mask():
    """An 8-token conversation in rows of 5: pieces [0 1 2 3 4] and [BOS 5 6 7], the mask cut at the same places
    (the second piece's BOS takes the mask's first value, 0). Targets are the next token where the mask is 1, else
    -1: the padding at the end of row 2 and the tokens that are not supervised."""
    ids, mask = conv([0, 1, 2, 3, 4, 5, 6, 7], [0, 0, 1, 1, 0, 1, 1, 1])
    [(rows, masks)], stats = pack_all([(ids, mask)], 2, 5, crop=False)
    assert rows.tolist() == [[0, 1, 2, 3, 4], [0, 5, 6, 7, 0]]
    assert masks.tolist() == [[0, 0, 1, 1, 0], [0, 1, 1, 1, 0]]
    inputs, targets = L.inputs_and_targets(rows, masks)
    assert inputs.tolist() == [[0, 1, 2, 3], [0, 5, 6, 7]]
    assert targets.tolist() == [[-1, 2, 3, -1], [5, 6, 7, -1]]
    assert (stats["cropped"], stats["supervised"], stats["padding"], stats["pieces"]) == (3, 5, 1, 2)
    assert stats["supervised"] == int((targets != -1).sum())


def test_text_without_masks_trains_on_every_next_token():
    """masked=False (text that never pads): no masks, and every target is the next token."""
    buffer, stats = L.PieceBuffer([]), dict.fromkeys(L.STAT_KEYS, 0)
    rows, masks = L.pack_batch(buffer, iter([doc(1, 2, 3), doc(4, 5, 6, 7, 8)]), 1, 6, BOS, crop=True,
                               buffer_docs=1, masked=False, stats=stats)
    assert masks is None and rows.tolist() == [[0, 1, 2, 3, 0, 4]]
    assert L.inputs_and_targets(rows, masks).tolist() == [[[0, 1, 2, 3, 0]], [[1, 2, 3, 0, 4]]]
    assert stats["supervised"] == stats["tokens"] == 5
    assert [ids.tolist() for ids, _, _ in buffer.pieces] == [[0, 5, 6, 7, 8]]  # the rest of the cropped document


def test_skipped_documents_are_counted_under_their_reason_and_never_reach_a_row():
    """None (an empty document) and a reason are counted; with nothing else, no rows and no batch."""
    batches, stats = pack_all([None, "too_long", "malformed", None], 2, 8, crop=False)
    assert batches == []
    assert {k: v for k, v in stats.items() if v} == {"empty": 2, "too_long": 1, "malformed": 1}


def test_the_loader_gives_exactly_the_rows_pack_batch_makes_from_the_same_documents(demo_world):
    """The threaded loader over the demo world's validation shard (one pass) against pack_batch() on the same
    documents, read and tokenized here: the same batches, element for element."""
    tok = Tokenizer.load(demo_world / "tokenizer")
    shard = D.split_shards(demo_world / "demo" / "pretrain", "val")[0]
    texts = [t for g in range(D.open_parquet(shard).num_row_groups) for t in D.read_row_group(shard, g)]
    encoded = iter(tok.encode_batch([t for t in texts if t], num_threads=1))
    documents = [np.array([tok.bos_id, *next(encoded)], dtype=np.int32) if t else None for t in texts]
    expected, stats = pack_all(documents, 4, 65, crop=True, buffer_docs=30, bos=tok.bos_id)
    loader = L.text_loader(demo_world / "demo" / "pretrain", "val", tok, 4, 64, buffer_docs=30, threads=1,
                           max_epochs=1)
    got = list(loader)
    assert len(got) == len(expected) > 10
    for (x, y), (rows, masks) in zip(got, expected, strict=True):
        inputs, targets = torch.from_numpy(L.inputs_and_targets(rows, masks)).long()
        assert torch.equal(x, inputs) and torch.equal(y, targets)
    assert loader.state["stats"] == stats


def test_prepare_rows_prints_a_batchs_first_row_and_exactly_the_tokens_it_trains_on(demo_world, capsys):
    """`python prepare.py rows --chat DIR`: the first row's inputs decoded, then its supervised targets (the assistant's
    answers and <|assistant_end|>), as chat_loader itself makes them."""
    tok, chat = Tokenizer.load(demo_world / "tokenizer"), demo_world / "demo" / "conversations"
    prepare.main(["rows", "--chat", str(chat), "--tokenizer", str(demo_world / "tokenizer"), "--seq_len", "64", "--rows", "1"])
    out = capsys.readouterr().out
    loader = L.chat_loader(chat, "train", tok, 4, 64)
    x, y = next(loader)
    loader.close()
    trained = y[0][y[0] != -1].tolist()
    assert 0 < len(trained) < 64
    assert out.startswith(f"--- row 0: {len(trained)} of 64 targets; inputs:\n{tok.decode(x[0].tolist())}\n--- row 0: "
                          f"its targets (the tokens it trains on), joined:\n{tok.decode(trained)}\n")
    assert tok.decode(trained).endswith("<|assistant_end|>")
