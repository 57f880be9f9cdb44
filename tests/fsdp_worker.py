"""Run under torchrun by tests/test_distributed.py: 20 steps of the shared loop's pieces (train_loop.forward_backward,
gradient clipping, the optimizers, train_loop.shard_model) on the same model and global batches, once through DDP and
once sharded by FSDP2: Muon in fp32 and bf16 (FSDP2's MixedPrecisionPolicy against DDP's autocast), AdamW in fp32
(FSDP2 with activation checkpointing). Also one step's loss and gradients through DDP with 2 micro-batches a rank
(no_sync accumulation) on test_train's masked global batch. After each run, greedy rows of the trained model through
decode.py (a sharded one is gathered whole first). Rank 0 saves it all."""
import sys
from argparse import Namespace

import torch
from helpers import global_batch, tiny_model

import distributed
import optim
import train_loop
from decode import decode
from model import GPTConfig, build_model

STEPS = 20
ROWS = {}  # each run's greedy rows after training


def losses(wrap, optimizer, dtype, rank, world, local_rank, device, activation_checkpointing=False):
    torch.manual_seed(0)
    model = build_model(GPTConfig(vocab_size=128, sequence_len=16, n_layer=1, n_embd=64, n_head=2, n_kv_head=2,
                                  activation_checkpointing=activation_checkpointing))
    args = Namespace(compile=False, fsdp="true" if wrap == "fsdp" else "false", optimizer=optimizer, adam8bit=False,
                     dtype=dtype, matrix_lr=0.02 if optimizer == "muon" else 0.003, embedding_lr=0.3, head_lr=0.004,
                     scalar_lr=0.5)
    train_loop.shard_model(model, args, world, device)
    train_model = train_loop.wrap_model(model, args, world, local_rank, device)
    optimizers = optim.build_optimizers(model, args, 64, 8 * 16, device)
    inputs, targets = global_batch()
    rows = len(inputs) // world
    result = []
    for step in range(STEPS):
        mine = slice(rank * rows, (rank + 1) * rows)  # of the global batch rolled by the step: other rows each step
        batch = [(inputs.roll(step, 0)[mine], targets.roll(step, 0)[mine])]
        loss_sum, count = train_loop.forward_backward(train_model, batch, dtype, device, world)
        train_loop.clip_grad_norm(model.parameters(), 1.0)
        for opt in optimizers:
            opt.step()
        model.zero_grad(set_to_none=distributed.is_sharded(model))
        result.append((loss_sum / count).item())
    ROWS[f"{wrap} {optimizer} {dtype}"] = decode(model, [[1, 2, 3], [4, 5, 6, 7, 8]], 8, dtype=dtype)[0]
    return result


def main():
    rank, local_rank, world, device = distributed.setup_distributed()
    runs = {f"{wrap} {optimizer} {dtype}": losses(wrap, optimizer, dtype, rank, world, local_rank, device,
                                                  activation_checkpointing=optimizer == "adamw" and wrap == "fsdp")
            for optimizer, dtype in [("muon", "float32"), ("muon", "bfloat16"), ("adamw", "float32")]
            for wrap in ("ddp", "fsdp")}
    model = tiny_model()
    train_model = train_loop.wrap_model(model, Namespace(compile=False), world, local_rank, device)
    inputs, targets = global_batch()
    rows = len(inputs) // world
    mine = [(inputs[s:s + 2], targets[s:s + 2]) for s in range(rank * rows, (rank + 1) * rows, 2)]
    loss_sum, count = train_loop.forward_backward(train_model, mine, "float32", device, world)
    if rank == 0:
        runs["rows"] = ROWS
        runs["one step"] = {"loss": loss_sum / count, "grads": {n: p.grad for n, p in model.named_parameters()}}
        torch.save(runs, sys.argv[1])


if __name__ == "__main__":
    sys.exit(distributed.run_main(main))  # as a stage ends: teardown, then os._exit
