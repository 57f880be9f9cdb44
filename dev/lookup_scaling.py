"""How the letter binding of multiple choice scales: a small model trained from scratch on pure lookup questions in
the chat eval's own format (nanochat's render_mc: "- option=letter" lines, "Which option is X?", the reply one
letter), loss on the reply letter only. Prints held-out letter accuracy at checkpoints along the way, for a model
shape; run it for several shapes to see what depth, width and steps buy.

    python dev/lookup_scaling.py --tokenizer runs/speedrun/tokenizer --n_layer 4 --n_embd 256 --steps 600
    python dev/lookup_scaling.py ... --names first   # options that differ in their first token
    python dev/lookup_scaling.py ... --two_first 1000 --lr_mult 3   # two options for 1,000 steps, then four;
                                                                    # embedding and head lrs x3

Names come from the demo world's tables (countries, capitals, languages, animals, colours); half of each table is
held out of training, so held-out accuracy measures the mechanism, not memorized names.
"""
import argparse
import json
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import optim
from dataset import render_mc
from demo import ANIMALS, COLOURS, COUNTRIES
from model import build_model, config_from_preset, num_params
from tokenizer import Tokenizer

LETTERS = "ABCD"


def name_pools(tok, first_token_distinct):
    names = sorted({r[i] for r in COUNTRIES for i in (0, 1, 2)} | {a[0] for a in ANIMALS} | set(COLOURS))
    rng = random.Random(0)
    rng.shuffle(names)
    return names[::2], names[1::2]


def example(rng, pool, tok, first_token_distinct, options=4):
    while True:
        choices = rng.sample(pool, options)
        firsts = {tok.encode(c)[0] for c in choices}
        if not first_token_distinct or len(firsts) == options:
            break
    gold = rng.randrange(options)
    msgs = [{"role": "user", "content": render_mc(f"Which option is {choices[gold]}?", LETTERS[:options], choices)},
            {"role": "assistant", "content": LETTERS[gold]}]
    ids, mask = tok.render_conversation(msgs)
    return ids, mask, gold


def dense_document(rng, pool, tok, first, queries=8):
    """Text (all tokens scored): a render_mc block answered, then more questions about the same options, each
    answered by its letter: ~8 letter targets per ~90 tokens instead of one per ~80."""
    while True:
        choices = rng.sample(pool, 4)
        if not first or len({tok.encode(c)[0] for c in choices}) == 4:
            break
    gold = rng.randrange(4)
    text = render_mc(f"Which option is {choices[gold]}?", LETTERS, choices) + f" {LETTERS[gold]}\n"
    for _ in range(queries - 1):
        g = rng.randrange(4)
        text += f"Which option is {choices[g]}? {LETTERS[g]}\n"
    return [tok.bos_id] + tok.encode(text)


def dense_batch(rng, pool, tok, n, first):
    rows = [dense_document(rng, pool, tok, first) for _ in range(n)]
    T = max(map(len, rows)) - 1
    x = torch.zeros(n, T, dtype=torch.long)
    y = torch.full((n, T), -1, dtype=torch.long)
    for i, ids in enumerate(rows):
        x[i, :len(ids) - 1] = torch.tensor(ids[:-1])
        y[i, :len(ids) - 1] = torch.tensor(ids[1:])
    return x, y


def batch(rng, pool, tok, n, first, options=4):
    rows = [example(rng, pool, tok, first, options) for _ in range(n)]
    T = max(len(r[0]) for r in rows) - 1
    x = torch.zeros(n, T, dtype=torch.long)
    y = torch.full((n, T), -1, dtype=torch.long)
    for i, (ids, mask, _) in enumerate(rows):
        ids = ids[:-1]  # drop <|assistant_end|>: only the letter is scored
        x[i, :len(ids) - 1] = torch.tensor(ids[:-1])
        y[i, len(ids) - 2] = ids[-1]
    return x, y


