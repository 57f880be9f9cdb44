"""core_eval.py: the bundle fetched from a local HTTP server (verify, unzip, cache hit), nanochat's few-shot draw and
scored tokens (checked against values worked out by hand), the dclm protocol's, exact accuracies from a model whose
logits the test sets, centered accuracy, 1 process = 2 processes, bad input."""
import json
import math
import re
import threading
from hashlib import sha256
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch
import torch.nn.functional as F
from helpers import (
    CORE_YAML,
    ECHO,
    META_CSV,
    PICK,
    QUIZ,
    bundle_zip,
    jsonl,
    run_in_process,
    run_script,
)

import checkpoint
import core_eval as E
import prepare
import prepare as P
import train_loop
from loader import val_rows
from model import build_model, config_from_preset
from prepare import train_tokenizer
from tokenizer import SPLIT_PATTERN, Tokenizer

BYTES = Tokenizer({bytes([b]): b for b in range(256)}, SPLIT_PATTERN)  # no merges: one token per byte


# -----------------------------------------------------------------------------
# A bundle in the real format, served over HTTP

@pytest.fixture
def server():
    """Serves `files` (path -> bytes); logs each request as (path, Authorization header)."""
    state = {"files": {}, "log": []}

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            state["log"].append((self.path, self.headers.get("Authorization")))
            body = state["files"].get(self.path)
            self.send_response(200 if body is not None else 404)
            self.send_header("Content-Length", str(len(body or b"")))
            self.end_headers()
            self.wfile.write(body or b"")

        def log_message(self, *args):
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    state["url"] = f"http://127.0.0.1:{httpd.server_address[1]}"
    yield state
    httpd.shutdown()


def test_bundle_is_downloaded_verified_unzipped_once_then_cached(server, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "secret")  # the hub's token must not travel to another host
    data = bundle_zip()
    server["files"]["/eval_bundle.zip"] = data
    url = server["url"] + "/eval_bundle.zip"
    root, provenance = E.fetch_bundle(url, cache_dir=tmp_path)
    assert provenance == {"url": url, "sha256": sha256(data).hexdigest(), "bytes": len(data)}
    assert server["log"] == [("/eval_bundle.zip", None)]
    assert (root / "core.yaml").read_text() == CORE_YAML and root.name == "eval_bundle"
    tasks = E.load_tasks(root)
    assert [(t.label, t.kind, t.fewshot, t.delimiter, t.baseline, len(t.items)) for t in tasks] == [
        ("quiz_mc", "multiple_choice", 2, "\nAnswer: ", 0.25, 8), ("pick_schema", "schema", 0, " ", 0.5, 6),
        ("echo_lm", "language_modeling", 1, " ", 0.0, 5)]
    again, provenance2 = E.fetch_bundle(url, cache_dir=tmp_path)
    assert again == root and provenance2 == provenance and len(server["log"]) == 1  # no second request
    with pytest.raises(ValueError, match="sha256"):  # a pinned hash that the cached bundle does not have
        E.fetch_bundle(url, expected_sha256="0" * 64, cache_dir=tmp_path)


def test_a_corrupt_bundle_is_refused_and_never_unzipped(server, tmp_path, monkeypatch):
    monkeypatch.setattr(prepare, "BACKOFF_BASE", 0.0)
    data = bytearray(bundle_zip())
    data[60] ^= 0xFF  # inside the first member's compressed bytes: its CRC fails
    server["files"]["/bad.zip"] = bytes(data)
    with pytest.raises(RuntimeError, match="CRC|not a readable zip"):
        E.fetch_bundle(server["url"] + "/bad.zip", cache_dir=tmp_path)
    assert not list(tmp_path.rglob("core.yaml")) and not list(tmp_path.rglob("unzipped*"))
    server["files"]["/page.zip"] = b"<html>not found</html>"
    with pytest.raises(RuntimeError, match="not a readable zip"):
        E.fetch_bundle(server["url"] + "/page.zip", cache_dir=tmp_path)


# -----------------------------------------------------------------------------
# Prompts and exact accuracies with controlled logits

