"""chat.py driven as a user drives it, in a pseudo-terminal: one session goes through a multi-turn exchange (the
second turn prefills only its new tokens, read from /stats), special-token text, a message longer than the context,
invalid UTF-8, Ctrl-C during a reply, a turn after it, /clear and EOF. `-p -` answers a held-out demo question with
the chat chain's SFT model, and a pretraining checkpoint runs in completion mode with a 100,000-character message.
In-process: UTF-8 streaming, the overflow logic, and chat.py's step's greedy tokens against decode.decode's."""
import os
import pty
import re
import select
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from types import SimpleNamespace

import pytest
import torch
from helpers import ROOT, held_out_questions, run_in_process

import chat
import chat_stage
import checkpoint
from decode import decode
from model import GPTConfig, KVCache, build_model
from tokenizer import Tokenizer

STATS = re.compile(rb"\[(\d+) tokens, prefill (\d+) tok in [\d.]+ s \([\d,]+ tok/s\), decode [\d,]+ tok/s\]\r?\n> ")


def endless_checkpoint(directory, tokenizer, tokenizer_dir, stage="sft"):
    """A 2-layer random model that never samples a special token, so a reply runs to --max_new_tokens: every embedding
    shares one strong direction u, attention and MLP write nothing, and the special tokens' head rows point to -u."""
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=tokenizer.vocab_size, sequence_len=2048, n_layer=2, n_embd=256, n_head=4,
                       n_kv_head=4)
    model = build_model(config)
    with torch.no_grad():
        u = torch.nn.functional.normalize(torch.randn(config.n_embd), dim=0)
        model.wte.weight.copy_(16 * u + torch.randn_like(model.wte.weight))
        for block in model.blocks:
            block.attn.o_proj.weight.zero_()
            block.mlp.down_proj.weight.zero_()
        model.lm_head.weight.normal_(0, 0.3)
        model.lm_head.weight[sorted(tokenizer.special_tokens.values())] = -5 * u
    meta = {"stage": stage, "model_config": config.__dict__, "world_size": 1, "tokenizer": str(tokenizer_dir),
            "tokenizer_sha256": tokenizer.fingerprint()}
    return checkpoint.save_checkpoint(directory, 7, model, [], [], meta, 0, 1)


UNREAD = {}  # fd: what the last read_until's chunk held past its match (one read can end a turn and start the next)


def read_until(fd, pattern, seconds, seen):
    """Read the pty until `pattern` (bytes regex) matches what arrived since the last match; never waits longer than
    `seconds` in all. seen: a list collecting the whole output (for failure messages)."""
    buffer, deadline = UNREAD.pop(fd, b""), time.monotonic() + seconds
    while (match := re.search(pattern, buffer)) is None:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            raise AssertionError(f"no {pattern!r} within {seconds} s; output so far:\n{b''.join(seen)[-3000:]!r}")
        try:
            chunk = os.read(fd, 65536)
        except OSError:  # EIO: the child closed the terminal
            chunk = b""
        if not chunk:
            raise AssertionError(f"chat.py ended before {pattern!r}:\n{b''.join(seen)[-3000:]!r}")
        buffer += chunk
        seen.append(chunk)
    UNREAD[fd] = buffer[match.end():]
    return buffer, match


