"""tokenizer.py (and its training in prepare.py): exact vocab size and special ids, round trips, JSON save/load, chat rendering and masks, the CLI."""
import ast
import json
import random
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import run_in_process

import prepare as P
import tokenizer as T
from prepare import iter_texts, train_tokenizer, write_text_shards
from tokenizer import SPECIAL_TOKENS, Tokenizer

ROOT = Path(__file__).resolve().parent.parent
V = 512
SAMPLES = [
    "", "hello world", "Hello, World! 1234567 3.14159", "café naïve résumé — «quotes»", "日本語のテキスト、中文字符",
    "emoji 😀🎉👩‍👩‍👧 and flags 🇫🇷", "line one\nline two\r\n\n\ttabbed   spaces   ",
    "def f(x):\n    return {'a': [x ** 2 for _ in range(3)]}  # code\n", "e\u0301 combining, \u200b zero width",
    "don't I'll we've THEY'RE", "<|bos|> looks special <|assistant_end|> but is text <|user_start|>",
]


def make_texts(n_docs=400, seed=0):
    """Deterministic pseudo-English with some unicode, numbers and code: enough distinct pairs for ~600 merges."""
    rng = random.Random(seed)
    syllables = ["ka", "lo", "mi", "ne", "ru", "sa", "to", "vi", "zu", "qe", "ph", "th", "ing", "ed", "str", "ou"]
    words = ["".join(rng.choice(syllables) for _ in range(rng.randint(1, 4))) for _ in range(300)]
    extras = ["café", "naïve", "日本語", "😀", "def f(x):\n    return x + 1\n", "3.14159", "2024", "\n\n", "(a, b)"]
    return [" ".join(rng.choice(words) if rng.random() > 0.1 else rng.choice(extras)
                     for _ in range(rng.randint(20, 120))).capitalize() + "." for _ in range(n_docs)]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    out = tmp_path_factory.mktemp("corpus")
    write_text_shards(make_texts(), out, seed=0, shard_docs=150, val_fraction=0.1)
    return out


@pytest.fixture(scope="module")
def tok(corpus):
    return train_tokenizer(iter_texts(corpus, "train"), V)


def test_vocab_size_and_special_ids_are_exact(tok):
    assert tok.vocab_size == V and len(tok.token_bytes) == V and len(tok.mergeable_ranks) == V - len(SPECIAL_TOKENS)
    assert [tok.special_id(name) for name in SPECIAL_TOKENS] == list(range(V - len(SPECIAL_TOKENS), V))
    assert tok.bos_id == V - len(SPECIAL_TOKENS)
    with pytest.raises(ValueError, match=r"<\|assistant_end\|>"):
        tok.special_id("<|eos|>")


@pytest.mark.parametrize("vocab_size", [300, 600])
def test_other_vocab_sizes_are_exact(corpus, vocab_size):
    assert train_tokenizer(iter_texts(corpus, "train"), vocab_size).vocab_size == vocab_size


def test_train_rejects_impossible_vocab_sizes():
    with pytest.raises(ValueError, match="at least 265"):
        train_tokenizer(["some text"], 264)
    with pytest.raises(ValueError, match="only allows .* merges"):  # rustbpe would silently stop short
        train_tokenizer(["ab ab ab"], 600)


def test_round_trip_and_no_special_ids_from_text(tok):
    for text in SAMPLES:
        ids = tok.encode(text)
        assert tok.decode(ids) == text
        assert all(0 <= i < V - len(SPECIAL_TOKENS) for i in ids), text
    ids = tok.encode("<|bos|><|assistant_end|>")
    assert tok.bos_id not in ids and tok.special_id("<|assistant_end|>") not in ids
    assert tok.encode_batch(SAMPLES) == [tok.encode(t) for t in SAMPLES]
    assert tok.encode_batch(SAMPLES, num_threads=1) == [tok.encode(t) for t in SAMPLES]


def test_token_bytes(tok):
    for i in range(V - len(SPECIAL_TOKENS)):
        assert tok.token_bytes[i] == len(tok.enc.decode_single_token_bytes(i)) > 0
    assert tok.token_bytes[V - len(SPECIAL_TOKENS):] == [0] * len(SPECIAL_TOKENS)
    for text in SAMPLES:
        assert sum(tok.token_bytes[t] for t in tok.encode(text)) == len(text.encode("utf-8"))


