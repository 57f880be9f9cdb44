"""Run under torchrun with 2 gloo processes by conftest.py's two_rank_results: the checks of tests/rl_worker.py,
tests/muon_worker.py and tests/fsdp_worker.py in one launch (each launch costs ~4.4 s of wall and 6 CPU-seconds on 2
cores). Muon's ends by tearing the process group down and counting the gloo threads left, which FSDP2's DeviceMesh would
keep alive (distributed.init_process_group), so FSDP2's checks run after it in a second process group. Rank 0 saves
{"rl": ..., "muon": ..., "fsdp": ...} to argv[1]."""
import sys

import fsdp_worker
import muon_worker
import rl_worker
import torch

import distributed


def main():
    rank, _, world, _ = distributed.setup_distributed()
    results = {"rl": rl_worker.results(rank, world), "muon": muon_worker.results()}
    rank, local_rank, world, device = distributed.setup_distributed()
    results["fsdp"] = fsdp_worker.results(rank, local_rank, world, device)
    if rank == 0:
        torch.save(results, sys.argv[1])


if __name__ == "__main__":
    sys.exit(distributed.run_main(main))  # as a stage ends: teardown, then os._exit
