"""chat_eval.py and sandbox.py: exact ChatCORE from a model whose replies the test scripts, GSM8K's final number,
HumanEval programs on hand-written completions, the sandbox against hostile programs, the four datasets' layouts
fetched from a local hub server, and the offline demo tasks end to end on a tiny checkpoint."""
import ast
import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
from decimal import Decimal
from http.server import ThreadingHTTPServer
from types import SimpleNamespace
from unittest.mock import patch

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from helpers import ADD, LAYOUTS, ROOT, arc, hub_handler, run_in_process, run_script
from huggingface_hub import constants as hf_constants

import chat_eval as E
import checkpoint
import prepare
import sandbox
import tasks
from model import GPTConfig, KVCache, build_model, config_from_preset
from tokenizer import SPLIT_PATTERN, Tokenizer

BYTES = Tokenizer({bytes([b]): b for b in range(256)}, SPLIT_PATTERN)  # no merges: one token per byte
CPU = torch.device("cpu")
FAST = 1.5  # seconds: the sandbox timeout in these tests


# -----------------------------------------------------------------------------
# A model that replies from a script

class ScriptedModel(torch.nn.Module):
    """Replies script[key] (then <|assistant_end|>) to the user message containing key, one token per position, by
    logits that favour that token; an item's one forward (categorical) sees the reply's first token. Generates through
    scripted_decode: it keeps the tokens it has seen and advances the cache's position."""

    def __init__(self, tokenizer, script, sequence_len=2048):
        super().__init__()
        self.config = GPTConfig(vocab_size=tokenizer.vocab_size, sequence_len=sequence_len, n_layer=1, n_embd=8,
                                n_head=1, n_kv_head=1)
        self.register_buffer("cos", torch.zeros(1))
        self.tokenizer, self.script, self.seen = tokenizer, script, []

    def forward(self, idx, targets=None, kv_cache=None, last_only=False):
        self.seen = (self.seen if kv_cache is not None and kv_cache.pos else []) + idx[0].tolist()
        if kv_cache is not None:
            kv_cache.pos += idx.size(1)
        start = self.tokenizer.special_id("<|assistant_start|>")
        at = len(self.seen) - self.seen[::-1].index(start)  # where the reply begins
        prompt = self.tokenizer.decode(self.seen[:at])
        reply = next(text for key, text in self.script.items() if key in prompt)
        wanted = list(reply) if isinstance(reply, list) else \
            self.tokenizer.encode(reply) + [self.tokenizer.special_id("<|assistant_end|>")]  # a list: the ids as given
        logits = torch.zeros(1, 1 if last_only else idx.size(1), self.config.vocab_size)
        logits[0, -1, wanted[min(len(self.seen) - at, len(wanted) - 1)]] = 10.0
        return logits


def scripted_decode(model, prompts, budgets, dtype, tools, stop):
    """decode.decode's greedy rows for a model that has only a forward on a KV cache (ScriptedModel), one prompt at a
    time: a row's calculator output is fed after its call, a row ends at a stop token it sampled or its budget."""
    rows = []
    for prompt, budget, tool in zip(prompts, budgets, tools, strict=True):
        cache, feed, row, forced, own = KVCache(model.config, 1, model.config.sequence_len), prompt, [], [], True
        while len(row) < budget and not (own and row and row[-1] in stop):
            token = model(torch.tensor([feed]), kv_cache=cache, last_only=True)[0, -1].argmax().item()
            own = not forced
            token = token if own else forced.pop(0)
            forced += tool(token) if own else []
            row.append(token)
            feed = [token]
        rows.append(row)
    return rows, None


def scored(task, rows, script, **kw):
    """evaluate_task's verdicts and records for rows in the task's hub (or demo) layout, replies from the script."""
    items = [{**tasks.make_item(task, row, f"row {i}"), "row": i} for i, row in enumerate(rows)]
    args = SimpleNamespace(dtype="float32", max_new_tokens=64, timeout=FAST, memory_mb=512, batch_items=1,
                           option_text="off", **kw)  # the scripted model answers one prompt at a time, no targets
    with patch.object(E, "decode", scripted_decode):
        return E.evaluate_task(task, items, ScriptedModel(BYTES, script), BYTES, args, 0, 1, CPU, "MARK",
                               sandbox.sandbox_level()[0])