@contextmanager
def chat_in_a_terminal(ckpt, *args):
    """Yields (pid, fd): chat.py on `ckpt` with a pseudo-terminal as its controlling terminal, fd the terminal's other
    end; killed at the end unless it has exited (wait_for_exit reaps it)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "LC_ALL": "C.UTF-8", "TERM": "dumb"}
    pid, fd = pty.fork()
    if pid == 0:  # the child
        os.execve(sys.executable, [sys.executable, str(ROOT / "chat.py"), "--checkpoint", str(ckpt), *args], env)
    try:
        yield pid, fd
    finally:
        try:
            if os.waitpid(pid, os.WNOHANG)[0] == 0:  # still running: the test failed before the session ended
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
        except ChildProcessError:  # reaped already
            pass
        os.close(fd)
        UNREAD.pop(fd, None)  # the number goes to the next terminal


def paste(fd, data, seen, seconds=60):
    """Write data to the terminal as a terminal delivers a paste, in 1,024-byte pieces, reading its output meanwhile
    into seen (chat.py stops when its output is not read); a write the terminal cannot take fails after `seconds`."""
    deadline = time.monotonic() + seconds
    os.set_blocking(fd, False)  # a full input buffer answers at once, so the test cannot hang on it
    try:
        while data:
            left = deadline - time.monotonic()
            assert left > 0, f"the terminal took no more input: {len(data):,} bytes of the paste left"
            readable, writable, _ = select.select([fd], [fd], [], left)
            if readable:
                seen.append(os.read(fd, 65536))
            if writable:
                try:
                    data = data[os.write(fd, data[:1024]):]
                except BlockingIOError:
                    time.sleep(0.01)
    finally:
        os.set_blocking(fd, True)


def test_an_interactive_session_in_a_terminal(demo_world, tmp_path):
    tokenizer = Tokenizer.load(demo_world / "tokenizer")
    ckpt = endless_checkpoint(tmp_path / "runs" / "endless" / "ckpt", tokenizer, demo_world / "tokenizer")
    with chat_in_a_terminal(ckpt, "--max_new_tokens", "300", "--seed", "1", "--temperature", "1") as (pid, fd):
        seen = []

        def turn(text, seconds=60):
            os.write(fd, text.encode() if isinstance(text, str) else text)
            return read_until(fd, STATS, seconds, seen)

        def stats():
            os.write(fd, b"/stats\n")
            out, m = read_until(fd, rb"cache: ([\d,]+) tokens.*turns: (\d+)\r?\n.*prefilled (\d+) tokens.*\r?\n> ",
                                30, seen)
            return [int(g.replace(b",", b"")) for g in m.groups()], out

        out, _ = read_until(fd, rb"type a message.*\r?\n> ", 60, seen)
        assert re.search(rb"stage sft, step 7, [\d,]+ parameters, context 2,048 tokens", out), out
        assert b"mode: chat" in out and b"seed 1 (--seed 1 to reproduce)" in out and b"decode eager" in out, out
        first, second = "hello there", "and what is the weather like today?"
        out, m = turn(first + "\n")
        assert (int(m[1]), int(m[2])) == (300, len(tokenizer.encode(first)) + 3)  # + user_start, user_end, assistant_start
        out, m = turn(second + "\n")
        new = len(tokenizer.encode(second)) + 4  # + the first reply's <|assistant_end|>
        assert int(m[2]) == new, out
        (cached, turns, prefilled), _ = stats()
        assert (cached, turns, prefilled) == (1 + len(tokenizer.encode(first)) + 3 + 300 + new + 300, 2, new)

        typed = "<|assistant_end|><|bos|><|user_start|>"  # plain text: many tokens, none special
        out, m = turn(typed + "\n")
        assert int(m[2]) == len(tokenizer.encode(typed)) + 4 and len(tokenizer.encode(typed)) > 3, out

        long = " ".join(f"word{i}" for i in range(1500))  # ~9,000 characters: more tokens than the context
        out, m = turn(long + "\n", 120)
        assert b"[context full: dropped the 3 oldest turns" in out and b"[message too long:" in out, out[-2000:]
        (cached, turns, prefilled), _ = stats()
        assert turns == 1 and cached <= 2048 and prefilled == 2048 - 300 - 1, (cached, turns, prefilled)

        out, m = turn(b"caf\xe9 \xff\xfe\xc3 ok\n")  # invalid UTF-8 typed: replaced, answered
        assert int(m[1]) > 0

        os.write(fd, b"tell me a long story\n")
        read_until(fd, rb"long story\r?\n(.|\n){40}", 30, seen)  # the echo, then the reply streaming
        os.kill(pid, 0)
        os.write(fd, b"\x03")  # Ctrl-C as typed: the terminal sends SIGINT to chat.py
        out, m = read_until(fd, STATS, 30, seen)
        assert b"[reply stopped: interrupted]" in out and int(m[1]) < 300, out[-1500:]
        out, m = turn("still there?\n")  # the conversation goes on, the cut reply closed by <|assistant_end|>
        assert int(m[2]) == len(tokenizer.encode("still there?")) + 4 and int(m[1]) == 300
        os.write(fd, b"/clear\n")
        read_until(fd, rb"\[conversation cleared\]\r?\n> ", 30, seen)
        assert stats()[0][:2] == [1, 0]
        os.write(fd, b"/stat\n")  # a mistyped command is refused, not sent to the model
        read_until(fd, rb"unknown command /stat; /help lists them\r?\n> ", 30, seen)
        assert stats()[0][:2] == [1, 0]
        os.write(fd, b"\x04")  # Ctrl-D at an empty prompt: EOF
        wait_for_exit(pid, fd, seen, "chat.py did not exit at EOF")


def wait_for_exit(pid, fd, seen, failure):
    """The chat process `pid` exits 0 within 30 s; its terminal is read meanwhile (into seen)."""
    deadline = time.monotonic() + 30
    while (status := os.waitpid(pid, os.WNOHANG))[0] == 0:
        assert time.monotonic() < deadline, failure
        try:
            if select.select([fd], [], [], 0.1)[0]:
                seen.append(os.read(fd, 65536))
        except OSError:
            pass
    assert os.waitstatus_to_exitcode(status[1]) == 0, b"".join(seen)[-2000:]


@pytest.mark.parametrize("words", [3, 1500])
def test_ctrl_d_after_a_paste_of_any_length_sends_it_then_ends_the_session(demo_world, tmp_path, words):
    """Text pasted at the prompt, then Ctrl-D: the reply, then the exit. 1,500 words are ~10,000 characters, over a
    terminal's 4,095-character line: every token of it arrives (the context keeps its end). Before, readline took
    Ctrl-D after text for delete-char: nothing was sent, and the session went on."""
    tokenizer = Tokenizer.load(demo_world / "tokenizer")
    ckpt = endless_checkpoint(tmp_path / "runs" / "endless" / "ckpt", tokenizer, demo_world / "tokenizer")
    seen, text = [], " ".join(f"word{i}" for i in range(words)).encode()
    with chat_in_a_terminal(ckpt, "--max_new_tokens", "20", "--seed", "1") as (pid, fd):
        read_until(fd, rb"type a message.*\r?\n> ", 60, seen)
        paste(fd, text + b"\x04", seen)
        out, m = read_until(fd, STATS.pattern.removesuffix(rb"\r?\n> "), 120, seen)  # no prompt after it: the end
        sent = len(tokenizer.encode(text.decode()))
        if words > 3:
            assert f"[message too long: {sent:,} tokens".encode() in out, out[-1000:]
        else:
            assert int(m[2]) == sent + 3, out  # + user_start, user_end, assistant_start
        wait_for_exit(pid, fd, seen, "chat.py did not exit after the reply")


@pytest.mark.parametrize("key", [b"\r", b"\x04"], ids=["enter", "ctrl-d"])
def test_a_paste_during_a_reply_reaches_the_next_turn_whole(demo_world, tmp_path, key):
    """~10,000 characters pasted while a reply streams, then Enter (or Ctrl-D): the next prompt shows the paste and the
    next turn gets every token of it (the notice counts them; the context keeps its end). Before, the terminal stayed
    in canonical mode during a reply and silently dropped what passed its 4,095-character line."""
    tokenizer = Tokenizer.load(demo_world / "tokenizer")
    ckpt = endless_checkpoint(tmp_path / "runs" / "endless" / "ckpt", tokenizer, demo_world / "tokenizer")
    seen, text = [], " ".join(f"word{i}" for i in range(1500)).encode()
    with chat_in_a_terminal(ckpt, "--max_new_tokens", "1000", "--seed", "1") as (pid, fd):
        read_until(fd, rb"type a message.*\r?\n> ", 60, seen)
        os.write(fd, b"tell me a long story\r")
        read_until(fd, rb"long story\r?\n(.|\n){40}", 30, seen)  # the reply streaming
        paste(fd, text + key, seen)
        assert not re.search(STATS.pattern[:20], b"".join(seen)), "the reply ended before the paste did"
        read_until(fd, STATS, 120, seen)  # the reply's end, then the prompt
        read_until(fd, rb"word1498 word1499", 30, seen)  # the prompt shows the paste to its end
        out, _ = read_until(fd, STATS.pattern.removesuffix(rb"\r?\n> "), 120, seen)  # the paste's turn
        sent = len(tokenizer.encode(text.decode()))
        assert f"[message too long: {sent:,} tokens".encode() in out, out[-1000:]
        if key == b"\x04":  # Ctrl-D after text: sent, then the end
            wait_for_exit(pid, fd, seen, "chat.py did not exit after the reply")


# Where a key can land around a reply's end: what chat.py has printed by then, and the seconds after it. The reply
# (60 tokens) streams for ~0.1-0.3 s; its stats line and the prompt follow within milliseconds
REPLY_END = [(rb"hello\r?\n", 0.0), (rb"hello\r?\n", 0.05), (rb"hello\r?\n", 0.1), (rb"\[\d+ tokens", 0.0),
             (rb"tok/s\]", 0.0), (rb"tok/s\]\r?\n> ", 0.0), (rb"tok/s\]\r?\n> ", 0.3)]
KEYS = {"ctrl-c, then ctrl-d": [b"\x03", 0.3, b"\x04"], "ctrl-c and ctrl-d at once": [b"\x03\x04"],
        "ctrl-d": [b"\x04"]}


def test_ctrl_c_and_ctrl_d_end_the_session_wherever_they_land_around_a_reply_s_end(demo_world, tmp_path):
    """Ctrl-C during a reply stops it and the session goes on; at the prompt it ends the session; one that lands
    after the last token is said, never lost; Ctrl-D at an empty prompt ends it, typed during the reply too. So
    Ctrl-C then Ctrl-D, both at once, or Ctrl-D alone, pressed at any point of a reply's end, end chat.py with exit 0
    and no traceback (a Ctrl-C that came with the Ctrl-D's EOF was raised in read_message's handler)."""
    tokenizer = Tokenizer.load(demo_world / "tokenizer")
    ckpt = endless_checkpoint(tmp_path / "runs" / "endless" / "ckpt", tokenizer, demo_world / "tokenizer")

    def session(point, keys):
        seen = []
        with chat_in_a_terminal(ckpt, "--max_new_tokens", "60", "--seed", "1") as (pid, fd):
            read_until(fd, rb"type a message.*\r?\n> ", 60, seen)
            os.write(fd, b"hello\r")
            read_until(fd, point[0], 30, seen)
            time.sleep(point[1])
            for key in KEYS[keys]:
                if isinstance(key, float):
                    time.sleep(key)
                    continue
                try:
                    os.write(fd, key)
                except OSError:  # EIO: the first key ended the session already
                    break
            wait_for_exit(pid, fd, seen, f"chat.py did not exit: {keys} after {point}")
        assert b"Traceback" not in b"".join(seen), (point, keys, b"".join(seen)[-1500:])

    with ThreadPoolExecutor(3) as pool:  # 21 sessions: 3 at a time (each mostly waits on its terminal)
        for future in [pool.submit(session, point, keys) for point in REPLY_END for keys in KEYS]:
            future.result()


def run_chat(args, stdin, cwd):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, str(ROOT / "chat.py"), *map(str, args)], input=stdin, capture_output=True,
                          cwd=cwd, env=env, timeout=300, check=False)


def test_prompt_from_stdin_answers_a_held_out_demo_question(chat_chain, demo_world):
    """The SFT model of the demo chain, found by itself (newest sft under --runs_dir), greedy, through `-p -`: the
    reply is chat_stage.chat_answers's greedy answer (decode.decode), and it is right."""
    tokenizer = Tokenizer.load(demo_world / "tokenizer")
    model, _ = checkpoint.load_model(chat_chain["sft"], torch.device("cpu"))
    for question, expected in held_out_questions():
        answer = chat_stage.chat_answers(model, tokenizer, [question], "float32",
                                         max_tokens=24)[0]["answer"]
        if expected.lower() in answer.lower():
            break
    else:
        pytest.fail("the SFT model answers no held-out question")
    runs = demo_world / "sft_only"  # the pipeline's rl stage may be writing beside its sft/ by now
    runs.mkdir(exist_ok=True)
    (runs / "sft").unlink(missing_ok=True)
    (runs / "sft").symlink_to(chat_chain["sft"].parent.parent)
    result = run_chat(["--runs_dir", runs, "-p", "-", "--temperature", "0", "--max_new_tokens", "24"],
                      question.encode(), demo_world)
    err = result.stderr.decode()
    assert result.returncode == 0, err
    found = runs / "sft" / "ckpt" / chat_chain["sft"].name
    assert f"checkpoint: {found} (newest sft checkpoint" in err and "mode: chat" in err, err
    reply = result.stdout.decode().strip()
    assert reply == answer.strip() and expected.lower() in reply.lower(), (reply, answer)


