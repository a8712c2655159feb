"""Optimiser steps must change the weights: the pre-training check, the in-training monitor, and the reference recipes'
precision measured on CPU (``benchmarks/update_fidelity.py``).

Shrunk: a small Qwen2 (2 layers, 128 hidden, 256-token vocabulary) with a 7B model's weight scale (std 0.02), a fixed
batch of 512 tokens, 3 optimiser steps per run instead of a training run.
"""

from __future__ import annotations

import logging
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from transformers import Trainer, TrainingArguments

import train_grpo
from benchmarks import update_fidelity
from benchmarks.update_fidelity import fixed_batch, small_model
from tau2_rl import experiment
from tau2_rl.run.precision import check_update_precision, fp32_master_weights, lost_update_fraction
from tau2_rl.run.update_monitor import METRIC, UpdateFractionCallback, add_update_monitor
from tau2_rl.trainers import grpo_run, multiturn_grpo

pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.mark.parametrize(("dtype", "lr"), [(torch.bfloat16, 1e-6), (torch.bfloat16, 1e-5), (torch.bfloat16, 1e-4),
                                           (torch.float32, 1e-6)])  # fmt: skip
def test_the_predicted_loss_is_what_an_adamw_step_loses(dtype, lr) -> None:
    """The check's arithmetic against torch's AdamW: the fraction of weights one real step leaves unchanged."""
    torch.manual_seed(0)
    weights = (torch.randn(256, 256) * 0.02).to(dtype)
    predicted = lost_update_fraction([weights], lr)
    param = torch.nn.Parameter(weights.clone())
    optimizer = torch.optim.AdamW([param], lr=lr, weight_decay=0.0)
    param.grad = torch.randn_like(param)
    optimizer.step()
    unchanged = (param.detach() == weights).double().mean().item()
    assert predicted == pytest.approx(unchanged, abs=0.02)
    assert lost_update_fraction([weights], lr, fp32_master=True) == 0.0  # fp32 keeps 1e-6 steps of 0.02-sized weights


def test_bf16_at_1e6_loses_most_updates_fp32_master_keeps_them() -> None:
    torch.manual_seed(0)
    weights = (torch.randn(512, 512) * 0.02).to(torch.bfloat16)
    assert lost_update_fraction([weights], 1e-6) > 0.95
    assert lost_update_fraction([weights], 1e-6, fp32_master=True) == 0.0


def _trainer(tmp_path: Path, dtype: torch.dtype, lr: float, steps: int = 3, report_to: str = "none") -> Trainer:
    batch = fixed_batch()
    rows = [{"input_ids": ids, "labels": ids} for ids in batch]
    args = TrainingArguments(
        output_dir=str(tmp_path / "out"), learning_rate=lr, max_steps=steps, per_device_train_batch_size=4,
        logging_steps=1, report_to=report_to, use_cpu=True, save_strategy="no", disable_tqdm=True,
        lr_scheduler_type="constant",
    )  # fmt: skip
    return Trainer(model=small_model().to(dtype), args=args, train_dataset=rows)


def test_check_refuses_bf16_weights_that_would_not_move(tmp_path, caplog) -> None:
    trainer = _trainer(tmp_path, torch.bfloat16, 1e-6)
    with pytest.raises(SystemExit) as refused:
        check_update_precision(trainer, allow=False)
    message = str(refused.value)
    assert message.startswith("error: 9") and "\n" not in message  # "error: 9x% of the trainable weights ..."
    assert "accelerate_configs/zero2_offload.yaml" in message and "--allow_rounded_updates true" in message
    with caplog.at_level(logging.WARNING, logger="tau2_rl.run.precision"):
        assert check_update_precision(trainer, allow=True) > 0.9
    assert "--allow_rounded_updates true" in caplog.text
    assert check_update_precision(_trainer(tmp_path, torch.float32, 1e-6), allow=False) == 0.0


def test_launches_with_fp32_master_weights() -> None:
    """DeepSpeed always keeps fp32 master weights; FSDP only when accelerate's mixed precision upcasts them."""
    args = SimpleNamespace(bf16=True, fp16=False)
    assert fp32_master_weights(SimpleNamespace(args=args, is_deepspeed_enabled=True, is_fsdp_enabled=False))
    assert fp32_master_weights(SimpleNamespace(args=args, is_deepspeed_enabled=False, is_fsdp_enabled=True))
    plain = SimpleNamespace(bf16=False, fp16=False)
    assert not fp32_master_weights(SimpleNamespace(args=plain, is_deepspeed_enabled=False, is_fsdp_enabled=True))
    assert not fp32_master_weights(SimpleNamespace(args=args, is_deepspeed_enabled=False, is_fsdp_enabled=False))


