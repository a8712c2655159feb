"""Multi-turn GRPO on the τ²-bench airline domain with one of five loss variants.

    # the embedded default: tiny random-weight Qwen2 + scripted user, on CPU, a few minutes
    accelerate launch --config_file accelerate_configs/cpu.yaml train_grpo.py --config recipes/grpo/cpu_smoke.yaml
    # a real run (see README "Reproducing the ablation")
    accelerate launch --config_file accelerate_configs/single_gpu.yaml train_grpo.py \
        --config recipes/grpo/joint.yaml --model_name_or_path /models/Qwen2.5-7B-Instruct

Any recipe field can be overridden on the command line (``--variant lata``, ``--max_steps 10``...).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import datasets
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.trainer_utils import get_last_checkpoint
from trl import ModelConfig, TrlParser, get_peft_config

from airline_rl.configs import GRPOScriptArguments, MultiTurnGRPOConfig
from airline_rl.envs.episode import AirlineEnv, EnvConfig
from airline_rl.envs.splits import get_split
from airline_rl.envs.tools import TOOL_SCHEMAS
from airline_rl.envs.users import get_user_simulator
from airline_rl.hub import HubError, LocalHubCallback, ensure_writable
from airline_rl.script_setup import setup_run
from airline_rl.trainers.console import use_step_lines
from airline_rl.trainers.multiturn_grpo import MultiTurnGRPOTrainer

logger = logging.getLogger(__name__)


def resolve_model_path(
    model_args: ModelConfig, script_args: GRPOScriptArguments, output_dir: str, env: AirlineEnv
) -> str:
    """The model to train: the given path, or the embedded tiny model (built once and cached)."""
    if model_args.model_name_or_path:
        path = Path(model_args.model_name_or_path)
        if not path.exists():
            raise SystemExit(
                f"error: --model_name_or_path {path} does not exist: pass a local model directory "
                "(nothing is downloaded)"
            )
        return str(path)
    if script_args.warmup_tasks:
        from airline_rl.data.default_policy import build_default_policy, default_policy_dir

        tasks = [t.strip() for t in script_args.warmup_tasks.split(",") if t.strip()]
        directory = default_policy_dir(Path(output_dir).parent, tasks, script_args.warmup_epochs)
        return str(
            build_default_policy(directory, tasks, epochs=script_args.warmup_epochs, data_dir=script_args.data_dir)
        )
    from airline_rl.data.tiny_model import build_tiny_model, default_tiny_model_dir

    directory = script_args.tiny_model_dir or default_tiny_model_dir(Path(output_dir).parent)
    extra = [env.system_prompt, *(str(schema) for schema in TOOL_SCHEMAS)]
    return str(build_tiny_model(directory, extra_texts=extra))


def task_dataset(script_args: GRPOScriptArguments, env: AirlineEnv, system_prompt: str) -> datasets.Dataset:
    """One prompt row per (task, repeat); the trainer plays the episode, the prompt column only feeds TRL's logs."""
    split = get_split(script_args.split, script_args.split_file, frozenset(env.domain.tasks))
    if script_args.tasks:
        task_ids = [t.strip() for t in script_args.tasks.split(",") if t.strip()]
        for task_id in task_ids:
            env.domain.get_task(task_id)  # unknown ids fail here with the valid range
    else:
        task_ids = list(split.train)
    prompt = [{"role": "system", "content": system_prompt}]
    rows = [{"prompt": prompt, "task_id": t} for _ in range(script_args.task_repeats) for t in task_ids]
    return datasets.Dataset.from_list(rows)


def warn_if_updates_round_away(model: torch.nn.Module, model_args: ModelConfig, args: MultiTurnGRPOConfig) -> None:
    """Full fine-tuning of bf16 weights without fp32 master weights (no DeepSpeed / FSDP) rounds small AdamW updates
    away: a 1e-6 step is below bf16's resolution for most weights. Say so instead of training silently on nothing."""
    launched_sharded = any(
        os.environ.get(k, "").lower() == "true" for k in ("ACCELERATE_USE_DEEPSPEED", "ACCELERATE_USE_FSDP")
    )
    if model_args.use_peft or args.deepspeed or args.fsdp or launched_sharded:
        return
    if next(model.parameters()).dtype == torch.bfloat16 and args.learning_rate < 1e-5:
        logger.warning(
            "bf16 weights with learning_rate=%g and no fp32 master copy: most updates round to zero. Use "
            "accelerate_configs/zero2_offload.yaml (fp32 master weights), --use_peft true, or --dtype float32.",
            args.learning_rate,
        )


