"""One trainer per ``output_dir``: rank 0 holds an exclusive lock on ``<output_dir>/.run.lock`` while it lives.

Why: ``kill <accelerate launch pid>`` returns the shell at once while the orphaned trainer goes on to write its
checkpoint, and a rerun of "the same command" then had two trainers writing one directory. The lock is an
``fcntl.flock`` on an open file, which the kernel releases when the holding process dies, however it dies: a lock
can never outlive its run, so there is no stale lock to clean up (the file itself stays, naming the last holder). A
second launch is refused at once, in one line naming the host and pid that holds it.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import sys
import time
from pathlib import Path
from typing import IO

LOCK_FILE = ".run.lock"
_HELD: dict[tuple[int, str], OutputDirLock] = {}  # (pid, path): a second run in the same process reuses the lock


class OutputDirLockedError(ValueError):
    """Another live process holds ``output_dir`` (the message is the one line a user sees)."""


class OutputDirLock:
    """The held lock; keep the object alive for the run (closing it, or the process ending, releases it)."""

    def __init__(self, output_dir: str | os.PathLike[str]) -> None:
        self.path = Path(output_dir) / LOCK_FILE
        self._handle: IO[str] | None = None

    def acquire(self, flag: str = "--output_dir") -> OutputDirLock:
        """Takes the lock, or raises ``OutputDirLockedError``; the same process asking again gets the held lock."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        key = (os.getpid(), str(self.path.resolve()))
        if key in _HELD:
            return _HELD[key]
        handle = open(self.path, "a+", encoding="utf-8")  # noqa: SIM115 - held open for the run's lifetime
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            handle.seek(0)
            holder = _describe(handle.read())
            handle.close()
            raise OutputDirLockedError(
                f"{flag} {self.path.parent} is in use by another run ({holder}); wait for it to end (a stopped run "
                "is still writing its checkpoint), stop it, or choose another " + flag
            ) from None
        handle.seek(0)
        handle.truncate()
        handle.write(json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "started": time.time(),
                                 "command": " ".join(sys.argv)}))  # fmt: skip
        handle.flush()
        self._handle = handle
        _HELD[key] = self
        return self

    def release(self) -> None:
        if self._handle is not None:
            self._handle.close()  # closing the descriptor drops the flock
            self._handle = None
            _HELD.pop((os.getpid(), str(self.path.resolve())), None)

    @property
    def held(self) -> bool:
        return self._handle is not None


def _describe(text: str) -> str:
    try:
        info = json.loads(text)
        started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(info["started"])))
        return f"pid {info['pid']} on host {info['host']}, since {started}"
    except (ValueError, KeyError, TypeError):
        return "a process that has not written its name yet"
