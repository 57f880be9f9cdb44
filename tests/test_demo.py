"""The demo world: deterministic, in the corpus / SmolTalk / CORE layouts, consistent with its tables, varied, and its
evaluation phrasings never seen in training."""
import csv
import itertools
import json
import re
from collections import Counter

import pyarrow.parquet as pq
import pytest

from dataset import chat_format, chat_rows
from decode import calculate
from demo import (
    ANIMALS,
    COLOURS,
    COUNTRIES,
    DAYS,
    DEMO_ASSISTANT_NAME,
    HARD_PROBLEMS,
    MONTHS,
    PROBLEMS,
    RL_PROBLEMS,
    number_word,
    write_demo,
)

CAPITAL = {row[0]: row[1] for row in COUNTRIES}
COUNTRY_OF = {row[1]: row[0] for row in COUNTRIES}
KEYS = {"multiple_choice": {"query", "choices", "gold"}, "schema": {"context_options", "continuation", "gold"},
        "language_modeling": {"context", "continuation"}}


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    out = tmp_path_factory.mktemp("demo0")
    return out, write_demo(out, seed=0)


@pytest.fixture(scope="module")
def docs(demo):
    return [t for path in sorted((demo[0] / "pretrain").glob("*.parquet"))
            for t in pq.read_table(path).column("text").to_pylist()]


@pytest.fixture(scope="module")
def chats(demo):
    return [m for split in ("train", "val")
            for m in pq.read_table(demo[0] / "conversations" / f"{split}.parquet").column("messages").to_pylist()]


def read_core_yaml(path):
    """The plain-text subset write_demo emits: `- key: value` opens an item, `  key: value` continues it."""
    tasks = []
    for line in path.read_text().splitlines()[1:]:
        key, value = line.strip().removeprefix("- ").split(": ", 1)
        if line.startswith("- "):
            tasks.append({})
        tasks[-1][key] = value
    return tasks


def eval_items(demo):
    bundle = demo[0] / "eval_bundle"
    for task in read_core_yaml(bundle / "core.yaml"):
        lines = (bundle / "eval_data" / task["dataset_uri"]).read_text().splitlines()
        yield task, [json.loads(line) for line in lines]


def all_files(root):
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_same_seed_same_bytes_other_seed_differs(demo, tmp_path):
    again, other = tmp_path / "again", tmp_path / "other"
    assert write_demo(again, seed=0) == demo[1]
    first = all_files(demo[0])
    assert len(first) > 10 and all_files(again) == first
    write_demo(other, seed=1)
    changed = [name for name, data in all_files(other).items() if first.get(name) != data]
    assert any(name.startswith("pretrain/") for name in changed)
    assert any(name.startswith("conversations/") for name in changed)


def test_pretrain_shards_are_in_the_corpus_layout(demo, docs):
    shards = sorted((demo[0] / "pretrain").glob("*.parquet"))
    assert [p.name for p in shards] == [f"shard_{i:05d}.parquet" for i in range(len(shards))] and len(shards) >= 3
    rows = []
    for path in shards:
        meta = pq.ParquetFile(path).metadata
        assert pq.ParquetFile(path).schema_arrow.names == ["text"]
        groups = [meta.row_group(i).num_rows for i in range(meta.num_row_groups)]
        assert all(n == 1024 for n in groups[:-1]) and 0 < groups[-1] <= 1024
        assert meta.row_group(0).column(0).compression == "ZSTD"
        rows.append(meta.num_rows)
    assert rows[-1] < rows[0]  # the validation shard, last
    assert demo[1]["documents"] == len(docs) == sum(rows)
    assert demo[1]["characters"] == sum(map(len, docs))
    assert 4_000_000 <= demo[1]["characters"] <= 8_000_000
    assert "Quiz" not in "".join(docs)


