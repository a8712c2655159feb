"""OpenMP's wait policy for generation ahead (``--max_staleness`` ≥ 1), set before torch loads.

Why: torch's CPU kernels run on an OpenMP team, and libgomp's default keeps an idle team thread spinning for a while
after every parallel region. A training step is thousands of small ops with Python between them, so the trainer's
team spins through most of the step and holds every core, and the rollout worker that should be decoding beside it
gets a fraction of one: on 2 cores its generation took 2–3× as long as in the synchronous rollout, and generation
ahead ran slower than no overlap at all (48 episodes per step, scripted user: 0.72×). With ``OMP_WAIT_POLICY=PASSIVE``
an idle thread sleeps at once and the worker gets its core. Synchronous runs keep libgomp's default: their own
decoding is faster with spinning threads, as nothing else wants the cores.

libgomp reads the variable once, when torch loads it, so this runs first thing in ``train_grpo.py``, from the
command line alone: ``--max_staleness`` given as a flag or in the ``--config`` recipe. A value the user exported
is kept. Nothing here imports torch.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

VARIABLE = "OMP_WAIT_POLICY"


def _flag_value(argv: Sequence[str], flag: str) -> str | None:
    """The last value of ``flag`` (``--flag v`` or ``--flag=v``), as argparse would take it."""
    value = None
    for index, arg in enumerate(argv):
        if arg == flag and index + 1 < len(argv):
            value = argv[index + 1]
        elif arg.startswith(flag + "="):
            value = arg.split("=", 1)[1]
    return value


def requested_staleness(argv: Sequence[str]) -> int:
    """``--max_staleness`` from the flags, else from the ``--config`` recipe, else 0. Anything unreadable counts
    as 0: the real parser reports it, with its flag, a moment later."""
    value = _flag_value(argv, "--max_staleness")
    if value is None:
        path = _flag_value(argv, "--config")
        if path:
            try:
                import yaml

                with open(path, encoding="utf-8") as handle:
                    recipe = yaml.safe_load(handle)
                value = recipe.get("max_staleness") if isinstance(recipe, dict) else None
            except (OSError, yaml.YAMLError):
                value = None
    try:
        return int(value) if value is not None else 0
    except (TypeError, ValueError):
        return 0


def passive_waits_for_generation_ahead(argv: Sequence[str] | None = None) -> bool:
    """Sets ``OMP_WAIT_POLICY=PASSIVE`` when the run generates ahead and nothing set it yet; True if it did.

    Call it before anything imports torch (afterwards it would not take effect, so it does nothing). The rollout
    worker, a spawned process, inherits the variable."""
    argv = sys.argv[1:] if argv is None else argv
    if VARIABLE in os.environ or "torch" in sys.modules or requested_staleness(argv) < 1:
        return False
    os.environ[VARIABLE] = "PASSIVE"
    return True


def wait_policy_note() -> str | None:
    """Why a generation-ahead run may be slow, for its log: None when idle OpenMP threads sleep."""
    policy = os.environ.get(VARIABLE)
    if policy is not None and policy.strip().upper() == "PASSIVE":
        return None
    return (
        f"{VARIABLE} is {policy or 'unset'} in the trainer: its idle OpenMP threads spin and take the cores the "
        f"rollout worker decodes on (train_grpo.py sets PASSIVE before torch loads unless the variable is exported)"
    )
