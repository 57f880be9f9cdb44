"""Does a chat checkpoint bind a letter to an option? For each of three item sets, the four letter probabilities at
the reply position (softmax over the item's letters only, as chat_eval.py's categorical scoring compares them):
letter accuracy, mean p(gold letter), the spread of the letter probabilities across items (the mean over letters of
their standard deviation across items: 0 when every item gets the same four probabilities), the predicted letters'
counts, and option-text accuracy (the option whose text, as the whole reply, has the highest mean log-probability).

    python dev/probe_letters.py --checkpoint runs/speedrun/sft --demo runs/speedrun/demo
    python dev/probe_letters.py --checkpoint runs/speedrun/midtrain --demo runs/speedrun/demo --n 66 --json out.json

Item sets: held_out (chat_eval/demo-choice.jsonl, the eval's items), sft_rows (the first N rows of choice/, which
midtraining and SFT train on), lookup ("Which option is X?" with X one of four names from the world's tables: no
knowledge needed, only the binding).
"""
import argparse
import json
import random
import sys
from pathlib import Path

import pyarrow.parquet as pq
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import checkpoint
from dataset import MC_LETTERS, render_mc
from demo import ANIMALS, COLOURS, COUNTRIES

LETTERS = MC_LETTERS[:4]


def lookup_items(n, seed=0):
    names = sorted({r[i] for r in COUNTRIES for i in (0, 1, 2)} | {a[0] for a in ANIMALS} | set(COLOURS))
    rng, items = random.Random(seed), []
    for _ in range(n):
        choices = rng.sample(names, 4)
        gold = rng.randrange(4)
        items.append({"question": f"Which option is {choices[gold]}?", "choices": choices, "gold": gold})
    return items


def item_sets(demo, n):
    held = [json.loads(line) for line in (Path(demo) / "chat_eval" / "demo-choice.jsonl").read_text().splitlines()]
    rows = pq.read_table(Path(demo) / "choice" / "train.parquet").to_pylist()[:n]
    sft = [{"question": r["question"], "choices": r["choices"], "gold": r["answer"]} for r in rows]
    return {"held_out": held[:n], "sft_rows": sft, "lookup": lookup_items(n)}


@torch.no_grad()
def probe(model, tok, items):
    letter_ids = [tok.encode(x)[0] for x in LETTERS]
    probs, text_right = [], 0
    for item in items:
        msgs = [{"role": "user", "content": render_mc(item["question"], LETTERS, item["choices"])}]
        ids = tok.render_for_completion(msgs)
        logits = model(torch.tensor([ids]), last_only=True)[0, -1]
        probs.append(torch.softmax(logits[letter_ids], -1))
        # option text as the reply: mean log-prob of its tokens after <|assistant_start|>
        scores = []
        for choice in item["choices"]:
            c = tok.encode(choice)
            out = torch.log_softmax(model(torch.tensor([ids + c[:-1]])), -1)[0, len(ids) - 1:]
            scores.append(out[torch.arange(len(c)), c].mean().item())
        text_right += max(range(4), key=scores.__getitem__) == item["gold"]
    p = torch.stack(probs)
    gold = torch.tensor([it["gold"] for it in items])
    pred = p.argmax(-1)
    return {"items": len(items), "letter_accuracy": round((pred == gold).float().mean().item(), 3),
            "p_gold": round(p[torch.arange(len(items)), gold].mean().item(), 3),
            "spread": round(p.std(0).mean().item(), 4),
            "predicted": {x: int((pred == i).sum()) for i, x in enumerate(LETTERS)},
            "option_text_accuracy": round(text_right / len(items), 3)}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", required=True, help="a checkpoint or a run directory (its newest checkpoint)")
    p.add_argument("--demo", required=True, help="the demo world directory (chat_eval/, choice/)")
    p.add_argument("--n", type=int, default=132, help="items per set (default: %(default)s)")
    p.add_argument("--tokenizer", default=None, help="the tokenizer directory (default: the one the checkpoint records)")
    p.add_argument("--threads", type=int, default=2, help="torch threads (default: %(default)s)")
    p.add_argument("--json", default=None, help="also append the results, as a JSON line, to this file")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    ckpt = checkpoint.find_checkpoint(args.checkpoint)
    model, meta = checkpoint.load_model(ckpt, torch.device("cpu"))
    tok, _ = checkpoint.checkpoint_tokenizer(meta, ckpt, args.tokenizer)
    results = {"checkpoint": str(ckpt)}
    for name, items in item_sets(args.demo, args.n).items():
        results[name] = probe(model, tok, items)
        print(name, json.dumps(results[name]), flush=True)
    if args.json:
        with open(args.json, "a") as f:
            f.write(json.dumps(results) + "\n")


if __name__ == "__main__":
    main()