def test_monitor_logs_the_changed_fraction(tmp_path) -> None:
    trainer = _trainer(tmp_path, torch.float32, 1e-4, report_to="tensorboard")
    callback = add_update_monitor(trainer)
    assert trainer.callback_handler.callbacks[0] is callback  # ahead of TensorBoardCallback, which writes our metric
    trainer.train()
    fractions = [entry[METRIC] for entry in trainer.state.log_history if METRIC in entry]
    assert len(fractions) == 3 and min(fractions) > 0.95
    assert len(callback.tensors or []) == 8 and not any("embed" in name for name, _ in callback.tensors)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(next((tmp_path / "out" / "runs").iterdir()))).Reload()
    assert len(events.Scalars(f"train/{METRIC}")) == 3


def test_monitor_warns_when_steps_round_away(tmp_path, caplog) -> None:
    trainer = _trainer(tmp_path, torch.bfloat16, 1e-6)
    add_update_monitor(trainer)
    with caplog.at_level(logging.WARNING, logger="tau2_rl.run.update_monitor"):
        trainer.train()
    fractions = [entry[METRIC] for entry in trainer.state.log_history if METRIC in entry]
    assert len(fractions) == 3 and max(fractions) < 0.1
    assert "changed only" in caplog.text and caplog.text.count("changed only") == 1  # once, not every step


def test_monitor_skips_a_zero_learning_rate_step(tmp_path) -> None:
    trainer = _trainer(tmp_path, torch.float32, 1e-4)
    trainer.args.lr_scheduler_type = "constant_with_warmup"
    trainer.args.warmup_steps = 2  # the first step runs at lr 0
    callback = UpdateFractionCallback(trainer)
    trainer.callback_handler.callbacks.insert(0, callback)
    trainer.train()
    logged = [entry.get(METRIC) for entry in trainer.state.log_history if "loss" in entry]
    assert logged[0] is None and logged[1] > 0.95


def test_reference_recipes_update_every_weight() -> None:
    """Each reference recipe's optimiser, dtype handling and learning rate, on 7B-scale weights: >= 95% of the weights
    change in 3 steps and the loss on the fixed batch drops as in fp32; the same recipes launched without master
    weights would not (the measurement can tell them apart)."""
    recipes = update_fidelity.reference_recipes()
    assert {"recipes/grpo/joint_2gpu.yaml", "recipes/grpo/vanilla.yaml", "recipes/sft/qwen2_5_7b.yaml",
            "recipes/sft/qwen2_5_7b_lora.yaml", "recipes/grpo/grpo_multinode.yaml"} <= set(recipes)  # fmt: skip
    result = update_fidelity.run(steps=3, alternatives=True, recipes=recipes)
    for row in result["recipes"]:
        assert row["changed"] >= 0.95, row["recipe"]
        assert row["tracking"] == pytest.approx(1.0, abs=0.05), row["recipe"]
    assert result["lowest"]["changed"] >= 0.95
    plain = [row for row in result["alternatives"] if "no master" in row["launch"]]
    assert len(plain) == 2  # GRPO at 1e-6, SFT at 1e-5
    for row in plain:
        assert row["changed"] < 0.2 and row["tracking"] < 0.3
        assert row["predicted"] == pytest.approx(row["changed"], abs=0.02)


def test_the_reference_launches_keep_fp32_master_weights() -> None:
    """The recipes' header commands and the gpu-reference driver launch full fine-tuning with fp32 master weights."""
    for recipe in update_fidelity.reference_recipes():
        setup = update_fidelity.recipe_setup(recipe)
        assert setup.fp32_master or setup.lora is not None, recipe
    reference = experiment.PROFILES["gpu-reference"]
    assert update_fidelity.launch_keeps_fp32_master(reference.accelerate_config)
    assert not update_fidelity.launch_keeps_fp32_master("accelerate_configs/single_gpu.yaml")