def write_bundle(root, tasks, meta_csv=META_CSV):
    """tasks: {relative jsonl path: text}; core.yaml as CORE_YAML."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "core.yaml").write_text(CORE_YAML)
    (root / "eval_meta_data.csv").write_text(meta_csv)
    for rel, text in tasks.items():
        (root / "eval_data" / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / "eval_data" / rel).write_text(text)
    return root


@pytest.fixture
def tasks(tmp_path):
    root = write_bundle(tmp_path / "b", {"world_knowledge/quiz.jsonl": jsonl(QUIZ),
                                         "language_understanding/pick.jsonl": jsonl(PICK),
                                         "symbolic/echo.jsonl": jsonl(ECHO)})
    return E.load_tasks(root)


BOS = BYTES.bos_id
ORDER8 = [0, 3, 7, 2, 1, 6, 4, 5]  # random.Random(1337).shuffle(list(range(8)))


def test_nanochat_shuffles_a_task_by_seed_1337_and_cuts_it_to_max_per_task():
    assert E.task_order(8, -1) == ORDER8
    assert E.task_order(8, 3) == [0, 3, 7]  # the first 3 of the shuffled task
    assert E.task_order(5, -1) == [1, 0, 3, 2, 4]


def test_nanochat_draws_examples_by_position_in_the_shuffled_cut_list(tasks):
    quiz = tasks[0]
    assert E.fewshot_positions(8, 5, 2) == [0, 2]  # random.Random(1234 + 5).sample([0, 1, 2, 3, 4, 6, 7], 2)
    assert E.fewshot_positions(3, 1, 2) == [2, 0]  # random.Random(1234 + 1).sample([0, 2], 2)
    assert all(p not in E.fewshot_positions(8, p, 7) for p in range(8))  # never the item, even when all others are
    # item 6 is at position 5 of the shuffled task: its examples are those at positions 0 and 2, items 0 and 7
    shown = "Q0?\nAnswer: a\n\nQ7?\nAnswer: d\n\nQ6?\nAnswer: "
    assert E.prompt_pairs(quiz, ORDER8, 5) == [(shown, choice) for choice in "abcd"]
    # cut to 3 items ([0, 3, 7]), item 3 (position 1) draws from those 3 only: positions 2 and 0, items 7 and 0
    assert E.prompt_pairs(quiz, [0, 3, 7], 1)[0][0] == "Q7?\nAnswer: d\n\nQ0?\nAnswer: a\n\nQ3?\nAnswer: "


def test_a_cut_list_too_short_for_the_fewshot_count_gives_every_other_item():
    assert E.fewshot_positions(2, 1, 5) == [0] and E.fewshot_positions(1, 0, 5) == []


def test_nanochat_scores_multiple_choice_after_the_choices_common_tokens(tasks):
    shown = "Q0?\nAnswer: a\n\nQ7?\nAnswer: d\n\nQ6?\nAnswer: "  # the delimiter's space is shared: only the letter is
    rows = E.item_rows(tasks[0], ORDER8, 5, BYTES, 1000)  # scored (with BPE, ' a' would be one token and scored)
    assert rows == [([BOS, *shown.encode(), ord(c)], 1 + len(shown), False) for c in "abcd"]


def test_nanochat_does_not_score_a_first_word_every_choice_shares():
    task = E.Task("t", "multiple_choice", 0, " ", 0.5, [{"query": "Pick:", "choices": ["the red fox", "the blue fox"],
                                                         "gold": 0}], "t.jsonl")
    rows = E.item_rows(task, [0], 0, BYTES, 1000)
    assert rows == [([BOS, *b"Pick: the red fox"], 1 + len("Pick: the "), False),  # 'red fox'
                    ([BOS, *b"Pick: the blue fox"], 1 + len("Pick: the "), False)]  # 'blue fox'
    dclm = E.item_rows(task, [0], 0, BYTES, 1000, "dclm")
    assert [start for _, start in [r[:2] for r in dclm]] == [1 + len("Pick:")] * 2  # ' the red fox', ' the blue fox'


def test_nanochat_scores_a_schema_item_from_its_common_suffix_which_reaches_into_the_options():
    task = E.Task("t", "schema", 0, " ", 0.5, [{"context_options": ["the pig on the farm", "the hen on the farm"],
                                                "continuation": "slept.", "gold": 0}], "t.jsonl")
    rows = E.item_rows(task, [0], 0, BYTES, 1000)  # 'pig'/'hen' differ mid-sentence: ' on the farm slept.' is scored
    assert rows == [([BOS, *f"the {a} on the farm slept.".encode()], 1 + len(f"the {a}"), False) for a in ("pig", "hen")]
    dclm = E.item_rows(task, [0], 0, BYTES, 1000, "dclm")  # the continuation only: ' slept.'
    assert [r[1] for r in dclm] == [1 + len("the pig on the farm")] * 2


def test_nanochat_scores_a_language_modelling_answer_after_the_stripped_context(tasks):
    shown = "say no: no\n\nsay yes:"  # item 3, at position 2 of [1, 0, 3, 2, 4]; its example, position 4, is item 4
    assert E.fewshot_positions(5, 2, 1) == [4]
    assert E.item_rows(tasks[2], [1, 0, 3, 2, 4], 2, BYTES, 1000) == [([BOS, *shown.encode(), *b" yes"],
                                                                         1 + len(shown), False)]


CATS = Tokenizer({**{bytes([b]): b for b in range(256)}, b"ts": 256}, SPLIT_PATTERN)  # one merge: 'cats' = c a ts


def test_where_nanochat_scores_nothing_every_row_still_scores_one_token():
    mc = E.Task("t", "multiple_choice", 0, " ", 0.5, [{"query": "Capital:", "choices": ["Paris", "Paris, France"],
                                                       "gold": 0}], "t.jsonl")
    paris = [BOS, *b"Capital: Paris"]  # all of it is the common prefix: both rows score from its last token, 's'
    assert E.item_rows(mc, [0], 0, BYTES, 1000) == [(paris, 14, False), ([*paris, *b", France"], 14, False)]
    same = E.Task("t", "schema", 0, " ", 0.5, [{"context_options": ["same", "same"], "continuation": "x", "gold": 0}],
                  "t.jsonl")  # identical rows: all common suffix; every token after BOS is scored
    assert E.item_rows(same, [0], 0, BYTES, 1000) == [([BOS, *b"same x"], 1, False)] * 2
    apart = E.Task("t", "schema", 0, "", 0.5, [{"context_options": ["cat", "dog"], "continuation": "s", "gold": 0}],
                   "t.jsonl")  # 'cats' ends in 'ts', 'dogs' in 's': no common last token; each scores its last
    assert E.item_rows(apart, [0], 0, CATS, 1000) == [([CATS.bos_id, *b"ca", 256], 3, False),
                                                      ([CATS.bos_id, *b"dogs"], 4, False)]
    lm = E.Task("t", "language_modeling", 0, "", 0.0, [{"context": "cat", "continuation": "s"}], "t.jsonl")
    # BPE merges across the context's end ('cat' + 's' = c a ts; nanochat asserts it cannot): scored from 'ts'
    assert E.item_rows(lm, [0], 0, CATS, 1000) == [([CATS.bos_id, *b"ca", 256], 3, False)]


def test_the_dclm_protocol_scores_every_continuation_token_tokenized_apart(tasks):
    quiz, pick, echo = tasks
    shown = "Q0?\nAnswer: a\n\nQ7?\nAnswer: d\n\nQ6?\nAnswer:"  # the delimiter's space moves to the continuation
    assert E.item_rows(quiz, ORDER8, 5, BYTES, 1000, "dclm") == [([BOS, *shown.encode(), *f" {c}".encode()],
                                                                  1 + len(shown), False) for c in "abcd"]
    assert E.item_rows(pick, [0], 0, BYTES, 1000, "dclm") == [([BOS, *opt.encode(), *b" x"], 1 + len(opt), False)
                                                              for opt in ["one 1", "two 2"]]
    shown = "say no: no\n\nsay yes:"
    assert E.item_rows(echo, [1, 0, 3, 2, 4], 2, BYTES, 1000, "dclm") == [([BOS, *shown.encode(), *b" yes"],
                                                                           1 + len(shown), False)]


def test_a_row_longer_than_the_window_keeps_its_bos_and_its_scored_tokens(tasks):
    shown = "Q0?\nAnswer: a\n\nQ7?\nAnswer: d\n\nQ6?\nAnswer: "
    # sequence_len 12: the model reads 12 tokens of a 13-token row: BOS, the context's last 11 bytes, the choice
    assert E.item_rows(tasks[0], ORDER8, 5, BYTES, 12)[2] == ([BOS, *shown[-11:].encode(), ord("c")], 12, True)
    assert E.fit_window(list(range(10)), 2, 4) == ([0, 6, 7, 8, 9], 1, True)  # a scored span too long: what fits
    assert E.fit_window(list(range(5)), 2, 4) == (list(range(5)), 2, False)


class Bigram(torch.nn.Module):
    """Logits at each position = table[current token]: the test decides every prediction."""

    def __init__(self, table, seq_len=1000):
        super().__init__()
        self.table = table
        self.config = config_from_preset("tiny", {"sequence_len": seq_len, "vocab_size": table.shape[0]})

    def forward(self, idx, targets, reduction, predictions):
        logits = self.table[idx]
        losses = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-1, reduction="none")
        return losses.view(targets.shape), logits.argmax(-1)


def controlled_model():
    table = torch.zeros(BYTES.vocab_size, BYTES.vocab_size)
    table[ord(" "), ord("c")] = 5.0  # multiple choice: after the space, 'c' is the likeliest answer
    table[ord("2"), ord(" ")] = 5.0  # schema: ' x' is likeliest after an option ending in '2'
    for prev, nxt in zip(": ye", " yes"):  # language modelling: ':' -> ' yes' greedily
        table[ord(prev), ord(nxt)] = 6.0  # above ' ' -> 'c', which stays the likeliest of the choices a-d
    return Bigram(table)


@pytest.mark.parametrize("protocol", E.PROTOCOLS)
@pytest.mark.parametrize("batch_items", [1, 3, 64])
def test_exact_accuracies_with_controlled_logits(tasks, batch_items, protocol):
    """The bigram model predicts from the current token alone, so both protocols' scored tokens give the same answers
    here (with single bytes, the choices' common prefix ends after the delimiter's space)."""
    cpu = torch.device("cpu")
    results = E.evaluate_tasks(controlled_model(), BYTES, tasks, -1, batch_items, "float32", 0, 1, cpu, protocol)
    quiz, pick, echo = results
    assert quiz == [(i, 2, i % 4 == 2, False) for i in range(8)]  # always 'c': right for the 2 items whose gold is 2
    assert pick == [(i, 1, i % 2 == 1, False) for i in range(6)]  # always option 2
    assert [c for _, _, c, _ in echo] == [True, False, True, True, False]  # 'yes' is produced, 'no' is not
    rows, core = E.summarize(tasks, results)
    assert [(r["correct"], r["items"], r["accuracy"]) for r in rows] == [(2, 8, 0.25), (3, 6, 0.5), (3, 5, 0.6)]
    assert [r["centered"] for r in rows] == [0.0, 0.0, pytest.approx(0.6)]  # (acc - b) / (1 - b)
    assert core == pytest.approx(0.2)
    subset = E.evaluate_tasks(controlled_model(), BYTES, tasks, 3, batch_items, "float32", 0, 1, cpu, protocol)
    assert [[i for i, *_ in r] for r in subset] == [[0, 3, 7], [0, 1, 3], [0, 1, 3]]  # each shuffled task's first 3
    assert all(item in full for r, full in zip(subset, results) for item in r)


def test_centered_accuracy_arithmetic():
    assert E.centered(0.25, 0.25) == 0.0 and E.centered(1.0, 0.25) == 1.0
    assert E.centered(0.7, 0.25) == pytest.approx(0.6) and E.centered(0.1, 0.5) == pytest.approx(-0.8)
    assert E.centered(0.35, 0.0) == 0.35


# -----------------------------------------------------------------------------
# Bad input

@pytest.mark.parametrize("line, message", [
    ('{"query": "Q?", "choices": ["a", "b"]', "not valid JSON"),
    ('{"query": "Q?", "gold": 0}', "a multiple_choice item needs query, choices, gold; missing choices"),
    ('{"query": "Q?", "choices": ["a", "b"], "gold": 5}', "needs a list of at least 2 options and a gold index"),
    ('{"query": "Q?", "choices": [1, 2], "gold": 1}', "every query, context, choice and continuation must be a string"),
    ('{"query": "Q?", "choices": ["a", ""], "gold": 1}', "an empty continuation or choice"),
])
def test_bad_item_names_file_and_line(tmp_path, line, message):
    root = write_bundle(tmp_path, {"world_knowledge/quiz.jsonl": jsonl(QUIZ[:3]) + line + "\n" + jsonl(QUIZ[3:]),
                                   "language_understanding/pick.jsonl": "", "symbolic/echo.jsonl": ""})
    with pytest.raises(ValueError, match=re.escape(f"quiz.jsonl, line 4: {message}")):
        E.load_tasks(root, ["quiz_mc"])


def test_task_with_fewer_items_than_its_fewshot_count(tmp_path):
    root = write_bundle(tmp_path, {"world_knowledge/quiz.jsonl": jsonl(QUIZ[:2]),
                                   "language_understanding/pick.jsonl": jsonl(PICK), "symbolic/echo.jsonl": jsonl(ECHO)})
    with pytest.raises(ValueError, match=r"task quiz_mc: 2 items .* 2-shot prompts need at least 3"):
        E.load_tasks(root)
    # --max_items below the few-shot count: the examples come from the evaluated items, here none are left
    # (nanochat's random.sample raises there, its #550); the rows report the count used
    (root / "eval_data/world_knowledge/quiz.jsonl").write_text(jsonl(QUIZ))
    tasks = E.load_tasks(root)
    results = E.evaluate_tasks(controlled_model(), BYTES, tasks, 1, 4, "float32", 0, 1, torch.device("cpu"))
    assert [len(r) for r in results] == [1, 1, 1]
    assert [r["fewshot"] for r in E.summarize(tasks, results)[0]] == [0, 0, 0]


def test_missing_baseline_and_unknown_task(tasks, tmp_path):
    root = write_bundle(tmp_path, {"world_knowledge/quiz.jsonl": jsonl(QUIZ),
                                   "language_understanding/pick.jsonl": jsonl(PICK), "symbolic/echo.jsonl": jsonl(ECHO)},
                        meta_csv=META_CSV.replace("pick_schema,lu,schema,50\n", ""))
    with pytest.raises(ValueError, match=r"eval_meta_data\.csv: no 'Random baseline' for task pick_schema"):
        E.load_tasks(root)
    with pytest.raises(ValueError, match="--tasks: nope not in"):
        E.load_tasks(root, ["nope"])


# -----------------------------------------------------------------------------
# The script end to end: 1 process = 2 processes; a tokenizer that does not match

@pytest.fixture(scope="module")
def demo(demo_world):
    """The demo world and its tokenizer (conftest.py), and an untrained tiny checkpoint saved as pretrain.py saves one."""
    tok = Tokenizer.load(demo_world / "tokenizer")
    torch.manual_seed(0)
    config = config_from_preset("tiny", {"n_layer": 2, "n_embd": 64, "n_head": 2, "n_kv_head": 2})
    meta = {"stage": "pretrain", "model_config": config.__dict__, "world_size": 1,
            "tokenizer": str(demo_world / "tokenizer"), "tokenizer_sha256": tok.fingerprint(),
            "data_dir": str(demo_world / "demo" / "pretrain")}
    checkpoint.save_checkpoint(demo_world / "core_runs" / "r" / "ckpt", 5, build_model(config), [], [], meta, 0, 1)
    return demo_world


def run_core_eval(root, args, nproc=1):
    return run_script("core_eval.py", args, root, nproc, check=False)


@pytest.mark.two_processes
def test_one_and_two_processes_give_identical_results(demo):
    outputs = []
    for nproc in (1, 2):
        out = demo / f"out{nproc}"
        result = run_core_eval(demo, ["--runs_dir", "core_runs", "--max_items", "9", "--batch_items", "4", "--bpb_tokens", "5000",
                                      "--max_new_tokens", "4", "--out", str(out)], nproc)
        assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
        report = json.loads((out / "results.json").read_text())
        assert report["bundle"] == {"dir": str(demo / "demo" / "eval_bundle")} and report["world_size"] == nproc
        assert not report["complete"] and "a subset: not comparable" in result.stdout
        assert report["protocol"] == "nanochat" and "(nanochat protocol; 8 tasks, 72 items" in result.stdout
        assert (out / "results.csv").read_text().splitlines()[-1].startswith("nanochat,CORE,")
        assert [r["items"] for r in report["tasks"]] == [9] * 8
        outputs.append((report["tasks"], report["core"], report["val_bpb"], report["val_bpb_tokens"],
                        (out / "items.jsonl").read_text(), (out / "results.csv").read_text()))
    assert outputs[0] == outputs[1]
    tok = Tokenizer.load(demo / "tokenizer")
    rows = val_rows(demo / "demo" / "pretrain", tok, 5000, 256)  # BOS-led rows as in training
    targets = rows[:, 1:]
    assert rows.shape == (20, 257) and outputs[0][3] == int(((targets != -1) & (targets != tok.bos_id)).sum())


def test_a_library_error_stops_the_script_with_its_one_line_message(demo, tmp_path, capsys):
    code, _, err = run_in_process(E.main, ["--checkpoint", demo / "core_runs" / "r", "--bundle", tmp_path], capsys,
                                  stage="core_eval.py")
    assert code == 1 and err == f"core_eval.py: error: --bundle {tmp_path}: no core.yaml in it or below: a " \
        f"bundle holds core.yaml, eval_meta_data.csv and eval_data/\n"


def test_a_tokenizer_the_checkpoint_was_not_trained_with_is_refused(demo, tmp_path, capsys):
    def refusal(tokenizer):  # in-process: the refusal comes before any evaluation
        code, _, err = run_in_process(E.main, ["--checkpoint", demo / "core_runs" / "r", "--tokenizer", tokenizer],
                                      capsys, stage="core_eval.py")
        assert code == 1
        return err
    other = train_tokenizer(P.iter_texts(demo / "demo" / "pretrain", "train", max_chars=2_000_000), 1024)  # other merges
    other.save(tmp_path / "other")
    err = refusal(tmp_path / "other")
    assert err.startswith("core_eval.py: error: tokenizer") and "is not the one" in err and "was trained with" in err
    small = train_tokenizer(P.iter_texts(demo / "demo" / "pretrain", "val"), 512)
    small.save(tmp_path / "small")
    assert "has 512 tokens, the model" in (err := refusal(tmp_path / "small")) and "has 1024" in err


def test_a_trained_model_beats_chance_on_the_demo_tasks(learned, demo, capsys):
    """conftest's model (1 layer, 100 steps, about a minute) against the untrained one, both scored here (in this
    process) as speedrun.sh's core_eval stage scores a run (its CORE_ARGS), on all 513 items, in the dtype the run
    trained in (its meta.json: the precision the pretraining stage chose), which its val bpb below was computed in."""
    run_dir, _ = learned
    newest = checkpoint.list_checkpoints(run_dir / "ckpt")[-1]
    dtype = json.loads((newest / "meta.json").read_text())["hparams"]["dtype"]
    scores = {}
    for name, path in (("trained", run_dir), ("untrained", demo / "core_runs" / "r")):
        out = demo / f"score_{name}"
        code, _, err = run_in_process(E.main, ["--checkpoint", path, "--max_new_tokens", "8", "--out", out,
                                               "--bpb_tokens", "20000", "--dtype", dtype], capsys,
                                      stage="core_eval.py")
        assert code == 0, err[-3000:]
        scores[name] = json.loads((out / "results.json").read_text())
    assert scores["trained"]["checkpoint"] == str(newest)  # a run: its newest
    trained, untrained = scores["trained"], scores["untrained"]
    assert trained["complete"] and sum(t["items"] for t in trained["tasks"]) == 513
    # chance: each MC/schema task's centered accuracy has a spread of ~0.07 over its 57-90 items, so the mean of 8
    # tasks ~0.025 around 0. Measured (nanochat protocol): trained 0.45, untrained -0.005.
    assert trained["core"] > 0.06 and untrained["core"] < 0.04, (trained["core"], untrained["core"])
    # the validation bits per byte pretrain.py reported at the end of training: one function, the same tokens (not
    # bitwise: that run used 2 threads, this one 1)
    assert trained["val_bpb"] == pytest.approx(json.loads((run_dir / "done.json").read_text())["val_bpb"], rel=1e-6)


def test_val_bpb_equals_a_direct_computation(demo_world):
    tok = Tokenizer.load(demo_world / "tokenizer")
    docs = list(P.iter_texts(demo_world / "demo" / "pretrain", "val"))
    rows = val_rows(demo_world / "demo" / "pretrain", tok, 3000, 100)
    first = tok.encode(docs[0])[:100]
    assert rows.shape == (30, 101) and (rows[:, 0] == tok.bos_id).all()  # BOS-led, like every training row
    assert rows[0, 1:1 + len(first)].tolist() == first  # the oldest piece, the split's first document, opens row 0
    torch.manual_seed(0)
    model = build_model(config_from_preset("tiny", {"n_layer": 1, "n_embd": 64, "n_head": 2, "n_kv_head": 2,
                                                   "sequence_len": 100}))
    bpb, scored = train_loop.val_bpb(model, rows, tok.token_bytes, 7, "float32", 0, 1, torch.device("cpu"))
    nats = nbytes = n = 0
    with torch.no_grad():
        for row in rows:
            logp = torch.log_softmax(model(row[None, :-1])[0], -1)
            for pos, target in enumerate(row[1:].tolist()):
                if target not in (tok.bos_id, -1):
                    nats -= logp[pos, target].item()
                    nbytes += len(tok.enc.decode_single_token_bytes(target))  # not token_bytes: independent
                    n += 1
    assert scored == n and bpb == pytest.approx(nats / (nbytes * math.log(2)), rel=1e-5)


def test_download_only_fetches_and_checks_the_bundle_without_a_checkpoint(server, tmp_path, monkeypatch, capsys):
    """What speedrun.sh runs at the start, in the background: the bundle cached and its tasks loaded; a bad URL is an
    error before any training (here a 404)."""
    monkeypatch.setattr(E, "CACHE_DIR", tmp_path)
    server["files"]["/eval_bundle.zip"] = bundle_zip()
    E.main(["--download_only", "--bundle", server["url"] + "/eval_bundle.zip"])
    assert "bundle: 3 tasks, 19 items in " in capsys.readouterr().out
    assert len(server["log"]) == 1
    with pytest.raises(RuntimeError, match="404"):
        E.main(["--download_only", "--bundle", server["url"] + "/missing.zip"])


def test_a_line_per_task_as_it_ends_with_items_accuracy_centered_and_seconds(tasks, capsys):
    """What a person watching speedrun.sh's log sees during a long evaluation: each task's line when it ends, with
    the figures the results hold; nothing without progress (the library's default)."""
    results = E.evaluate_tasks(controlled_model(), BYTES, tasks, -1, 3, "float32", 0, 1, torch.device("cpu"),
                               progress=True)
    lines = capsys.readouterr().out.splitlines()
    rows, _ = E.summarize(tasks, results)
    assert len(lines) == 3
    for line, row in zip(lines, rows):
        figures = re.escape(f"{row['items']} items  acc {row['accuracy']:.4f}  centered {row['centered']:+.4f}")
        assert re.fullmatch(rf"core_eval: {row['task']} +{figures}  \d+\.\d s", line), line
    E.evaluate_tasks(controlled_model(), BYTES, tasks, -1, 3, "float32", 0, 1, torch.device("cpu"))
    assert capsys.readouterr().out == ""
