"""The model a training run starts from: a given local directory (checked, never downloaded), or the embedded
default, built once and cached: the tiny random-weight Qwen2 (``tiny_model``) or, for GRPO's CPU recipe, the
default policy warmed up by SFT on the covered tasks (``default_policy``).

The tiny model's tokenizer is trained on the run's system prompts and the corpus domain's tool schemas
(``tau2_rl.data.tiny_model``), the same for both scripts, so an SFT model and a GRPO run from it read the same prompts.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from tau2_rl.envs.multi import RunEnv
from tau2_rl.envs.protocol import TAU2_RL, agent_tool_schemas
from tau2_rl.envs.spec import DomainSpec
from tau2_rl.run.hub import HubError, check_model_dir
from tau2_rl.run.sharding import world_size_from_env


def check_local_model(path: str | Path, flag: str = "--model_name_or_path") -> str:
    """A given model must be a complete local directory; the exit names ``flag`` and what is missing."""
    path = Path(path)
    if not path.exists():
        raise SystemExit(f"error: {flag} {path} does not exist: pass a local model directory (nothing is downloaded)")
    try:
        check_model_dir(path, flag)
    except HubError as err:
        raise SystemExit(f"error: {err}") from None
    return str(path)


def tiny_default(
    env: RunEnv, output_dir: str, tiny_model_dir: str | None, *, hidden: int = 64, layers: int = 2
) -> str:
    """The embedded tiny model (next to ``output_dir`` unless ``tiny_model_dir``); a non-default size gets its own
    directory, so one cache never holds two shapes."""
    from tau2_rl.data.tiny_model import build_tiny_model, default_tiny_model_dir

    directory = tiny_model_dir or default_tiny_model_dir(Path(output_dir).parent)
    if not tiny_model_dir and (hidden, layers) != (64, 2):
        directory = Path(directory).with_name(f"{Path(directory).name}-h{hidden}-l{layers}")
    from tau2_rl.domains import legacy_domain

    schemas = agent_tool_schemas(TAU2_RL, legacy_domain())  # the corpus domain's, as domain_corpus's text
    extra = [*(member.system_prompt for member in env.members), *(str(schema) for schema in schemas)]
    return str(
        build_tiny_model(
            directory, hidden_size=hidden, num_layers=layers, intermediate_size=2 * hidden, extra_texts=extra
        )
    )


def default_policy(
    tasks_csv: str, cache_dir: str | None, epochs: int, data_dir: str | None, specs: list[DomainSpec]
) -> str:
    """GRPO's embedded default: the tiny model after SFT on ``tasks_csv`` (``--warmup_tasks``), cached by its
    settings wherever ``--output_dir`` is. A rank of a multi-process launch builds it in a one-process child, never
    inside the run's process group."""
    from tau2_rl.data import default_policy as build

    tasks = [t.strip() for t in tasks_csv.split(",") if t.strip()]
    directory = build.default_policy_dir(cache_dir, tasks, epochs, specs)
    builder = build.build_default_policy_isolated if world_size_from_env() > 1 else build.build_default_policy
    return str(builder(directory, tasks, epochs=epochs, data_dir=data_dir, specs=specs))


def load_tokenizer(model_path: str, model_args: Any) -> Any:
    """The tokenizer at ``model_path`` (``--model_revision``); one without a pad token pads with its end-of-sequence
    token."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path, revision=model_args.model_revision)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_model(model_path: str, model_args: Any) -> Any:
    """The causal LM at ``model_path`` as TRL's ``ModelConfig`` asks (revision, dtype, attention implementation)."""
    from transformers import AutoModelForCausalLM

    dtype = model_args.dtype if model_args.dtype in ("auto", None) else getattr(torch, model_args.dtype)
    return AutoModelForCausalLM.from_pretrained(
        model_path,
        revision=model_args.model_revision,
        dtype=dtype,
        attn_implementation=model_args.attn_implementation,
    )