def test_chatcore_from_scripted_replies_is_exact_per_task_and_in_the_mean():
    arc_rows = [arc("q1", "A"), arc("q2", "B"), arc("q3", "C"), arc("q4", "2", labels="1234")]
    arc_script = {"q1": "A", "q2": "B", "q3": "D", "q4": "2"}  # 3 of 4: the 4th item's letters are ARC's digits
    mmlu_rows = [{"question": f"m{i}", "subject": "x", "choices": ["a", "b", "c", "d"], "answer": i} for i in range(4)]
    mmlu_script = {"m0": "A", "m1": "E", "m2": "C", "m3": "A"}  # 2 of 4: 'E' is no choice, so 'A' (first) wins
    gsm_rows = [{"question": f"g{i}", "answer": f"so <<6*7=42>>42\n#### {a}"} for i, a in enumerate(
        ["1,234", "42", "9", "5", "7"])]
    gsm_script = {"g0": "It is 1234.\n#### 1,234", "g1": "The answer is 42.", "g2": "#### 7 and then 9",
                  "g3": "I do not know", "g4": "#### 7"}  # right, wrong (no marker), wrong (first ####), wrong, right
    human_rows = [ADD, {**ADD, "task_id": "HumanEval/1"}]
    human_script = {"Add.": "```python\ndef add(a, b):\n    return a + b\n```"}
    exact_rows = [{"question": "c1?", "answers": ["Pelmo"]}, {"question": "c2?", "answers": ["7", "seven"]},
                  {"question": "c3?", "answers": ["Pelmo"]}]
    exact_script = {"c1?": "The Pelmo.", "c2?": "Seven!", "c3?": "It is Pelmo"}  # exact after normalization: 2 of 3
    verdicts = {"ARC-Easy": scored("ARC-Easy", arc_rows, arc_script), "MMLU": scored("MMLU", mmlu_rows, mmlu_script),
                "GSM8K": scored("GSM8K", gsm_rows, gsm_script), "HumanEval": scored("HumanEval", human_rows,
                                                                                   human_script),
                "demo-answer": scored("demo-answer", exact_rows, exact_script)}
    assert [c for c, _ in verdicts["ARC-Easy"][0]] == [True, True, False, True]
    assert [r["predicted"] for r in verdicts["MMLU"][1]] == ["A", "A", "C", "A"]
    assert [c for c, _ in verdicts["GSM8K"][0]] == [True, False, False, False, True]
    assert [r["predicted"] for r in verdicts["GSM8K"][1]] == ["1234", None, "7", None, "7"]
    assert [c for c, _ in verdicts["HumanEval"][0]] == [True, True]
    assert [c for c, _ in verdicts["demo-answer"][0]] == [True, True, False]
    assert not any(cut for v, _ in verdicts.values() for _, cut in v)
    tasks = list(verdicts)
    rows, chatcore = E.summarize(tasks, {t: v for t, (v, _) in verdicts.items()}, {t: 9 for t in tasks})
    assert [(r["correct"], r["items"], r["accuracy"], r["baseline"]) for r in rows] == [
        (3, 4, 0.75, 0.25), (2, 4, 0.5, 0.25), (2, 5, 0.4, 0.0), (2, 2, 1.0, 0.0), (2, 3, 2 / 3, 0.0)]
    centered = [(0.75 - 0.25) / 0.75, (0.5 - 0.25) / 0.75, 0.4, 1.0, 2 / 3]
    assert [r["centered"] for r in rows] == pytest.approx(centered)
    assert chatcore == pytest.approx(sum(centered) / 5)


def test_a_reply_cut_by_the_window_is_counted_and_a_letter_must_be_one_token():
    model = ScriptedModel(BYTES, {"long": "x" * 500}, sequence_len=64)
    args = SimpleNamespace(dtype="float32", max_new_tokens=512, batch_items=1)
    item = {"prompt": "long", "answers": ["x"], "row": 0}
    with patch.object(E, "decode", scripted_decode):
        (verdict,), (record,) = E.evaluate_task("demo-answer", [item], model, BYTES, args, 0, 1, CPU, "M", None)
    assert verdict == (False, True) and len(record["reply"]) == 64 - len(BYTES.render_for_completion(
        [{"role": "user", "content": "long"}]))
    with pytest.raises(ValueError, match="'AB' is 2 tokens"):
        E.letter_scores(model, BYTES, [{"prompt": "long", "letters": ["AB", "C"]}], "float32", CPU)


def test_own_words_count_when_the_reply_contains_the_answer_and_stay_out_of_chatcore():
    rows = [{"question": "w1?", "answers": ["Pelmo"]}, {"question": "w2?", "answers": ["owl"]},
            {"question": "w3?", "answers": ["owl"]}]
    script = {"w1?": "The government sits in Pelmo.", "w2?": "They chose the owl!", "w3?": "They chose the bowler."}
    words = scored("demo-words", rows, script)
    assert [c for c, _ in words[0]] == [True, True, False]  # a whole word: 'bowler' is not 'owl'
    choice = scored("demo-choice", [{"question": "c?", "choices": ["a", "b", "c", "d"], "gold": 1}], {"c?": "B"})
    rows, chatcore = E.summarize(["demo-choice", "demo-words"], {"demo-choice": choice[0], "demo-words": words[0]},
                                 {"demo-choice": 1, "demo-words": 3})
    assert chatcore == 1.0 and rows[1]["accuracy"] == pytest.approx(2 / 3) and rows[1]["centered"] is None


