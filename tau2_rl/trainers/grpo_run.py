"""What ``train_grpo.py`` builds around ``MultiTurnGRPOTrainer``: the model it trains, the task rows it trains on, the
prompt style, the run's fingerprint (which checkpoint may be resumed) and model-card fields, and the stops on a dead
user simulator or rollout worker.

Kept out of the entry script so that its ``main()`` reads as parse → build → train → export, and beside the trainer
because each piece is the GRPO run's own (SFT's counterparts are in ``trainers/sft.py``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import datasets
from trl import ModelConfig

from tau2_rl.configs import GRPOScriptArguments, MultiTurnGRPOConfig
from tau2_rl.data import base_model
from tau2_rl.data.default_policy import domains_tag
from tau2_rl.envs.multi import RunEnv, run_env, run_split
from tau2_rl.envs.prompt_style import compact_env, style_name, use_compact_prompt
from tau2_rl.envs.splits import Split
from tau2_rl.evaluation.results import domains_config
from tau2_rl.rewards.outcome import require_scorable, scorer
from tau2_rl.run.cli import error_line, exit_with_line
from tau2_rl.run.guard import model_identity

VARIANT_COEFFICIENTS = ("turn_discount_alpha", "prm_coef", "prm_clip", "turn_credit_coef")


def resolve_model_path(model_args: ModelConfig, script_args: GRPOScriptArguments, output_dir: str, env: RunEnv) -> str:
    """The model to train: the given path, the default policy (``--warmup_tasks``), or the tiny model; cached."""
    if model_args.model_name_or_path:
        return base_model.check_local_model(model_args.model_name_or_path)
    if script_args.warmup_tasks:  # one cache wherever --output_dir is
        return base_model.default_policy(
            script_args.warmup_tasks,
            script_args.warmup_cache_dir,
            script_args.warmup_epochs,
            script_args.data_dir,
            [member.spec for member in env.members],
        )
    return base_model.tiny_default(env, output_dir, script_args.tiny_model_dir)


def compact_prompt(script_args: GRPOScriptArguments, model_args: ModelConfig) -> bool:
    """``--compact_prompt`` when given; else compact for the embedded default, else what the model records."""
    embedded_default = bool(script_args.warmup_tasks and not model_args.model_name_or_path)
    return use_compact_prompt(script_args.compact_prompt, model_args.model_name_or_path, default=embedded_default)


def run_environment(script_args: GRPOScriptArguments, compact: bool) -> tuple[RunEnv, Split]:
    """The run's environment over ``--domain`` (each domain with its one-line prompt when ``compact``) and split."""
    env = run_env(script_args.domain_specs(), script_args.data_dirs(), script_args.env_config())
    if compact:
        for member in env.members:
            compact_env(member)
    return env, run_split(env, script_args.split, script_args.split_file)


def task_dataset(script_args: GRPOScriptArguments, env: RunEnv, split: Split) -> datasets.Dataset:
    """One prompt row per (task, repeat); the trainer plays the episode, the prompt column (the system prompt of
    the task's domain) only feeds TRL's logs."""
    if script_args.tasks:
        task_ids = [t.strip() for t in script_args.tasks.split(",") if t.strip()]
        for task_id in task_ids:
            try:
                env.task(task_id)  # unknown ids fail here with the valid range
            except KeyError as err:
                raise ValueError(f"--tasks: {err.args[0]}") from None
    else:
        task_ids = list(split.train)
    prompts = {t: [{"role": "system", "content": env.env_of(t).system_prompt}] for t in task_ids}
    rows = [{"prompt": prompts[t], "task_id": t} for _ in range(script_args.task_repeats) for t in task_ids]
    return datasets.Dataset.from_list(rows)