def test_a_pretraining_checkpoint_completes_text_and_a_100k_message_is_cut(learned, demo_world):
    message = ("The capital of " + "x" * 100_000 + "\x00\x01 caf\xe9").encode("latin-1")  # binary bytes included
    result = run_chat(["--checkpoint", learned[0], "-p", "-", "--max_new_tokens", "8"], message, demo_world)
    err = result.stderr.decode()
    assert result.returncode == 0, err
    assert "stage pretrain" in err and "mode: completion" in err and "[message too long:" in err, err
    assert re.search(r"\[\d+ tokens, prefill \d+ tok", err), err


def test_bad_checkpoint_or_tokenizer_is_one_line_naming_the_flag(demo_world, tmp_path, capsys):
    code, _, err = run_in_process(chat.main, ["--checkpoint", tmp_path / "nothing"], capsys, stage="chat.py")
    assert code == 1 and err.strip().count("\n") == 0 and "--checkpoint" in err, err
    code, _, err = run_in_process(chat.main, ["--runs_dir", tmp_path], capsys, stage="chat.py")
    assert code == 1 and "no checkpoint in " in err and "--checkpoint" in err, err
    tokenizer = Tokenizer.load(demo_world / "tokenizer")
    ckpt = endless_checkpoint(tmp_path / "runs" / "e" / "ckpt", tokenizer, demo_world / "tokenizer")
    code, _, err = run_in_process(chat.main, ["--checkpoint", ckpt, "--tokenizer", tmp_path / "none"], capsys,
                                  stage="chat.py")
    assert code == 1 and err.strip().count("\n") == 0 and f"--tokenizer {tmp_path / 'none'}" in err, err
    code, _, err = run_in_process(chat.main, ["--checkpoint", ckpt, "-p", " \n"], capsys, stage="chat.py")
    assert code == 1 and "-p: the prompt is empty: pass the text" in err, err


