"""SFT warm-up on teacher trajectories of the τ²-bench airline domain (TRL's SFTTrainer, assistant-token masks).

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
import os
import time
from pathlib import Path

import datasets
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import ModelConfig, SFTConfig, TrlParser, get_peft_config

from airline_rl.cli import parse_or_exit, run_main
from airline_rl.configs import CollectArguments, SFTScriptArguments
from airline_rl.console import ratio_steps_are_no_mismatch, tied_missing_keys_are_expected
from airline_rl.data.collect import CollectError, collect, load_trajectories, parse_task_list, select_tasks
from airline_rl.deepspeed_cpu import DeepSpeedLaunchError
from airline_rl.envs.data import DomainDataError
from airline_rl.envs.episode import AirlineEnv
from airline_rl.envs.splits import SplitError, get_split
from airline_rl.envs.tools import TOOL_SCHEMAS
from airline_rl.graceful_stop import train_or_stop
from airline_rl.hub import (
    HubError,
    check_model_dir,
    claim_hub_run,
    ensure_writable,
    save_consolidated,
    write_json_atomic,
)
from airline_rl.optional import MissingDependencyError, require_for_training
from airline_rl.precision import check_update_precision
from airline_rl.run_guard import RunGuardError, claim_output_dir, model_identity
from airline_rl.script_setup import setup_run
from airline_rl.sharding import LaunchError
from airline_rl.trainers.console import summary_line, tensorboard_dir
from airline_rl.trainers.sft import (
    REPORT_FILE,
    AirlineSFTTrainer,
    SFTDataError,
    export_model_dir,
    prepare_sft_dataset,
    trainer_columns,
    validate_columns,
)
from airline_rl.update_monitor import add_update_monitor

logger = logging.getLogger(__name__)


def check_model_path(model_args: ModelConfig) -> None:
    """A given ``--model_name_or_path`` must be a complete local model directory (checked before any work)."""
    path = Path(model_args.model_name_or_path)
    if not path.exists():
        raise SystemExit(
            f"--model_name_or_path {path} does not exist: pass a local model directory (nothing is downloaded)"
        )
    check_model_dir(path, "--model_name_or_path")  # a HubError naming the missing files


def resolve_model_path(
    model_args: ModelConfig, script_args: SFTScriptArguments, output_dir: str, env: AirlineEnv
) -> str:
    """The model to fine-tune: the given path, or the embedded tiny model (built once and cached)."""
    if model_args.model_name_or_path:
        check_model_path(model_args)
        return str(model_args.model_name_or_path)
    from airline_rl.data.tiny_model import build_tiny_model, default_tiny_model_dir

    hidden, layers = script_args.tiny_hidden_size, script_args.tiny_num_layers
    directory = script_args.tiny_model_dir or default_tiny_model_dir(Path(output_dir).parent)
    if not script_args.tiny_model_dir and (hidden, layers) != (64, 2):
        directory = Path(directory).with_name(f"{Path(directory).name}-h{hidden}-l{layers}")
    extra = [env.system_prompt, *(str(schema) for schema in TOOL_SCHEMAS)]  # as train_grpo.py: the same tokenizer
    return str(
        build_tiny_model(
            directory, hidden_size=hidden, num_layers=layers, intermediate_size=2 * hidden, extra_texts=extra
        )
    )


def resolve_dataset(script_args: SFTScriptArguments) -> datasets.Dataset:
    """The trajectories: ``--dataset_path``, or the embedded default (oracle on the split's covered tasks)."""
    if script_args.dataset_path:
        dataset = load_trajectories(script_args.dataset_path, script_args.hub_dir)
        try:  # a foreign dataset is refused here, before any model is built
            validate_columns(dataset)
        except SFTDataError as err:
            raise SFTDataError(f"--dataset_path {script_args.dataset_path}: {err}") from None
        return dataset
    args = CollectArguments(
        data_dir=script_args.data_dir,
        split=script_args.split,
        split_file=script_args.split_file,
        max_turns=script_args.max_turns,
        max_tool_errors=script_args.max_tool_errors,
        teacher="oracle",
        user_simulator="scripted",
        hub_dir=script_args.hub_dir,
        progress=False,
    )
    result = collect(args)  # resumable: a second run only reloads it
    return load_trajectories(result.output_dir)


def save_final_model(trainer: AirlineSFTTrainer, tokenizer, output_dir: str, peft: bool) -> None:
    """``output_dir`` holds a plain model (LoRA merged; the adapter alone goes to ``output_dir/adapter``)."""
    if not peft:
        save_consolidated(trainer, output_dir)  # a plain HF model, also under FSDP's sharded checkpoints
        return
    trainer.save_model(os.path.join(output_dir, "adapter"))
    if trainer.is_world_process_zero():
        merged = trainer.accelerator.unwrap_model(trainer.model).merge_and_unload()
        merged.save_pretrained(output_dir)
        tokenizer.save_pretrained(output_dir)


def main(script_args: SFTScriptArguments, training_args: SFTConfig, model_args: ModelConfig) -> dict:
    setup_run(training_args, logger)
    try:
        require_for_training(training_args)  # DeepSpeed asked for but not installed: one line, before any work
    except (MissingDependencyError, DeepSpeedLaunchError) as err:
        raise SystemExit(f"error: {err}") from None
    ensure_writable(script_args.hub_dir)
    if model_args.model_name_or_path:
        check_model_path(model_args)
    run_name = training_args.run_name or Path(training_args.output_dir).name
    # hub/<run_name> of another run (another output_dir) would be replaced by this run's export
    claim_hub_run(script_args.hub_dir, run_name, training_args.output_dir, overwrite=script_args.overwrite_hub)

    env = AirlineEnv(script_args.data_dir, script_args.env_config())
    split = get_split(script_args.split, script_args.split_file, frozenset(env.domain.tasks))
    if script_args.tasks is not None:  # an unknown id is named here, not reported later as an empty dataset
        select_tasks(parse_task_list(script_args.tasks), split, env.domain.tasks, allow_test_tasks=True)
    with training_args.main_process_first(desc="teacher trajectories"):  # the default collects them once
        trajectories = resolve_dataset(script_args)
    model_path = resolve_model_path(model_args, script_args, training_args.output_dir, env)
    tokenizer = AutoTokenizer.from_pretrained(model_path, revision=model_args.model_revision)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token

    fingerprint = {  # what makes an SFT run *this* run: a checkpoint of another one is never resumed (run_guard.py)
        "model": model_identity(model_path),
        "model_revision": model_args.model_revision,
        "use_peft": model_args.use_peft,
        "dataset": model_identity(script_args.dataset_path) if script_args.dataset_path else None,
        "data_dir": model_identity(script_args.data_dir) if script_args.data_dir else None,
        "tasks": script_args.tasks,
        "min_reward": script_args.min_reward,
        "split": script_args.split,
        "split_file": script_args.split_file,
        "max_length": training_args.max_length,
    }
    record = claim_output_dir(training_args, fingerprint, overwrite_output_dir=script_args.overwrite_output_dir)
    if record.decision.complete:  # a rerun of a finished run trains nothing and exports nothing
        logger.info("%s", record.decision.message)
        return {"complete": True, "message": record.decision.message}

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

    dtype = model_args.dtype if model_args.dtype in ("auto", None) else getattr(torch, model_args.dtype)
    model = AutoModelForCausalLM.from_pretrained(
        model_path,
        revision=model_args.model_revision,
        dtype=dtype,
        attn_implementation=model_args.attn_implementation,
    )
    peft_config = get_peft_config(model_args)
    try:
        trainer = AirlineSFTTrainer(
            model=model,
            args=training_args,
            train_dataset=trainer_columns(train_dataset),
            processing_class=tokenizer,
            peft_config=peft_config,
        )
    except LaunchError as err:  # a sharded config that would not shard (airline_rl/sharding.py)
        raise SystemExit(f"error: {err}") from None
    check_update_precision(trainer, script_args.allow_rounded_updates)  # refuses bf16 weights that would not move
    add_update_monitor(trainer)
    tied_missing_keys_are_expected(trainer)  # no lm_head.weight warning on resume for tied embeddings
    ratio_steps_are_no_mismatch(training_args.max_steps)  # "save_steps: 0.5 != 3" on every resume
    checkpoint = record.decision.checkpoint
    if checkpoint:
        logger.info("resuming from %s", checkpoint)
    started = time.perf_counter()
    result = train_or_stop(trainer, checkpoint)  # SIGTERM (also to the launcher): checkpoint, then exit
    seconds = time.perf_counter() - started
    trainer.log_metrics("train", result.metrics)
    trainer.save_metrics("train", result.metrics)
    trainer.save_state()
    save_final_model(trainer, tokenizer, training_args.output_dir, peft_config is not None)

    exported = None
    if trainer.is_world_process_zero():
        metrics = {}
        for entry in reversed(trainer.state.log_history):
            metrics = {k: v for k, v in entry.items() if isinstance(v, int | float)}
            if metrics:
                break
        info = {
            "config": {
                "base_model": model_path,
                "dataset": script_args.dataset_path or "oracle trajectories (embedded default)",
                "learning_rate": training_args.learning_rate,
                "num_train_epochs": training_args.num_train_epochs,
                "max_steps": training_args.max_steps,
                "max_length": training_args.max_length,
                "lora": peft_config is not None,
                "split": script_args.split,
            },
            "data": report.summary(),
            "metrics": metrics,
        }
        exported = export_model_dir(
            training_args.output_dir, script_args.hub_dir, run_name, trainer.state.global_step, info
        )
        logger.info("local hub revision: %s", exported)
        record.mark_complete(trainer.state.global_step)
        tensorboard = tensorboard_dir(trainer.callback_handler)
        line = summary_line(trainer.state.log_history, training_args.output_dir, str(exported), tensorboard, seconds,
                            metric=("loss", "loss"), picture=False, steps_done=trainer.state.global_step)  # fmt: skip
        print(line, flush=True)
    trainer.accelerator.wait_for_everyone()
    return {"report": report.to_dict(), "metrics": result.metrics, "hub_path": str(exported) if exported else None}


def make_parser() -> TrlParser:
    return TrlParser((SFTScriptArguments, SFTConfig, ModelConfig))


INPUT_ERRORS = (SFTDataError, CollectError, HubError, SplitError, RunGuardError, DomainDataError)


def cli(argv: list[str] | None = None) -> dict:
    """The command line: bad input (``INPUT_ERRORS``) exits with status 2 and one line naming the row, file or flag."""
    return run_main(lambda: main(*parse_or_exit(make_parser(), argv)), INPUT_ERRORS)


if __name__ == "__main__":
    cli()