def test_gsm8k_is_answered_with_the_calculator_on_and_scored_on_the_text_without_the_calls():
    """The model writes a call, the calculator's result is fed in place of whatever the model would have written
    there (the script's 99), and the reply scored is its text: the calls and their outputs are left out."""
    sid, enc = BYTES.special_id, BYTES.encode
    call = [sid("<|python_start|>"), *enc("6*7"), sid("<|python_end|>")]
    scripted = [*call, sid("<|output_start|>"), *enc("99"), sid("<|output_end|>")]  # same length as "42"
    rows = [{"question": "g0", "answer": "<<6*7=42>>42\n#### 42"}, {"question": "g1", "answer": "#### 3"}]
    script = {"g0": [*enc("So "), *scripted, *enc("42.\n#### 42"), sid("<|assistant_end|>")],
              "g1": [*enc("It is "), sid("<|python_start|>"), *enc("__import__('os')"), sid("<|python_end|>"),
                     *enc(" 3\n#### 3"), sid("<|assistant_end|>")]}
    verdicts, records = scored("GSM8K", rows, script)
    assert [c for c, _ in verdicts] == [True, True]
    assert records[0]["reply"] == "So 42.\n#### 42" and records[0]["calculator"] == [["6*7", "42"]]
    assert records[1]["reply"] == "It is  3\n#### 3" and records[1]["calculator"][0][1].startswith("refused: '_'")


def test_batched_answers_equal_one_at_a_time_item_for_item():
    """Generated answers decoded together (--batch_items > 1, decode.py) give each item's record as one item at a
    time (one row) does: a random model whose replies the window cuts at different lengths, and the calculator per
    row (rl's hand-made policy, which calls it after <|assistant_start|>)."""
    from rl_worker import hand_made_policy, tokenizer
    torch.manual_seed(0)
    config = config_from_preset("tiny", {"vocab_size": BYTES.vocab_size, "n_layer": 2, "n_embd": 64, "n_head": 2,
                                         "n_kv_head": 2, "sequence_len": 80})
    model = build_model(config).eval()
    questions = ["Which is red?", "Name the seat of Aldora, the old kingdom by the sea.", "2+2?", "Who barks?",
                 "A long question about the banner of a land far away?", "Why?", "Which river runs to the sea?"]
    items = [{"prompt": q, "answers": ["x"], "row": i} for i, q in enumerate(questions)]

    def run(task, items, model, tok, batch_items):
        args = SimpleNamespace(dtype="float32", max_new_tokens=40, batch_items=batch_items)
        return E.evaluate_task(task, items, model, tok, args, 0, 1, CPU, "M", None)

    one = run("demo-answer", items, model, BYTES, 1)
    assert run("demo-answer", items, model, BYTES, 3) == one and run("demo-answer", items, model, BYTES, 8) == one
    assert {cut for _, cut in one[0]} == {True, False}  # the window cut the longer questions' replies
    tok = tokenizer()
    policy, _ = hand_made_policy(tok)
    items = [{"prompt": q, "answer": "7", "row": i} for i, q in enumerate(["what is three plus four", "plus four",
                                                                           "what is three"])]
    one = run("GSM8K", items, policy, tok, 1)
    assert run("GSM8K", items, policy, tok, 3) == one
    assert all(r["calculator"] == [["3+4", "7"]] for r in one[1])


def test_the_lenient_gsm8k_reading_takes_the_number_after_the_marker_else_the_last_number():
    assert E.final_number("Natalia sold 48/2 = <<48/2=24>>24 clips.\n#### 72", marker_only=True) == 72
    assert E.final_number("#### 1,000,000") == Decimal(1000000)
    assert E.final_number("####-3.5 dollars") == Decimal("-3.5")
    assert E.final_number("#### 5 ... #### 6 and 7") == 5  # the first marker, as nanochat's re.search
    assert E.final_number("she has 3 apples, then 12, so 15.") == 15  # no marker: the last number
    assert E.final_number("no number", marker_only=False) is None
    assert E.final_number("answer 15", marker_only=True) is None  # a reference must have its marker
    with pytest.raises(ValueError, match="no '#### <number>'"):
        tasks.make_item("GSM8K", {"question": "q", "answer": "15"}, "file.parquet, row 3")


def humaneval(reply):
    item = tasks.make_item("HumanEval", ADD, "row 0")
    result = sandbox.run(E.humaneval_program(item, reply, "PASSED-42"), timeout_s=FAST,
                         level=sandbox.sandbox_level()[0])
    return result.status == "ok" and "PASSED-42" in result.output.splitlines()


