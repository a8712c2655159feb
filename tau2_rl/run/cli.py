"""How the entry scripts fail on bad input: one line naming the flag, file or field, exit status 2, no traceback.

- argparse errors (``--variant foo``) print ``<prog>: error: ...`` without the ~200-line usage block first;
- ``--config missing.yaml`` and an unparsable recipe are one line, not a ``FileNotFoundError`` traceback;
- ``run_main`` turns the scripts' own ``SystemExit("error: ...")`` and their input-error classes into that line.

Every such line has argparse's shape, ``<script>.py: error: ...``, whichever check found the problem (argparse, a
config's ``__post_init__``, the script's own checks): the script passes its name as ``prog``. Failures of a run that
started (a dead user endpoint, a lost peer: exit 1) read ``error: ...``.

Under ``accelerate launch`` the launcher answers a child's non-zero exit with its own traceback
(``subprocess.CalledProcessError`` from the simple launcher, a ``ChildFailedError`` summary from torchrun), printed
*after* our line. So, when the parent process is an ``accelerate`` launcher, the main process also leaves a tiny
forked watcher that repeats the line once the launcher has exited: what the user sees last is what went wrong.
(``accelerate launch --quiet`` suppresses the launcher's traceback for single-process configs, but exits 1.)
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn, TypeVar

T = TypeVar("T")

EXIT_USAGE = 2
"""Bad input (argparse's convention): the run never started."""

_REPEAT_TIMEOUT_S = 60.0

EXIT_INTERRUPTED = 130
"""Ctrl-C (the shell's 128 + SIGINT)."""
INTERRUPTED_LINE = "interrupted (Ctrl-C); rerun the same command to resume from what was saved"


QUIET_LAUNCHER_ENV = "TAU2_RL_QUIET_LAUNCHER"
"""Set by ``launch.py`` for its children: no launcher traceback follows their line, so it is not repeated."""


_PREFIXED = re.compile(r"^\S+: error: ")


def error_line(message: str, prog: str | None = None) -> str:
    """``message`` on one line as ``error: ...``, or ``<prog>: error: ...`` with ``prog``; a line that already has
    a ``<prog>: error:`` prefix keeps it."""
    text = " ".join(str(message).split())  # one line, whatever the message held
    if _PREFIXED.match(text):
        return text
    text = text.removeprefix("error:").strip()
    return f"{prog}: error: {text}" if prog else f"error: {text}"


def _parent_is_accelerate_launcher() -> bool:
    """Whether this process was started by ``accelerate launch`` (the launcher prints a traceback after us)."""
    try:
        cmdline = Path(f"/proc/{os.getppid()}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    words = [Path(w.decode(errors="replace")).name for w in cmdline if w]
    # `accelerate launch ...`, `python -m accelerate.commands.launch ...` or this project's `python launch.py ...`
    return (
        ("launch" in words and any(w.startswith("accelerate") for w in words))
        or "accelerate.commands.launch" in words
        or "launch.py" in words[:2]
    )


def _process_gone(pid: int) -> bool:
    """True once ``pid`` exited (a zombie counts: it has written everything it will write)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat.rsplit(")", 1)[-1].split()[0] in ("Z", "X")


def _repeat_after_launcher(line: str) -> None:
    """Forks a watcher that writes ``line`` to stderr after the launcher (our parent) has exited."""
    launcher = os.getppid()
    try:
        pid = os.fork()
    except OSError:
        return
    if pid:
        return
    try:  # the watcher: no Python cleanup, no inherited handlers, only a wait and one write
        deadline = time.monotonic() + _REPEAT_TIMEOUT_S
        try:  # a pidfd turns readable the moment the launcher exits: the line lands before the shell's prompt
            import select

            select.select([os.pidfd_open(launcher)], [], [], _REPEAT_TIMEOUT_S)
        except (AttributeError, OSError):
            pass
        while not _process_gone(launcher) and time.monotonic() < deadline:
            time.sleep(0.02)
        if _process_gone(launcher):
            os.write(2, f"{line}\n".encode(errors="replace"))
    finally:
        os._exit(0)


def exit_with_error(message: str, code: int = EXIT_USAGE, prog: str | None = None) -> NoReturn:
    """Prints the one-line error (``<prog>: error: ...`` with ``prog``) and exits with ``code`` (2: bad input)."""
    exit_with_line(error_line(message, prog), code)


def exit_with_line(line: str, code: int) -> NoReturn:
    """Prints ``line`` (to stderr) and exits with ``code``; under a live ``accelerate launch`` the line is repeated
    once the launcher has printed its own traceback and exited."""
    print(line, file=sys.stderr, flush=True)
    quiet_launcher = os.environ.get(QUIET_LAUNCHER_ENV) == "1"  # launch.py prints no traceback after us
    if os.environ.get("LOCAL_RANK", "0") == "0" and _parent_is_accelerate_launcher() and not quiet_launcher:
        sys.stdout.flush()
        _repeat_after_launcher(line)
    sys.exit(code)


def one_line_argparse_errors(parser: argparse.ArgumentParser, prog: str | None = None) -> argparse.ArgumentParser:
    """argparse errors without the usage block (hundreds of lines for TRL's configs); ``--help`` still shows it.
    ``prog``: the script's name, instead of argparse's guess from ``sys.argv[0]``."""
    if prog:
        parser.prog = prog

    def error(message: str) -> NoReturn:
        exit_with_error(f"{parser.prog}: error: {message} (see --help)")

    parser.error = error  # type: ignore[method-assign]
    return parser


_UNKNOWN_FLAGS = "Some specified arguments are not used by the HfArgumentParser: "
_UNKNOWN_KEYS = "Unknown arguments from config file: "


def _listed_names(message: str, lead: str) -> list[str]:
    """The names in ``lead + "['--a', '1', '--b']..."`` (HfArgumentParser / TrlParser messages): flags only."""
    import ast

    listed = message[len(lead) :]
    try:
        words = ast.literal_eval(listed[: listed.index("]") + 1])
    except (ValueError, SyntaxError):
        return []
    return [str(w) for w in words if str(w).startswith("--")]


def _config_path(argv: list[str] | None) -> str | None:
    words = list(sys.argv[1:] if argv is None else argv)
    for i, word in enumerate(words):
        if word == "--config" and i + 1 < len(words):
            return words[i + 1]
        if word.startswith("--config="):
            return word.split("=", 1)[1]
    return None


def _parse_error(message: str, argv: list[str] | None) -> str:
    """TrlParser's unknown-flag and unknown-key messages in the project's words (TRL's advises setting
    ``fail_with_unknown_args=False``, which is no flag a user can pass)."""
    if message.startswith(_UNKNOWN_FLAGS):
        flags = _listed_names(message, _UNKNOWN_FLAGS)
        return f"unrecognized argument(s): {' '.join(flags) or message[len(_UNKNOWN_FLAGS) :]} (see --help)"
    if message.startswith(_UNKNOWN_KEYS):
        keys = [flag[2:] for flag in _listed_names(message, _UNKNOWN_KEYS)]
        return (
            f"--config {_config_path(argv)}: unknown key(s) {', '.join(keys) or message[len(_UNKNOWN_KEYS) :]}; "
            "remove them or fix their spelling (see --help for the fields)"
        )
    return message


def parse_or_exit(parser: Any, argv: list[str] | None = None, prog: str | None = None) -> Any:
    """``parser.parse_args_and_config(argv)`` (TrlParser); a bad ``--config`` or field value is one line, and an
    abbreviated flag is unknown (argparse took ``--learning_rat`` for ``--learning_rate`` without a word). With
    ``prog`` every such line reads ``<prog>: error: ...``, as argparse's own do."""
    import yaml

    def fail(message: str) -> NoReturn:
        exit_with_error(message, prog=prog)

    one_line_argparse_errors(parser, prog)
    parser.allow_abbrev = False  # read at parse time; TrlParser builds its argparse parser without the option
    try:
        return parser.parse_args_and_config(args=argv)
    except FileNotFoundError as err:
        fail(f"--config {err.filename}: no such file")
    except IsADirectoryError as err:
        fail(f"--config {err.filename}: is a directory, not a YAML recipe")
    except yaml.YAMLError as err:
        fail(f"--config: not a valid YAML recipe ({err})")
    except (TypeError, ValueError) as err:  # a recipe key of the wrong type, or a config's __post_init__ check
        fail(_parse_error(str(err), argv))


def run_main(main: Callable[[], T], input_errors: tuple[type[BaseException], ...] = (), prog: str | None = None) -> T:
    """Runs an entry point; its ``SystemExit("error: ...")`` and ``input_errors`` become the one line
    (``<prog>: error: ...``), status 2."""
    try:
        result = main()
    except SystemExit as exc:
        if isinstance(exc.code, str):
            exit_with_error(exc.code, prog=prog)
        raise
    except KeyboardInterrupt:  # Ctrl-C outside training (which stops gracefully): one line, not a traceback
        exit_with_line(INTERRUPTED_LINE, EXIT_INTERRUPTED)
    except input_errors as err:
        exit_with_error(str(err.args[0]) if isinstance(err, KeyError) and err.args else str(err), prog=prog)
    except RuntimeError as err:
        message = lost_peer_message(err)
        if message is None:
            raise
        exit_with_line(error_line(message), EXIT_LOST_PEER)
    from tau2_rl.run.start import leave_distributed_run  # noqa: PLC0415 - torch only where a run ends

    leave_distributed_run()  # a finished rank of a multi-process run leaves without finalization (start.py)
    return result


EXIT_LOST_PEER = 1
# What torch's collectives say when another process of the run died or stopped answering (gloo, NCCL, the store).
_LOST_PEER_MARKERS = ("Connection closed by peer", "Connection reset by peer", "Socket Timeout", "Timed out waiting",
                      "NCCL communicator was aborted")  # fmt: skip


def _clip(text: str, limit: int) -> str:
    """``text`` cut to at most ``limit`` characters at a word boundary, with an ellipsis when cut."""
    if len(text) <= limit:
        return text
    cut = text[: limit - 1].rsplit(" ", 1)[0].rstrip(" ,;:.")
    return f"{cut}…"


def lost_peer_message(err: BaseException) -> str | None:
    """One line for a collective that failed because another rank or node is gone, else None (a real bug: keep its
    traceback). A dead peer closes its sockets, so the others fail at once; a hung one, after --ddp_timeout."""
    distributed = sys.modules.get("torch.distributed")
    dist_error = getattr(distributed, "DistError", None)
    text = str(err)
    if not (dist_error is not None and isinstance(err, dist_error)) and not any(m in text for m in _LOST_PEER_MARKERS):
        return None
    first = text.strip().splitlines()[0] if text.strip() else type(err).__name__
    first = _clip(first.split("] ", 1)[-1], 200)  # gloo prefixes its source location
    return (
        f"another process of this run failed or stopped answering ({first}); its own log says why. Rerun the same "
        "command on every node: it resumes from the last checkpoint"
    )
