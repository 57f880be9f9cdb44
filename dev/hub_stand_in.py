"""A stand-in for the Hugging Face hub (and the CORE bundle's URL) that serves every repository the gpu plan reads,
in the real repositories' file layouts, schemas and row-group structure, with generated English text:

    python dev/hub_stand_in.py --port 8765         # then, in another shell, the lines it prints:
    HF_ENDPOINT=http://127.0.0.1:8765 CORE_ARGS="--bundle http://127.0.0.1:8765/eval_bundle.zip" \\
        bash speedrun.sh --rehearse --gpus 2

It speaks the hub's protocol as huggingface_hub uses it: the tree API (/api/datasets/<repo>/tree/main, every file
with its size and sha256 or git blob id), and resolve URLs (/datasets/<repo>/resolve/main/<path>) that redirect
parquet files (LFS) to a "CDN" path with X-Linked-Etag/X-Linked-Size, as the hub does. Every answer about a repo's
file, HEAD or GET, the redirect and what it points to, carries X-Repo-Commit, an ETag, Content-Length and for LFS files
X-Linked-Etag and X-Linked-Size: huggingface_hub 1.x follows a redirect to the same host name (the "CDN" is another
port of this one) and refuses an answer without X-Repo-Commit. What it serves:

- karpathy/fineweb-edu-100b-shuffle: shard_00000.parquet ... (the last one is the validation shard), one string
  column `text`, row groups of 1024 documents (dataset.py's layout; the real shards hold many more row groups). Each
  shard names every one of 64,000 made-up places (a few sentences a document), so that any one shard alone trains the
  gpu plan's 65,536-token vocabulary (a few seconds), as the rehearsal's tokenizer does on the first shard;
- HuggingFaceTB/smoltalk (data/all/train-*, test-*: `messages`, `source`), HuggingFaceH4/ultrachat_200k (data/
  train_sft-*, test_sft-*, train_gen-*, test_gen-*: `prompt`, `prompt_id`, `messages`);
- cais/mmlu (all/auxiliary_train-* whose one column `train` nests the rows, all/test-*, all/dev-*, all/validation-*,
  and per-subject configs), allenai/ai2_arc (ARC-Easy and ARC-Challenge, train/validation/test), openai/gsm8k (main
  and socratic, train/test; answers with <<expr=result>> calculator annotations and "#### N"), openai/
  openai_humaneval (task_id, prompt, canonical_solution, test, entry_point: each canonical solution passes its test);
- /eval_bundle.zip: the CORE bundle in nanochat's layout (eval_bundle/core.yaml, eval_meta_data.csv, eval_data/
  <category>/<task>.jsonl) with its 22 task names, types and few-shot counts, each task's items generated.
The identity conversations are no download: prepare.py writes them from identity.json.

Tests import it (build_files, start, hub_handler, ...): one server per test, on a free port."""
import argparse
import hashlib
import io
import json
import random
import re
import socket
import struct
import sys
import threading
import time
import zipfile
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace
from urllib.parse import unquote, urlsplit

import pyarrow as pa
import pyarrow.parquet as pq

FINEWEB = "karpathy/fineweb-edu-100b-shuffle"
ROW_GROUP_DOCS = 1024  # FineWeb-Edu's shards as nanochat repackaged them (dataset.py writes the same)
COMMIT = "c0ffee" * 6 + "c0ff"  # the X-Repo-Commit every resolve answer carries, as the hub's do
STALL_S = 1.0  # how long a "stall" fault keeps the socket silent; test_prepare sets the read timeout below it

# -----------------------------------------------------------------------------
# English text: sentences of a small school-book vocabulary, so a tokenizer learns real words and merges

SUBJECTS = ["the river", "a teacher", "the sun", "every plant", "the old bridge", "a young student", "the ocean",
            "our planet", "the small village", "a careful scientist", "the library", "each cell", "the mountain",
            "a busy farmer", "the wind", "the museum", "a good book", "the human heart", "the city council",
            "the first engine", "a honey bee", "the moon", "the forest", "a clear map"]
VERBS = ["carries", "explains", "warms", "needs", "connects", "studies", "shapes", "protects", "feeds", "measures",
         "holds", "changes", "follows", "shows", "moves", "supports", "describes", "collects", "builds", "reaches"]
