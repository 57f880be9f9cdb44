"""Validation bits per byte on a corpus's val split (val_rows, val_bpb): pretrain.py's,
core_eval.py's, the chat stages' forgetting figure; the same on 1 or N processes (dealt_sums).
Not a stage; one command line, in one process:

    python validation.py --checkpoint runs/<run> --data_dir data/demo/pretrain     # its val bpb
"""
import argparse
import math
import sys

import torch

from checkpoint import add_checkpoint_args, checkpoint_tokenizer, load_model, pick_checkpoint
from distributed import all_reduce_tensor, is_sharded, run_main
from loader import text_loader
from model import autocast_context


def val_rows(data_dir, tokenizer, max_tokens, seq_len):
    """Validation rows of seq_len + 1 tokens for up to max_tokens targets, packed as training packs
    (one pass, one virtual rank): each starts with BOS (a window from mid-document scores tokens
    without their context), the same in every process and stage. A last, partly filled row has -1
    targets after its text."""
    n_rows = max(1, math.ceil(max_tokens / seq_len))
    loader = text_loader(data_dir, "val", tokenizer, min(n_rows, 64), seq_len, max_epochs=1, name=
                         "val")
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
    """(bits per byte, tokens scored) over val_rows, in batches of batch_rows (dealt_sums). Special
    (BOS) and -1 targets stand for no text: out of loss and bytes."""
    token_bytes = torch.as_tensor(token_bytes, device=device)

    def batch_sums(b):
        batch = rows[b * batch_rows:(b + 1) * batch_rows].to(device)
        # -1 padding would index out of the embedding; it follows the text and has -1 targets: any
        # id serves
        x, y = batch[:, :-1].clamp(min=0), batch[:, 1:]
        nbytes = token_bytes[y.clamp(min=0)] * (y != -1)
        text = nbytes > 0
        with autocast_context(device.type, dtype):
            losses = model(x, torch.where(text, y, -1), reduction="none")
        return torch.stack([losses.sum().double(), nbytes.sum().double(),
                            text.sum().double()]).cpu()
    nats, total_bytes, scored = dealt_sums(model, math.ceil(len(rows) / batch_rows), 3, rank, world,
                                           batch_sums)
    return nats / (math.log(2) * total_bytes), int(scored)


@torch.no_grad()
def dealt_sums(model, n_batches, width, rank, world, batch_sums):
    """The sums over batches of batch_sums(b) (`width` float64 sums of batch b, in eval mode), the
    batches dealt to the ranks round robin and summed in batch order after the all-reduce: bitwise
    the same on 1 or N processes. A sharded model's every forward needs every rank (a rank with one
    batch fewer would leave the others waiting in an all-gather): the rounds go up to a multiple of
    world, a rank past the last batch redoing one, not counted."""
    sums = torch.zeros(n_batches, width, dtype=torch.float64)
    was_training = model.training
    model.eval()
    for b in range(rank, math.ceil(n_batches / world) * world if is_sharded(model) else n_batches,
                   world):
        row = batch_sums(b % n_batches)
        if b < n_batches:
            sums[b] = row
    model.train(was_training)
    return all_reduce_tensor(sums).sum(0).tolist()


def main(argv=None):
    parser = argparse.ArgumentParser(description="a checkpoint's val bpb on a corpus's val split, "
                                     "in one process")
    add_checkpoint_args(parser, eval_dtype=True)
    parser.add_argument("--data_dir", required=True, help="the corpus")
    parser.add_argument("--bpb_tokens", type=int, default=2 ** 20,
                        help="its val split's first N tokens, in rows of the model's sequence_len "
                        "(default: %(default)s, as pretrain.py)")
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    path, _ = pick_checkpoint(args)
    model, meta = load_model(path, device)
    tokenizer, _ = checkpoint_tokenizer(meta, path, args.tokenizer)
    rows = val_rows(args.data_dir, tokenizer, args.bpb_tokens, model.config.sequence_len)
    bpb, scored = val_bpb(model, rows, tokenizer.token_bytes, 8, args.dtype, 0, 1, device)
    print(f"{path}: val bpb {bpb:.4f} over {scored:,} tokens of {args.data_dir}")

if __name__ == "__main__":
    sys.exit(run_main(main))
