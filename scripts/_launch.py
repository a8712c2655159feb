"""Shared launcher logic for the vLLM servers: pre-flight checks, offline environment, health wait, lifecycle.

A launch goes: check the model directory (must hold ``config.json``), check the port is free, check vLLM is
installed, start the server with its output in a log file, poll ``http://127.0.0.1:<port>/health`` until it answers
200 (failing at once if the process exits, or after ``--health-timeout`` seconds), then print the base URL on stdout —
the only thing a launcher prints on stdout, so ``URL=$(python -m scripts.serve_user_llm ... --detach)`` works.
Everything else (progress, the log path, how to stop it) goes to stderr.

Foreground (default): the launcher stays attached and stops the server on Ctrl-C / SIGTERM. ``--detach``: it
returns once the server is healthy and leaves it running in its own session (``--pid-file`` records its pid).
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import importlib.util
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

# Nothing is ever downloaded: models are local directories, and vLLM/HF libraries must not try the Hub.
OFFLINE_ENV = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
}
LOOPBACK = "127.0.0.1"


class LaunchError(RuntimeError):
    """A launcher pre-flight check or the health wait failed; the message says what and how to fix it."""


def check_model_dir(path: str | os.PathLike[str], flag: str = "--model") -> Path:
    """The model must be a local directory with a ``config.json`` (nothing is downloaded)."""
    model = Path(path)
    if not model.is_dir():
        raise LaunchError(
            f"{flag} {model}: no such directory. Pass a local model directory (HF_HUB_OFFLINE=1: nothing is "
            "downloaded), e.g. one made beforehand with `hf download <repo> --local-dir /models/<name>` on a "
            "machine with network access."
        )
    if not (model / "config.json").is_file():
        raise LaunchError(f"{flag} {model}: the directory has no config.json, so it is not a model directory")
    return model


def check_port_free(port: int, host: str = LOOPBACK) -> None:
    """Fails when something already listens on ``port`` (checked on ``host`` and on the loopback address)."""
    if not 0 < port < 65536:
        raise LaunchError(f"--port {port} is not a valid TCP port (1-65535)")
    for address in dict.fromkeys((host, LOOPBACK)):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            # Like uvicorn: SO_REUSEADDR, so a TIME_WAIT leftover from a stopped server does not count as busy.
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind((address, port))
            except OSError as err:
                if err.errno == errno.EADDRINUSE:
                    raise LaunchError(
                        f"port {port} on {address} is already in use (another server?): pass a free --port or stop "
                        f"the process holding it (`ss -ltnp 'sport = :{port}'` shows it)"
                    ) from err
                raise LaunchError(f"cannot bind {address}:{port} to check it is free: {err}") from err


def require_vllm() -> None:
    """Fails with the install instruction when vLLM is not importable."""
    if importlib.util.find_spec("vllm") is None:
        raise LaunchError(
            "vLLM is not installed in this Python environment; install the GPU extras on a CUDA machine: "
            "pip install -r requirements-gpu.txt (vllm==0.31.0)"
        )


def parse_gpu_ids(value: str | None) -> list[str] | None:
    """``"0,1"`` → ``["0", "1"]``; None/empty → None (inherit CUDA_VISIBLE_DEVICES)."""
    if value is None or not value.strip():
        return None
    ids = [part.strip() for part in value.split(",")]
    if any(not part.isdigit() for part in ids) or len(set(ids)) != len(ids):
        raise LaunchError(f"--gpu-ids {value!r} must be distinct comma-separated GPU indices, e.g. '1' or '2,3'")
    return ids


def server_env(gpu_ids: Sequence[str] | None, extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The variables a launch sets on top of the inherited environment (printed by ``--dry-run``)."""
    env = dict(OFFLINE_ENV)
    if gpu_ids is not None:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(gpu_ids)
    env.update(extra or {})
    return env


