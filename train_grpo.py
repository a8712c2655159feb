"""Multi-turn GRPO on the τ²-bench airline domain with one of five loss variants.

    # the embedded default: tiny random-weight Qwen2 + scripted user, on CPU, a few minutes
    accelerate launch --config_file accelerate_configs/cpu.yaml train_grpo.py --config recipes/grpo/cpu_smoke.yaml
    # a real run (see README "Reproducing the ablation")
    accelerate launch --config_file accelerate_configs/zero2_offload.yaml train_grpo.py \
        --config recipes/grpo/joint.yaml --model_name_or_path /models/Qwen2.5-7B-Instruct

Any recipe field can be overridden on the command line (``--variant lata``, ``--max_steps 10``...).
"""

from __future__ import annotations

import logging
from pathlib import Path

import datasets
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import ModelConfig, TrlParser, get_peft_config

from airline_rl.cli import error_line, exit_with_line, parse_or_exit, run_main
from airline_rl.configs import GRPOScriptArguments, MultiTurnGRPOConfig
from airline_rl.console import (
    DropNoneLogs,
    install_first,
    ratio_steps_are_no_mismatch,
    silence_known_warnings,
    tied_missing_keys_are_expected,
)
from airline_rl.envs.episode import AirlineEnv
from airline_rl.envs.prompt_style import compact_env, style_name, use_compact_prompt, write_prompt_style
from airline_rl.envs.splits import get_split
from airline_rl.envs.tools import TOOL_SCHEMAS
from airline_rl.envs.users import check_user_endpoint, get_user_simulator
from airline_rl.evaluation.heldout import build_heldout
from airline_rl.graceful_stop import train_or_stop
from airline_rl.hub import (
    HubError,
    LocalHubCallback,
    check_model_dir,
    claim_hub_run,
    ensure_writable,
    save_consolidated,
)
from airline_rl.optional import require_for_training
from airline_rl.precision import check_update_precision
from airline_rl.run_guard import RunGuardError, claim_output_dir, model_identity
from airline_rl.script_setup import setup_run
from airline_rl.sharding import LaunchError, world_size_from_env
from airline_rl.trainers.console import use_step_lines
from airline_rl.trainers.multiturn_grpo import MultiTurnGRPOTrainer
from airline_rl.update_monitor import add_update_monitor

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
        try:
            check_model_dir(path, "--model_name_or_path")
        except HubError as err:
            raise SystemExit(f"error: {err}") from None
        return str(path)
    if script_args.warmup_tasks:
        from airline_rl.data import default_policy

        tasks = [t.strip() for t in script_args.warmup_tasks.split(",") if t.strip()]
        # one cache wherever --output_dir is (it used to be built again next to an output_dir outside outputs/)
        directory = default_policy.default_policy_dir(script_args.warmup_cache_dir, tasks, script_args.warmup_epochs)
        # a rank of a multi-process launch builds in a one-process child: never inside the run's process group
        build = default_policy.build_default_policy_isolated if world_size_from_env() > 1 else (
            default_policy.build_default_policy)  # fmt: skip
        return str(build(directory, tasks, epochs=script_args.warmup_epochs, data_dir=script_args.data_dir))
    from airline_rl.data.tiny_model import build_tiny_model, default_tiny_model_dir

    directory = script_args.tiny_model_dir or default_tiny_model_dir(Path(output_dir).parent)
    extra = [env.system_prompt, *(str(schema) for schema in TOOL_SCHEMAS)]
    return str(build_tiny_model(directory, extra_texts=extra))


def compact_prompt(script_args: GRPOScriptArguments, model_args: ModelConfig) -> bool:
    """``--compact_prompt`` when given; else compact for the embedded default, else what the model records."""
    embedded_default = bool(script_args.warmup_tasks and not model_args.model_name_or_path)
    return use_compact_prompt(script_args.compact_prompt, model_args.model_name_or_path, default=embedded_default)


def task_dataset(script_args: GRPOScriptArguments, env: AirlineEnv, system_prompt: str) -> datasets.Dataset:
    """One prompt row per (task, repeat); the trainer plays the episode, the prompt column only feeds TRL's logs."""
    split = get_split(script_args.split, script_args.split_file, frozenset(env.domain.tasks))
    if script_args.tasks:
        task_ids = [t.strip() for t in script_args.tasks.split(",") if t.strip()]
        for task_id in task_ids:
            try:
                env.domain.get_task(task_id)  # unknown ids fail here with the valid range
            except KeyError as err:
                raise ValueError(f"--tasks: {err.args[0]}") from None
    else:
        task_ids = list(split.train)
    prompt = [{"role": "system", "content": system_prompt}]
    rows = [{"prompt": prompt, "task_id": t} for _ in range(script_args.task_repeats) for t in task_ids]
    return datasets.Dataset.from_list(rows)