@pytest.mark.parametrize("reply, passes", [
    ("```python\ndef add(a, b):\n    return a + b\n```\nThis adds.", True),  # a fenced whole function
    ("def add(a, b):\n    return math.fsum([a, b])", True),  # unfenced; the prompt's import is added
    ("    return a + b\n", True),  # the body only: it continues the prompt
    ("def add(a, b):\n    return a - b", False),  # wrong
    ("def add(a, b):\n    return a +", False),  # a syntax error
    ("import sys\nsys.exit(0)", False),  # exits 0 before the tests run: no marker, no pass
])
def test_humaneval_programs_from_hand_written_replies(reply, passes):
    assert humaneval(reply) is passes


# -----------------------------------------------------------------------------
# The sandbox against hostile programs (each scored a failure, each run bounded)

def sandbox_processes():
    """Processes running sandbox.BOOTSTRAP (in their command line), ours or leftovers."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if b"sandbox: cannot mount" in f.read():
                    found.append(pid)
        except OSError:
            pass
    return found


@pytest.fixture(params=["namespaces", "process"])
def level(request):
    """Each containment test at both levels: the namespaces where this machine gives them, and the process level
    that remains where it does not."""
    if request.param == "namespaces" and sandbox.sandbox_level()[0] != "namespaces":
        pytest.skip(f"no namespaces on this machine: {sandbox.sandbox_level()[1]}")
    return request.param


def contained(program, level, **kw):
    start = time.perf_counter()
    result = sandbox.run(program, timeout_s=FAST, level=level, **kw)
    assert time.perf_counter() - start < FAST + 3
    deadline = time.time() + 3  # the pid namespace's processes die as its first one is reaped: soon, not at once
    while sandbox_processes() and time.time() < deadline:
        time.sleep(0.05)
    assert not sandbox_processes(), "a sandboxed process outlived its run"
    return result


def test_a_program_outlives_no_evaluator_killed_while_it_runs(level):
    """The evaluator (a chat_eval worker that speedrun.sh stops, say) dies by SIGKILL while a program sleeps with a
    minute left on its timeout: the program and its group end with it, not a minute later."""
    code = f"import sandbox; sandbox.run({SLEEPER!r}, timeout_s=60, level={level!r})"
    evaluator = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, start_new_session=True,
                                 env={**os.environ, "PYTHONPATH": str(ROOT)})
    deadline = time.time() + 20
    while len(sandbox_processes()) < 2 and time.time() < deadline:  # the program and the child it forked
        time.sleep(0.05)
    assert sandbox_processes(), "the program never started"
    evaluator.kill()
    evaluator.wait()
    deadline = time.time() + 3
    while sandbox_processes() and time.time() < deadline:
        time.sleep(0.05)
    assert not sandbox_processes(), "a sandboxed process outlived its evaluator"


SLEEPER = "import os, time\nos.fork()\ntime.sleep(60)\n"


def test_a_program_that_loops_forever_is_stopped_at_the_timeout(level):
    result = contained("while True:\n    pass\n", level)
    assert result.status in ("timeout", "killed") and result.seconds < FAST + 1


def test_a_fork_bomb_is_bounded_and_all_of_it_killed(level):
    program = ("import os, time\nn = 0\nwhile True:\n    try:\n        pid = os.fork()\n    except OSError:\n"
               "        os.write(1, b'fork refused after %d\\n' % n)\n        break\n    n = 0 if pid == 0 else n + 1\n"
               "time.sleep(60)\n")
    result = contained(program, level)
    assert result.status in ("timeout", "killed") and "fork refused" in result.output  # RLIMIT_NPROC said no


def test_unbounded_allocation_fails_with_memory_error(level):
    result = contained("blocks = []\nwhile True:\n    blocks.append(bytearray(50 * 2**20))\n", level, memory_mb=256)
    assert result.status == "error" and "MemoryError" in result.output


def test_endless_output_is_capped_by_the_file_size_limit(level):
    result = contained("while True:\n    print('y' * 10000)\n", level)
    assert result.status != "ok" and len(result.output) <= 4000


def test_the_environment_holds_only_path_and_lang(level, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_secret_token_123")
    result = contained("import os\nprint(sorted(os.environ.items()))\n", level)
    assert result.status == "ok" and "hf_secret_token_123" not in result.output
    assert ast.literal_eval(result.output) == sorted(sandbox.ENV.items())


def test_a_secret_file_outside_the_sandbox_cannot_be_read(level, tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("the launch codes")
    relative = os.path.relpath(secret, "/tmp")  # from a working directory under /tmp, as the process level's is
    program = (f"import os\nprint(os.getcwd(), os.listdir('.'))\nfor p in ['secret.txt', {relative!r}, "
               f"'../' + {relative!r}, {str(secret)!r}]:\n    try:\n        print(open(p).read())\n"
               f"    except OSError as e:\n        print(type(e).__name__)\n")
    found = contained(program, level).output
    assert "the launch codes" not in found.splitlines()[1] and "[]" in found.splitlines()[0]  # an empty cwd
    if level == "process" and os.geteuid() != 0:  # as root it runs as nobody, who may not enter tmp_path
        pytest.skip("process level: a file this user can read is readable by its absolute path (docs/eval.md: the sandbox)")
    assert "the launch codes" not in found and found.count("Error") == 4


def test_no_socket_reaches_a_listener_here(level):
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    listener.settimeout(0.5)
    port = listener.getsockname()[1]
    patched = contained(f"import socket\nsocket.create_connection(('127.0.0.1', {port}))\nprint('connected')\n",
                        level)
    assert patched.status == "error" and "network access is disabled" in patched.output
    if level == "namespaces":  # the original class, past the patch: no interface to use (the process level has one)
        raw = contained(f"import socket\ns = socket.socket.__mro__[2](socket.AF_INET, socket.SOCK_STREAM)\n"
                        f"s.connect(('127.0.0.1', {port}))\nprint('connected')\n", level)
        assert raw.status == "error" and "connected" not in raw.output.splitlines()
    with pytest.raises(TimeoutError):
        listener.accept()  # nobody connected
    listener.close()


def test_the_evaluator_scores_hostile_programs_as_failures_and_keeps_going():
    hostile = {"loop": "while True:\n    pass", "fork": "import os\nwhile True:\n    os.fork()",
               "alloc": "blocks = []\nwhile True:\n    blocks.append(bytearray(10**8))", "exit": "import os\nos._exit(0)"}
    rows = [{**ADD, "task_id": name, "prompt": f"# {name}\n" + ADD["prompt"]} for name in [*hostile, "good"]]
    script = {f"# {name}\n": f"```python\n{code}\n```" for name, code in hostile.items()}
    script["# good\n"] = "```python\ndef add(a, b):\n    return a + b\n```"
    verdicts, records = scored("HumanEval", rows, script)
    assert [c for c, _ in verdicts] == [False] * len(hostile) + [True]
    statuses = {r["id"]: r["status"] for r in records}
    assert statuses["loop"] in ("timeout", "killed") and statuses["alloc"] == "error"
    assert statuses["exit"] == "ok" and statuses["good"] == "ok"  # the exit passed nothing: no marker
    assert statuses.get("fork", "error") in ("error", "timeout", "killed")


# -----------------------------------------------------------------------------
# The hub tasks from a local server in the hub's protocol, with the real layouts

@pytest.fixture
def hub(tmp_path, monkeypatch):
    files = {}
    for repo, layout in LAYOUTS.items():
        for path, rows in layout.items():
            local = tmp_path / "source" / repo / path
            local.parent.mkdir(parents=True, exist_ok=True)
            pq.write_table(pa.Table.from_pylist(rows), local)
            files[f"{repo}/{path}"] = local.read_bytes()
    hub = SimpleNamespace(files=files, faults={}, log=[])
    servers = [ThreadingHTTPServer(("127.0.0.1", 0), hub_handler(hub)) for _ in range(2)]  # the hub, the "CDN"
    for server in servers:
        threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    url, hub.cdn_url = (f"http://127.0.0.1:{server.server_address[1]}" for server in servers)
    monkeypatch.setenv("HF_ENDPOINT", url)
    monkeypatch.setenv("NO_PROXY", "127.0.0.1")
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setattr(hf_constants, "HF_HUB_CACHE", str(tmp_path / "hf_cache"))
    monkeypatch.setattr(prepare, "BACKOFF_BASE", 0.0)
    yield hub
    for server in servers:
        server.shutdown()
        server.server_close()


def test_the_five_tasks_come_from_the_hub_in_their_real_layouts_and_then_from_the_cache(hub, tmp_path):
    cache = tmp_path / "cache"
    with pytest.raises(FileNotFoundError, match=r"GSM8K's test files are not in .*: download them with "
                       r"`python chat_eval.py --download_only --tasks GSM8K --cache_dir "):
        tasks.load_items("GSM8K", cache, None, -1)  # rl.py reads the cache only
    assert len(hub.log) == 0
    for task in tasks.HUB_TASKS:
        E.download_task(task, cache)
    loaded = {task: tasks.load_items(task, cache, None, -1) for task in tasks.HUB_TASKS}
    for task, (repo, pattern, _, _) in tasks.HUB_TASKS.items():
        (path,) = [p for p in LAYOUTS[repo] if re.fullmatch(pattern, p)]
        assert sorted(os.listdir(cache / task)) == ["files.json", path.split("/")[-1]]  # only the test split
        assert (cache / task / path.split("/")[-1]).read_bytes() == hub.files[f"{repo}/{path}"]
        items, size = loaded[task]
        assert size == len(LAYOUTS[repo][path])
        assert [i["row"] for i in items] == np.random.default_rng(42).permutation(size).tolist()  # nanochat's order
    easy = {i["row"]: i for i in loaded["ARC-Easy"][0]}
    assert easy[1] == {"prompt": "Multiple Choice question: arc question 1?\n- tA=A\n- tB=B\n- tC=C\n- tD=D\n\n"
                                 "Respond only with the letter of the correct answer.", "letters": list("ABCD"),
                       "answer": "B", "options": ["tA", "tB", "tC", "tD"], "question": "arc question 1?", "row": 1}
    assert easy[6]["letters"] == list("1234") and easy[6]["answer"] == "3"
    assert {i["row"]: i["answer"] for i in loaded["MMLU"][0]} == {0: "A", 1: "B", 2: "C", 3: "D", 4: "A"}
    assert {i["row"]: i["answer"] for i in loaded["GSM8K"][0]} == {0: "1", 1: "2", 2: "3", 3: "4"}
    assert {i["row"]: (i["id"], i["entry_point"]) for i in loaded["HumanEval"][0]} == {
        0: ("HumanEval/0", "add"), 1: ("HumanEval/1", "add")}
    requests = len(hub.log)
    assert all(E.download_task(t, cache) == tasks.hub_files(t, cache) for t in tasks.HUB_TASKS)
    again = {task: tasks.load_items(task, cache, None, 2) for task in tasks.HUB_TASKS}
    assert len(hub.log) == requests  # the cache answered
    assert all(again[t][0] == loaded[t][0][:2] for t in tasks.HUB_TASKS)


def test_a_row_out_of_its_layout_names_the_file_and_row(hub, tmp_path):
    pq.write_table(pa.Table.from_pylist([{"question": "q", "choices": ["a"], "answer": 3}]), tmp_path / "bad.parquet")
    hub.files["cais/mmlu/all/test-00000-of-00001.parquet"] = (tmp_path / "bad.parquet").read_bytes()
    E.download_task("MMLU", tmp_path / "cache")
    with pytest.raises(ValueError, match=r"test-00000-of-00001.parquet, row 0: not in MMLU's layout \(IndexError"):
        tasks.load_items("MMLU", tmp_path / "cache", None, -1)


# -----------------------------------------------------------------------------
# The script end to end, offline, on the demo world

@pytest.fixture(scope="module")
def tiny(demo_world):
    """An untrained tiny checkpoint of the demo world (saved as the stages save one) in a run with metrics."""
    tok = Tokenizer.load(demo_world / "tokenizer")
    torch.manual_seed(0)
    config = config_from_preset("tiny", {"n_layer": 1, "n_embd": 64, "n_head": 2, "n_kv_head": 2,
                                         "sequence_len": 128})
    meta = {"stage": "sft", "model_config": config.__dict__, "world_size": 1, "tokenizer": str(demo_world / "tokenizer"),
            "tokenizer_sha256": tok.fingerprint(), "data_dir": str(demo_world / "demo" / "pretrain")}
    checkpoint.save_checkpoint(demo_world / "tiny_runs" / "r" / "ckpt", 7, build_model(config), [], [], meta, 0, 1)
    (demo_world / "tiny_runs" / "r" / "metrics.jsonl").write_text('{"step": 7, "loss": 6.9}\n')
    return demo_world


@pytest.mark.two_processes
def test_the_demo_tasks_run_end_to_end_on_two_processes_and_report_what_ran(tiny):
    """As a user runs it, under torchrun: the items are dealt to 2 ranks, and give what one rank alone gives."""
    result = run_script("chat_eval.py", ["--runs_dir", "tiny_runs", "--max_items", "4", "--max_new_tokens", "6",
                                         "--dtype", "float32"], tiny, nproc=2)
    run = tiny / "tiny_runs" / "r"
    report = json.loads((run / "chat_eval.json").read_text())
    records = [json.loads(line) for line in (run / "chat_eval_items.jsonl").read_text().splitlines()]
    picked = "checkpoint: tiny_runs/r/ckpt/step_000007 (newest sft checkpoint under tiny_runs; stage sft, step 7, "
    assert picked in result.stdout
    assert f"{report['parameters']:,} parameters)" in result.stdout and report["tasks_from"] == str(tiny / "demo")
    assert [(r["task"], r["items"], r["items_in_task"]) for r in report["tasks"]] == [("demo-choice", 4, 132),
                                                                                        ("demo-answer", 4, 109),
                                                                                        ("demo-problems", 4, 120)]
    for r in report["tasks"]:
        mine = [x for x in records if x["task"] == r["task"]]
        assert 0 < r["seconds"] < report["seconds"]  # what plan_cost prices each task's items at
        assert r["correct"] == sum(x["correct"] for x in mine) and r["accuracy"] == r["correct"] / 4
        assert 0 <= r["accuracy"] <= 1 and r["centered"] == (r["accuracy"] - r["baseline"]) / (1 - r["baseline"])
        assert re.search(rf"{r['task']} .* {r['correct']}/4 .* {r['accuracy']:.4f}", result.stdout)
    assert all(x["predicted"] in "ABCD" for x in records if x["task"] == "demo-choice")
    assert report["chatcore"] == sum(r["centered"] for r in report["tasks"]) / 3 and not report["complete"]
    assert f"ChatCORE {report['chatcore']:.4f} (3 tasks, a subset" in result.stdout and report["world_size"] == 2
    assert report["sandbox"] is None  # no HumanEval: nothing was run
    line = json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])
    assert line == {"step": 7, "chatcore": report["chatcore"], "chat_eval": {r["task"]: r["accuracy"] for r in
                                                                             report["tasks"]},
                    "chat_eval_complete": False}
    model, _ = checkpoint.load_model(run / "ckpt" / "step_000007", CPU)  # one rank, in this process
    args = SimpleNamespace(dtype="float32", max_new_tokens=6, batch_items=8, option_text="on")  # the defaults
    alone = [r for task in tasks.DEMO_TASKS for r in E.evaluate_task(
        task, tasks.load_items(task, None, tiny / "demo", 4)[0], model, Tokenizer.load(tiny / "tokenizer"), args, 0, 1,
        CPU, "M", None)[1]]
    assert records == alone and len(records) == 12


def test_the_hub_tasks_run_end_to_end_with_the_sandbox(tiny, hub, tmp_path, capsys):
    out = tmp_path / "report.json"
    accept = [] if sandbox.sandbox_level()[0] == "namespaces" else ["--sandbox", "process"]  # no namespaces here
    code, stdout, err = run_in_process(E.main, ["--checkpoint", tiny / "tiny_runs" / "r", "--demo", "none",
                                                "--max_items", "2", "--max_new_tokens", "3", "--dtype", "float32",
                                                "--cache_dir", tmp_path / "cache", "--out", out, *accept], capsys,
                                       stage="chat_eval.py")
    assert code == 0, err
    report = json.loads(out.read_text())
    assert [(r["task"], r["items"]) for r in report["tasks"]] == [(t, 2) for t in tasks.HUB_TASKS]
    assert report["sandbox"]["level"] == sandbox.sandbox_level()[0] and report["sandbox"]["description"] in stdout
    records = [json.loads(line) for line in out.with_name("report_items.jsonl").read_text().splitlines()]
    assert [r["status"] for r in records if r["task"] == "HumanEval"] == ["error", "error"]  # 3 random tokens
    assert "HumanEval      humaneval         0/2" in stdout and not report["complete"]


@pytest.mark.parametrize("choice", ["auto", "namespaces"])
def test_humaneval_is_refused_where_there_are_no_namespaces_unless_the_process_level_is_asked_for(
        choice, tiny, tmp_path, capsys, monkeypatch):
    """Never a silent fallback: without namespaces model-written code runs only with --sandbox process."""
    monkeypatch.setattr(sandbox, "_LEVEL", ("process", "no unshare command"))  # a machine without namespaces
    code, out, err = run_in_process(E.main, ["--checkpoint", tiny / "tiny_runs" / "r", "--demo", "none", "--tasks",
                                             "HumanEval", "--sandbox", choice, "--cache_dir", tmp_path], capsys,
                                    stage="chat_eval.py")
    assert code == 1 and err.startswith(f"chat_eval.py: error: --sandbox {choice}: this machine gives no namespaces "
                                        "to contain model-written code (no unshare command); at the process level it "
                                        "could read ") and "HumanEval " not in out
    assert err.endswith("accept that with --sandbox process, or leave HumanEval out (--tasks)\n")
    assert not list(tmp_path.iterdir())  # before any download
    with pytest.raises(RuntimeError, match="this machine gives no namespaces"):
        sandbox.run("print('ran')")  # the library's default is the same
    assert sandbox.run("print('ran')", level="process").output == "ran\n"  # asked for: it runs


@pytest.mark.skipif(os.geteuid() != 0, reason="as root only")
def test_as_root_the_process_level_runs_the_program_as_nobody_with_the_interpreter_reachable():
    result = contained("import os, decimal\nprint(os.getuid(), os.getgid(), os.getgroups())\n", "process")
    assert result.status == "ok" and result.output == "65534 65534 []\n", result.output


@pytest.mark.parametrize("args, message", [
    (["--tasks", "MMLU"], ("--tasks: MMLU not among the demo world tasks: demo-choice, demo-answer, demo-problems (--demo "
                           "none for the hub tasks)")),
    (["--demo", "nowhere"], ("--demo nowhere: no chat_eval/ in it: write the demo world there with `python demo.py "
                             "--out nowhere`")),
])
def test_bad_input_stops_with_one_line_before_any_evaluation(tiny, capsys, args, message):
    code, out, err = run_in_process(E.main, ["--checkpoint", tiny / "tiny_runs" / "r", *args], capsys,
                                    stage="chat_eval.py")
    assert code == 1 and err == f"chat_eval.py: error: {message}\n" and "task " not in out


def test_download_only_fetches_every_hub_task_without_a_checkpoint(hub, tmp_path, capsys):
    """What speedrun.sh runs before pretraining: no checkpoint, no process group; every task's test files cached."""
    cache = tmp_path / "cache"
    E.main(["--download_only", "--cache_dir", str(cache)])
    out = capsys.readouterr().out
    for task in tasks.HUB_TASKS:
        assert f"download: {task}: 1 files in {cache / task}" in out
        assert (cache / task / "files.json").is_file()
    requests = len(hub.log)
    assert {t: tasks.load_items(t, cache, None, 1)[1] for t in tasks.HUB_TASKS} and len(hub.log) == requests  # cached
    with pytest.raises(ValueError, match="--tasks: Trivia not among the hub tasks"):
        E.main(["--download_only", "--cache_dir", str(cache), "--tasks", "Trivia"])


