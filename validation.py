"""Validation: bits per byte on a corpus's val split (val_rows, val_bpb: pretrain.py during training, core_eval.py on
a checkpoint), a chat stage's validation loss and greedy answers to a few questions (chat_validation), and how much
of its pretraining a chat stage's model kept (forgetting). Every figure is the same on 1 or N processes. Not a stage;
one command line, a checkpoint's forgetting figure (val bpb in its pretraining run's rows), in one process:

    python validation.py runs/<run> --bpb_tokens 20000
"""
import argparse
import math
import sys
from pathlib import Path

import torch

from calculator import ToolUse, reply_text
from checkpoint import checkpoint_tokenizer, find_checkpoint, load_model, pretraining_run
from common import append_jsonl
from decode import decode
from distributed import all_reduce_tensor, is_sharded, run_main
from loader import chat_loader, text_loader
from model import autocast_context

# -----------------------------------------------------------------------------
# Validation bits per byte, shared by pretrain.py (during training) and core_eval.py (on a checkpoint)

def val_rows(data_dir, tokenizer, max_tokens, seq_len):
    """Validation rows of seq_len + 1 tokens for up to max_tokens targets, packed as training packs (one pass, one
    virtual rank): each starts with BOS (a window from mid-document scores tokens without their context), the same in
    every process and stage. A last, partly filled row has -1 targets after its text."""
    n_rows = max(1, math.ceil(max_tokens / seq_len))
    loader = text_loader(data_dir, "val", tokenizer, min(n_rows, 64), seq_len, max_epochs=1, name="val")
    rows, have = [], 0
    try:
        for inputs, targets in loader:
            rows.append(torch.cat([inputs[:, :1], targets], dim=1))
            have += len(inputs)
            if have >= n_rows:
                break
    finally:
        loader.close()
    return torch.cat(rows)[:n_rows]


def val_bpb(model, rows, token_bytes, batch_rows, dtype, rank, world, device):
    """(bits per byte, tokens scored) over val_rows, in batches of batch_rows (dealt_sums). Special (BOS) and -1
    targets stand for no text: out of loss and bytes."""
    token_bytes = torch.as_tensor(token_bytes, device=device)

    def batch_sums(b):
        batch = rows[b * batch_rows:(b + 1) * batch_rows].to(device)
        # -1 padding would index out of the embedding; it follows the text and has -1 targets: any id serves
        x, y = batch[:, :-1].clamp(min=0), batch[:, 1:]
        nbytes = token_bytes[y.clamp(min=0)] * (y != -1)
        text = nbytes > 0
        with autocast_context(device.type, dtype):
            losses = model(x, torch.where(text, y, -1), reduction="none")
        return torch.stack([losses.sum().double(), nbytes.sum().double(), text.sum().double()]).cpu()
    nats, total_bytes, scored = dealt_sums(model, math.ceil(len(rows) / batch_rows), 3, rank, world, batch_sums)
    return nats / (math.log(2) * total_bytes), int(scored)


@torch.no_grad()
def dealt_sums(model, n_batches, width, rank, world, batch_sums):
    """The sums over batches of batch_sums(b) (`width` float64 sums of batch b, in eval mode), the batches dealt to
    the ranks round robin and summed in batch order after the all-reduce: bitwise the same on 1 or N processes. A
    sharded model's every forward needs every rank (a rank with one batch fewer would leave the others waiting in an
    all-gather): the rounds go up to a multiple of world, a rank past the last batch redoing one, not counted."""
    sums = torch.zeros(n_batches, width, dtype=torch.float64)
    was_training = model.training
    model.eval()
    for b in range(rank, math.ceil(n_batches / world) * world if is_sharded(model) else n_batches, world):
        row = batch_sums(b % n_batches)
        if b < n_batches:
            sums[b] = row
    model.train(was_training)
    return all_reduce_tensor(sums).sum(0).tolist()


# -----------------------------------------------------------------------------
# Chat validation: the loss per supervised token and greedy answers

CHAT_QUESTIONS = ["What is the capital of France?", "How many legs does a spider have?", "What is two plus three?",
                  "Who are you?"]


def held_out_dir(val_chat_dir, first_source):
    """Where a chat stage's held-out conversations are: --val_chat_dir, else its first chat source (its test*/val*
    files). A source that is one file (.jsonl) holds none: a ValueError that says to give them."""
    if val_chat_dir:
        return val_chat_dir
    if first_source is None:
        raise ValueError("no chat source to hold conversations out of: pass --val_chat_dir")
    if Path(first_source).suffix in (".jsonl", ".parquet"):
        raise ValueError(f"{first_source} is one file of training conversations, none of them held out for the "
                         f"validation loss: pass --val_chat_dir VAL.jsonl (other conversations, in the same format) "
                         f"or a directory of test*/val* parquet files")
    return first_source


def chat_val_batches(chat_dir, tokenizer, seq_len, max_rows, skip_bad_rows=False):
    """The first max_rows rows of a chat directory's held-out (test*/val*) conversations (or a .jsonl file's), padded
    whole as sft.py packs them, the same on every rank."""
    batches, rows = [], 0
    for inputs, targets in chat_loader(chat_dir, "val", tokenizer, 8, seq_len, max_epochs=1, threads=1,
                                       skip_bad_rows=skip_bad_rows):
        batches.append((inputs, targets))
        rows += len(inputs)
        if rows >= max_rows:
            break
    return batches


