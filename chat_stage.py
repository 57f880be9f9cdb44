"""What midtrain.py and sft.py share: their flags, chat validation and end (forgetting: the
pretraining val bpb their model kept); their start is checkpoint.py's. Not a stage; its command
line prints a checkpoint's forgetting figure:

    python chat_stage.py runs/<run> --bpb_tokens 20000
"""
import argparse
import json
import sys
from pathlib import Path

import torch

import checkpoint
import train_loop
from checkpoint import add_run_args
from dataset import SKIP_BAD_ROWS_HELP
from decode import ToolUse, decode, reply_text
from distributed import append_jsonl, is_sharded, run_main
from loader import chat_loader, val_rows
from model import autocast_context
from train_loop import dealt_sums, val_bpb

# -----------------------------------------------------------------------------
# Flags, validation and end

def add_chat_stage_args(parser, data, stage, parents, budgets, eval_every, lr_scale,
                        warmdown_frac, why):
    """The shared flags; `data`: the stage's data group."""
    data.add_argument("--val_chat_dir", default=None,
                      help="held-out conversations for the validation loss: a directory (its "
                      "test*/val* files) or a .jsonl file (default: the first chat source's "
                      "test*/val* files)")
    data.add_argument("--skip_bad_rows", action="store_true", help=SKIP_BAD_ROWS_HELP)
    train_loop.add_loader_threads_arg(data)
    train_loop.add_budget_args(
        parser.add_argument_group("budget: one of; given both, the last one is in force"), budgets)
    g = parser.add_argument_group("evaluation")
    g.add_argument("--eval_every", type=int, default=eval_every,
                   help="validation loss + greedy answers every N steps; 0 = only at the end "
                   "(default: %(default)s)")
    g.add_argument("--eval_rows", type=int, default=256,
                   help="validation rows of held-out conversations (default: %(default)s)")
    g.add_argument("--sample_prompt", action="append", default=None,
                   help=f"question answered greedily at every eval, repeatable (default: "
                   f"{CHAT_QUESTIONS})")
    add_run_args(parser, stage)
    add_forgetting_args(parser)
    train_loop.add_init_args(parser, parents, lr_scale=lr_scale, schedule="wsd",
                             warmdown_frac=warmdown_frac, why=why)


CHAT_QUESTIONS = ["What is the capital of France?", "How many legs does a spider have?",
                  "What is two plus three?", "Who are you?"]


def held_out_dir(val_chat_dir, first_source):
    """--val_chat_dir, else the first chat source's test*/val* files (a one-file source has
    none)."""
    if val_chat_dir:
        return val_chat_dir
    if first_source is None:
        raise ValueError("no chat source to hold conversations out of: pass --val_chat_dir")
    if Path(first_source).suffix in (".jsonl", ".parquet"):
        raise ValueError(f"{first_source} is one file of training conversations, none of them held "
                         "out for the validation loss: pass --val_chat_dir VAL.jsonl (other "
                         "conversations, in the same format) or a directory of test*/val* parquet "
                         "files")
    return first_source


def chat_val_batches(chat_dir, tokenizer, seq_len, max_rows, skip_bad_rows=False):
    """The first max_rows rows of held-out conversations, padded as sft.py packs them."""
    batches, rows = [], 0
    for inputs, targets in chat_loader(chat_dir, "val", tokenizer, 8, seq_len, max_epochs=1,
                                       threads=1, skip_bad_rows=skip_bad_rows):
        batches.append((inputs, targets))
        rows += len(inputs)
        if rows >= max_rows:
            break
    return batches


def chat_validation(model, tokenizer, batches, args, rank, world, device, run_dir, step):
    """Validation loss per supervised token over `batches` (the same on 1 or N processes), and
    greedy answers to --sample_prompt, printed and saved by rank 0."""
    def batch_sums(b):
        inputs, targets = (t.to(device) for t in batches[b])
        with autocast_context(device.type, args.dtype):
            loss_sum = model(inputs, targets, reduction="sum")
        return torch.stack([loss_sum.double().cpu(), (targets != -1).sum().double().cpu()])
    loss_sum, count = dealt_sums(model, len(batches), 2, rank, world, batch_sums)
    loss = loss_sum / max(count, 1)
    questions = args.sample_prompt or CHAT_QUESTIONS
    answers = None
    if rank == 0 or is_sharded(model):  # a sharded model is gathered by every rank
        answers = chat_answers(model, tokenizer, questions, args.dtype)
    if rank == 0:
        append_jsonl(run_dir / "samples.jsonl", *({"step": step, **a} for a in answers))
        print(f"eval step {step}: val loss {loss:.4f}; " + " | ".join(
            f"{a['question']!r} -> {a['answer']!r}" + ("" if a["ended"] else " [no end]")
            for a in answers))
    return {"val_loss": loss}


