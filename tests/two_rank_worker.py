"""Run under torchrun with 2 gloo processes by conftest.py's two_rank_results: the checks of tests/rl_worker.py and
tests/muon_worker.py in one launch (a launch costs ~4.4 s of wall and 6 CPU-seconds on 2 cores). Muon's comes last: it
tears the process group down and lists the gloo threads left. (FSDP2's checks, tests/fsdp_worker.py, take a launch of
their own: its DeviceMesh keeps the process group's threads alive past the teardown, see
distributed.init_process_group, and a second process group in the same launch read the first one's stale addresses
from torchrun's store now and then.) Rank 0 saves {"rl": ..., "muon": ...} to argv[1]."""
import sys

import muon_worker
import rl_worker
import torch

import distributed


def main():
    rank, _, world, _ = distributed.setup_distributed()
    results = {"rl": rl_worker.results(rank, world), "muon": muon_worker.results()}
    if rank == 0:
        torch.save(results, sys.argv[1])


if __name__ == "__main__":
    sys.exit(distributed.run_main(main))  # as a stage ends: teardown (done by muon_worker already), then os._exit