# --- in-process: the pieces that need no terminal ----------------------------------------------------------------

def test_utf8_streaming_prints_each_character_once_when_complete(demo_world):
    tokenizer = Tokenizer.load(demo_world / "tokenizer")
    text = "café, naïve 日本語 ✓ 🙂 done"
    ids = tokenizer.encode(text)
    assert len(ids) > len(text.split())  # multi-byte characters span several tokens with this vocabulary
    feed, pieces = chat.utf8_stream(tokenizer), []
    for i in ids:
        pieces.append(feed(i))
        assert "\ufffd" not in pieces[-1]
    pieces.append(feed(None))
    assert "".join(pieces) == text == tokenizer.decode(ids)
    assert any(p == "" for p in pieces)  # some token completed no character
    feed = chat.utf8_stream(tokenizer)  # a reply cut inside a character ends with one replacement character
    assert feed(tokenizer.encode("é")[0]) == "" and feed(None) == "\ufffd"


def small_model(**overrides):
    torch.manual_seed(0)
    model = build_model(GPTConfig(**{"vocab_size": 1024, "sequence_len": 96, "n_layer": 2, "n_embd": 64,
                                     "n_head": 4, "n_kv_head": 4, **overrides})).eval()
    with torch.no_grad():
        for p in model.parameters():  # a random model's logits are ~0; widen them so argmax is meaningful
            p.add_(torch.randn_like(p) * 0.05)
    return model