OBJECTS = ["fresh water", "the lesson", "the green fields", "light and air", "two towns", "the history of the region",
           "the coast", "many animals", "the whole family", "the temperature", "old letters", "energy from food",
           "the seasons", "a long road", "the weather", "simple machines", "the rules of grammar", "useful tools",
           "the night sky", "small stones", "new ideas", "the local market"]
ENDINGS = ["every day", "in the spring", "for many years", "during the winter", "with great care", "near the school",
           "after the rain", "across the valley", "before the harvest", "in most countries", "over time",
           "without any help"]
LINKS = ["This is why", "Because of this,", "In the same way,", "For example,", "As a result,", "Many people know that",
         "Students often learn that", "It is clear that"]
FACTS = [("What carries fresh water to the sea?", "The river carries fresh water to the sea."),
         ("Why do plants need light?", "Plants need light to make their food from air and water."),
         ("What does a teacher do?", "A teacher explains the lesson and helps students learn."),
         ("What warms our planet?", "The sun warms our planet and gives it light."),
         ("What does a honey bee collect?", "A honey bee collects nectar and pollen from flowers."),
         ("Where can you read old letters?", "You can read old letters in the library or the museum."),
         ("What does the heart do?", "The human heart moves blood through the whole body."),
         ("How does a map help?", "A clear map shows the roads, rivers and towns of a region.")]


def sentence(rng):
    words = f"{rng.choice(SUBJECTS)} {rng.choice(VERBS)} {rng.choice(OBJECTS)} {rng.choice(ENDINGS)}"
    if rng.random() < 0.3:
        words = f"{rng.choice(LINKS)} {words}"
    return words[0].upper() + words[1:] + "."


def paragraph(rng, low=3, high=9):
    return " ".join(sentence(rng) for _ in range(rng.randint(low, high)))


def document(rng):
    return "\n\n".join(paragraph(rng) for _ in range(rng.randint(1, 3)))


# Made-up place names: BPE merges a word's bytes into one token only if the word occurs, so a 65,536-token vocabulary
# needs about as many distinct words (the stand-in's sentences hold a few hundred). 64,000 names of 2-3 syllables
# allow ~70,000 merges (65,271 needed), in ~1.9 MB of text a shard: rustbpe trains 65,536 on one in ~2 s.
SYLLABLES = [c + v + n for c in "bcdfghklmnprstvz" for v in "aeiou" for n in ("", "n")]
PLACE_COUNT = 64_000
PLACE_SENTENCES = ["The old map names {}.", "Villages along the coast include {}.", "The museum keeps letters from {}.",
                   "Students on the trip visited {}.", "The long road passes {}."]


def place_names(count=PLACE_COUNT, seed=1):
    """count distinct capitalised made-up names, the same for a seed."""
    rng, seen, names = random.Random(seed), set(), []
    while len(names) < count:
        name = "".join(rng.choice(SYLLABLES) for _ in range(rng.randint(2, 3))).capitalize()
        if name not in seen:
            seen.add(name)
            names.append(name)
    return names


def place_sentences(rng, names, per_sentence=6):
    """Sentences naming each of `names` once."""
    lists = (names[i:i + per_sentence] for i in range(0, len(names), per_sentence))
    return " ".join(rng.choice(PLACE_SENTENCES).format(", ".join(group[:-1]) + " and " + group[-1]
                                                       if len(group) > 1 else group[0]) for group in lists)