@torch.no_grad()
def accuracy(model, data, letter_ids):
    """Letter accuracy at every position whose target is one of letter_ids, the four competing (as chat_eval.py
    scores): the chat rows' one reply letter, or each " A".." D" answer in a dense document."""
    x, y = data
    logits = model(x)
    ids = torch.tensor(letter_ids)
    at = torch.isin(y, ids)
    pred = ids[logits[at][:, ids].argmax(-1)]
    return (pred == y[at]).float().mean().item()


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokenizer", required=True)
    p.add_argument("--n_layer", type=int, default=4)
    p.add_argument("--n_embd", type=int, default=256)
    p.add_argument("--n_head", type=int, default=4)
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--eval_every", type=int, default=100)
    p.add_argument("--names", default="any", choices=["any", "first"], help="first: options differ in their first "
                   "token")
    p.add_argument("--train", default="chat", choices=["chat", "dense"], help="chat: render_mc rows, loss on the "
                   "reply letter; dense: text documents of many lookups about one option list, every token scored "
                   "(evaluation is always the chat rows' reply letter)")
    p.add_argument("--matrix_lr", type=float, default=0.02)
    p.add_argument("--lr_mult", type=float, default=1.0, help="the embedding and head lrs times this")
    p.add_argument("--two_first", type=int, default=0, help="chat rows of two options (A, B) for this many steps, "
                   "then four")
    p.add_argument("--log_every", type=int, default=50, help="the mean training letter loss of the last N steps")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default=None, help="append a JSON line of the results here")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    tok = Tokenizer.load(args.tokenizer)
    first = args.names == "first"
    train_pool, held_pool = name_pools(tok, first)
    config = config_from_preset("tiny", {"n_layer": args.n_layer, "n_embd": args.n_embd, "n_head": args.n_head,
                                         "n_kv_head": args.n_head, "vocab_size": tok.vocab_size})
    model = build_model(config)
    sched = argparse.ArgumentParser()
    optim.add_schedule_args(sched)
    oargs = sched.parse_args([])
    oargs.matrix_lr = args.matrix_lr
    oargs.embedding_lr, oargs.head_lr = oargs.embedding_lr * args.lr_mult, oargs.head_lr * args.lr_mult
    oargs.muon_momentum_warmup = min(300, args.steps // 2)
    opts = optim.build_optimizers(model, oargs, args.n_embd, args.batch * 48, torch.device("cpu"))
    rng, erng = random.Random(args.seed), random.Random(1000)
    held = batch(erng, held_pool, tok, 200, first)
    seen = batch(erng, train_pool, tok, 200, first)
    letter_ids = [tok.encode(x)[0] for x in LETTERS]
    space_letter_ids = [tok.encode(" " + x)[0] for x in LETTERS]
    held_dense = dense_batch(erng, held_pool, tok, 64, first)
    seen_dense = dense_batch(erng, train_pool, tok, 64, first)
    held_two = batch(erng, held_pool, tok, 200, first, options=2)
    curve, t0, losses = [], time.time(), []
    for step in range(args.steps + 1):
        if step % args.eval_every == 0 or step == args.steps:
            model.eval()
            row = {"step": step, "held_out": round(accuracy(model, held, letter_ids), 3),
                   "train_names": round(accuracy(model, seen, letter_ids), 3),
                   "dense_held_out": round(accuracy(model, held_dense, space_letter_ids), 3),
                   "dense_train_names": round(accuracy(model, seen_dense, space_letter_ids), 3),
                   "held_out_two": round(accuracy(model, held_two, letter_ids[:2]), 3),
                   "seconds": round(time.time() - t0, 1)}
            model.train()
            curve.append(row)
            print(json.dumps(row), flush=True)
        if step == args.steps:
            break
        optim.apply_schedule(opts, step, args.steps, oargs)
        if args.train == "dense":
            x, y = dense_batch(rng, train_pool, tok, args.batch, first)
        else:
            x, y = batch(rng, train_pool, tok, args.batch, first, 2 if step < args.two_first else 4)
        loss = model(x, y)
        loss.backward()
        losses.append(loss.item())
        if (step + 1) % args.log_every == 0:
            print(json.dumps({"step": step + 1, "letter_loss": round(sum(losses) / len(losses), 4),
                              "options": 2 if step < args.two_first else 4}), flush=True)
            curve.append({"step": step + 1, "letter_loss": round(sum(losses) / len(losses), 4)})
            losses = []
        for o in opts:
            o.step()
            o.zero_grad(set_to_none=True)
    result = {"n_layer": args.n_layer, "n_embd": args.n_embd, "n_head": args.n_head, "params": num_params(config),
              "steps": args.steps, "batch": args.batch, "names": args.names, "train": args.train, "seed": args.seed,
              "matrix_lr": args.matrix_lr, "lr_mult": args.lr_mult, "two_first": args.two_first, "curve": curve}
    print(json.dumps({k: v for k, v in result.items() if k != "curve"}))
    if args.out:
        with open(args.out, "a") as f:
            f.write(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