def format_command(command: Sequence[str], env: Mapping[str, str] | None = None) -> str:
    """A shell line that runs ``command`` with ``env`` set: what ``--dry-run`` prints."""
    prefix = [f"{key}={shlex.quote(value)}" for key, value in (env or {}).items()]
    return " ".join([*prefix, shlex.join(list(command))])


def display_host(host: str) -> str:
    """The address clients on this machine use for a server bound to ``host``."""
    return LOOPBACK if host in ("", "0.0.0.0", "::") else host


def log_tail(path: Path | None, lines: int = 25) -> str:
    if path is None or not path.is_file():
        return ""
    text = path.read_text(encoding="utf-8", errors="replace").splitlines()[-lines:]
    return "\n".join("    " + line for line in text)


def _probe(url: str, timeout: float) -> bool:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # never route loopback through a proxy
    try:
        with opener.open(url, timeout=timeout) as response:
            return response.status == 200
    except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
        return False


def wait_healthy(
    url: str,
    process: subprocess.Popen | None = None,
    timeout: float = 900.0,
    interval: float = 2.0,
    log_path: Path | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> float:
    """Polls ``url`` until it answers 200; returns the seconds waited.

    Raises ``LaunchError`` at once when ``process`` exits first, and after ``timeout`` seconds otherwise; both
    messages end with the tail of ``log_path``.
    """
    start = clock()
    while True:
        if process is not None and process.poll() is not None:
            tail = log_tail(log_path)
            raise LaunchError(
                f"the server process exited with code {process.returncode} before {url} became healthy"
                + (f"; last lines of {log_path}:\n{tail}" if tail else f" (log: {log_path})" if log_path else "")
            )
        if _probe(url, timeout=max(0.5, min(5.0, interval))):
            return clock() - start
        if clock() - start >= timeout:
            tail = log_tail(log_path)
            raise LaunchError(
                f"{url} did not become healthy within {timeout:g} s (--health-timeout)"
                + (f"; last lines of {log_path}:\n{tail}" if tail else "")
            )
        time.sleep(interval)


def group_alive(pgid: int) -> bool:
    """Whether a process of group ``pgid`` still runs (zombies waiting for a reaper do not count)."""
    proc = Path("/proc")
    if not proc.is_dir():  # not Linux: signal 0 (counts zombies too)
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return False
        return True
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:  # gone meanwhile
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":  # fields after the command: state, ppid, pgrp, ...
            return True
    return False


def stop_process(process: subprocess.Popen, grace: float = 30.0) -> None:
    """SIGTERM the server's process group (vLLM spawns workers), then SIGKILL what is left after ``grace`` seconds.

    Returns once no process of the group runs: vLLM's engine-core process outlives the API server by a few seconds,
    and a next server on the same device must not start next to it.
    """
    pgid = process.pid  # started with start_new_session: it leads its group, which outlives it while workers run
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    try:
        process.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        pass
    while group_alive(pgid) and time.monotonic() < deadline:
        time.sleep(0.2)
    if process.poll() is None or group_alive(pgid):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGKILL)
        process.wait()


def add_common_arguments(parser: argparse.ArgumentParser, default_port: int, default_log_name: str) -> None:
    """Flags both launchers share: where, which GPUs, how long to wait, foreground/detached, dry run."""
    parser.add_argument("--model", required=True, help="Local model directory (must contain config.json).")
    parser.add_argument("--tensor-parallel-size", type=int, default=1, help="GPUs the model is sharded over.")
    parser.add_argument("--port", type=int, default=default_port, help=f"TCP port (default {default_port}).")
    parser.add_argument(
        "--host", default=LOOPBACK, help="Bind address (default 127.0.0.1; 0.0.0.0 to serve other nodes)."
    )
    parser.add_argument(
        "--gpu-ids", default=None, help="CUDA_VISIBLE_DEVICES for the server, e.g. '1' or '2,3' (default: inherit)."
    )
    parser.add_argument("--max-model-len", type=int, default=16384, help="Maximum context length (tokens).")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9, help="Share of GPU memory vLLM takes.")
    parser.add_argument("--health-timeout", type=float, default=900.0, help="Seconds to wait for /health.")
    parser.add_argument(
        "--log-file", default=None, help=f"Server log (default outputs/servers/{default_log_name}-<port>.log)."
    )
    parser.add_argument("--detach", action="store_true", help="Return once healthy, leaving the server running.")
    parser.add_argument("--pid-file", default=None, help="With --detach: write the server's pid here.")
    parser.add_argument("--dry-run", action="store_true", help="Print the command (with its environment) and exit.")


