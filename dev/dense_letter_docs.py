"""Dense knowledge-to-letter practice for midtraining (a text source): each document is one render_mc option list of
4 countries' capitals (or languages, or animals), answered, then 7 more questions about the same options, each
answered by the bare letter on its own line (the same token as "=B" in the options and as the chat reply). The
phrasings are not chat_eval's ("Pick the city that serves as the seat of X.").

    python dev/dense_letter_docs.py runs/letters/dense_knowledge    # 4 shards of 2048 documents; the last is val
    python midtrain.py --checkpoint runs/speedrun/pretrain --source text:runs/letters/dense_knowledge:0.15 ...
"""
import random
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from dataset import render_mc
from demo import COUNTRIES

FIELDS = {1: "What is the capital of {c}?", 2: "Which language do people in {c} speak?", 5: "Which animal stands for {c}?"}
rng = random.Random(7)


def doc():
    field = rng.choice(list(FIELDS))
    rows = rng.sample(COUNTRIES, 4)
    if len({r[field] for r in rows}) < 4:
        return doc()
    opts = [r[field] for r in rows]
    g = rng.randrange(4)
    text = render_mc(FIELDS[field].format(c=rows[g][0]), "ABCD", opts) + "\n" + "ABCD"[g] + "\n"
    for _ in range(7):
        k = rng.randrange(4)
        text += FIELDS[field].format(c=rows[k][0]) + "\n" + "ABCD"[k] + "\n"
    return text


if __name__ == "__main__":
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    for i in range(4):
        pq.write_table(pa.table({"text": [doc() for _ in range(2048)]}), out / f"shard_{i:05d}.parquet")
    print(doc())