def test_download_only_refuses_humaneval_at_the_start_where_nothing_can_contain_its_programs(hub, tmp_path, capsys,
                                                                                              monkeypatch):
    """speedrun.sh's gpu plan runs --download_only before pretraining: a machine without namespaces stops it there,
    naming --sandbox process, not after hours of training; with --sandbox process (accepted) it fetches."""
    monkeypatch.setattr(sandbox, "_LEVEL", ("process", "no unshare command"))
    cache = tmp_path / "cache"
    with pytest.raises(RuntimeError, match="accept that with --sandbox process"):
        E.main(["--download_only", "--cache_dir", str(cache)])
    assert not cache.exists()
    E.main(["--download_only", "--cache_dir", str(cache), "--tasks", "ARC-Easy"])  # no program runs: no check
    E.main(["--download_only", "--cache_dir", str(cache), "--tasks", "HumanEval", "--sandbox", "process"])
    out = capsys.readouterr().out
    assert "sandbox: process only (--sandbox process: the user accepted what it does not contain)" in out
    assert (cache / "HumanEval" / "files.json").is_file()


def test_demo_words_runs_by_name_beside_chatcore_and_is_left_out_of_its_mean(tiny, tmp_path):
    out = tmp_path / "words.json"
    result = run_script("chat_eval.py", ["--runs_dir", "tiny_runs", "--tasks", "demo-choice,demo-words", "--max_items",
                                         "3", "--max_new_tokens", "4", "--dtype", "float32", "--out", out], tiny)
    report = json.loads(out.read_text())
    choice, words = report["tasks"]
    assert (words["task"], words["items"], words["items_in_task"], words["centered"]) == ("demo-words", 3, 140, None)
    assert report["chatcore"] == choice["centered"] and "ChatCORE" in result.stdout and "(1 tasks," in result.stdout


