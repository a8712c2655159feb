"""SFT warm-up on teacher trajectories of τ²-bench's domains (TRL's SFTTrainer, assistant-token masks).

    # the embedded default: tiny random-weight Qwen2 + oracle trajectories of the covered tasks, CPU, a few minutes
    accelerate launch --config_file accelerate_configs/cpu.yaml train_sft.py --config recipes/sft/cpu_smoke.yaml
    # a real run on trajectories collected with collect_trajectories.py
    accelerate launch --config_file accelerate_configs/zero2_offload.yaml train_sft.py \
        --config recipes/sft/qwen2_5_7b.yaml --model_name_or_path /models/Qwen2.5-7B-Instruct \
        --dataset_path outputs/trajectories/openai-seed
    # then GRPO from the SFT model
    accelerate launch ... train_grpo.py --config recipes/grpo/joint.yaml --model_name_or_path outputs/sft-qwen2_5-7b

Any recipe field can be overridden on the command line. The final model (LoRA merged into the base weights) is saved
to ``output_dir`` and exported to ``<hub_dir>/<run_name>/step-<N>``; both load with ``from_pretrained``.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

from trl import ModelConfig, SFTConfig, TrlParser, get_peft_config

from tau2_rl.configs import SFTScriptArguments
from tau2_rl.data import base_model
from tau2_rl.data.collect import CollectError, parse_task_list, select_tasks
from tau2_rl.domains import UnknownDomainError
from tau2_rl.envs.data import DomainDataError
from tau2_rl.envs.multi import RunEnv, run_env, run_split
from tau2_rl.envs.splits import SplitError
from tau2_rl.run.cli import parse_or_exit, run_main
from tau2_rl.run.guard import RunGuardError
from tau2_rl.run.hub import HubError, write_json_atomic
from tau2_rl.run.sharding import LaunchError
from tau2_rl.run.training_run import TrainingRun
from tau2_rl.trainers.sft import REPORT_FILE, SFTDataError, ShardedSFTTrainer, prepare_sft_dataset, trainer_columns
from tau2_rl.trainers.sft_run import export_and_summarize, resolve_dataset, run_fingerprint, save_final_model

logger = logging.getLogger(__name__)


def resolve_model_path(model_args: ModelConfig, script_args: SFTScriptArguments, output_dir: str, env: RunEnv) -> str:
    """The model to fine-tune: the given path, or the embedded tiny model (built once and cached)."""
    if model_args.model_name_or_path:
        base_model.check_local_model(model_args.model_name_or_path)
        return str(model_args.model_name_or_path)  # as given (the card's base_model), not normalised
    return base_model.tiny_default(  # the tokenizer train_grpo.py's tiny model has: an SFT model feeds GRPO
        env, output_dir, script_args.tiny_model_dir, hidden=script_args.tiny_hidden_size,
        layers=script_args.tiny_num_layers,
    )  # fmt: skip


def main(script_args: SFTScriptArguments, training_args: SFTConfig, model_args: ModelConfig) -> dict:
    run = TrainingRun.begin(training_args, script_args.hub_dir, logger)
    if model_args.model_name_or_path:
        base_model.check_local_model(model_args.model_name_or_path)
    run.claim_hub(overwrite=script_args.overwrite_hub)  # another run's export would be replaced by this one's

    env = run_env(script_args.domain_specs(), script_args.data_dirs(), script_args.env_config())
    split = run_split(env, script_args.split, script_args.split_file)
    if script_args.tasks is not None:  # an unknown id is named here, not reported later as an empty dataset
        select_tasks(parse_task_list(script_args.tasks), split, env.task_keys, allow_test_tasks=True)
    with training_args.main_process_first(desc="teacher trajectories"):  # the default collects them once
        trajectories = resolve_dataset(script_args, env)
    model_path = resolve_model_path(model_args, script_args, training_args.output_dir, env)
    tokenizer = base_model.load_tokenizer(model_path, model_args)
    fingerprint = run_fingerprint(script_args, training_args, model_args, model_path, env, split)
    if not run.claim_output_dir(fingerprint, overwrite=script_args.overwrite_output_dir):
        return {"complete": True, "message": run.complete_message}  # a rerun trains and exports nothing

    train_dataset, report = prepare_sft_dataset(
        trajectories,
        tokenizer,
        tasks=parse_task_list(script_args.tasks),
        min_reward=script_args.min_reward,
        split=split,
        allow_test_tasks=script_args.allow_test_tasks,
        max_length=training_args.max_length,
        truncation_mode=training_args.truncation_mode,
    )
    logger.info("SFT data: %s", report.summary())
    if training_args.process_index == 0:
        write_json_atomic(Path(training_args.output_dir) / REPORT_FILE, report.to_dict())
    model = base_model.load_model(model_path, model_args)
    peft_config = get_peft_config(model_args)
    try:
        trainer = ShardedSFTTrainer(model=model, args=training_args, train_dataset=trainer_columns(train_dataset),
                                    processing_class=tokenizer, peft_config=peft_config)  # fmt: skip
    except LaunchError as err:  # a sharded config that would not shard (tau2_rl/run/sharding.py)
        raise SystemExit(f"error: {err}") from None
    run.guard(trainer, allow_rounded_updates=script_args.allow_rounded_updates)

    started = time.perf_counter()
    result = run.train(trainer)
    seconds = time.perf_counter() - started
    run.save_metrics(trainer, result)
    save_final_model(trainer, tokenizer, training_args.output_dir, peft_config is not None)
    exported = None
    if trainer.is_world_process_zero():
        exported, line = export_and_summarize(
            trainer,
            script_args,
            run.run_name,
            model_path,
            report,
            peft_config is not None,
            seconds,
            env,
            split,
            resumed_from=run.resumed_step,
        )
        logger.info("local hub revision: %s", exported)
        run.complete(trainer.state.global_step)
        print(line, flush=True)
    trainer.accelerator.wait_for_everyone()
    return {"report": report.to_dict(), "metrics": result.metrics, "hub_path": exported}


def make_parser() -> TrlParser:
    return TrlParser((SFTScriptArguments, SFTConfig, ModelConfig))


PROG = "train_sft.py"
INPUT_ERRORS = (SFTDataError, CollectError, HubError, SplitError, RunGuardError, DomainDataError, UnknownDomainError)


def cli(argv: list[str] | None = None) -> dict:
    """The command line: bad input (``INPUT_ERRORS``) exits with status 2 and one line naming the row, file or flag."""
    return run_main(lambda: main(*parse_or_exit(make_parser(), argv, PROG)), INPUT_ERRORS, PROG)


if __name__ == "__main__":
    cli()