def validate_common(args: argparse.Namespace) -> list[str] | None:
    """Checks that need no GPU and no vLLM: sizes and GPU ids; returns the parsed GPU ids."""
    if args.tensor_parallel_size < 1:
        raise LaunchError(f"--tensor-parallel-size must be >= 1, got {args.tensor_parallel_size}")
    if args.max_model_len is not None and args.max_model_len < 1:
        raise LaunchError(f"--max-model-len must be >= 1, got {args.max_model_len}")
    if not 0.0 < args.gpu_memory_utilization <= 1.0:
        raise LaunchError(f"--gpu-memory-utilization must be in (0, 1], got {args.gpu_memory_utilization}")
    gpu_ids = parse_gpu_ids(args.gpu_ids)
    if gpu_ids is not None and len(gpu_ids) < args.tensor_parallel_size:
        raise LaunchError(
            f"--tensor-parallel-size {args.tensor_parallel_size} needs that many GPUs but --gpu-ids lists "
            f"{len(gpu_ids)} ({args.gpu_ids})"
        )
    return gpu_ids


def serve(
    command: Sequence[str],
    env: Mapping[str, str],
    *,
    port: int,
    base_url: str,
    log_file: Path,
    health_path: str = "/health",
    health_timeout: float = 900.0,
    interval: float = 2.0,
    detach: bool = False,
    pid_file: Path | None = None,
    name: str = "server",
    hint: str = "",
) -> int:
    """Starts ``command``, waits until it is healthy, prints ``base_url``; then waits on it unless ``detach``."""
    health_url = f"http://{LOOPBACK}:{port}{health_path}"
    log_file.parent.mkdir(parents=True, exist_ok=True)
    print(f"[{name}] starting: {format_command(command, env)}", file=sys.stderr)
    print(f"[{name}] log: {log_file}", file=sys.stderr)
    with open(log_file, "ab") as log:
        process = subprocess.Popen(
            list(command),
            env={**os.environ, **env},
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group: stop_process reaches vLLM's workers too
        )
    try:
        waited = wait_healthy(health_url, process, timeout=health_timeout, interval=interval, log_path=log_file)
    except BaseException:
        stop_process(process, grace=10.0)
        raise
    print(f"[{name}] healthy after {waited:.0f} s (pid {process.pid}){hint}", file=sys.stderr)
    print(base_url, flush=True)
    if detach:
        if pid_file is not None:
            pid_file.parent.mkdir(parents=True, exist_ok=True)
            pid_file.write_text(f"{process.pid}\n", encoding="utf-8")
        print(f"[{name}] detached; stop it with: kill -- -{process.pid}", file=sys.stderr)
        return 0

    def _terminate(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, _terminate)
    try:
        code = process.wait()
        print(f"[{name}] exited with code {code}; log: {log_file}", file=sys.stderr)
        return code
    except KeyboardInterrupt:
        print(f"[{name}] stopping (pid {process.pid})", file=sys.stderr)
        stop_process(process)
        return 0
    finally:
        signal.signal(signal.SIGTERM, previous)


def run_launcher(main: Callable[[list[str] | None], int], argv: list[str] | None = None) -> int:
    """Turns a ``LaunchError`` into a one-line message on stderr and exit code 2."""
    try:
        return main(argv)
    except LaunchError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
