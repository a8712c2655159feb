"""A two-rank job under torchrun in which rank 1 dies mid-run; rank 0's collective then fails (tests/test_sharded.py).

python -m torch.distributed.run --nproc_per_node 2 tests/lost_peer_probe.py
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from tau2_rl.run.cli import run_main  # noqa: E402


def main() -> None:
    dist.init_process_group("gloo")
    tensor = torch.ones(1)
    dist.all_reduce(tensor)  # both ranks are here
    if dist.get_rank() == 1:
        os._exit(3)  # dies without a word, as an OOM-killed rank does
    time.sleep(1)
    dist.all_reduce(tensor)  # rank 0: the peer is gone


if __name__ == "__main__":
    run_main(main)