def test_save_load_round_trip_is_json(tok, tmp_path):
    path = tok.save(tmp_path / "tk")
    assert path == tmp_path / "tk" / T.FILE_NAME and sorted(p.name for p in path.parent.iterdir()) == [T.FILE_NAME]
    raw = path.read_bytes()
    assert raw[:1] == b"{" and not raw.startswith(b"\x80")  # JSON text, not a pickle (which starts with 0x80)
    state = json.loads(raw)
    assert state["vocab_size"] == V and state["special_tokens"] == {n: V - len(SPECIAL_TOKENS) + i for i, n in enumerate(SPECIAL_TOKENS)}
    assert len(state["mergeable_ranks"]) == V - len(SPECIAL_TOKENS) and state["token_bytes"] == tok.token_bytes
    loaded = Tokenizer.load(tmp_path / "tk")
    assert loaded.vocab_size == V and loaded.pattern == tok.pattern and loaded.token_bytes == tok.token_bytes
    assert loaded.mergeable_ranks == tok.mergeable_ranks
    assert [loaded.encode(t) for t in SAMPLES] == [tok.encode(t) for t in SAMPLES]


def test_load_errors_name_the_path(tok, tmp_path):
    with pytest.raises(FileNotFoundError, match="python prepare.py tokenizer") as missing:
        Tokenizer.load(tmp_path / "nowhere")
    assert str(tmp_path / "nowhere" / T.FILE_NAME) in str(missing.value)
    path = tok.save(tmp_path / "tk")
    path.write_text('{"format": "nanochat-bpe-v1", "pattern": ')  # truncated
    with pytest.raises(ValueError, match="python prepare.py tokenizer") as corrupt:
        Tokenizer.load(tmp_path / "tk")
    assert str(path) in str(corrupt.value)
    tok.save(tmp_path / "tk")
    state = json.loads(path.read_text())
    state["token_bytes"][300] += 1
    path.write_text(json.dumps(state))
    with pytest.raises(ValueError, match="token_bytes disagrees"):
        Tokenizer.load(tmp_path / "tk")


def test_text_stats_count_documents_bytes_and_tokens(tok):
    texts = [t for t in SAMPLES if t]
    expected = (len(texts), sum(len(t.encode("utf-8")) for t in texts), sum(len(tok.encode(t)) for t in texts))
    assert P.text_stats(tok, texts) == expected == P.text_stats(tok, iter(texts), batch_docs=2)
    assert P.text_stats(tok, [""]) == (1, 0, 0)


# -----------------------------------------------------------------------------
# Chat rendering

CONVERSATION = [{"role": "user", "content": "What is 2 + 2?"}, {"role": "assistant", "content": "It is 4."},
                {"role": "user", "content": "And 3 + 3?"}, {"role": "assistant", "content": "6, café 😀"}]


def test_render_conversation_exact(tok):
    us, ue, ast, ae = (tok.special_id(n) for n in SPECIAL_TOKENS[1:5])
    u1, a1, u2, a2 = (tok.encode(m["content"]) for m in CONVERSATION)
    expected_ids = [tok.bos_id, us, *u1, ue, ast, *a1, ae, us, *u2, ue, ast, *a2, ae]
    expected_mask = ([0] + [0] * (len(u1) + 2) + [0] + [1] * (len(a1) + 1)
                     + [0] * (len(u2) + 2) + [0] + [1] * (len(a2) + 1))
    ids, mask = tok.render_conversation(CONVERSATION)
    assert ids == expected_ids and mask == expected_mask
    assert [i for i, m in zip(ids, mask) if m] == [*a1, ae, *a2, ae]  # only assistant content + assistant_end
    assert tok.decode([i for i, m in zip(ids, mask) if m and i < V - len(SPECIAL_TOKENS)]) == "It is 4.6, café 😀"


def test_a_tool_call_is_trained_on_and_its_output_is_not(tok):
    """GSM8K's 'It is <<2+2=4>>4.' as parts: the call (<|python_start|>2+2<|python_end|>) carries loss, the
    calculator's output (<|output_start|>4<|output_end|>) does not: generation inserts it."""
    parts = [{"type": "text", "text": "It is "}, {"type": "python", "text": "2+2"},
             {"type": "python_output", "text": "4"}, {"type": "text", "text": "4."}]
    ids, mask = tok.render_conversation([CONVERSATION[0], {"role": "assistant", "content": parts}])
    ps, pe, os_, oe = (tok.special_id(n) for n in SPECIAL_TOKENS[5:])
    us, ue, ast, ae = (tok.special_id(n) for n in SPECIAL_TOKENS[1:5])
    u1, t1, expr, out, t2 = (tok.encode(x) for x in ("What is 2 + 2?", "It is ", "2+2", "4", "4."))
    assert ids == [tok.bos_id, us, *u1, ue, ast, *t1, ps, *expr, pe, os_, *out, oe, *t2, ae]
    assert [i for i, m in zip(ids, mask) if m] == [*t1, ps, *expr, pe, *t2, ae]
    assert sum(mask) == len(t1) + len(expr) + 2 + len(t2) + 1


