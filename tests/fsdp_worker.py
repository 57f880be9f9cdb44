"""Run under torchrun by tests/test_distributed.py: 20 steps of the shared loop's pieces (common.forward_backward,
gradient clipping, the optimizers, common.shard_model) on the same model and global batches, once through DDP and
once sharded by FSDP2: Muon and AdamW in fp32, Muon in bf16 (FSDP2's MixedPrecisionPolicy against DDP's autocast),
and FSDP2 with activation checkpointing; rank 0 saves every run's losses."""
import sys
from argparse import Namespace

import torch
from test_train import global_batch

import common as C
from model import GPTConfig, build_model

STEPS = 20


def losses(wrap, optimizer, dtype, rank, world, local_rank, device, activation_checkpointing=False):
    torch.manual_seed(0)
    model = build_model(GPTConfig(vocab_size=128, sequence_len=16, n_layer=2, n_embd=64, n_head=2, n_kv_head=2,
                                  activation_checkpointing=activation_checkpointing))
    args = Namespace(compile=False, fsdp="true" if wrap == "fsdp" else "false", optimizer=optimizer, adam8bit=False,
                     dtype=dtype, matrix_lr=0.02 if optimizer == "muon" else 0.003, embedding_lr=0.3, head_lr=0.004,
                     scalar_lr=0.5)
    C.shard_model(model, args, world, device)
    train_model = C.wrap_model(model, args, world, local_rank, device)
    optimizers = C.build_optimizers(model, args, 64, 8 * 16, device)
    inputs, targets = global_batch()
    rows = len(inputs) // world
    result = []
    for step in range(STEPS):
        mine = slice(rank * rows, (rank + 1) * rows)  # of the global batch rolled by the step: other rows each step
        batch = [(inputs.roll(step, 0)[mine], targets.roll(step, 0)[mine])]
        loss_sum, count = C.forward_backward(train_model, batch, dtype, device, world)
        C.clip_grad_norm(model.parameters(), 1.0)
        for opt in optimizers:
            opt.step()
        model.zero_grad(set_to_none=C.is_sharded(model))
        result.append((loss_sum / count).item())
    return result


if __name__ == "__main__":
    rank, local_rank, world, device = C.setup_distributed()
    runs = {f"{wrap} {optimizer} {dtype}": losses(wrap, optimizer, dtype, rank, world, local_rank, device)
            for optimizer, dtype in [("muon", "float32"), ("adamw", "float32"), ("muon", "bfloat16")]
            for wrap in ("ddp", "fsdp")}
    runs["fsdp muon float32 checkpointed"] = losses("fsdp", "muon", "float32", rank, world, local_rank, device, True)
    if rank == 0:
        torch.save(runs, sys.argv[1])
    C.teardown_distributed()
