"""Does a chat model know its demo world when asked in plain words it was never taught as a template? Every country's
capital and national animal, asked in taught vocabulary but in phrasings no training row holds (checked here against
every document, conversation and task row of the world, as tests/test_demo.py checks chat_eval's questions), scored
by chat_eval.py as its demo-words task (a reply containing the answer is right).

    python dev/plain_words.py --demo runs/speedrun/demo --checkpoint runs/speedrun/sft

Writes --out (a copy of the world that links every file but chat_eval/demo-words.jsonl, which holds these questions)
and runs `chat_eval.py --demo <copy> --tasks demo-words` there; its line "demo-words: done, a/b right" is the figure.
"""
import argparse
import json
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from demo import COUNTRIES

TEMPLATES = [("What is the capital city of {c}?", 1), ("What is {c}'s capital?", 1),
             ("Tell me the national animal of {c}.", 5), ("What is {c}'s national animal?", 5)]


def strings(value):
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from strings(v)
    elif isinstance(value, list):
        for v in value:
            yield from strings(v)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--demo", required=True, help="the demo world the model was trained on (runs/<run>/demo)")
    p.add_argument("--checkpoint", required=True, help="the chat model: a checkpoint or its run directory")
    p.add_argument("--out", default="/tmp/plain_words", help="where the world's copy goes (default: %(default)s)")
    args = p.parse_args()
    demo, out = Path(args.demo), Path(args.out)
    corpus = "\x00".join(s for path in sorted(demo.rglob("*.parquet")) for row in pq.read_table(path).to_pylist()
                         for s in strings(row))
    # each country twice: its capital in one phrasing and its animal in one, the phrasings taken in turn
    items = [{"question": TEMPLATES[(i % 2) + 2 * k][0].format(c=row[0]), "answers": [row[TEMPLATES[2 * k][1]]]}
             for i, row in enumerate(COUNTRIES) for k in (0, 1)]
    seen = [it["question"] for it in items if it["question"] in corpus
            or " ".join(it["question"].split()[:5]) in corpus]
    if seen:
        sys.exit(f"these questions occur in {demo}'s training rows: {seen[:3]}; pick other phrasings")
    (out / "chat_eval").mkdir(parents=True, exist_ok=True)
    for path in demo.iterdir():
        if path.name != "chat_eval" and not (out / path.name).exists():
            (out / path.name).symlink_to(path.resolve())
    for path in (demo / "chat_eval").iterdir():
        if path.name != "demo-words.jsonl" and not (out / "chat_eval" / path.name).exists():
            (out / "chat_eval" / path.name).symlink_to(path.resolve())
    (out / "chat_eval" / "demo-words.jsonl").write_text("".join(json.dumps(it) + "\n" for it in items))
    print(f"{len(items)} questions, none in {demo}'s training rows, e.g. {items[0]['question']!r}", flush=True)
    root = Path(__file__).resolve().parent.parent
    sys.exit(subprocess.call([sys.executable, str(root / "chat_eval.py"), "--checkpoint", args.checkpoint, "--demo",
                              str(out), "--tasks", "demo-words", "--out", str(out / "chat_eval.json")]))


if __name__ == "__main__":
    main()
