"""DeepSpeed on a machine without a GPU (``accelerate_configs/cpu_zero{2,3}.yaml``): what such a launch needs.

DeepSpeed 0.19.8 runs ZeRO-2 and ZeRO-3 on its CPU accelerator over gloo through accelerate 1.15 (tests/
test_deepspeed_cpu.py), but only with two training flags that an accelerate config cannot carry:

1. ``--use_cpu false``: accelerate starts DeepSpeed only when ``use_cpu`` is off; with it on, a DeepSpeed config
   silently becomes plain DDP (``MULTI_CPU``: no ZeRO, no sharded checkpoint). Off, every tensor still stays on the
   CPU, since there is no GPU to move it to.
2. ``--ddp_backend gloo`` (unset by default): with no backend accelerate finds none for a CPU that is not
   ``use_cpu`` and counts one process per rank, while DeepSpeed counts two, and DeepSpeed's batch-size check
   fails when training starts, in a traceback ("train_batch_size is not equal to micro_batch_per_gpu *
   gradient_acc_step * world_size 8 != 8 * 1 * 2").

Both are refused here, in one line, before any model is loaded (for an accelerate config; ``--deepspeed <json>``,
which transformers starts without a backend, has not been run on CPU). Nothing here imports DeepSpeed.
"""

from __future__ import annotations

from typing import Any

FLAGS = "--use_cpu false --ddp_backend gloo"


class DeepSpeedLaunchError(ValueError):
    """A DeepSpeed launch on CPU that would not run ZeRO as asked; the message names the flag to pass."""


def deepspeed_cpu_problem(training_args: Any, cuda_available: bool) -> str | None:
    """Why this DeepSpeed launch (an accelerate config's) cannot run ZeRO on this GPU-less machine, or None (also
    None when a GPU is there, and for ``--deepspeed <json>``, which transformers starts without a backend: not run)."""
    if cuda_available or getattr(training_args, "deepspeed", None):
        return None
    if getattr(training_args, "use_cpu", False):
        return (
            f"a DeepSpeed accelerate config with --use_cpu true trains plain DDP, not ZeRO (accelerate starts "
            f"DeepSpeed only with use_cpu off); on a machine without a GPU pass {FLAGS}"
        )
    if getattr(training_args, "ddp_backend", None) is None:  # another backend (e.g. oneCCL's "ccl") is the user's
        return (
            f"DeepSpeed on CPU needs a process-group backend (--ddp_backend gloo): without one accelerate counts one "
            f"process per rank and DeepSpeed's batch-size check fails when training starts; pass {FLAGS}"
        )
    return None


def check_deepspeed_cpu_launch(training_args: Any) -> None:
    """Raises ``DeepSpeedLaunchError`` (one line) for a DeepSpeed launch on CPU that lacks ``FLAGS``."""
    import torch

    problem = deepspeed_cpu_problem(training_args, torch.cuda.is_available())
    if problem is not None:
        raise DeepSpeedLaunchError(problem)