def reward_scorer(script_args: GRPOScriptArguments, env: RunEnv, task_ids: list[str]) -> Any:
    """The outcome reward of the run's tasks (training and held-out): with τ²'s NL-assertion judge (``--judge_*``,
    its endpoint checked now) when one is given; a task whose reward needs a term the run cannot compute stops the
    run here, in one line (``require_scorable``)."""
    judge = script_args.judge()
    require_scorable({key: env.task(key) for key in task_ids}, judge is not None)
    if judge is not None:
        judge.check_endpoint(timeout=min(10.0, script_args.judge_timeout))
    return scorer(judge)


def run_fingerprint(
    script_args: GRPOScriptArguments,
    training_args: MultiTurnGRPOConfig,
    model_args: ModelConfig,
    model_path: str,
    task_ids: list[str],
    compact: bool,
    env: RunEnv,
    split: Split,
) -> dict[str, Any]:
    """What makes a GRPO run *this* run: a checkpoint of another fingerprint is never resumed (run/guard.py)."""
    tag = domains_tag([member.spec for member in env.members])
    return {
        "model": model_identity(model_path),
        "model_revision": model_args.model_revision,
        "use_peft": model_args.use_peft,
        "variant": training_args.variant,
        **{k: getattr(training_args, k) for k in VARIANT_COEFFICIENTS},
        "prm_rules": training_args.prm_rules,  # the process reward's rule set (docs/prm_lite.md)
        "tasks": task_ids,
        "task_repeats": script_args.task_repeats,
        "data_dir": model_identity(script_args.data_dir) if script_args.data_dir else None,
        "split": split.name,
        "split_file": script_args.split_file,
        "user_simulator": script_args.user_simulator,
        "user_model": script_args.user_model,
        "compact_prompt": compact,
        **({"judge": script_args.judge_model} if script_args.judge_base_url else {}),  # who judges NL_ASSERTION
        # another domain is another run; the fingerprint of the domain that predates domains stays as it was
        **({"domain": tag} if tag is not None else {}),
    }  # fmt: skip


def hub_card_config(
    script_args: GRPOScriptArguments,
    training_args: MultiTurnGRPOConfig,
    model_path: str,
    compact: bool,
    env: RunEnv,
    split: Split,
) -> dict[str, Any]:
    """The training fields a local-hub revision's card and ``config`` record (``evaluate.py --compare`` shows them)."""
    return {
        "variant": training_args.variant,
        "prm_rules": training_args.prm_rules,  # evaluate.py copies it into results.json, --compare shows it
        "base_model": model_path,
        "learning_rate": training_args.learning_rate,
        "num_generations": training_args.num_generations,
        "max_completion_length": training_args.max_completion_length,
        **domains_config(env),
        "split": split.name,
        "user_simulator": script_args.user_simulator,
        "system_prompt": style_name(compact),
        **{k: getattr(training_args, k) for k in VARIANT_COEFFICIENTS if getattr(training_args, k) is not None},
    }  # fmt: skip


def stop_for_user_errors(trainer: Any, script_args: GRPOScriptArguments) -> None:
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


def stop_for_worker_failure(trainer: Any, err: Exception) -> None:
    """The rollout worker died (``--max_staleness``): the weights of the last finished step are saved as a
    checkpoint, the worker is stopped, and the run exits 1 in one line; rerunning resumes from that checkpoint."""
    if trainer._ahead is not None:
        trainer._ahead.close()
    step = trainer.state.global_step
    saved = Path(trainer.args.output_dir) / f"checkpoint-{step}"
    trainer.accelerator.wait_for_everyone()  # every rank sees the same checkpoint folder before any of them saves
    if step > 0 and not saved.is_dir() and trainer.args.save_strategy != "no":
        trainer._save_checkpoint(trainer.model, trial=None)
        trainer.control = trainer.callback_handler.on_save(trainer.args, trainer.state, trainer.control)
    where = f", checkpoint saved in {saved}" if saved.is_dir() else " (no step finished: nothing to save)"
    line = error_line(f"{err}; stopped at step {step}{where}; rerun the same command to resume")
    if trainer.is_world_process_zero():
        exit_with_line(line, 1)
    raise SystemExit(1)
