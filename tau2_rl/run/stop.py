"""A stop signal ends training cleanly: finish the current step, save a checkpoint, exit; a rerun resumes it.

``kill <accelerate pid>`` used to leave the training process running: the simple launcher dies at once and its
child is orphaned. So the training process asks the kernel for SIGTERM when its launcher dies
(``PR_SET_PDEATHSIG``, Linux), and on SIGTERM (or SIGUSR1) this callback makes the Trainer save and stop at
the end of the step. Processes agree on the stop (a max-reduce each step) so no rank waits in a collective alone.
One stop often arrives more than once: a signal to the whole process group (a terminal's ``kill %1``, the ablation
driver, SLURM's ``scancel``, systemd) reaches the trainer and its launcher, and the launcher relays it (torchrun's and
``launch.py``'s forwarding, or its death). Its death alone can relay it twice: the kernel sends the parent-death
signal when the *thread* that started the trainer ends, and again at each re-parenting while the launcher's other
threads end (accelerate's launcher has two), so a single ``kill <accelerate pid>`` reached the trainer as two
SIGTERMs 4 ms apart on two busy cores. So every stop signal within ``RELAY_WINDOW_S`` of the first is that same stop
and says nothing; a later one is the user's second signal: one line, and not "stop now" for a SIGTERM (a repeated
SIGTERM used to be, and killed the trainer mid-step in 3 of 4 group signals under load).

Ctrl-C (SIGINT) is the same graceful stop the first time (it used to print two KeyboardInterrupt tracebacks, ~150
lines, and lose every step since the last checkpoint); a second Ctrl-C while stopping stops at once (one line, exit
130), as does SIGKILL. In a terminal a Ctrl-C goes to the whole foreground process group, so accelerate's simple
launcher would die of it at once (its own traceback, the shell's prompt back while the trainer still saves, and no
way to send the second Ctrl-C). So a training process started by ``accelerate launch`` in the foreground of a
terminal moves into its own process group and takes the terminal's foreground (``take_terminal_from_launcher``):
Ctrl-C then reaches the trainer only, and the launcher waits for it as usual; the foreground goes back to the
launcher's group when the process exits. (Ctrl-Z is declined with one line then: it would suspend the trainer alone,
behind the shell's back.)
torchrun (multi-GPU) forwards SIGTERM to its workers itself but kills them after its own grace period (30 s by
default, ``TORCH_ELASTIC_SHUTDOWN_TIMEOUT``), which a long step exceeds: the callback warns once, naming the setting,
when a step takes more than half of it.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import logging
import math
import os
import signal
import sys
import time
from collections.abc import Iterator
from typing import Any

import torch
from transformers import TrainerCallback

from tau2_rl.run.cli import _parent_is_accelerate_launcher, exit_with_line
from tau2_rl.run.torchrun import SHUTDOWN_TIMEOUT_ENV, torchrun_shutdown_timeout_s

logger = logging.getLogger(__name__)

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
PR_SET_PDEATHSIG = 1
EXIT_STOPPED = 128 + signal.SIGTERM  # the shell's convention for "terminated by SIGTERM"
EXIT_INTERRUPTED = 128 + signal.SIGINT  # "terminated by SIGINT": a second Ctrl-C
RELAY_WINDOW_S = 1.0
"""A stop signal this soon after the first is the same stop by another path (group, relay, parent death); a person's
second signal comes later."""
_terminal_taken = False


def take_terminal_from_launcher() -> bool:
    """Moves this process into its own process group and makes it the terminal's foreground group, when it was
    started by ``accelerate launch`` in the foreground of a terminal; True when done (see the module docstring).

    The launcher's group gets the foreground back when this process exits (``atexit``; after a SIGKILL the shell
    takes it back when the launcher, which waits for us, exits)."""
    global _terminal_taken
    if _terminal_taken or not _parent_is_accelerate_launcher():
        return False
    try:
        tty = os.open("/dev/tty", os.O_RDWR | os.O_NOCTTY)  # the controlling terminal, if there is one
    except OSError:
        return False
    launcher_group = os.getpgrp()
    try:
        if os.tcgetpgrp(tty) != launcher_group:  # not in the foreground (a background job, nohup, a pipeline...)
            os.close(tty)
            return False
        os.setpgid(0, 0)
        _set_foreground(tty, os.getpgrp())
    except OSError:
        os.close(tty)
        return False
    _terminal_taken = True
    # Ctrl-Z would stop only this process group: the shell, waiting for the launcher, would not see a stopped job
    # and the terminal would hang. So it is declined with one line (Ctrl-C stops with a checkpoint; a rerun resumes).
    signal.signal(signal.SIGTSTP, _decline_suspend)

    def give_back() -> None:
        try:
            if os.tcgetpgrp(tty) == os.getpgrp():
                _set_foreground(tty, launcher_group)
        except OSError:
            pass

    atexit.register(give_back)
    return True


def _decline_suspend(signum: int, frame: Any) -> None:
    print(
        "Ctrl-Z: a training run started by accelerate launch holds the terminal and is not suspended; Ctrl-C stops it "
        "with a checkpoint (rerun the same command to resume)",
        file=sys.stderr,
        flush=True,
    )


def _set_foreground(tty: int, group: int) -> None:
    """``tcsetpgrp`` from a background group: SIGTTOU would stop us, so it is blocked around the call."""
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTTOU})
    try:
        os.tcsetpgrp(tty, group)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)


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
        self._first_signal_at = -math.inf  # time.monotonic() of the first stop signal this process received
        self.stopped_at: int | None = None
        self._repeat_noted = False
        self.grace_s = torchrun_shutdown_timeout_s()  # None: no launcher kills us after a deadline
        self.grace_warning: str | None = None
        self._step_started = time.monotonic()
        self._launcher: int | None = None  # the accelerate launch pid this process dies with, once installed

    def install(self) -> GracefulStop:
        self._previous = {sig: signal.signal(sig, self._handle) for sig in STOP_SIGNALS}
        self._launcher = os.getppid() if die_with_launcher() else None
        take_terminal_from_launcher()
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
        now = time.monotonic()
        if self.signal_name is not None:
            if now - self._first_signal_at < RELAY_WINDOW_S:  # the first stop again, by another path: one stop
                return
            if signum == signal.SIGINT:  # a second Ctrl-C: the user means now
                self.stop_now(name)
            if not self._repeat_noted:  # an impatient repeat
                self._repeat_noted = True
                logger.warning("%s again: already stopping at the end of this step (Ctrl-C again stops at once)",
                               name)  # fmt: skip
            return
        self.signal_name = name
        self._first_signal_at = now
        logger.warning("%s received: saving a checkpoint at the end of this step, then stopping %s", name,
                       self._orphan_note() or "(Ctrl-C again stops at once, without it)")  # fmt: skip

    def _orphan_note(self) -> str | None:
        """When the stop came from the launcher's death (``kill <accelerate pid>`` on one process: accelerate's simple
        launcher exits at once), the shell is back before the checkpoint exists: say which process is still at work
        and that the output_dir stays locked until it exits."""
        launcher = self._launcher
        if launcher is None or os.getppid() == launcher:
            return None
        pid = os.getpid()
        return (
            f"(its launcher, pid {launcher}, has already exited: this process, pid {pid}, is still writing; the "
            f"output_dir stays locked until it exits, so wait for it before rerunning: tail --pid={pid} -f /dev/null. "
            "To have the command itself wait, signal the trainer process, not the launcher: docs/reproducing.md, "
            "Stopping a run)"
        )

    def stop_now(self, name: str) -> None:
        """Exits at once (no checkpoint, no traceback): one line saying what is lost."""
        print(
            f"{name} again: stopped at once without a checkpoint; the steps since the last checkpoint are lost "
            "(rerun the same command to resume from it)",
            file=sys.stderr,
            flush=True,
        )
        sys.stdout.flush()
        os._exit(EXIT_INTERRUPTED)

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
            if self.signal_name is None:  # its own copy of that signal, if it comes, is the same stop
                self.signal_name, self._first_signal_at = "a stop signal on another process", time.monotonic()
            self.stopped_at = state.global_step
            control.should_save = True
            control.should_training_stop = True

    @property
    def stopped(self) -> bool:
        return self.stopped_at is not None


_DISCARDED_ON_STOP: list[str] = []


@contextlib.contextmanager
def discarded_on_stop(what: str) -> Iterator[None]:
    """Inside, a stopped training says it is thrown away instead of promising a resume: ``what`` (the default-policy
    build's SFT) trains in a scratch directory that goes with the stop, and a rerun builds it from the start."""
    _DISCARDED_ON_STOP.append(what)
    try:
        yield
    finally:
        _DISCARDED_ON_STOP.pop()


def train_or_stop(trainer: Any, checkpoint: str | None) -> Any:
    """``trainer.train`` that a stop signal ends cleanly: the checkpoint of the current step is saved, then the
    process exits with ``EXIT_STOPPED`` (no final model, no hub export: the run is not complete; a rerun resumes)."""
    stop = GracefulStop(trainer.accelerator).install()
    trainer.add_callback(stop)
    try:
        result = trainer.train(resume_from_checkpoint=checkpoint)
    finally:  # a training that raises never reaches on_train_end: the process's own handlers come back either way
        stop.uninstall()
    if stop.stopped:
        line = (
            f"stopped by {stop.signal_name} at step {stop.stopped_at}: checkpoint saved in {trainer.args.output_dir}"
            f"/checkpoint-{stop.stopped_at}; rerun the same command to resume"
        )
        if _DISCARDED_ON_STOP:
            line = (
                f"stopped by {stop.signal_name} at step {stop.stopped_at} of {_DISCARDED_ON_STOP[-1]}: it is "
                "discarded, not resumable; rerun the same command to build it again from the start"
            )
        if trainer.is_world_process_zero():
            exit_with_line(line, EXIT_STOPPED)  # repeated after a live launcher's own exit traceback
        raise SystemExit(EXIT_STOPPED)
    return result