def shard_texts(rng, docs, places):
    """A FineWeb-Edu shard's documents: generated English, each ending with a paragraph naming its share of every
    place (in an order of this shard's own)."""
    order = rng.sample(places, len(places))
    share = -(-len(order) // docs)
    return [f"{document(rng)}\n\n{place_sentences(rng, order[i * share:(i + 1) * share])}".rstrip()
            for i in range(docs)]


# -----------------------------------------------------------------------------
# The repositories' rows

def conversation(rng, turns):
    messages = []
    for _ in range(turns):
        question, answer = rng.choice(FACTS)
        messages += [{"content": question, "role": "user"},
                     {"content": f"{answer} {paragraph(rng, 1, 3)}", "role": "assistant"}]
    return messages


def mc_row(rng, i):
    """A multiple-choice question about the vocabulary: which word finishes the sentence."""
    subject, verb = rng.choice(SUBJECTS), rng.choice(VERBS)
    choices = rng.sample(OBJECTS, 4)
    return {"question": f"Which ending fits best? {subject[0].upper() + subject[1:]} {verb} ...", "choices": choices,
            "answer": i % 4}


def arc_row(rng, i, split):
    row = mc_row(rng, i)
    labels = list("ABCD") if i % 7 else list("1234")  # a few real ARC rows are labelled with digits
    return {"id": f"Mercury_{split}_{i:05d}", "question": row["question"],
            "choices": {"text": row["choices"], "label": labels}, "answerKey": labels[row["answer"]]}


def gsm8k_row(rng):
    a, b, c = rng.randint(2, 20), rng.randint(2, 9), rng.randint(1, 30)
    return {"question": f"A farmer has {a} baskets with {b} apples in each basket. He gives away {c} apples. "
                        f"How many apples does he have left?",
            "answer": f"He has {a} * {b} = <<{a}*{b}={a * b}>>{a * b} apples.\nAfter giving some away he has "
                      f"{a * b} - {c} = <<{a * b}-{c}={a * b - c}>>{a * b - c} apples.\n#### {a * b - c}"}


HUMANEVAL = [  # (signature, docstring, an example call and its value, canonical body, asserts on `candidate`)
    ("def add(a: int, b: int) -> int:", "Return the sum of a and b.", "add(2, 3)", "5", "return a + b",
     ["candidate(2, 3) == 5", "candidate(-1, 1) == 0", "candidate(10, 7) == 17"]),
    ("def count_vowels(text: str) -> int:", "Count the vowels in text.", "count_vowels('river')", "2",
     "return sum(c in 'aeiou' for c in text.lower())",
     ["candidate('river') == 2", "candidate('') == 0", "candidate('AEIOU') == 5"]),
    ("def largest(numbers: List[int]) -> int:", "The largest number.", "largest([1, 5, 3])", "5",
     "return max(numbers)", ["candidate([1, 5, 3]) == 5", "candidate([-2, -7]) == -2"]),
    ("def reverse_words(text: str) -> str:", "The words of text in reverse order.", "reverse_words('the old bridge')",
     "'bridge old the'", "return ' '.join(reversed(text.split()))",
     ["candidate('the old bridge') == 'bridge old the'", "candidate('sun') == 'sun'"]),
    ("def is_even(n: int) -> bool:", "Whether n is even.", "is_even(4)", "True", "return n % 2 == 0",
     ["candidate(4) is True", "candidate(7) is False", "candidate(0) is True"]),
    ("def square_all(numbers: List[int]) -> List[int]:", "Each number squared.", "square_all([1, 2, 3])", "[1, 4, 9]",
     "return [n * n for n in numbers]", ["candidate([1, 2, 3]) == [1, 4, 9]", "candidate([]) == []"]),
]


def humaneval_rows():
    """HumanEval's columns: the prompt is a signature and docstring, the test a check(candidate) function."""
    rows = []
    for i, (signature, doc, call, value, body, checks) in enumerate(HUMANEVAL):
        header = "from typing import List\n\n\n" if "List" in signature else ""
        prompt = f'{header}{signature}\n    """{doc}\n    >>> {call}\n    {value}\n    """\n'
        test = "\n\nMETADATA = {'author': 'stand-in', 'dataset': 'test'}\n\n\ndef check(candidate):\n" + \
               "".join(f"    assert {c}\n" for c in checks)
        rows.append({"task_id": f"HumanEval/{i}", "prompt": prompt, "canonical_solution": f"    {body}\n",
                     "test": test, "entry_point": re.match(r"def (\w+)", signature).group(1)})
    return rows


# The CORE bundle: nanochat's core.yaml (the DCLM "core" tasks): label, file under eval_data/, type, few-shot count,
# continuation delimiter (None: core.yaml gives none), and eval_meta_data.csv's category and random baseline (%)
CORE_TASKS = [
    ("hellaswag_zeroshot", "language_understanding/hellaswag.jsonl", "multiple_choice", 0, None, "language understanding", 25),
    ("jeopardy", "world_knowledge/jeopardy_all.jsonl", "language_modeling", 10, "\nAnswer: ", "world knowledge", 0),
    ("bigbench_qa_wikidata", "world_knowledge/bigbench_qa_wikidata.jsonl", "language_modeling", 10, None,
     "world knowledge", 0),
    ("arc_easy", "world_knowledge/arc_easy.jsonl", "multiple_choice", 10, "\nAnswer: ", "world knowledge", 25),
    ("arc_challenge", "world_knowledge/arc_challenge.jsonl", "multiple_choice", 10, "\nAnswer: ", "world knowledge", 25),
    ("copa", "commonsense_reasoning/copa.jsonl", "multiple_choice", 0, None, "commonsense reasoning", 50),
    ("commonsense_qa", "commonsense_reasoning/commonsense_qa.jsonl", "multiple_choice", 10, None,
     "commonsense reasoning", 20),
    ("piqa", "commonsense_reasoning/piqa.jsonl", "multiple_choice", 10, "\nAnswer: ", "commonsense reasoning", 50),
    ("openbook_qa", "commonsense_reasoning/openbook_qa.jsonl", "multiple_choice", 0, None, "commonsense reasoning", 25),
    ("lambada_openai", "language_understanding/lambada_openai.jsonl", "language_modeling", 0, None,
     "language understanding", 0),
    ("hellaswag", "language_understanding/hellaswag.jsonl", "multiple_choice", 10, None, "language understanding", 25),
    ("winograd", "language_understanding/winograd_wsc.jsonl", "schema", 0, None, "language understanding", 50),
    ("winogrande", "language_understanding/winogrande.jsonl", "schema", 0, None, "language understanding", 50),
    ("bigbench_dyck_languages", "symbolic_problem_solving/bigbench_dyck_languages.jsonl", "language_modeling", 10,
     None, "symbolic problem solving", 0),
    ("agi_eval_lsat_ar", "symbolic_problem_solving/agi_eval_lsat_ar.jsonl", "multiple_choice", 3, None,
     "symbolic problem solving", 25),
    ("bigbench_cs_algorithms", "symbolic_problem_solving/bigbench_cs_algorithms.jsonl", "language_modeling", 10, None,
     "symbolic problem solving", 0),
    ("bigbench_operators", "symbolic_problem_solving/bigbench_operators.jsonl", "language_modeling", 10, None,
     "symbolic problem solving", 0),
    ("bigbench_repeat_copy_logic", "symbolic_problem_solving/bigbench_repeat_copy_logic.jsonl", "language_modeling",
     10, None, "symbolic problem solving", 0),
    ("squad", "reading_comprehension/squad.jsonl", "language_modeling", 10, None, "reading comprehension", 0),
    ("coqa", "reading_comprehension/coqa.jsonl", "language_modeling", 0, None, "reading comprehension", 0),
    ("boolq", "reading_comprehension/boolq.jsonl", "multiple_choice", 10, "\nAnswer: ", "reading comprehension", 62),
    ("bigbench_language_identification", "language_understanding/bigbench_language_identification.jsonl",
     "multiple_choice", 10, None, "language understanding", 25),
]


def core_item(rng, kind, i):
    if kind == "multiple_choice":
        row = mc_row(rng, i)
        return {"query": row["question"], "choices": row["choices"], "gold": row["answer"]}
    if kind == "schema":  # the context varies, the continuation is shared
        subject, other = rng.sample(SUBJECTS, 2)
        return {"context_options": [f"{subject[0].upper() + subject[1:]} {rng.choice(VERBS)}",
                                    f"{other[0].upper() + other[1:]} {rng.choice(VERBS)}"],
                "continuation": f"{rng.choice(OBJECTS)} {rng.choice(ENDINGS)}.", "gold": i % 2}
    words = sentence(rng).rstrip(".").split()
    return {"context": " ".join(words[:-2]), "continuation": " " + " ".join(words[-2:])}


def bundle_zip(items_per_task=16, seed=0):
    """eval_bundle.zip as nanochat downloads it: eval_bundle/{core.yaml, eval_meta_data.csv, eval_data/...}."""
    rng = random.Random(seed)
    yaml = ["icl_tasks:"]
    meta = ["Eval Task,Task Category,Task Type,Random baseline"]
    data = {}
    for label, uri, kind, shots, delimiter, category, baseline in CORE_TASKS:
        yaml += [f"- label: {label}", f"  dataset_uri: {uri}", f"  num_fewshot: [{shots}]", f"  icl_task_type: {kind}"]
        if delimiter is not None:
            yaml.append(f"  continuation_delimiter: {json.dumps(delimiter)}")
        meta.append(f"{label},{category},{kind.replace('_', ' ')},{baseline}")
        if uri not in data:  # hellaswag and hellaswag_zeroshot share a file, as in the real bundle
            data[uri] = "".join(json.dumps(core_item(rng, kind, i)) + "\n" for i in range(items_per_task))
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as z:
        z.writestr("eval_bundle/core.yaml", "\n".join(yaml) + "\n")
        z.writestr("eval_bundle/eval_meta_data.csv", "\n".join(meta) + "\n")
        for uri, text in data.items():
            z.writestr(f"eval_bundle/eval_data/{uri}", text)
    return buf.getvalue()


def parquet_bytes(rows, row_group_size=None):
    """rows (dicts, or a pyarrow table) as a parquet file's bytes, zstd as the hub's are, in row groups of
    row_group_size rows (pyarrow's default: one)."""
    table = rows if isinstance(rows, pa.Table) else pa.Table.from_pylist(rows)
    buf = io.BytesIO()
    pq.write_table(table, buf, compression="zstd", row_group_size=row_group_size)
    return buf.getvalue()


def build_files(shards=10, shard_docs=1536, chat_rows=240, seed=0):
    """{"<repo>/<path>": bytes} of every repository, and "eval_bundle.zip". shards: FineWeb-Edu shards, the last
    one the validation shard; shard_docs documents each (1536: a full row group of 1024 and a partial one)."""
    rng = random.Random(seed)
    files, places = {}, place_names()
    for i in range(shards):
        texts = pa.table({"text": shard_texts(rng, shard_docs, places)})
        files[f"{FINEWEB}/shard_{i:05d}.parquet"] = parquet_bytes(texts, ROW_GROUP_DOCS)
    sources = ["smol-magpie-ultra", "everyday-conversations", "explore-instruct-rewriting"]
    for split, count, parts in (("train", chat_rows, 2), ("test", chat_rows // 4, 1)):
        for part in range(parts):
            rows = [{"messages": conversation(rng, rng.randint(1, 3)), "source": rng.choice(sources)}
                    for _ in range(count // parts)]
            files[f"HuggingFaceTB/smoltalk/data/all/{split}-{part:05d}-of-{parts:05d}.parquet"] = parquet_bytes(rows)
    for split, count in (("train_sft", chat_rows), ("test_sft", chat_rows // 4), ("train_gen", 16), ("test_gen", 8)):
        rows = []
        for _ in range(count):
            messages = conversation(rng, rng.randint(1, 3))
            prompt = messages[0]["content"]
            rows.append({"prompt": prompt, "prompt_id": hashlib.sha256(prompt.encode()).hexdigest(),
                         "messages": messages})
        files[f"HuggingFaceH4/ultrachat_200k/data/{split}-00000-of-00001-{COMMIT[:16]}.parquet"] = parquet_bytes(rows)
    subjects = ["abstract_algebra", "anatomy", "astronomy"]
    mmlu = {split: [{**mc_row(rng, i), "subject": subjects[i % 3]} for i in range(n)]
            for split, n in (("test", 60), ("validation", 12), ("dev", 15))}
    files["cais/mmlu/all/auxiliary_train-00000-of-00001.parquet"] = parquet_bytes(
        [{"train": {"answer": r["answer"], "choices": r["choices"], "question": r["question"], "subject": ""}}
         for r in (mc_row(rng, i) for i in range(chat_rows))])
    for split, rows in mmlu.items():
        files[f"cais/mmlu/all/{split}-00000-of-00001.parquet"] = parquet_bytes(rows)
        for subject in subjects:
            files[f"cais/mmlu/{subject}/{split}-00000-of-00001.parquet"] = parquet_bytes(
                [r for r in rows if r["subject"] == subject])
    for config in ("ARC-Easy", "ARC-Challenge"):
        for split, n in (("train", chat_rows // 2), ("validation", 20), ("test", 60)):
            files[f"allenai/ai2_arc/{config}/{split}-00000-of-00001.parquet"] = parquet_bytes(
                [arc_row(rng, i, split) for i in range(n)])
    for config in ("main", "socratic"):
        for split, n in (("train", chat_rows), ("test", 60)):
            files[f"openai/gsm8k/{config}/{split}-00000-of-00001.parquet"] = parquet_bytes(
                [gsm8k_row(rng) for _ in range(n)])
    files["openai/openai_humaneval/openai_humaneval/test-00000-of-00001.parquet"] = parquet_bytes(humaneval_rows())
    files["eval_bundle.zip"] = bundle_zip(seed=seed)
    return files


# -----------------------------------------------------------------------------
# The hub's protocol (also used by tests/test_prepare.py and tests/test_chat_eval.py, through tests/helpers.py)

def git_blob_id(data):
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def lfs_pointer(data):
    """The text git keeps for an LFS file: its tree entry's oid is this text's blob id."""
    return f"version https://git-lfs.github.com/spec/v1\noid sha256:{hashlib.sha256(data).hexdigest()}\nsize " \
           f"{len(data)}\n".encode()


def tree_entry(path, data):
    """A tree API entry as the hub sends it: parquet files are LFS (sha256 in lfs.oid), others are kept in git."""
    if path.endswith(".parquet"):
        pointer = lfs_pointer(data)
        lfs = {"oid": hashlib.sha256(data).hexdigest(), "size": len(data), "pointerSize": len(pointer)}
        return {"type": "file", "path": path, "size": len(data), "oid": git_blob_id(pointer), "lfs": lfs}
    return {"type": "file", "path": path, "size": len(data), "oid": git_blob_id(data)}


def repo_file_headers(handler, data, lfs):
    """What the hub sends with every answer about a repo's file (resolve HEAD and GET, the redirect and its target):
    the commit, and for an LFS file its sha256 and size (huggingface_hub 1.x reads them from whichever answer it stops
    at: it follows a redirect to the same host name, which the stand-in's "CDN" is)."""
    handler.send_header("X-Repo-Commit", COMMIT)
    if lfs:
        handler.send_header("X-Linked-Etag", f'"{hashlib.sha256(data).hexdigest()}"')
        handler.send_header("X-Linked-Size", str(len(data)))


def serve(hub, handler, name, repo_file=True):
    """Send hub.files[name], honouring Range, after applying the next queued fault for that file. repo_file: a
    repository's file (through its resolve URL, or the redirect's target), with the hub's headers (repo_file_headers;
    a git file's ETag is its blob id); else a plain URL's (the CORE bundle), with a CDN's MD5-like ETag."""
    data = hub.files[name]
    fault = hub.faults[name].pop(0) if hub.faults.get(name) else None
    if fault in ("500", "429"):
        handler.send_response(int(fault))
        handler.send_header("Retry-After", "0")
        handler.send_header("Content-Length", "0")
        handler.end_headers()
        return
    start, status = 0, 200
    match = re.fullmatch(r"bytes=(\d+)-", handler.headers.get("Range") or "")
    if match and fault != "norange":
        start, status = int(match.group(1)), 206
        if start >= len(data):
            handler.send_response(416)
            handler.send_header("Content-Length", "0")
            handler.end_headers()
            return
    body = data[start:]
    handler.send_response(status)
    handler.send_header("Content-Length", str(len(body)))
    handler.send_header("Accept-Ranges", "bytes")
    git_file = repo_file and not name.endswith(".parquet")
    # a git file's blob id, as the hub's resolve URL sends; else what a CDN sends: not the sha256
    handler.send_header("ETag", f'"{git_blob_id(data) if git_file else hashlib.md5(data).hexdigest()}"')
    if repo_file:
        repo_file_headers(handler, data, lfs=name.endswith(".parquet"))
    if status == 206:
        handler.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
    handler.end_headers()
    if handler.command == "HEAD":
        return
    if fault == "stall":  # headers, then silence past the client's read timeout
        time.sleep(STALL_S)
        return
    if fault == "flip":
        body = body[:len(body) // 2] + bytes([body[len(body) // 2] ^ 0xFF]) + body[len(body) // 2 + 1:]
    if fault == "garbage":
        body = random.Random(0).randbytes(len(body))
    if fault == "drop":  # half the body, then a reset (RST, not a clean close)
        handler.wfile.write(body[:len(body) // 2])
        handler.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        handler.connection.close()
        return
    if fault == "short":  # a clean close 100 bytes before the announced Content-Length
        body = body[:-100]
    handler.wfile.write(body)


def resolve_headers(hub, handler, name):
    """What the hub's resolve URL answers for a file, before any body: hf_hub_download's HEAD reads these."""
    data = hub.files[name]
    lfs = name.endswith(".parquet")
    if lfs:  # an LFS file: the hub redirects to the CDN and names the sha256 and size; its ETag is the pointer's
        handler.send_response(302)
        handler.send_header("Location", f"{hub.cdn_url}/cdn/{name}")
        handler.send_header("ETag", f'"{git_blob_id(lfs_pointer(data))}"')
        handler.send_header("Content-Length", "0")
    else:  # a small git file: served directly, its git blob id as ETag
        handler.send_response(200)
        handler.send_header("ETag", f'"{git_blob_id(data)}"')
        handler.send_header("Content-Length", str(len(data)))
    repo_file_headers(handler, data, lfs)
    handler.end_headers()


def hub_handler(hub):
    """A request handler for hub (files, faults, log, cdn_url): the tree API, resolve URLs, /cdn/<name> (the
    redirect target, also the bundle's /cdn/eval_bundle.zip) and /eval_bundle.zip."""
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def do_GET(self):
            path = unquote(urlsplit(self.path).path)
            hub.log.append(path)
            if m := re.fullmatch(r"/api/datasets/([^/]+/[^/]+)/tree/main", path):
                payload = json.dumps([tree_entry(p, d) for name, d in hub.files.items()
                                      for p in [name[len(m.group(1)) + 1:]] if name.startswith(m.group(1) + "/")])
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                return self.wfile.write(payload.encode()) if self.command == "GET" else None
            if (m := re.fullmatch(r"/datasets/([^/]+/[^/]+)/resolve/main/(.+)", path)) and \
                    "/".join(m.groups()) in hub.files:  # parquet files are LFS: a redirect to the "CDN"
                name = "/".join(m.groups())
                if self.command == "GET" and not name.endswith(".parquet"):  # a git file's body
                    return serve(hub, self, name)
                return resolve_headers(hub, self, name)
            if path in ("/eval_bundle.zip", "/cdn/eval_bundle.zip") and "eval_bundle.zip" in hub.files:
                return serve(hub, self, "eval_bundle.zip", repo_file=False)  # a plain URL, not a repo's file
            if path.startswith("/cdn/") and path[5:] in hub.files:
                return serve(hub, self, path[5:])
            self.send_response(404)
            self.send_header("Content-Length", "0")
            self.end_headers()

        do_HEAD = do_GET
    return Handler


def start(files=None, port=0, host="127.0.0.1"):
    """The hub on `port` and its "CDN" on a free port (huggingface_hub follows a redirect only within one origin: the
    hub's redirect to another is what tells it the file's sha256 and size), each in a daemon thread: (hub, servers,
    url). hub.files (default build_files()) can be changed while they run; hub.log lists every path asked for."""
    hub = SimpleNamespace(files=build_files() if files is None else files, faults={}, log=[])
    servers = [ThreadingHTTPServer((host, p), hub_handler(hub)) for p in (port, 0)]
    for server in servers:
        server.daemon_threads = True
        threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    url, hub.cdn_url = (f"http://{host}:{server.server_address[1]}" for server in servers)
    return hub, servers, url


def stop(servers):
    for server in servers:
        server.shutdown()
        server.server_close()


def main(argv=None):
    p = argparse.ArgumentParser(description="a stand-in hub serving every repository the gpu plan reads, generated")
    p.add_argument("--port", type=int, default=8765, help="port to listen on; 0 = any free one (default: %(default)s)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    p.add_argument("--shards", type=int, default=10, help="FineWeb-Edu shards, the last one for validation "
                   "(default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="seed of the generated text (default: %(default)s)")
    args = p.parse_args(argv)
    if args.shards < 2:
        p.error("--shards: at least 2 (training shards and the validation shard)")
    started = time.time()
    files = build_files(shards=args.shards, seed=args.seed)
    _, servers, url = start(files, args.port, args.host)
    repos = sorted({"/".join(name.split("/")[:2]) for name in files if name.count("/") >= 2})
    print(f"hub stand-in: {url} serves {len(files)} files ({sum(map(len, files.values())) / 1e6:.1f} MB, made in "
          f"{time.time() - started:.1f} s): {', '.join(repos)}, and the CORE bundle at {url}/eval_bundle.zip")
    print("point the gpu plan at it (identity comes from identity.json, no download):")
    print(f"  export HF_ENDPOINT={url} NO_PROXY={args.host} CORE_ARGS=\"--bundle {url}/eval_bundle.zip\"")
    print("  bash speedrun.sh --rehearse --gpus 2   # Ctrl-C here stops the stand-in", flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        stop(servers)
    return 0


if __name__ == "__main__":
    sys.exit(main())