def test_a_tokenizer_from_before_the_calculator_tokens_names_the_command_to_retrain(tok, tmp_path):
    path = tok.save(tmp_path)
    state = json.loads(path.read_text())
    old = SPECIAL_TOKENS[:5]
    ranks = len(state["mergeable_ranks"])
    state.update(special_tokens={n: ranks + i for i, n in enumerate(old)}, vocab_size=ranks + 5,
                 token_bytes=state["token_bytes"][:ranks + 5])
    path.write_text(json.dumps(state))
    with pytest.raises(ValueError, match=r"trained before the special tokens <\|python_start\|>.*"
                                         r"python prepare.py tokenizer --data_dir DIR --out "):
        Tokenizer.load(tmp_path)


def test_system_message_is_merged_into_first_user_turn(tok):
    with_system = [{"role": "system", "content": "Be brief."}] + CONVERSATION
    merged = [{"role": "user", "content": "Be brief.\n\nWhat is 2 + 2?"}] + CONVERSATION[1:]
    assert tok.render_conversation(with_system) == tok.render_conversation(merged)
    ids, _ = tok.render_conversation(with_system)
    assert ids[2:2 + len(tok.encode("Be brief.\n\nWhat is 2 + 2?"))] == tok.encode("Be brief.\n\nWhat is 2 + 2?")


@pytest.mark.parametrize("roles, index", [
    (["assistant"], 0), (["user", "user"], 1), (["user", "assistant", "assistant"], 2), (["system"], 0),
    (["system", "assistant"], 1), (["system", "user", "system"], 2), (["user", "assistant", "system"], 2),
    (["user", "tool"], 1),
])
def test_bad_role_order_names_the_message(tok, roles, index):
    messages = [{"role": role, "content": "x"} for role in roles]
    with pytest.raises(ValueError, match=f"^message {index}: "):
        tok.render_conversation(messages)


def test_bad_messages(tok):
    with pytest.raises(ValueError, match="at least one message"):
        tok.render_conversation([])
    with pytest.raises(ValueError, match="^message 1: "):
        tok.render_conversation([{"role": "user", "content": "x"}, {"role": "assistant", "content": None}])


def test_max_tokens_cuts_at_a_turn_boundary(tok):
    ids, mask = tok.render_conversation(CONVERSATION)
    first_end = ids.index(tok.special_id("<|assistant_end|>")) + 1
    assert tok.render_conversation(CONVERSATION, max_tokens=len(ids)) == (ids, mask)
    for limit in (len(ids) - 1, first_end + 1, first_end):
        assert tok.render_conversation(CONVERSATION, max_tokens=limit) == (ids[:first_end], mask[:first_end])
    assert tok.render_conversation(CONVERSATION, max_tokens=first_end - 1) == ([], [])
    assert tok.render_conversation(CONVERSATION, max_tokens=1) == ([], [])


def test_render_for_completion(tok):
    prompt = tok.render_for_completion(CONVERSATION[:3])
    assert prompt[-1] == tok.special_id("<|assistant_start|>")
    full, _ = tok.render_conversation(CONVERSATION)
    assert prompt == full[:len(prompt)] and prompt[:-1] == tok.render_conversation(CONVERSATION[:3])[0]
    with pytest.raises(ValueError, match="^message 3: .*end with a user message"):
        tok.render_for_completion(CONVERSATION)


# -----------------------------------------------------------------------------
# Command line

def run_cli(*args):
    return subprocess.run([sys.executable, "prepare.py", *map(str, args)], cwd=ROOT, capture_output=True, text=True,
                          check=False, timeout=60)


def test_cli_train_then_eval(corpus, tmp_path):
    out = tmp_path / "tk"
    result = run_cli("tokenizer", "--data_dir", corpus, "--vocab_size", 400, "--out", out)
    assert result.returncode == 0, result.stderr
    train = list(iter_texts(corpus, "train"))
    assert f"training text: {len(train):,} documents, {sum(map(len, train)):,} characters" in result.stdout
    assert "vocab size: 400 (256 bytes + 135 merges + 9 special tokens)" in result.stdout
    assert f"saved to {out / T.FILE_NAME}" in result.stdout
    result = run_cli("bytes_per_token", "--data_dir", corpus, "--tokenizer", out)
    assert result.returncode == 0, result.stderr
    _, n_bytes, n_tokens = P.text_stats(Tokenizer.load(out), iter_texts(corpus, "val"))
    expected = n_bytes / n_tokens
    assert f"bytes/token: {expected:.6f}" in result.stdout
    assert f"{len(list(iter_texts(corpus, 'val'))):,} documents" in result.stdout


