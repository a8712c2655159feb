"""``python launch.py``: ``accelerate launch`` with its own failures said in one line, and a SIGTERM that waits.

``accelerate launch`` is the launcher every command in the docs uses, and three of its behaviours are outside what a
training script can reach, because they happen in the launcher's process:

- a DeepSpeed config without DeepSpeed installed ends in accelerate's 11-line ``ImportError``, which suggests an
  unpinned ``pip3 install deepspeed``;
- a node that never joins a multi-node launch ends, after the rendezvous timeout, in torch's 44-line
  ``DistStoreError`` traceback and no word on what to do;
- ``kill <accelerate pid>`` on a one-process launch returns at once (accelerate's simple launcher dies of it) while
  the trainer still finishes its step and writes its checkpoint; and after any failure the simple launcher prints
  its own ``CalledProcessError`` traceback below the trainer's one line.

This wrapper takes exactly ``accelerate launch``'s flags (it parses them with accelerate's own parser and runs
accelerate's ``launch_command`` in this process) and changes only those: one line naming the pin or the rendezvous
(which nodes were expected, how many joined, the timeout and the flag that raises it), status 2; the trainer's exit
status without a traceback; and a SIGTERM to it is passed on to the trainer, whose checkpoint it waits for (under
torchrun, multi-process, torchrun's agent forwards and waits itself: ``TORCH_ELASTIC_SHUTDOWN_TIMEOUT``).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

from tau2_rl.run.cli import QUIET_LAUNCHER_ENV, exit_with_error
from tau2_rl.run.dependencies import MissingDependencyError, require

_JOINED = re.compile(r"Timed out after (\d+) seconds waiting for clients\. (\d+)/(\d+) clients joined")


def _children() -> list[int]:
    found: list[int] = []
    for task in Path(f"/proc/{os.getpid()}/task").glob("*"):
        try:
            found += [int(pid) for pid in (task / "children").read_text().split()]
        except OSError:
            continue
    return found


def _forward_stop(signum: int, frame: Any) -> None:
    """The one-process launch: the trainer stops at the end of its step and saves (a second SIGINT: at once, as
    in a terminal); this launcher waits for it."""
    for pid in _children():
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass


def rendezvous_line(message: str, args: Any) -> str | None:
    """One line for a rendezvous that timed out waiting for nodes, or None when ``message`` is another error."""
    found = _JOINED.search(message)
    if not found:
        return None
    seconds, joined, expected = (int(g) for g in found.groups())
    where = f"{getattr(args, 'main_process_ip', None) or '?'}:{getattr(args, 'main_process_port', None) or '?'}"
    nodes = getattr(args, "num_machines", None) or expected
    return (
        f"launch.py: error: the launch expected {nodes} nodes ({expected} rendezvous clients) at {where}, but "
        f"{joined} joined within the rendezvous timeout ({seconds} s); start the same command on every node with "
        "its own --machine_rank, check that each can reach --main_process_ip:--main_process_port, or raise the "
        "timeout with --rdzv_conf timeout=<seconds>"
    )


def main(argv: list[str] | None = None) -> int:
    from accelerate.commands.launch import launch_command, launch_command_parser

    parser = launch_command_parser()
    parser.prog = "launch.py"
    args = parser.parse_args(argv)
    os.environ[QUIET_LAUNCHER_ENV] = "1"  # the trainers' one line stays the last: no traceback of ours follows it
    # SIGTERM and SIGINT go on to the trainer (torchrun's agent installs its own handlers when it starts)
    previous = {sig: signal.signal(sig, _forward_stop) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        launch_command(args)
    except subprocess.CalledProcessError as err:  # the trainer's own line was the last thing it printed
        return err.returncode if err.returncode > 0 else 128 - err.returncode
    except ImportError as err:
        if "DeepSpeed" not in str(err) and "deepspeed" not in str(err):
            raise
        config = f"--config_file {args.config_file}" if getattr(args, "config_file", None) else "--use_deepspeed"
        try:
            require("deepspeed", config)  # the project's one wording for a missing optional package
        except MissingDependencyError as missing:
            exit_with_error(str(missing), prog="launch.py")
        raise
    except Exception as err:  # torch's DistStoreError and the elastic errors that wrap it
        line = rendezvous_line(f"{err} {err.__cause__ or ''}", args)
        if line is None:
            raise
        print(line, file=sys.stderr, flush=True)
        return 2
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 0