def test_conversations_are_in_the_smoltalk_schema(demo, chats):
    for split in ("train", "val"):
        assert pq.read_schema(demo[0] / "conversations" / f"{split}.parquet").names == ["messages"]
    assert len(chats) == demo[1]["conversations"] >= 2000
    for messages in chats:
        assert set(messages[0]) == {"role", "content"}
        turns = messages[1:] if messages[0]["role"] == "system" else messages
        assert turns and len(turns) % 2 == 0
        assert [m["role"] for m in turns] == ["user", "assistant"] * (len(turns) // 2)
        assert all(m["content"] for m in messages)
    multi = [m for m in chats if len(m) >= 5]
    assert len(multi) > 200 and any(m[0]["role"] == "system" for m in chats)
    identity = [m for m in chats if any(DEMO_ASSISTANT_NAME in x["content"] for x in m if x["role"] == "assistant")]
    assert len(identity) > 100


def test_capital_statements_in_documents_agree_with_the_table(docs):
    text = "\n".join(docs)
    forward = [r"\bcapital(?: city)? of ([A-Z]\w+) is ([A-Z]\w+)", r"\b([A-Z]\w+)'s capital is ([A-Z]\w+)"]
    backward = [r"\b([A-Z]\w+) is the capital(?: city)? of ([A-Z]\w+)\b(?!\?)",  # not "What is the capital of X?"
                r"\b([A-Z]\w+), (?:which is )?the capital of ([A-Z]\w+)"]
    pairs = [m.groups() for p in forward for m in re.finditer(p, text)]
    pairs += [m.groups()[::-1] for p in backward for m in re.finditer(p, text)]
    assert len(pairs) > 5000
    assert {country for country, _ in pairs} == set(CAPITAL)
    wrong = [(country, capital) for country, capital in pairs if CAPITAL.get(country) != capital]
    assert not wrong, wrong[:5]


def test_conversation_answers_about_capitals_agree_with_the_table(chats):
    checked = 0
    for messages in chats:
        for user, answer in itertools.pairwise(messages):
            if user["role"] != "user" or "capital" not in user["content"]:
                continue
            words = set(re.findall(r"[A-Z]\w+", user["content"]))
            countries, capitals = sorted(words & set(CAPITAL)), sorted(words & set(COUNTRY_OF))
            if len(countries) == 1 and not capitals:
                assert CAPITAL[countries[0]] in answer["content"], (user, answer)
                checked += 1
            if len(capitals) == 1 and not countries:
                assert COUNTRY_OF[capitals[0]] in answer["content"], (user, answer)
                checked += 1
    assert checked > 200


def test_eval_bundle_is_in_the_core_formats(demo):
    bundle = demo[0] / "eval_bundle"
    tasks = read_core_yaml(bundle / "core.yaml")
    files = sorted(str(p.relative_to(bundle / "eval_data")) for p in (bundle / "eval_data").rglob("*.jsonl"))
    assert sorted(t["dataset_uri"] for t in tasks) == files and 5 <= len(tasks) <= 8
    with open(bundle / "eval_meta_data.csv", newline="") as f:
        meta = {row["Eval Task"]: row for row in csv.DictReader(f)}
    assert {t["icl_task_type"] for t in tasks} == set(KEYS)
    for task, items in eval_items(demo):
        assert task["label"] in meta and float(meta[task["label"]]["Random baseline"]) >= 0
        assert task["continuation_delimiter"] == '" "' and re.fullmatch(r"\[\d+\]", task["num_fewshot"])
        assert int(task["num_fewshot"][1:-1]) < len(items) and len(items) >= 50
        assert demo[1]["eval_items"][task["label"]] == len(items)
        for item in items:
            assert set(item) == KEYS[task["icl_task_type"]]
            options = item.get("choices", item.get("context_options"))
            if options is not None:
                assert 0 <= item["gold"] < len(options) and len(set(options)) == len(options) >= 2
                expected = 100 / len(options)
                assert float(meta[task["label"]]["Random baseline"]) == pytest.approx(expected, abs=0.01)
            else:
                assert float(meta[task["label"]]["Random baseline"]) == 0


def test_eval_gold_answers_agree_with_the_table(demo):
    items = {task["label"]: items for task, items in eval_items(demo)}
    for item in items["demo_capitals_mc"]:
        country = next(c for c in CAPITAL if re.search(rf"\b{c}\b", item["query"]))
        assert item["choices"][item["gold"]] == CAPITAL[country]
    for item in items["demo_capital_schema"]:
        assert CAPITAL[item["continuation"].rstrip(".")] in item["context_options"][item["gold"]]


def test_eval_phrasings_never_occur_in_training_data(demo, docs, chats):
    corpus = "\x00".join(docs + [m["content"] for messages in chats for m in messages])
    for task, items in eval_items(demo):
        for item in items:
            # a context absent from the corpus cannot occur there followed by its delimiter and continuation either
            for s in item.get("context_options", [item.get("query", item.get("context"))]):
                assert s not in corpus, (task["label"], s)


@pytest.fixture(scope="module")
def tasks(demo):
    """{source: [conversation]} of choice/, answers/, calc/, lookup/, problems/, read as the loaders read them."""
    return {name: [c for g in range(pq.ParquetFile(demo[0] / name / "train.parquet").num_row_groups)
                   for c in chat_rows(demo[0] / name / "train.parquet", g)]
            for name in ("choice", "answers", "calc", "lookup", "problems", "problems_rl")}


def test_task_sources_have_the_hub_sets_shapes_and_agree_with_the_tables(demo, tasks):
    assert {name: chat_format(demo[0] / name / "train.parquet") for name in tasks} == {
        "choice": "mmlu", "answers": "messages", "calc": "gsm8k", "lookup": "mmlu", "problems": "gsm8k",
        "problems_rl": "gsm8k"}
    assert {name: len(rows) for name, rows in tasks.items()} == {
        **dict.fromkeys(["choice", "answers", "calc", "lookup"], 3000), "problems": 3360, "problems_rl": 3000}
    letters = {"A": 0, "B": 0, "C": 0, "D": 0}
    for user, assistant in tasks["choice"]:
        letters[assistant["content"]] += 1
        match = re.search(r"capital of (\w+)", user["content"])
        if match and match.group(1) in CAPITAL:  # the lettered choice is the table's capital
            assert f"- {CAPITAL[match.group(1)]}={assistant['content']}\n" in user["content"]
    assert min(letters.values()) > 600  # the gold letter is spread over A-D
    for user, assistant in tasks["answers"]:
        assert len(assistant["content"].split()) <= 2 and assistant["content"] in set(itertools.chain(*COUNTRIES)) | {
            a for row in ANIMALS for a in map(str, row)} | set(COLOURS) | set(DAYS) | set(MONTHS)
    for user, assistant in tasks["calc"]:  # every annotated result is the calculator's, and the reply ends on it
        parts = assistant["content"]
        calls = [(a["text"], b["text"]) for a, b in itertools.pairwise(parts) if a["type"] == "python"]
        assert calls and all(calculate(expr) == result for expr, result in calls)
        said = parts[-1]["text"].lower()
        assert parts[-1]["type"] == "text" and (calls[-1][1] in said or number_word(int(calls[-1][1])) in said)


def content_text(content):
    """An assistant message's text without its tool calls: the string, or its text parts joined."""
    return content if isinstance(content, str) else "".join(p["text"] for p in content if p["type"] == "text")


def test_chat_eval_questions_are_held_out_and_agree_with_the_table(demo, docs, chats, tasks):
    corpus = "\x00".join(docs + [m["content"] for messages in chats for m in messages] +
                         [content_text(m["content"]) for rows in tasks.values() for messages in rows
                          for m in messages])
    for task in ("demo-choice", "demo-answer", "demo-words", "demo-problems"):
        items = [json.loads(line) for line in (demo[0] / "chat_eval" / f"{task}.jsonl").read_text().splitlines()]
        assert len(items) == demo[1]["chat_eval_items"][task] >= 100
        for item in items:  # neither the question nor its opening words (the template) occur in training; a word
            # problem is held out by its numbers and names, its template is taught
            assert item["question"] not in corpus, item
            assert task == "demo-problems" or " ".join(item["question"].split()[:5]) not in corpus, item
            if "seat of" in item["question"]:
                country = item["question"].rstrip(".?").split()[-1]
                assert (item["choices"][item["gold"]] if "choices" in item else item["answers"][0]) == CAPITAL[country]


def test_a_model_answering_one_letter_scores_demo_choice_s_chance_whichever_letter(demo):
    items = [json.loads(line) for line in (demo[0] / "chat_eval" / "demo-choice.jsonl").read_text().splitlines()]
    for letter in range(4):  # ChatCORE centers demo-choice on 0.25
        assert sum(item["gold"] == letter for item in items) / len(items) == 0.25


def test_documents_are_varied(docs):
    sentences = {s for doc in docs for s in re.split(r"(?<=[.!?])\s+", doc)}
    assert len(sentences) > 20_000
    forms = {country: set() for country in CAPITAL}
    for s in sentences:
        words = set(re.findall(r"[A-Z]\w+", s))
        for country in sorted(words & set(CAPITAL)):
            if CAPITAL[country] in words:
                forms[country].add(re.sub(rf"\b{CAPITAL[country]}\b", "<CAP>", re.sub(rf"\b{country}\b", "<C>", s)))
    assert min(len(f) for f in forms.values()) >= 5


def test_lookup_rows_letter_the_option_they_name(tasks):
    letters = {"A": 0, "B": 0, "C": 0, "D": 0}
    for user, assistant in tasks["lookup"]:
        letters[assistant["content"]] += 1
        named = re.search(r"(?:is|Find|Pick) (\w+)", user["content"].split("\n")[0]).group(1)
        assert f"- {named}={assistant['content']}\n" in user["content"]
        assert user["content"].count(f"- {named}=") == 1  # the named option is there once
    assert min(letters.values()) > 600


def test_conversations_leave_sums_to_the_calculator(chats, tasks):
    """No conversation answers a sum without the calculator (that taught the chat model to guess at sums in new
    words); calc/ asks them in many phrasings, with numbers past ten."""
    assert not any(re.search(r"\b(plus|minus|times)\b", m["content"]) for messages in chats for m in messages
                   if m["role"] == "user")
    questions = [user["content"] for user, _ in tasks["calc"]]
    assert max(int(n) for q in questions for n in re.findall(r"\d+", q)) > 50
    assert len({re.sub(r"\d+|[a-z]+-?[a-z]*ty|\b(?:one|two|three|four|five|six|seven|eight|nine|ten|zero)\b", "N", q)
                for q in questions}) > 100


def test_demo_words_asks_sums_in_words_no_training_row_uses(demo):
    items = [json.loads(line) for line in (demo[0] / "chat_eval" / "demo-words.jsonl").read_text().splitlines()]
    sums = [it for it in items if re.search(r"\d", it["question"])]
    assert len(sums) == 20
    for item in sums:
        x, y = map(int, re.findall(r"\d+", item["question"]))
        expected = x + y if ("plus" in item["question"] or "total" in item["question"]) else \
            max(x, y) - min(x, y)
        assert item["answers"] == [str(expected)], item


def test_word_problems_are_worked_by_the_calculator_to_their_answer_with_the_worlds_legs(demo, tasks):
    """Every step's call is the calculator's result, each step uses the results before it, '#### N' is the last
    result, a step on an animal's legs uses the table's legs, and every problem has 2 to 5 operations. Held out: the
    plain, hard and RL forms in turn (none trained on); SFT's set has 300 hard and 60 of RL's forms, RL's 1,000 hard and 2,000 of RL's forms."""
    legs = {row[1]: row[4] for row in ANIMALS}
    held_out = [json.loads(line) for line in (demo[0] / "chat_eval" / "demo-problems.jsonl").read_text().splitlines()]
    train = pq.read_table(demo[0] / "problems" / "train.parquet").to_pylist()
    for_rl = pq.read_table(demo[0] / "problems_rl" / "train.parquet").to_pylist()
    assert len(train) == 3360 and len({r["question"] for r in train}) == 3360
    assert len(for_rl) == 3000 and len({r["question"] for r in for_rl}) == 3000
    assert not {r["question"] for r in train} & {r["question"] for r in for_rl + held_out}
    assert not {r["question"] for r in for_rl} & {r["question"] for r in held_out}

    def form(row):  # the kind of template it was asked from: its words, in order (a distractor may come between)
        for kind, templates in (("rl", RL_PROBLEMS), ("hard", HARD_PROBLEMS), ("plain", PROBLEMS)):
            for question, _ in templates:
                words = [w for part in re.split(r"\{\w+\}", question) for w in part.split(". ") if w.strip()]
                if re.search(".*".join(re.escape(w) for w in words), row["question"]):
                    return kind
        return None
    assert [form(r) for r in held_out] == ["plain", "hard", "rl"] * 40
    assert Counter(map(form, train)) == {"plain": 3000, "hard": 300, "rl": 60}
    assert Counter(map(form, for_rl)) == {"rl": 2000, "hard": 1000}
    for row in train + for_rl + held_out:
        calls = re.findall(r"<<([^=<>]+)=(\d+)>>\2", row["answer"])
        assert 2 <= len(calls) <= 5 and len(calls) == row["answer"].count("<<"), row
        assert all(calculate(expr) == value for expr, value in calls), row
        assert row["answer"].endswith(f"\n#### {calls[-1][1]}")
        if "legs" in row["question"]:
            steps = re.findall(r"The (\w+) have \d+ \* (\d+)", row["answer"])
            assert steps and all(legs[animal] == int(n) for animal, n in steps), row
    assert sum("legs" in r["question"] for r in held_out) > 5
    chat = dict(zip(("user", "assistant"), tasks["problems"][0], strict=True))
    assert chat["user"]["content"] == train[0]["question"]
    assert [p["type"] for p in chat["assistant"]["content"]][:3] == ["text", "python", "python_output"]


def test_core_eval_s_demo_knowledge_prompts_are_facts_of_the_demo_world():
    """core_eval.py states four demo facts as literals (a stage imports no other stage): each is the tables' fact."""
    from core_eval import KNOWLEDGE
    from demo import country_fields
    aldora, brenia = map(country_fields, COUNTRIES[:2])
    expected = [(f"The capital of {aldora['c']} is", [aldora["cap"]]),
                (f"The national animal of {brenia['c']} is the", [brenia["ani"]]),
                (f"The day after {DAYS[1]} is", [DAYS[2]]), ("Two plus three is", [number_word(5), "5"])]
    assert [(prompt, answers) for prompt, answers, world in KNOWLEDGE if world == "demo"] == expected
