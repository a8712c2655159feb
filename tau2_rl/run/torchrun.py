"""What a training process can tell about its launcher from the environment (torchrun's stop grace).

``accelerate launch`` runs a multi-process config through torchrun. On a stop signal torchrun forwards SIGTERM to its
ranks and SIGKILLs them ``shutdown_timeout`` seconds later: 30 s by default, less than one GRPO step of a 7B policy,
so the rank's "finish the step, save, exit" (``run/stop.py``) needs it raised. torch reads it from
``PET_SHUTDOWN_TIMEOUT`` (its ``--shutdown_timeout`` flag, which ``accelerate launch`` does not pass on) or else
``TORCH_ELASTIC_SHUTDOWN_TIMEOUT``; the workers inherit the launcher's environment, so they can see the value too.
"""

from __future__ import annotations

import os

SHUTDOWN_TIMEOUT_ENV = "TORCH_ELASTIC_SHUTDOWN_TIMEOUT"
TORCHRUN_DEFAULT_SHUTDOWN_TIMEOUT_S = 30.0


def under_torchrun() -> bool:
    """Whether this process is a torchrun (torch elastic) worker."""
    return "TORCHELASTIC_RUN_ID" in os.environ


def torchrun_shutdown_timeout_s() -> float | None:
    """Seconds torchrun leaves its ranks between forwarding a stop signal and SIGKILL; None outside torchrun."""
    if not under_torchrun():
        return None
    for name in ("PET_SHUTDOWN_TIMEOUT", SHUTDOWN_TIMEOUT_ENV):
        value = os.environ.get(name, "").strip()
        if value:
            try:
                return float(value)
            except ValueError:
                return TORCHRUN_DEFAULT_SHUTDOWN_TIMEOUT_S  # torch itself would fail on it at launch
    return TORCHRUN_DEFAULT_SHUTDOWN_TIMEOUT_S
