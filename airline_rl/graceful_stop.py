"""A stop signal ends training cleanly: finish the current step, save a checkpoint, exit; a rerun resumes it.

``kill <accelerate pid>`` used to leave the training process running: the simple launcher dies at once and its
child is orphaned. So the training process asks the kernel for SIGTERM when its launcher dies
(``PR_SET_PDEATHSIG``, Linux), and on SIGTERM (or SIGUSR1) this callback makes the Trainer save and stop at
the end of the step. Processes agree on the stop (a max-reduce each step) so no rank waits in a collective alone.
The same stop often arrives twice: a signal to the whole process group (a terminal's ``kill %1``, the ablation driver,
SLURM's ``scancel``, systemd) reaches the trainer and its launcher, and the launcher's death (or torchrun's
forwarding) relays a second SIGTERM a moment later. So a repeated stop signal is not "stop now" (it used to be, and
killed the trainer mid-step in 3 of 4 group signals under load); Ctrl-C (SIGINT) or SIGKILL stop at once.
torchrun (multi-GPU) forwards SIGTERM to its workers itself but kills them after its own grace period (30 s by
default, ``TORCH_ELASTIC_SHUTDOWN_TIMEOUT``), which a long step exceeds: the callback warns once, naming the setting,
when a step takes more than half of it.
"""

from __future__ import annotations

import ctypes
import logging
import math
import signal
import time
from typing import Any

import torch
from transformers import TrainerCallback

from airline_rl.cli import _parent_is_accelerate_launcher
from airline_rl.launch_env import SHUTDOWN_TIMEOUT_ENV, torchrun_shutdown_timeout_s

logger = logging.getLogger(__name__)

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
PR_SET_PDEATHSIG = 1
EXIT_STOPPED = 128 + signal.SIGTERM  # the shell's convention for "terminated by SIGTERM"


def die_with_launcher(sig: int = signal.SIGTERM) -> bool:
    """Asks for ``sig`` when the parent (an ``accelerate launch`` process) dies; True when set up."""
    if not _parent_is_accelerate_launcher():
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


class GracefulStop(TrainerCallback):
    """Turns a stop signal into ``should_save`` + ``should_training_stop`` at the end of the current step."""

    def __init__(self, accelerator: Any = None) -> None:
        self.accelerator = accelerator
        self.signal_name: str | None = None
        self.stopped_at: int | None = None
        self._repeat_noted = False
        self.grace_s = torchrun_shutdown_timeout_s()  # None: no launcher kills us after a deadline
        self.grace_warning: str | None = None
        self._step_started = time.monotonic()

    def install(self) -> GracefulStop:
        self._previous = {sig: signal.signal(sig, self._handle) for sig in STOP_SIGNALS}
        die_with_launcher()
        return self

    def uninstall(self) -> None:
        """Restores the handlers that were there before (training is over: a signal acts as it did before)."""
        for sig, handler in getattr(self, "_previous", {}).items():
            signal.signal(sig, handler)
        self._previous = {}

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.uninstall()

    def _handle(self, signum: int, frame: Any) -> None:
        name = signal.Signals(signum).name
        if self.signal_name is not None:  # the same stop relayed by the launcher, or an impatient repeat
            if not self._repeat_noted:
                self._repeat_noted = True
                logger.warning("%s again: already stopping at the end of this step (Ctrl-C or SIGKILL stop at once)",
                               name)  # fmt: skip
            return
        self.signal_name = name
        logger.warning("%s received: saving a checkpoint at the end of this step, then stopping", name)

    def _agreed(self) -> bool:
        requested = self.signal_name is not None
        accelerator = self.accelerator
        if accelerator is None or accelerator.num_processes <= 1:
            return requested
        flag = torch.tensor([1.0 if requested else 0.0], device=accelerator.device)
        return bool(accelerator.reduce(flag, reduction="max").item() > 0)

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._step_started = time.monotonic()

    def check_grace(self, step_seconds: float) -> str | None:
        """The warning (once) when a stop could be killed by torchrun before the step ends and its checkpoint is
        saved: a signal early in a step needs about a whole step plus the save."""
        if self.grace_s is None or self.grace_warning is not None or step_seconds <= self.grace_s / 2:
            return None
        suggested = max(300, 60 * math.ceil(3 * step_seconds / 60))
        self.grace_warning = (
            f"a training step took {step_seconds:.0f} s but torchrun kills the ranks {self.grace_s:.0f} s after a "
            f"stop signal ({SHUTDOWN_TIMEOUT_ENV}): a SIGTERM would lose the step and its checkpoint; launch with "
            f"{SHUTDOWN_TIMEOUT_ENV}={suggested} (about three steps) to let it save"
        )
        return self.grace_warning

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        warning = self.check_grace(time.monotonic() - self._step_started)
        if warning is not None and getattr(state, "is_world_process_zero", True):
            logger.warning("%s", warning)
        if self._agreed():
            self.signal_name = self.signal_name or "a stop signal on another process"
            self.stopped_at = state.global_step
            control.should_save = True
            control.should_training_stop = True

    @property
    def stopped(self) -> bool:
        return self.stopped_at is not None


def train_or_stop(trainer: Any, checkpoint: str | None) -> Any:
    """``trainer.train`` that a stop signal ends cleanly: the checkpoint of the current step is saved, then the
    process exits with ``EXIT_STOPPED`` (no final model, no hub export: the run is not complete; a rerun resumes)."""
    stop = GracefulStop(trainer.accelerator).install()
    trainer.add_callback(stop)
    result = trainer.train(resume_from_checkpoint=checkpoint)
    if stop.stopped:
        logger.warning(
            "stopped by %s at step %d: checkpoint saved in %s; rerun the same command to resume",
            stop.signal_name,
            stop.stopped_at,
            trainer.args.output_dir,
        )
        raise SystemExit(EXIT_STOPPED)
    return result
