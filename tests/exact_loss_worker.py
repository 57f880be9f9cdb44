"""Run under torchrun by tests/test_train.py: one optimizer step's forward and backward (common.forward_backward)
over this rank's half of a fixed global batch with masked targets, through DDP; rank 0 saves the loss and gradients."""
import sys
from argparse import Namespace

import torch
from test_train import global_batch, tiny_model

import common as C

if __name__ == "__main__":
    rank, local_rank, world, device = C.setup_distributed()
    model = tiny_model()
    train_model = C.wrap_model(model, Namespace(compile=False), world, local_rank, device)
    inputs, targets = global_batch()
    rows = len(inputs) // world
    micro = int(sys.argv[2])
    mine = [(inputs[s:s + micro], targets[s:s + micro]) for s in range(rank * rows, (rank + 1) * rows, micro)]
    loss_sum, count = C.forward_backward(train_model, mine, "float32", device, world)
    if rank == 0:
        torch.save({"loss": loss_sum / count, "grads": {n: p.grad for n, p in model.named_parameters()}}, sys.argv[1])
    C.teardown_distributed()