def chat_validation(args, s, batches, step):
    """A chat stage's evaluation (s: runs.start_stage's): the validation loss per supervised token over `batches`
    [(inputs, targets)] (dealt_sums: the same on 1 or N processes), and greedy answers to --sample_prompt (rank 0:
    printed and appended to samples.jsonl). Returns {"val_loss": the loss}."""
    def batch_sums(b):
        inputs, targets = (t.to(s.device) for t in batches[b])
        with autocast_context(s.device.type, args.dtype):
            loss_sum = s.model(inputs, targets, reduction="sum")
        return torch.stack([loss_sum.double().cpu(), (targets != -1).sum().double().cpu()])
    loss_sum, count = dealt_sums(s.model, len(batches), 2, s.rank, s.world, batch_sums)
    loss = loss_sum / max(count, 1)
    questions = args.sample_prompt or CHAT_QUESTIONS
    answers = chat_answers(s.model, s.tokenizer, questions, args.dtype) if s.rank == 0 or is_sharded(s.model) else None
    if s.rank == 0:
        append_jsonl(s.run_dir / "samples.jsonl", *({"step": step, **a} for a in answers))
        print(f"eval step {step}: val loss {loss:.4f}; " + " | ".join(
            f"{a['question']!r} -> {a['answer']!r}" + ("" if a["ended"] else " [no end]") for a in answers))
    return {"val_loss": loss}


@torch.no_grad()
def chat_answers(model, tokenizer, questions, dtype, max_tokens=64):
    """Greedy answers to one-turn questions, each up to <|assistant_end|> (whether it came is recorded), decoded
    together with the calculator on, as in chat.py (a sharded model gathered on every rank first: decode.py)."""
    end = tokenizer.special_id("<|assistant_end|>")
    prompts = [tokenizer.render_for_completion([{"role": "user", "content": q}]) for q in questions]
    tools = [ToolUse(tokenizer) for _ in questions]
    budgets = [min(max_tokens, model.config.sequence_len - len(p)) for p in prompts]
    rows, _ = decode(model, prompts, budgets, dtype=dtype, tools=tools, stop={end},
                     compiled=False)  # a few samples: eager (decode.py's docstring says why)
    return [{"question": q, "answer": reply_text(tokenizer, row[:-1] if row[-1] == end else row),
             "ended": row[-1] == end, **({"calculator": [list(c) for c in t.calls]} if t.calls else {})}
            for q, row, t in zip(questions, rows, tools)]


# -----------------------------------------------------------------------------
# Forgetting: the pretraining val bpb of a chat stage's model

def add_forgetting_args(parser):
    g = parser.add_argument_group("forgetting")
    g.add_argument("--bpb_tokens", type=int, default=None, help="at the end, the pretraining val bpb of this stage's "
                   "model on the first N tokens of the pretraining corpus's val split, in the rows the pretraining "
                   "run's final evaluation used, so the figures of the stages compare; 0 = skip (default: the "
                   "pretraining run's --bpb_tokens)")


def forgetting(model, tokenizer, parent, parent_meta, args, rank, world, device):
    """How much of its pretraining the stage's model kept: val_bpb in the pretraining run's rows and token count
    (unless --bpb_tokens), as a dict for done.json; val_bpb None with a note saying why where it cannot be computed."""
    found = pretraining_run(parent, parent_meta)
    if args.bpb_tokens == 0:
        return {"val_bpb": None, "note": "skipped (--bpb_tokens 0)"}
    if found is None:
        return {"val_bpb": None, "note": f"unknown: the pretraining run of {parent} is not found through its parents'"
                                         f" meta.json"}
    data_dir, seq_len, eval_tokens = found
    tokens = args.bpb_tokens or eval_tokens
    if not tokens:
        return {"val_bpb": None, "note": "unknown: the pretraining run records no --bpb_tokens; pass --bpb_tokens"}
    if not Path(data_dir).is_dir():
        return {"val_bpb": None, "note": f"unknown: the pretraining corpus {data_dir} is not here"}
    rows = val_rows(data_dir, tokenizer, tokens, seq_len)
    bpb, scored = val_bpb(model, rows, tokenizer.token_bytes, 8, args.dtype, rank, world, device)
    return {"val_bpb": bpb, "tokens": scored, "data_dir": str(data_dir), "sequence_len": seq_len}


def forgetting_line(kept):
    return "pretraining val bpb: " + (f"{kept['val_bpb']:.4f} over {kept['tokens']:,} tokens of {kept['data_dir']} "
                                      f"(rows of {kept['sequence_len']} tokens)" if kept["val_bpb"] is not None
                                      else kept["note"])


def main(argv=None):
    parser = argparse.ArgumentParser(description="a checkpoint's val bpb on the val split of the pretraining corpus it "
                                     "descends from, in that run's rows, in one process")
    parser.add_argument("checkpoint", nargs="?", help="a step_* directory or a run directory (its newest) (default: "
                        "the newest checkpoint under --runs_dir)")
    parser.add_argument("--runs_dir", default="runs", help="where runs live (default: %(default)s)")
    parser.add_argument("--dtype", default="float32", choices=["bfloat16", "float32"], help="compute dtype (default: "
                        "%(default)s)")
    add_forgetting_args(parser)
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    path = find_checkpoint(args.checkpoint, args.runs_dir)
    model, meta = load_model(path, device)
    tokenizer, _ = checkpoint_tokenizer(meta, path)
    print(f"{path}: " + forgetting_line(forgetting(model, tokenizer, path, meta, args, 0, 1, device)))


if __name__ == "__main__":
    sys.exit(run_main(main))
