"""What ``train_sft.py`` builds around ``ShardedSFTTrainer``: the trajectories it trains on, the run's fingerprint
(which checkpoint may be resumed), the final model and the local-hub export with its card.

Kept out of the entry script so that its ``main()`` reads as parse → build → train → export (GRPO's counterparts
are in ``trainers/grpo_run.py``).
"""

from __future__ import annotations

import os
from typing import Any

import datasets

from tau2_rl.configs import CollectArguments, SFTScriptArguments
from tau2_rl.data.collect import collect, collection_domains, load_trajectories
from tau2_rl.data.default_policy import domains_tag
from tau2_rl.envs.multi import RunEnv
from tau2_rl.envs.splits import Split
from tau2_rl.evaluation.results import domains_config
from tau2_rl.files import honour_umask
from tau2_rl.run.console import summary_line, tensorboard_dir
from tau2_rl.run.guard import model_identity
from tau2_rl.run.hub import save_consolidated
from tau2_rl.trainers.sft import SFTDataError, SFTDataReport, ShardedSFTTrainer, export_model_dir, validate_columns


def resolve_dataset(script_args: SFTScriptArguments, env: RunEnv) -> datasets.Dataset:
    """The trajectories: ``--dataset_path``, or the embedded default (oracle on the split's covered tasks)."""
    if script_args.dataset_path:
        dataset = load_trajectories(script_args.dataset_path, script_args.hub_dir)
        try:  # a foreign dataset is refused here, before any model is built
            validate_columns(dataset)
            check_domains(dataset, collection_domains(script_args.dataset_path, script_args.hub_dir), env)
        except SFTDataError as err:
            raise SFTDataError(f"--dataset_path {script_args.dataset_path}: {err}") from None
        return dataset
    args = CollectArguments(
        domain=script_args.domain,
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


def check_domains(dataset: datasets.Dataset, recorded: list[str] | None, env: RunEnv) -> None:
    """Trajectories of another domain are refused, not trained on under this one's name: the domains their
    collection recorded (``collect_info.json``) must be the run's ``--domain``'s, and every row's task id one of its
    tasks (a task id the domain lacks is counted, never skipped)."""
    mine = [member.spec.name for member in env.members]
    if recorded is not None and not set(recorded) <= set(mine):
        raise SFTDataError(
            f"its trajectories were collected on the {' and '.join(recorded)} domain(s); this run's --domain is "
            f"{','.join(mine)} (pass --domain {','.join(recorded)})"
        )
    keys = set(env.task_keys)
    ids = [str(task_id) for task_id in dataset["task_id"]]
    unknown = sorted({task_id for task_id in ids if task_id not in keys}, key=lambda t: (len(t), t))
    if unknown:
        rows = sum(task_id not in keys for task_id in ids)
        raise SFTDataError(
            f"{rows} of its {len(ids)} rows name task ids the {','.join(mine)} domain(s) lack "
            f"({', '.join(unknown[:8])}{', …' if len(unknown) > 8 else ''}): trajectories of another domain or task "
            "set? pass their --domain (and --task_set)"
        )


def run_fingerprint(
    script_args: SFTScriptArguments, training_args: Any, model_args: Any, model_path: str, env: RunEnv, split: Split
) -> dict:
    """What makes an SFT run *this* run: a checkpoint of another one is never resumed (run/guard.py)."""
    tag = domains_tag([member.spec for member in env.members])
    return {
        "model": model_identity(model_path),
        "model_revision": model_args.model_revision,
        "use_peft": model_args.use_peft,
        "dataset": model_identity(script_args.dataset_path) if script_args.dataset_path else None,
        "data_dir": model_identity(script_args.data_dir) if script_args.data_dir else None,
        "tasks": script_args.tasks,
        "min_reward": script_args.min_reward,
        "split": split.name,
        "split_file": script_args.split_file,
        "max_length": training_args.max_length,
        **({"domain": tag} if tag is not None else {}),  # the domain that predates domains: as it was
    }


def save_final_model(trainer: ShardedSFTTrainer, tokenizer: Any, output_dir: str, peft: bool) -> None:
    """``output_dir`` holds a plain model (LoRA merged; the adapter alone goes to ``output_dir/adapter``)."""
    if not peft:
        save_consolidated(trainer, output_dir)  # a plain HF model, also under FSDP's sharded checkpoints
        return
    trainer.save_model(os.path.join(output_dir, "adapter"))
    if trainer.is_world_process_zero():
        merged = trainer.accelerator.unwrap_model(trainer.model).merge_and_unload()
        merged.save_pretrained(output_dir)
        tokenizer.save_pretrained(output_dir)
        honour_umask(output_dir)


def export_and_summarize(
    trainer: ShardedSFTTrainer,
    script_args: SFTScriptArguments,
    run_name: str,
    model_path: str,
    report: SFTDataReport,
    lora: bool,
    seconds: float,
    env: RunEnv,
    split: Split,
    resumed_from: int | None = None,
) -> tuple[str, str]:
    """Rank 0: exports ``output_dir`` to ``<hub_dir>/<run_name>/step-<N>`` with its card (config, data, last
    metrics); returns (the revision, the one summary line the run prints last)."""
    args = trainer.args
    metrics = {}
    for entry in reversed(trainer.state.log_history):
        metrics = {k: v for k, v in entry.items() if isinstance(v, int | float)}
        if metrics:
            break
    info = {
        "config": {
            "base_model": model_path,
            "dataset": script_args.dataset_path or "oracle trajectories (embedded default)",
            "learning_rate": args.learning_rate,
            "num_train_epochs": args.num_train_epochs,
            "max_steps": args.max_steps,
            "max_length": args.max_length,
            "lora": lora,
            **domains_config(env),
            "split": split.name,
        },
        "data": report.summary(),
        "metrics": metrics,
    }
    exported = export_model_dir(args.output_dir, script_args.hub_dir, run_name, trainer.state.global_step, info)
    tensorboard = tensorboard_dir(trainer.callback_handler)
    line = summary_line(trainer.state.log_history, args.output_dir, str(exported), tensorboard, seconds,
                        metric=("loss", "loss"), picture=False, steps_done=trainer.state.global_step,
                        resumed_from=resumed_from)  # fmt: skip
    return str(exported), line