@torch.no_grad()
def chat_answers(model, tokenizer, questions, dtype, max_tokens=64):
    """Greedy answers to one-turn questions, with the calculator; "ended": whether
    <|assistant_end|> came."""
    end = tokenizer.special_id("<|assistant_end|>")
    prompts = [tokenizer.render_for_completion([{"role": "user", "content": q}])
               for q in questions]
    tools = [ToolUse(tokenizer) for _ in questions]
    budgets = [min(max_tokens, model.config.sequence_len - len(p)) for p in prompts]
    rows, _ = decode(model, prompts, budgets, dtype=dtype, tools=tools, stop={end},
                     compiled=False)  # a few samples: eager
    return [{"question": q, "answer": reply_text(tokenizer, row[:-1] if row[-1] == end else row),
             "ended": row[-1] == end,
             **({"calculator": [list(c) for c in t.calls]} if t.calls else {})}
            for q, row, t in zip(questions, rows, tools)]


# -----------------------------------------------------------------------------
# Forgetting: the pretraining val bpb of a chat stage's model

def add_forgetting_args(parser):
    g = parser.add_argument_group("forgetting")
    g.add_argument("--bpb_tokens", type=int, default=None,
                   help="at the end, this stage's model's val bpb on the first N tokens of the "
                   "pretraining run's val split, in its rows, so the stages compare; 0 = skip "
                   "(default: the pretraining run's --bpb_tokens)")


def forgetting(model, tokenizer, parent, parent_meta, args, rank, world, device):
    """Pretraining val_bpb of this model in the pretraining run's rows, for done.json; None
    with a note where it cannot be computed."""
    found = checkpoint.pretraining_run(parent, parent_meta)
    if args.bpb_tokens == 0:
        return {"val_bpb": None, "note": "skipped (--bpb_tokens 0)"}
    if found is None:
        return {"val_bpb": None, "note": f"unknown: the pretraining run of {parent} is not found "
                                         f"through its parents' meta.json"}
    data_dir, seq_len, eval_tokens = found
    tokens = args.bpb_tokens or eval_tokens
    if not tokens:
        return {"val_bpb": None, "note": "unknown: the pretraining run records no --bpb_tokens; "
                                         "pass --bpb_tokens"}
    if not Path(data_dir).is_dir():
        return {"val_bpb": None, "note": f"unknown: the pretraining corpus {data_dir} is not here"}
    rows = val_rows(data_dir, tokenizer, tokens, seq_len)
    bpb, scored = val_bpb(model, rows, tokenizer.token_bytes, 8, args.dtype, rank, world, device)
    return {"val_bpb": bpb, "tokens": scored, "data_dir": str(data_dir), "sequence_len": seq_len}


def forgetting_line(kept):
    if kept["val_bpb"] is None:
        return "pretraining val bpb: " + kept["note"]
    return (f"pretraining val bpb: {kept['val_bpb']:.4f} over {kept['tokens']:,} tokens of "
            f"{kept['data_dir']} (rows of {kept['sequence_len']} tokens)")


def finish(run_dir, step, figures, kept, done, lines):
    """Rank 0's end: final `figures` and `kept` into metrics.jsonl and done.json (`done`: only
    there), then `lines` and the done line."""
    loss = figures.pop("val_loss")
    append_jsonl(run_dir / "metrics.jsonl", {"step": step, "final_val_loss": loss, **figures,
                                             "pretrain_val_bpb": kept["val_bpb"]})
    (run_dir / "done.json").write_text(json.dumps(
        {"step": step, "val_loss": loss, **figures, **done, "pretrain_val_bpb": kept}))
    print("\n".join([forgetting_line(kept), *lines,
                     f"done: {step} steps, val loss {loss:.4f}, run dir {run_dir}"]))


def main(argv=None):
    parser = argparse.ArgumentParser(description="a checkpoint's val bpb on its pretraining "
                                     "corpus's val split, in that run's rows, in one process")
    parser.add_argument("checkpoint", nargs="?",
                        help="a step_* directory or a run directory (its newest) (default: the "
                        "newest checkpoint under --runs_dir)")
    parser.add_argument("--runs_dir", default="runs",
                        help="where runs live (default: %(default)s)")
    parser.add_argument("--dtype", default="float32", choices=["bfloat16", "float32"],
                        help="compute dtype (default: %(default)s)")
    add_forgetting_args(parser)
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    path = checkpoint.find_checkpoint(args.checkpoint, args.runs_dir)
    model, meta = checkpoint.load_model(path, device)
    tokenizer, _ = checkpoint.checkpoint_tokenizer(meta, path)
    kept = forgetting(model, tokenizer, path, meta, args, 0, 1, device)
    print(f"{path}: " + forgetting_line(kept))


if __name__ == "__main__":
    sys.exit(run_main(main))