def run_fingerprint(
    script_args: GRPOScriptArguments,
    training_args: MultiTurnGRPOConfig,
    model_args: ModelConfig,
    model_path: str,
    task_ids: list[str],
    compact: bool,
) -> dict:
    """What makes a GRPO run *this* run: a checkpoint of another fingerprint is never resumed (run_guard.py)."""
    return {
        "model": model_identity(model_path),
        "model_revision": model_args.model_revision,
        "use_peft": model_args.use_peft,
        "variant": training_args.variant,
        **{k: getattr(training_args, k) for k in ("turn_discount_alpha", "prm_coef", "prm_clip", "turn_credit_coef")},
        "prm_rules": training_args.prm_rules,  # the process reward's rule set (docs/prm_lite.md)
        "tasks": task_ids,
        "task_repeats": script_args.task_repeats,
        "data_dir": model_identity(script_args.data_dir) if script_args.data_dir else None,
        "split": script_args.split,
        "split_file": script_args.split_file,
        "user_simulator": script_args.user_simulator,
        "user_model": script_args.user_model,
        "compact_prompt": compact,
    }  # fmt: skip


def main(script_args: GRPOScriptArguments, training_args: MultiTurnGRPOConfig, model_args: ModelConfig) -> None:
    setup_run(training_args, logger)
    # Everything the user can get wrong is checked before any model is built or loaded; each message names its flag.
    try:
        require_for_training(training_args)  # --use_vllm / DeepSpeed: here, where the run starts, not in the config
        ensure_writable(script_args.hub_dir)
        env = AirlineEnv(script_args.data_dir, script_args.env_config())
        compact = compact_prompt(script_args, model_args)
        if compact:
            compact_env(env)
        train_dataset = task_dataset(script_args, env, env.system_prompt)
        user = get_user_simulator(script_args.user_simulator, **script_args.user_kwargs())
        check_user_endpoint(user, timeout=min(10.0, float(script_args.user_timeout)))  # as evaluate.py does
    except (HubError, KeyError, ValueError, ConnectionError) as err:  # bad --hub_dir, --data_dir, --split, --tasks,
        # --user_* flags, or a user endpoint that does not answer
        raise SystemExit(f"error: {err.args[0] if isinstance(err, KeyError) else err}") from None
    run_name = training_args.run_name or Path(training_args.output_dir).name
    try:  # hub/<run_name> of another run (the recipes fix run_name) would be overwritten by this run's exports
        claim_hub_run(script_args.hub_dir, run_name, training_args.output_dir, overwrite=script_args.overwrite_hub)
    except HubError as err:
        raise SystemExit(f"error: {err}") from None

    try:  # held-out pass^k at eval steps (eval_strategy: steps); None when evaluation is off
        split = get_split(script_args.split, script_args.split_file, frozenset(env.domain.tasks))
        heldout = build_heldout(script_args, training_args, env, user, split, run_name)
    except ValueError as err:
        raise SystemExit(f"error: {err}") from None
    model_path = resolve_model_path(model_args, script_args, training_args.output_dir, env)
    logger.info("policy model: %s; variant: %s; user simulator: %s", model_path, training_args.variant, user.name)
    task_ids = list(dict.fromkeys(train_dataset["task_id"]))
    fingerprint = run_fingerprint(script_args, training_args, model_args, model_path, task_ids, compact)
    try:
        record = claim_output_dir(training_args, fingerprint, overwrite_output_dir=script_args.overwrite_output_dir)
    except RunGuardError as err:
        raise SystemExit(f"error: {err}") from None
    if record.decision.complete:  # a rerun of a finished run trains nothing and leaves the hub's main alone
        logger.info("%s", record.decision.message)
        return

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
    silence_known_warnings()  # TRL's luspo/importance-sampling advice does not apply to per-token advantages
    ratio_steps_are_no_mismatch(training_args.max_steps)  # "eval_steps: 0.5 != 3" on every resume
    try:
        trainer = MultiTurnGRPOTrainer(
            model=model,
            args=training_args,
            env=env,
            user=user,
            train_dataset=train_dataset,
            processing_class=tokenizer,
            peft_config=get_peft_config(model_args),
            heldout=heldout,
        )
    except LaunchError as err:  # a sharded config that would not shard, a setting the rollouts cannot honour
        raise SystemExit(f"error: {err}") from None
    if heldout is not None:
        try:
            heldout.check_existing(trainer)
        except ValueError as err:
            raise SystemExit(f"error: {err}") from None
    hub_config = {
        "variant": training_args.variant,
        "prm_rules": training_args.prm_rules,  # evaluate.py copies it into results.json, --compare shows it
        "base_model": model_path,
        "learning_rate": training_args.learning_rate,
        "num_generations": training_args.num_generations,
        "max_completion_length": training_args.max_completion_length,
        "split": script_args.split,
        "user_simulator": script_args.user_simulator,
        "system_prompt": style_name(compact),
        **{k: getattr(training_args, k) for k in ("turn_discount_alpha", "prm_coef", "prm_clip", "turn_credit_coef")
           if getattr(training_args, k) is not None},
    }  # fmt: skip
    install_first(trainer, DropNoneLogs())
    tied_missing_keys_are_expected(trainer)
    hub = LocalHubCallback(trainer, script_args.hub_dir, run_name, hub_config)
    trainer.add_callback(hub)
    check_update_precision(trainer, script_args.allow_rounded_updates)  # refuses bf16 weights that would not move
    add_update_monitor(trainer)
    step_lines = use_step_lines(trainer, str(Path(script_args.hub_dir) / run_name))

    checkpoint = record.decision.checkpoint
    if checkpoint:
        logger.info("resuming from %s", checkpoint)
    result = train_or_stop(trainer, checkpoint)  # SIGTERM (also to the launcher): checkpoint, then exit
    if trainer.user_error_stop.stopped:  # the user simulator failed every episode: not a trained model
        stop_for_user_errors(trainer, script_args)
    trainer.log_metrics("train", result.metrics)
    trainer.save_metrics("train", result.metrics)
    trainer.save_state()
    save_consolidated(trainer, training_args.output_dir)  # a plain HF model, also under FSDP's sharded checkpoints
    if trainer.is_world_process_zero():
        write_prompt_style(training_args.output_dir, compact)  # evaluate.py prompts the model as it was trained
    exported = hub.export(trainer.state)
    if exported is not None and trainer.is_world_process_zero():
        logger.info("local hub revision: %s", exported)
    if trainer.is_world_process_zero():
        record.mark_complete(trainer.state.global_step)
        revision = exported or hub.last_exported
        user_errors = (trainer.user_error_episodes, trainer.episodes_played)
        print(step_lines.summary(trainer.state, training_args.output_dir, revision, user_errors), flush=True)