def test_gsm8k_counts_by_nanochats_rule_and_keeps_the_lenient_reading_outside_chatcore():
    """nanochat's extract_answer: the digits, dots and commas after the first '#### ', commas dropped, compared as
    strings; a reply without the marker is wrong, whatever its last number. The lenient reading (any number, as
    numbers) is recorded per item and summarized in the task's diagnostics, never in its accuracy."""
    assert [E.gsm8k_answer(t) for t in ["#### 1,234", "#### -3.5 dollars", "#### 5 then #### 6", "####-3", "#### $5",
                                        "#### 7.00", "so 15", "#### 1,234."]] == \
        ["1234", "-3.5", "5", None, None, "7.00", None, "1234."]
    rows = [{"question": f"g{i}", "answer": "<<6*7=42>>42 in all\n#### 42"} for i in range(6)]
    script = {"g0": "#### 42", "g1": "So 42.", "g2": "#### 42.00", "g3": "#### 4,2", "g4": "#### $42", "g5": "41"}
    verdicts, records = scored("GSM8K", rows, script)
    assert [c for c, _ in verdicts] == [True, False, False, True, False, False]
    assert [r["predicted"] for r in records] == ["42", None, "42.00", "42", None, None]
    assert [r["lenient"]["correct"] for r in records] == [True, True, True, True, True, False]
    rows, chatcore = E.summarize(["GSM8K"], {"GSM8K": verdicts}, {"GSM8K": 6})
    assert rows[0]["accuracy"] == 2 / 6 and chatcore == 2 / 6
    assert E.task_diagnostics("gsm8k", records) == {"lenient": {"rule": E.LENIENT_RULE, "correct": 5, "items": 6,
                                                                "accuracy": 5 / 6}}
