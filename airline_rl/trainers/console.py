"""What a training run prints: where its outputs go, then one readable line per logged step.

Why: transformers prints every log as a Python dict; a GRPO step logs ~70 keys, which buries the few numbers a person
watches (reward, its spread inside groups, truncation, episode length, loss). The full set still goes to TensorBoard.
"""

from __future__ import annotations

import logging
import math
import os
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


def format_step_line(
    step: int, max_steps: int, logs: dict[str, Any], seconds: float | None, extras: list[tuple[str, float]] = ()
) -> str:
    """``step 3/20 | reward 0.250 | std 0.433 | ... | loss 0.0123 | 21.4 s`` from one log dict; ``extras`` are
    (what, seconds) that the time includes besides the step itself (``184.0 s incl. eval 150.2 s + save 3.1 s``)."""
    parts = [f"step {step}/{max_steps}" if max_steps > 0 else f"step {step}"]
    for label, key, fmt in STEP_FIELDS:
        value = logs.get(key)
        if isinstance(value, int | float) and not (isinstance(value, float) and math.isnan(value)):
            parts.append(f"{label} {fmt.format(value)}")
    user_errors = logs.get("episode/user_sim_errors")
    if isinstance(user_errors, int | float) and user_errors > 0:  # only when there are any: a dead endpoint shows
        parts.append(f"user errors {user_errors:g}")
    skipped = logs.get("train/user_error_skip")
    if isinstance(skipped, int | float) and skipped > 0:
        parts.append("no update (every episode a user error)" if skipped >= 1 else f"no update in {skipped:.0%}")
    if seconds is not None:
        included = " + ".join(f"{what} {took:.1f} s" for what, took in extras)
        parts.append(f"{seconds:.1f} s" + (f" incl. {included}" if included else ""))
    return " | ".join(parts)


def _duration(seconds: float) -> str:
    minutes, rest = divmod(round(seconds), 60)
    return f"{minutes} min {rest} s" if minutes else f"{rest} s"


def summary_line(
    log_history: list[dict[str, Any]],
    output_dir: str,
    hub_revision: str | None,
    tensorboard_dir: str | None,
    seconds: float | None,
    metric: tuple[str, str] = ("reward", STEP_FIELDS[0][1]),
    picture: bool = True,
    user_errors: tuple[int, int] | None = None,
    steps_done: int | None = None,
) -> str:
    """The run's last line: its length, ``metric`` (label, log key; GRPO: the outcome reward, SFT: the loss) first →
    last quarter of the steps, ``user_errors`` (episodes that failed in the user simulator, episodes played) when
    there were any, and where the last checkpoint, the hub revision, the TensorBoard events and (with ``picture``)
    the learning-curve picture are. ``steps_done`` (the trainer's ``global_step``) is the length; without it, the last
    logged step (which undercounts when ``logging_steps`` does not divide the run)."""
    from transformers.trainer_utils import get_last_checkpoint

    from airline_rl.evaluation.learning_curve import CURVE_FILE, quarter_gain

    label, key = metric
    steps = [e for e in log_history if "loss" in e and "step" in e]
    done = steps_done if steps_done is not None else (steps[-1]["step"] if steps else 0)
    parts = [f"done: {done} steps" + (f" in {_duration(seconds)}" if seconds else "")]
    untrained = sum(1 for e in steps if e.get("train/user_error_skip", 0) >= 1)
    if untrained:
        parts[0] += f" ({untrained} without update: every episode a user error)"
    values = [float(e[key]) for e in steps if isinstance(e.get(key), int | float)]
    if values:
        first, last, gain = quarter_gain(values)
        parts.append(f"{label} {first:.3f} → {last:.3f} ({gain:+.3f}, first → last quarter)")
    if user_errors is not None and user_errors[0]:
        parts.append(f"user errors {user_errors[0]} of {user_errors[1]} episodes")
    checkpoint = get_last_checkpoint(output_dir) if os.path.isdir(output_dir) else None
    parts.append(f"last checkpoint {checkpoint}" if checkpoint else f"final model {output_dir}")
    if hub_revision:
        parts.append(f"hub revision {hub_revision}")
    if tensorboard_dir:
        parts.append(f"TensorBoard {tensorboard_dir}")
        if picture:
            parts.append(f"picture: python plot_run.py {output_dir} → {os.path.join(output_dir, CURVE_FILE)}")
    return " | ".join(parts)


def tensorboard_dir(callback_handler: Any) -> str | None:
    """Where the trainer's TensorBoard callback writes its events, or None without one."""
    found = None
    for callback in getattr(callback_handler, "callbacks", []):
        found = getattr(callback, "logging_dir", None) or found
    return found


class StepLineCallback(TrainerCallback):
    """Prints the output locations at the start and one line per training log (main process only)."""

    def __init__(self, hub_dir: str | None = None, callback_handler: Any = None) -> None:
        self.hub_dir = hub_dir
        self.callback_handler = callback_handler  # to find the TensorBoard callback's event directory
        self._last: float | None = None
        self._mark: float | None = None  # the end of the last thing timed (a step line, an evaluation, a save)
        self._extras: list[tuple[str, float]] = []  # evaluations and saves since the last step line
        self.started: float | None = None
        self.tensorboard_dir: str | None = None

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._last = self._mark = self.started = time.perf_counter()
        if not state.is_world_process_zero:
            return
        tensorboard = self.tensorboard_dir = tensorboard_dir(self.callback_handler)
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
        self._last = self._mark = now
        extras, self._extras = self._extras, []
        print(format_step_line(state.global_step, state.max_steps, logs, seconds, extras), flush=True)

    def _timed(self, what: str) -> None:
        """An evaluation or a save just ended: the next step line's time includes it, and says so. (The Trainer
        evaluates and saves after logging a step, so their time lands in the next step's interval.)"""
        now = time.perf_counter()
        if self._mark is not None:
            self._extras.append((what, now - self._mark))
        self._mark = now

    def on_evaluate(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._timed("eval")

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._timed("save")

    def summary(
        self, state: Any, output_dir: str, hub_revision: str | None, user_errors: tuple[int, int] | None = None
    ) -> str:
        """The end-of-run line (``summary_line``) for this run."""
        seconds = None if self.started is None else time.perf_counter() - self.started
        return summary_line(
            state.log_history, output_dir, hub_revision, self.tensorboard_dir, seconds, user_errors=user_errors,
            steps_done=state.global_step,
        )  # fmt: skip


def use_step_lines(trainer: Any, hub_dir: str | None = None) -> StepLineCallback:
    """Replaces the trainer's dict printer (and progress bar) with ``StepLineCallback``; returns it."""
    trainer.remove_callback(PrinterCallback)
    trainer.remove_callback(ProgressCallback)
    callback = StepLineCallback(hub_dir, trainer.callback_handler)
    trainer.add_callback(callback)
    return callback