def stop_for_user_errors(trainer: MultiTurnGRPOTrainer, script_args: GRPOScriptArguments) -> None:
    """Exits 1 with one line naming the endpoint and its error; the checkpoint stays, the run is not complete."""
    stop = trainer.user_error_stop
    where = f" at --user_base_url {script_args.user_base_url}" if script_args.user_simulator == "llm" else ""
    saved = f"{trainer.args.output_dir}/checkpoint-{stop.stopped_at}"
    line = error_line(
        f"the user simulator{where} failed every episode of {stop.streak} consecutive step(s) "
        f"({trainer.user_error_episodes} of {trainer.episodes_played} episodes of this run were user errors; "
        f"last error: {trainer.last_user_error}); stopped at step {stop.stopped_at} without updating the weights "
        f"in those steps"
        + (f", checkpoint saved in {saved}" if Path(saved).is_dir() else "")
        + "; fix the user simulator and rerun the same command to resume"
    )
    if trainer.is_world_process_zero():
        exit_with_line(line, 1)
    raise SystemExit(1)


def make_parser() -> TrlParser:
    return TrlParser((GRPOScriptArguments, MultiTurnGRPOConfig, ModelConfig))


def parse_args(argv: list[str] | None = None) -> tuple[GRPOScriptArguments, MultiTurnGRPOConfig, ModelConfig]:
    """Parses the recipe and flags; a configuration error exits with its one-line message, not a traceback."""
    return parse_or_exit(make_parser(), argv)


def cli(argv: list[str] | None = None) -> None:
    """The command line: bad input exits with status 2 and one line (airline_rl/cli.py)."""
    run_main(lambda: main(*parse_args(argv)))


if __name__ == "__main__":
    cli()
