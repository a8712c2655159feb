"""Build (or reuse) the embedded default policy model offline and print its directory.

    python -m scripts.build_tiny_model --output_dir outputs/tiny-qwen2            # what train_grpo.py builds
    python -m scripts.build_tiny_model --output_dir outputs/gpu-smoke/tiny-qwen2-h64 --hidden_size 256

The tokenizer corpus includes the airline system prompt and the tool schemas, exactly as ``train_grpo.py`` builds
it, so with the default sizes this gives the same cached build. ``--hidden_size 256`` (4 heads of 64) suits vLLM's
attention kernels, whose head sizes start at 32/64; the default (64 → heads of 16) is for CPU.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from tau2_rl.domains import get_domain

AIRLINE = get_domain("airline")

if __package__ in (None, ""):  # run as a file: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m scripts.build_tiny_model", description=__doc__.splitlines()[0])
    parser.add_argument("--output_dir", default="outputs/tiny-qwen2", help="Where to build (reused when complete).")
    parser.add_argument("--hidden_size", type=int, default=64)
    parser.add_argument("--num_layers", type=int, default=2)
    parser.add_argument("--num_attention_heads", type=int, default=4)
    parser.add_argument("--num_key_value_heads", type=int, default=2)
    parser.add_argument("--intermediate_size", type=int, default=None, help="Default: 2 × hidden_size.")
    parser.add_argument("--data_dir", default=None, help="Airline data directory (default: the installed package).")
    return parser


def build(args: argparse.Namespace) -> Path:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from tau2_rl.data.tiny_model import build_tiny_model
    from tau2_rl.domains.airline.tools import TOOL_SCHEMAS
    from tau2_rl.envs.episode import DomainEnv, EnvConfig

    if args.hidden_size % args.num_attention_heads:
        raise SystemExit(f"--hidden_size {args.hidden_size} must be a multiple of --num_attention_heads")
    env = DomainEnv(AIRLINE, args.data_dir, EnvConfig())
    extra = [env.system_prompt, *(str(schema) for schema in TOOL_SCHEMAS)]
    return build_tiny_model(
        args.output_dir,
        hidden_size=args.hidden_size,
        num_layers=args.num_layers,
        num_attention_heads=args.num_attention_heads,
        num_key_value_heads=args.num_key_value_heads,
        intermediate_size=args.intermediate_size or 2 * args.hidden_size,
        extra_texts=extra,
    )


def main(argv: list[str] | None = None) -> int:
    print(build(make_parser().parse_args(argv)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
