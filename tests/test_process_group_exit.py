"""A process that built a gloo group destroys it at a normal exit (``tau2_rl.run.start``), while the interpreter
is whole: leaving it to finalization aborted finished runs in CI (``terminate called without an active exception``)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

SCRIPT = """
import atexit, os, sys
import torch.distributed as dist
from tau2_rl.run.start import release_process_group_at_exit

def report():  # registered first, so it runs after the release (atexit runs last-in, first-out)
    print("initialized at exit:", dist.is_initialized(), flush=True)

atexit.register(report)
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1])
dist.init_process_group("gloo", rank=0, world_size=1)
release_process_group_at_exit()
release_process_group_at_exit()  # once per process, however many trainers it builds
dist.all_reduce(__import__("torch").ones(1))
"""


@pytest.mark.serial
def test_the_process_group_is_destroyed_before_the_interpreter_finalizes(tmp_path) -> None:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(port)], cwd=ROOT, capture_output=True, text=True,
                          timeout=120, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines() == ["initialized at exit: False"]


TWO_RANKS = """
import atexit, os, sys
from pathlib import Path
import torch, torch.distributed as dist
from tau2_rl.run.start import leave_distributed_run, release_process_group_at_exit

out = Path(sys.argv[1])
dist.init_process_group("gloo")
release_process_group_at_exit()
rank = dist.get_rank()
atexit.register(lambda: (out / f"atexit-{rank}").write_text("ran"))  # the run's own exit handlers still run
dist.all_reduce(torch.ones(1))
print(f"rank {rank} finished", flush=True)
leave_distributed_run()
(out / f"after-{rank}").write_text("not reached")  # a multi-process rank does not come back
"""


@pytest.mark.serial
def test_a_finished_rank_of_a_multi_process_run_runs_its_exit_handlers_and_leaves(tmp_path) -> None:
    script = tmp_path / "two_ranks.py"
    script.write_text(TWO_RANKS)
    env = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                           "29653", str(script), str(tmp_path)], cwd=ROOT, capture_output=True, text=True,
                          timeout=120, env=env)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert "rank 0 finished" in done.stdout and "rank 1 finished" in done.stdout
    assert sorted(p.name for p in tmp_path.iterdir() if p.name != "two_ranks.py") == ["atexit-0", "atexit-1"]
