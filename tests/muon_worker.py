"""For tests/test_train.py, run under torchrun by tests/two_rank_worker.py: optim.Muon under 2 gloo processes, where
each rank orthogonalizes its share of each shape's matrices and an all-gather shares them, against the same steps
with every matrix computed by this one process (divide_work=False). Same parameters and gradients on every rank, as
DDP leaves them: the parameters after 3 steps of each, in fp32 and bf16 Newton-Schulz, and how many matrices each
rank orthogonalized. Then it tears the process group down and lists the gloo threads left."""
import torch
import torch.distributed as dist
from helpers import threads_named

import distributed
import optim

SHAPES = [(64, 64)] * 5 + [(64, 256), (256, 64)] * 2 + [(12, 2)]  # square ones, an MLP pair of each way, a gate


def run(ns_dtype, divide_work, counted):
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(shape)) for shape in SHAPES]
    muon = optim.Muon([{"params": params}], lr=0.02, weight_decay=0.1, ns_dtype=ns_dtype, divide_work=divide_work)
    for step in range(3):
        for p in params:
            p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(step * 100 + p.numel()))
        muon.step()
    return [p.detach().clone() for p in params]


def results():
    counted = []
    original = optim.newton_schulz

    def counting(stack, steps, dtype):
        counted.append(stack.size(0))
        return original(stack, steps, dtype)
    optim.newton_schulz = counting
    torch.manual_seed(0)
    result = {"initial": [torch.randn(shape) for shape in SHAPES]}  # as run() draws them
    for ns_dtype in ("float32", "bfloat16"):
        counted.clear()
        result[f"divided {ns_dtype}"] = run(ns_dtype, True, counted)
        result[f"counted {ns_dtype}"] = sum(counted)
        counted.clear()
        result[f"alone {ns_dtype}"] = run(ns_dtype, False, counted)
    counts = [None] * dist.get_world_size()
    dist.all_gather_object(counts, result["counted float32"])
    result["counts per rank"] = counts
    optim.newton_schulz = original
    distributed.teardown_distributed()
    result["gloo threads after teardown"] = threads_named("gloo")  # none: the process group is gone, not at exit
    return result
