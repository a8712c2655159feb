"""What a training run prints: where its outputs go, then one readable line per logged step.

Why: transformers prints every log as a Python dict; a GRPO step logs ~70 keys, which buries the few numbers a person
watches (reward, its spread inside groups, truncation, episode length, loss). The full set still goes to TensorBoard.
"""

from __future__ import annotations

import logging
import math
import time
from typing import Any

from transformers import TrainerCallback
from transformers.trainer_callback import PrinterCallback, ProgressCallback

logger = logging.getLogger(__name__)

# (label, log key, format): the line's fields, in order. Missing keys are skipped.
STEP_FIELDS: tuple[tuple[str, str, str], ...] = (
    ("reward", "episode/outcome_reward", "{:.3f}"),
    ("std", "reward_std", "{:.3f}"),
    ("process", "episode/process_reward", "{:+.3f}"),
    ("trunc", "episode/truncation_rate", "{:.2f}"),
    ("sat", "episode/group_saturation", "{:.2f}"),
    ("turns", "episode/turns", "{:.1f}"),
    ("tool calls", "episode/tool_calls", "{:.1f}"),
    ("loss", "loss", "{:.4g}"),
)


def format_step_line(step: int, max_steps: int, logs: dict[str, Any], seconds: float | None) -> str:
    """``step 3/20 | reward 0.250 | std 0.433 | ... | loss 0.0123 | 21.4 s`` from one log dict."""
    parts = [f"step {step}/{max_steps}" if max_steps > 0 else f"step {step}"]
    for label, key, fmt in STEP_FIELDS:
        value = logs.get(key)
        if isinstance(value, int | float) and not (isinstance(value, float) and math.isnan(value)):
            parts.append(f"{label} {fmt.format(value)}")
    if seconds is not None:
        parts.append(f"{seconds:.1f} s")
    return " | ".join(parts)


class StepLineCallback(TrainerCallback):
    """Prints the output locations at the start and one line per training log (main process only)."""

    def __init__(self, hub_dir: str | None = None, callback_handler: Any = None) -> None:
        self.hub_dir = hub_dir
        self.callback_handler = callback_handler  # to find the TensorBoard callback's event directory
        self._last: float | None = None

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._last = time.perf_counter()
        if not state.is_world_process_zero:
            return
        tensorboard = None
        for callback in getattr(self.callback_handler, "callbacks", []):
            tensorboard = getattr(callback, "logging_dir", None) or tensorboard
        print(f"checkpoints: {args.output_dir}/checkpoint-<step> (every {args.save_steps} steps)", flush=True)
        if tensorboard:
            print(f"TensorBoard events: {tensorboard}  (tensorboard --logdir {args.output_dir}/runs)", flush=True)
        if self.hub_dir:
            print(f"local hub revisions: {self.hub_dir}/step-<step>", flush=True)

    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None, **kwargs: Any) -> None:
        if not state.is_world_process_zero or not logs or "loss" not in logs:
            return  # the end-of-training summary (train_runtime, ...) is printed by log_metrics
        now = time.perf_counter()
        seconds = None if self._last is None else now - self._last
        self._last = now
        print(format_step_line(state.global_step, state.max_steps, logs, seconds), flush=True)


def use_step_lines(trainer: Any, hub_dir: str | None = None) -> StepLineCallback:
    """Replaces the trainer's dict printer (and progress bar) with ``StepLineCallback``; returns it."""
    trainer.remove_callback(PrinterCallback)
    trainer.remove_callback(ProgressCallback)
    callback = StepLineCallback(hub_dir, trainer.callback_handler)
    trainer.add_callback(callback)
    return callback