def test_train_grpo_refuses_bf16_at_1e6_before_training(tmp_path, tiny_model_dir, short_env, monkeypatch) -> None:
    monkeypatch.setattr(grpo_run, "run_env", lambda specs, data_dir=None, config=None: short_env(config.max_turns))
    trained = []
    monkeypatch.setattr(multiturn_grpo.MultiTurnGRPOTrainer, "train", lambda self, **kw: trained.append(1))
    flags = [  # shrunk like cpu_smoke.yaml: one task, 4 episodes of 2 turns
        "--model_name_or_path", str(tiny_model_dir), "--user_simulator", "scripted", "--use_cpu", "true",
        "--bf16", "false", "--output_dir", str(tmp_path / "run"), "--hub_dir", str(tmp_path / "hub"), "--tasks", "0",
        "--task_repeats", "1", "--num_generations", "4", "--per_device_train_batch_size", "4", "--max_turns", "2",
        "--max_turn_tokens", "8", "--max_completion_length", "160", "--max_steps", "1", "--report_to", "none",
        "--dtype", "bfloat16", "--learning_rate", "1e-6",  # the old reference recipes' precision, without master
    ]  # fmt: skip
    with pytest.raises(SystemExit, match=r"^error: .*--allow_rounded_updates true"):
        train_grpo.main(*train_grpo.parse_args(flags))
    assert not trained


def test_train_sft_refuses_bf16_at_1e5_before_training(tmp_path, tiny_model_dir, monkeypatch) -> None:
    import train_sft

    monkeypatch.chdir(tmp_path)  # the embedded default collects oracle trajectories into ./hub
    trained = []
    monkeypatch.setattr(train_sft.ShardedSFTTrainer, "train", lambda self, **kw: trained.append(1))
    argv = [
        "--model_name_or_path", str(tiny_model_dir), "--tasks", "0", "--use_cpu", "true", "--bf16", "false",
        "--output_dir", str(tmp_path / "sft"), "--hub_dir", str(tmp_path / "hub"), "--max_steps", "1",
        "--report_to", "none", "--max_length", "8192",
        "--dtype", "bfloat16", "--learning_rate", "1e-5",  # recipes/sft/qwen2_5_7b.yaml's precision, without master
    ]  # fmt: skip
    script_args, training_args, model_args = train_sft.make_parser().parse_args_and_config(args=argv)
    with pytest.raises(SystemExit, match=r"^error: .*--allow_rounded_updates true"):
        train_sft.main(script_args, training_args, model_args)
    assert not trained


def test_monitor_does_not_blame_rounding_for_a_zero_gradient(tmp_path, caplog) -> None:
    """GRPO steps whose groups all have equal rewards have a zero gradient: an unchanged model is expected then."""
    trainer = _trainer(tmp_path, torch.float32, 1e-4)
    callback = UpdateFractionCallback(trainer)
    state = trainer.state
    with caplog.at_level(logging.WARNING, logger="tau2_rl.run.update_monitor"):
        for step in (1, 2, 3):
            state.global_step, callback.fraction = step, 0.0
            callback.on_log(trainer.args, state, trainer.control, logs={"grad_norm": 0.0})
        assert "changed only" not in caplog.text
        for step in (4, 5):
            state.global_step, callback.fraction = step, 0.0
            callback.on_log(trainer.args, state, trainer.control, logs={"grad_norm": 0.3})
    assert "step 5: the optimiser step changed only 0.0%" in caplog.text


def test_monitor_says_when_a_low_step_had_near_zero_loss_instead_of_blaming_precision(tmp_path, caplog) -> None:
    """Issue 23.6: in the README's SFT → GRPO chain every group is saturated (reward 0, loss ~1e-9) and the monitor
    said "changed only 30.4% ... rounded away"."""
    trainer = _trainer(tmp_path, torch.float32, 1e-4)
    callback = UpdateFractionCallback(trainer)
    state = trainer.state
    with caplog.at_level(logging.WARNING, logger="tau2_rl.run.update_monitor"):
        for step in (1, 2):
            state.global_step, callback.fraction = step, 0.304
            logs = {"loss": 1e-9, "grad_norm": 2e-7, "frac_reward_zero_std": 1.0}
            callback.on_log(trainer.args, state, trainer.control, logs=logs)
    expected = (
        "step 2: the optimiser step changed only 30.4% of the sampled weights, but the step had (near) zero loss"
    )
    assert expected in caplog.text
    assert "frac_reward_zero_std 1.00" in caplog.text and "rounded away" not in caplog.text