def main(script_args: GRPOScriptArguments, training_args: MultiTurnGRPOConfig, model_args: ModelConfig) -> None:
    setup_run(training_args, logger)
    # Everything the user can get wrong is checked before any model is built or loaded; each message names its flag.
    try:
        ensure_writable(script_args.hub_dir)
        env = AirlineEnv(script_args.data_dir, EnvConfig(script_args.max_turns, script_args.max_tool_errors))
        if script_args.compact_prompt or (script_args.warmup_tasks and not model_args.model_name_or_path):
            from airline_rl.data.default_policy import compact_env

            compact_env(env)
        train_dataset = task_dataset(script_args, env, env.system_prompt)
    except (HubError, KeyError, ValueError) as err:  # bad --hub_dir, --data_dir, --split or --tasks
        raise SystemExit(f"error: {err.args[0] if isinstance(err, KeyError) else err}") from None
    run_name = training_args.run_name or Path(training_args.output_dir).name

    user = get_user_simulator(script_args.user_simulator, **script_args.user_kwargs())
    model_path = resolve_model_path(model_args, script_args, training_args.output_dir, env)
    logger.info("policy model: %s; variant: %s; user simulator: %s", model_path, training_args.variant, user.name)

    tokenizer = AutoTokenizer.from_pretrained(model_path, revision=model_args.model_revision)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    dtype = model_args.dtype if model_args.dtype in ("auto", None) else getattr(torch, model_args.dtype)
    model = AutoModelForCausalLM.from_pretrained(
        model_path,
        revision=model_args.model_revision,
        dtype=dtype,
        attn_implementation=model_args.attn_implementation,
    )
    warn_if_updates_round_away(model, model_args, training_args)
    trainer = MultiTurnGRPOTrainer(
        model=model,
        args=training_args,
        env=env,
        user=user,
        train_dataset=train_dataset,
        processing_class=tokenizer,
        peft_config=get_peft_config(model_args),
    )
    hub_config = {
        "variant": training_args.variant,
        "base_model": model_path,
        "learning_rate": training_args.learning_rate,
        "num_generations": training_args.num_generations,
        "max_completion_length": training_args.max_completion_length,
        "split": script_args.split,
        "user_simulator": script_args.user_simulator,
        **{k: getattr(training_args, k) for k in ("turn_discount_alpha", "prm_coef", "prm_clip", "turn_credit_coef")
           if getattr(training_args, k) is not None},
    }  # fmt: skip
    hub = LocalHubCallback(trainer, script_args.hub_dir, run_name, hub_config)
    trainer.add_callback(hub)
    use_step_lines(trainer, str(Path(script_args.hub_dir) / run_name))

    checkpoint = training_args.resume_from_checkpoint
    if checkpoint is None and os.path.isdir(training_args.output_dir):
        checkpoint = get_last_checkpoint(training_args.output_dir)
    if checkpoint:
        logger.warning("resuming from %s", checkpoint)  # warning: shown at the default log level
    result = trainer.train(resume_from_checkpoint=checkpoint)
    trainer.log_metrics("train", result.metrics)
    trainer.save_metrics("train", result.metrics)
    trainer.save_state()
    trainer.save_model(training_args.output_dir)
    exported = hub.export(trainer.state)
    if exported is not None and trainer.is_world_process_zero():
        logger.info("local hub revision: %s", exported)


def make_parser() -> TrlParser:
    return TrlParser((GRPOScriptArguments, MultiTurnGRPOConfig, ModelConfig))


def parse_args(argv: list[str] | None = None) -> tuple[GRPOScriptArguments, MultiTurnGRPOConfig, ModelConfig]:
    """Parses the recipe and flags; a configuration error exits with its one-line message, not a traceback."""
    try:
        return make_parser().parse_args_and_config(args=argv)
    except ValueError as err:  # the configs' __post_init__ checks (variant fields, --use_vllm without vLLM, ...)
        raise SystemExit(f"error: {err}") from None


if __name__ == "__main__":
    main(*parse_args())