def test_cli_max_chars_and_help(corpus, tmp_path, capsys):
    code, out, err = run_in_process(P.main, ["tokenizer", "--data_dir", corpus, "--vocab_size", 300, "--max_chars", 5000,
                                             "--out", tmp_path], capsys)
    assert code == 0, err
    docs, total = 0, 0
    for text in iter_texts(corpus, "train"):  # iter_texts stops after the document that reaches max_chars
        docs, total = docs + 1, total + len(text)
        if total >= 5000:
            break
    assert f"training text: {docs:,} documents, {total:,} characters" in out
    help_text = run_in_process(P.main, ["tokenizer", "--help"], capsys)[1]
    assert "65536" in help_text and "2000000000" in help_text and "runs/tokenizer" in help_text


def test_the_command_line_shows_each_token_of_a_text(tok, tmp_path, capsys):
    tok.save(tmp_path)
    text = "café naïve 2024"
    code, out, _ = run_in_process(T.main, [text, "--tokenizer", tmp_path], capsys)
    ids = tok.encode(text)
    assert code == 0 and len(ids) > 3
    lines = out.splitlines()
    assert lines[0] == f"{len(ids)} tokens, {len(text.encode())} UTF-8 bytes"
    shown = [(int(line.split(" ", 1)[0]), ast.literal_eval(line.split(" ", 1)[1])) for line in lines[1:]]
    assert [i for i, _ in shown] == ids and b"".join(b for _, b in shown) == text.encode()
    code, _, err = run_in_process(T.main, [text, "--tokenizer", tmp_path / "none"], capsys)
    assert code == 1 and "python prepare.py tokenizer" in err


def test_cli_bad_input(tmp_path, capsys):
    code, _, err = run_in_process(P.main, ["tokenizer", "--data_dir", tmp_path / "missing", "--vocab_size", 300, "--out",
                                           tmp_path / "tk"], capsys)
    assert code == 1 and err.count("\n") == 1  # a runtime error: 1, as every script; 2 is argparse's, a bad flag
    assert f"data directory {tmp_path / 'missing'} does not exist" in err  # dataset.list_shards' message
    code, _, err = run_in_process(P.main, ["bytes_per_token", "--data_dir", tmp_path, "--tokenizer", tmp_path / "no_tokenizer"],
                                  capsys)
    assert code == 1 and str(tmp_path / "no_tokenizer" / T.FILE_NAME) in err and "python prepare.py tokenizer" in err
    code, _, err = run_in_process(P.main, ["tokenizer", "--data_dir", tmp_path, "--vocab_size", "many"], capsys)
    assert code == 2 and "invalid int value: 'many'" in err


def test_training_prints_what_it_read_and_rustbpes_merge_progress(corpus, capsys):
    """rustbpe's own log (through Python's logging): its set-up steps, then its merge loop every 10%; the reading
    side counts documents and bytes. A tokenizer trained without progress prints nothing, before or after."""
    train_tokenizer(make_texts(50, seed=1), 300)
    assert capsys.readouterr().out == ""
    stats = {"docs": 0, "chars": 0, "bytes": 0}
    texts = make_texts()
    tok = train_tokenizer(P.counting(iter(texts), stats, every_s=0), V, progress=True)
    out = capsys.readouterr().out.splitlines()
    merges = V - len(SPECIAL_TOKENS) - 256
    assert tok.vocab_size == V and stats["docs"] == len(texts)
    read = [line for line in out if " read " in line]
    assert len(read) == len(texts) and f"read {len(texts):,} documents, {stats['bytes'] / 1e6:,.1f} MB (" in read[-1]
    progress = [line.split("rustbpe: ")[1] for line in out if "rustbpe: Progress" in line]
    assert [p.split("%")[0] for p in progress] == [f"Progress: {p}" for p in range(10, 101, 10)]
    assert progress[-1].startswith(f"Progress: 100% ({merges}/{merges} merges)")
    assert any(f"rustbpe: Starting BPE training: {merges} merges to compute" in line for line in out)
    assert any(f"rustbpe: Processed {len(texts)} sequences total" in line for line in out)
    train_tokenizer(make_texts(50, seed=1), 300)  # the handler is gone
    assert capsys.readouterr().out == ""
