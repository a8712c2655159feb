"""The start of every training entry script (seed, logging, device sanity), in one place; and what a run that
runs another inside its own process keeps from it (log levels, random states): the held-out evaluation during
training, the in-process default-policy build."""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import random
import sys
from collections.abc import Iterator
from typing import Any

import datasets
import numpy as np
import torch
import transformers
from transformers import set_seed

_release_registered = False


def release_process_group_at_exit() -> None:
    """Destroys the default process group when the interpreter exits normally, once per process.

    A process that exits with its gloo group alive can abort in interpreter finalization (``terminate called
    without an active exception``, SIGABRT, exit -6): gloo's worker threads still hold work whose tensors need the
    GIL that finalization is tearing down. In CI it struck rank 1 of two finished gloo runs (after ``done:``, and
    after a held-out evaluation), failing runs whose work was all written. ``atexit`` runs while the interpreter is
    still whole; ``os._exit`` (a second Ctrl-C, a lost peer's hard stop) skips it, as it should."""
    global _release_registered
    if not _release_registered:
        _release_registered = True
        atexit.register(_destroy_process_group)


def leave_distributed_run() -> None:
    """Ends a process of a finished multi-process run: the exit handlers run, interpreter finalization does not.

    Destroying the gloo group at exit (``release_process_group_at_exit``) did not stop the abort: CI saw rank 1 of a
    finished ZeRO-3 run die with ``terminate called without an active exception`` again, once everything was written.
    The abort happens while the process tears itself down (C++ destructors of the group's threads, finalization).
    A finished rank has nothing left to tear down, so it runs the ``atexit`` handlers (logging, files, the terminal)
    and leaves with ``os._exit(0)``: the kernel closes its sockets, as it would for any exit. A single process, or
    an in-process caller (tests, notebooks), returns from here and exits normally."""
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return
    atexit.unregister(_destroy_process_group)  # the sockets close with the process; nothing to wait for
    atexit._run_exitfuncs()
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(0)


def _destroy_process_group() -> None:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        with contextlib.suppress(Exception):  # exiting anyway: a peer already gone must not turn exit into a trace
            torch.distributed.destroy_process_group()


def setup_run(training_args: Any, script_logger: logging.Logger) -> None:
    """Seeds everything, routes logs to stdout at the process's log level, and refuses bf16 on a CPU-only machine."""
    release_process_group_at_exit()
    set_seed(training_args.seed)
    logging.basicConfig(
        format="%(asctime)s - %(levelname)s - %(name)s - %(message)s",
        handlers=[logging.StreamHandler(sys.stdout)],
    )
    log_level = training_args.get_process_log_level()
    # Our own INFO lines ("resuming from ...", "local hub revision ...") are what a user needs to see: at the default
    # ("passive") level the main process shows them; libraries stay at their warning level.
    ours = logging.INFO if training_args.log_level == "passive" and training_args.should_log else log_level
    script_logger.setLevel(ours)
    logging.getLogger("tau2_rl").setLevel(ours)
    datasets.utils.logging.set_verbosity(log_level)
    transformers.utils.logging.set_verbosity(log_level)
    if training_args.bf16 and not torch.cuda.is_available():
        raise SystemExit("error: --bf16 true needs a GPU; on CPU pass --bf16 false (the CPU recipes do)")


@contextlib.contextmanager
def keep_log_levels(*names: str) -> Iterator[None]:
    """Restores the levels of our loggers (and the ``names`` given) and of transformers' and datasets' verbosity:
    a script run in-process (the default-policy build runs ``train_sft.main`` at ``--log_level warning``) would
    otherwise leave them at its level, and the caller's INFO lines (held-out evals, hub exports) would vanish."""
    loggers = [logging.getLogger(name) for name in ("tau2_rl", *names)]
    levels = [logger.level for logger in loggers]
    verbosity = transformers.utils.logging.get_verbosity(), datasets.utils.logging.get_verbosity()
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.setLevel(level)
        transformers.utils.logging.set_verbosity(verbosity[0])
        datasets.utils.logging.set_verbosity(verbosity[1])


@contextlib.contextmanager
def keep_random_state() -> Iterator[None]:
    """Restores the Python, NumPy, torch (CPU) and CUDA random states on exit: what runs inside draws nothing from
    the caller's generators (``torch.random.fork_rng`` covers torch and the initialised CUDA devices). The held-out
    evaluation runs inside it, and the in-process default-policy build (whose ``train_sft.main`` reseeds them all)."""
    python_state, numpy_state = random.getstate(), np.random.get_state()
    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    try:
        with torch.random.fork_rng(devices=list(range(torch.cuda.device_count())) if cuda else []):
            yield
    finally:
        random.setstate(python_state)
        np.random.set_state(numpy_state)