@pytest.mark.parametrize("overrides", [{"value_embeds": True}, {"n_kv_head": 2, "mlp": "swiglu", "norm_learnable": True,
                                            "tie_embeddings": True, "qk_norm": False}])
def test_chat_s_step_gives_the_greedy_tokens_of_one_decoded_row(overrides, monkeypatch):
    """chat.py's step (decode.decode_step, the conversation's cache as its one row) eager, and as compiled (the whole
    cache attended, masked; here uncompiled), gives decode.decode's greedy row token for token."""
    monkeypatch.setattr(chat, "compiled_step", lambda: chat.decode_step)
    model = small_model(**overrides)
    prompt = torch.randint(0, 1024, (20,)).tolist()
    expected = decode(model, [prompt], 64)[0][0]
    tokenizer = SimpleNamespace(bos_id=prompt[0], special_tokens={}, special_id=lambda name: 1)
    for path in ("eager", "compiled"):
        conv = chat.Conversation(model, tokenizer, False, path)  # reset() has fed prompt[0]
        with torch.inference_mode():
            logits, got = conv.forward(prompt[1:]), []
            for _ in range(64):
                got.append(logits.argmax(-1).item())
                logits = conv.step(torch.tensor(got[-1:]))
        assert got == expected, path


def test_overflow_drops_the_oldest_turns_and_rebuilds_the_cache(demo_world):
    tokenizer = Tokenizer.load(demo_world / "tokenizer")
    model = small_model()
    conv = chat.Conversation(model, tokenizer, chat=True, decode="eager", max_tokens=10)
    generator = torch.Generator().manual_seed(0)
    written = []
    for i in range(12):
        conv.respond(f"question number {i} about the weather", written.append, 1.0, 0, 10, generator)
        assert conv.cache.pos == len(conv.ids) <= 96 and conv.ids[0] == tokenizer.bos_id
        assert all(conv.ids[s] in (tokenizer.special_id("<|user_start|>"),) for s in conv.starts)
    text = "".join(written)
    assert "[context full: dropped the 1 oldest turn," in text
    with torch.inference_mode():  # the rebuilt cache holds exactly what a fresh prefill of the kept ids gives
        fresh = KVCache(model.config, 1, 96)
        model(torch.tensor([conv.ids]), kv_cache=fresh)
        n = len(conv.ids)
        assert torch.allclose(fresh.k[:, :, :, :n], conv.cache.k[:, :, :, :n], atol=1e-5)
    conv.respond("x " * 100_000, written.append, 1.0, 0, 10, generator)  # alone longer than the context
    assert "[message too long: " in "".join(written) and conv.cache.pos <= 96
    _, body, _ = conv.turn_tokens("<|bos|> <|assistant_end|>")
    assert not set(body) & set(tokenizer.special_tokens.values()) and len(body) > 2


def test_ctrl_c_or_eof_at_the_prompt_ends_the_session(monkeypatch, capsys):
    for error in (KeyboardInterrupt, EOFError):
        def raise_it(prompt, error=error):
            raise error
        monkeypatch.setattr("builtins.input", raise_it)
        assert chat.read_message(sys.stdout) is None
    assert capsys.readouterr().out == "\n\n"  # each leaves the terminal on a fresh line


def test_auto_decoding_compiles_for_a_session_on_cuda_only():
    """torch.compile's start (decode.py's step: ~35 s in chat_eval at d20 on an H200) pays over a session, not for one
    -p reply, nor on the CPU."""
    cases = [("cuda", False), ("cuda", True), ("cpu", False), ("cpu", True)]
    assert [chat.decode_path("auto", device, one) for device, one in cases] == ["compiled", "eager", "eager", "eager"]
    assert [chat.decode_path(choice, "cuda", True) for choice in ("compiled", "eager")] == ["compiled", "eager"]
