"""Multi-turn GRPO on τ²-bench's domains with one of five loss variants.

    # the embedded default: tiny random-weight Qwen2 + scripted user, on CPU, a few minutes
    accelerate launch --config_file accelerate_configs/cpu.yaml train_grpo.py --config recipes/grpo/cpu_smoke.yaml
    # a real run (see README "On a GPU" and docs/reproducing.md)
    accelerate launch --config_file accelerate_configs/zero2_offload.yaml train_grpo.py \
        --config recipes/grpo/joint.yaml --model_name_or_path /models/Qwen2.5-7B-Instruct

Any recipe field can be overridden on the command line (``--variant lata``, ``--max_steps 10``...).
"""

from __future__ import annotations

import logging
from pathlib import Path

from tau2_rl.run.omp_wait import passive_waits_for_generation_ahead

passive_waits_for_generation_ahead()  # --max_staleness >= 1: before torch loads (libgomp reads it once)

from trl import ModelConfig, TrlParser, get_peft_config

from tau2_rl.configs import GRPOScriptArguments, MultiTurnGRPOConfig
from tau2_rl.data import base_model
from tau2_rl.envs.prompt_style import write_prompt_style
from tau2_rl.envs.users import check_user_endpoint, get_user_simulator
from tau2_rl.evaluation.heldout import build_heldout
from tau2_rl.rewards.judge import JudgeError
from tau2_rl.run.cli import parse_or_exit, run_main
from tau2_rl.run.console import DropNoneLogs, install_first, silence_known_warnings, use_step_lines
from tau2_rl.run.hub import HubError, LocalHubCallback, save_consolidated
from tau2_rl.run.sharding import LaunchError
from tau2_rl.run.training_run import TrainingRun
from tau2_rl.trainers.generation_ahead import RolloutWorkerError
from tau2_rl.trainers.grpo_run import (
    compact_prompt,
    hub_card_config,
    resolve_model_path,
    reward_scorer,
    run_environment,
    run_fingerprint,
    stop_for_user_errors,
    stop_for_worker_failure,
    task_dataset,
)
from tau2_rl.trainers.multiturn_grpo import MultiTurnGRPOTrainer

logger = logging.getLogger(__name__)


def main(script_args: GRPOScriptArguments, training_args: MultiTurnGRPOConfig, model_args: ModelConfig) -> None:
    run = TrainingRun.begin(training_args, script_args.hub_dir, logger, exit_on_input_errors=True)
    # Everything the user can get wrong is checked before any model is built or loaded; each message names its flag.
    try:
        compact = compact_prompt(script_args, model_args)
        env, split = run_environment(script_args, compact)  # --domain, --data_dir, --split
        train_dataset = task_dataset(script_args, env, split)
        user = get_user_simulator(script_args.user_simulator, **script_args.user_kwargs())
        check_user_endpoint(user, timeout=min(10.0, float(script_args.user_timeout)))  # as evaluate.py does
        run.claim_hub(overwrite=script_args.overwrite_hub)
        schedule = script_args.episode_schedule()
        heldout = build_heldout(script_args, training_args, env, user, split, run.run_name)  # None: no evaluation
        played = list(dict.fromkeys([*train_dataset["task_id"], *(heldout.task_ids if heldout else [])]))
        score = reward_scorer(script_args, env, played)  # every term of these tasks' rewards, or one line now
    except (HubError, KeyError, ValueError, ConnectionError) as err:  # --data_dir, --split, --tasks, --user_*
        # flags, a user endpoint that does not answer, the held-out evaluation's settings
        raise SystemExit(f"error: {err.args[0] if isinstance(err, KeyError) else err}") from None
    model_path = resolve_model_path(model_args, script_args, training_args.output_dir, env)
    logger.info("policy model: %s; variant: %s; user simulator: %s", model_path, training_args.variant, user.name)
    task_ids = list(dict.fromkeys(train_dataset["task_id"]))
    fingerprint = run_fingerprint(script_args, training_args, model_args, model_path, task_ids, compact, env, split)
    if not run.claim_output_dir(fingerprint, overwrite=script_args.overwrite_output_dir):
        return  # a rerun of a finished run trains nothing and leaves the hub's main alone

    tokenizer = base_model.load_tokenizer(model_path, model_args)
    model = base_model.load_model(model_path, model_args)
    silence_known_warnings()  # TRL's luspo/importance-sampling advice does not apply to per-token advantages
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
            schedule=schedule,
            score=score,
        )
    except LaunchError as err:  # a sharded config that would not shard, a setting the rollouts cannot honour
        raise SystemExit(f"error: {err}") from None
    if heldout is not None:
        try:
            heldout.check_existing(trainer)
        except ValueError as err:
            raise SystemExit(f"error: {err}") from None
    install_first(trainer, DropNoneLogs())
    hub = LocalHubCallback(trainer, script_args.hub_dir, run.run_name, hub_card_config(
        script_args, training_args, model_path, compact, env, split))  # fmt: skip
    trainer.add_callback(hub)
    run.guard(trainer, allow_rounded_updates=script_args.allow_rounded_updates)
    step_lines = use_step_lines(trainer, str(Path(script_args.hub_dir) / run.run_name))

    try:
        result = run.train(trainer)
    except (RolloutWorkerError, JudgeError) as err:  # the worker died or failed, the judge failed: one line, the last
        stop_for_worker_failure(trainer, err)  # finished step kept as a checkpoint
    if trainer.user_error_stop.stopped:  # the user simulator failed every episode: not a trained model
        stop_for_user_errors(trainer, script_args)
    run.save_metrics(trainer, result)
    save_consolidated(trainer, training_args.output_dir)  # a plain HF model, also under FSDP's sharded checkpoints
    if trainer.is_world_process_zero():
        specs = [member.spec for member in env.members]  # evaluate.py prompts the model as it was trained
        write_prompt_style(training_args.output_dir, compact, specs)
    exported = hub.export(trainer.state)
    if trainer.is_world_process_zero():
        if exported is not None:
            logger.info("local hub revision: %s", exported)
        run.complete(trainer.state.global_step)
        user_errors = (trainer.user_error_episodes, trainer.episodes_played)
        summary = step_lines.summary(
            trainer.state, training_args.output_dir, exported or hub.last_exported, user_errors
        )
        print(summary, flush=True)


def make_parser() -> TrlParser:
    return TrlParser((GRPOScriptArguments, MultiTurnGRPOConfig, ModelConfig))


def parse_args(argv: list[str] | None = None) -> tuple[GRPOScriptArguments, MultiTurnGRPOConfig, ModelConfig]:
    """Parses the recipe and flags; a configuration error exits with its one-line message, not a traceback."""
    return parse_or_exit(make_parser(), argv, prog="train_grpo.py")


def cli(argv: list[str] | None = None) -> None:
    """The command line: bad input exits with status 2 and one line (tau2_rl/run/cli.py)."""
    run_main(lambda: main(*parse_args(argv)), prog="train_grpo.py")


if __name__ == "__main__":
    cli()
