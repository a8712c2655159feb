"""What a run prints, in one place: the warning filters and log hooks that keep the console to what applies, then
where the run's outputs go and one readable line per logged step.

Why both halves live here: they are one job, the console a person watches. transformers prints every log as a Python
dict; a GRPO step logs ~70 keys, which buries the few numbers a person watches (reward, its spread inside groups,
truncation, episode length, loss), and libraries warn about settings that do not apply to this trainer. The full
set of logs still goes to TensorBoard.
"""

from __future__ import annotations

import logging
import math
import os
import re
import time
from typing import Any

from transformers import TrainerCallback
from transformers.trainer_callback import PrinterCallback, ProgressCallback

from tau2_rl.learning_gain import CURVE_FILE, quarter_gain

logger = logging.getLogger(__name__)

# --- warnings and log hooks: what the console leaves out ---

LUSPO_WARNING = "When using `'luspo'` loss, `importance_sampling_level` should be set to `'sequence'`"


class _DropMessages(logging.Filter):
    def __init__(self, prefixes: tuple[str, ...]) -> None:
        super().__init__()
        self.prefixes = prefixes

    def filter(self, record: logging.LogRecord) -> bool:
        message = str(record.getMessage())
        return not any(prefix in message for prefix in self.prefixes)


def silence_known_warnings() -> None:
    """TRL warns that ``luspo`` should use sequence-level importance sampling "to mirror the paper's setup". We use
    ``luspo`` only as the aggregation (mean over trajectories of the sum over tokens) under per-token advantages:
    the variants weight each token, and ``joint`` gives each turn its own credit, so the importance ratio must stay
    per token (a sequence-level ratio would apply one clipped ratio to tokens of different turns). Why, in
    docs/variants.md ("Importance sampling")."""
    logging.getLogger("trl.trainer.grpo_trainer").addFilter(_DropMessages((LUSPO_WARNING,)))


class DropNoneLogs(TrainerCallback):
    """Removes ``None`` values from a log entry before the reporters see it: TensorBoard's callback warns "Trainer is
    attempting to log a value of None" for each, on every logging step. Must run first (``install_first``)."""

    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None, **kwargs: Any) -> None:
        if logs:
            for key in [k for k, v in logs.items() if v is None]:
                del logs[key]


def install_first(trainer: Any, callback: TrainerCallback) -> None:
    """Adds ``callback`` before every other callback (the log dict is shared: later reporters see its edits)."""
    trainer.callback_handler.callbacks.insert(0, callback)


def tied_missing_keys_are_expected(trainer: Any) -> None:
    """On resume the HF Trainer warns "missing keys in the checkpoint: ['lm_head.weight']" for models with tied
    embeddings (the tiny Qwen2, Qwen2.5-0.5B...): safetensors checkpoints store a shared tensor once, under
    ``embed_tokens.weight``, and the Trainer only recognises ``_keys_to_ignore_on_save`` as expected. Nothing is
    lost: when the missing keys are exactly output embeddings that *share storage* with the input embeddings, the
    weights are re-tied and no warning is printed; any other missing key still warns."""
    original = trainer._issue_warnings_after_load

    def issue_warnings_after_load(load_result: Any) -> None:
        model = trainer.accelerator.unwrap_model(trainer.model)
        inputs, outputs = model.get_input_embeddings(), model.get_output_embeddings()
        tied = (
            inputs is not None
            and outputs is not None
            and outputs.weight.data_ptr() == inputs.weight.data_ptr()
            and set(load_result.missing_keys) <= {"lm_head.weight", "model.lm_head.weight"}
            and not load_result.unexpected_keys
        )
        if tied and load_result.missing_keys:
            model.tie_weights()
            logging.getLogger(__name__).debug("lm_head.weight is tied to the input embeddings; restored from them")
            return
        original(load_result)

    trainer._issue_warnings_after_load = issue_warnings_after_load


_MISMATCH = re.compile(r"\n\t(\w+_steps): ([0-9.eE+-]+) \(from args\) != ([0-9.eE+-]+) \(from trainer_state.json\)")


class _RatioStepsAreNoMismatch(logging.Filter):
    """See ``ratio_steps_are_no_mismatch``."""

    def __init__(self, max_steps: int) -> None:
        super().__init__()
        self.max_steps = max_steps

    def _same(self, match: re.Match[str]) -> bool:
        arg, stored = float(match.group(2)), float(match.group(3))
        return 0 < arg < 1 and self.max_steps > 0 and math.ceil(self.max_steps * arg) == stored

    def filter(self, record: logging.LogRecord) -> bool:
        message = str(record.getMessage())
        if "do not match the ones in the `trainer_state.json`" not in message:
            return True
        kept = _MISMATCH.sub(lambda m: "" if self._same(m) else m.group(0), message)
        if kept == message:
            return True
        if "\n\t" not in kept:  # nothing else differed
            return False
        record.msg, record.args = kept, ()
        return True


def ratio_steps_are_no_mismatch(max_steps: int) -> None:
    """On every resume transformers warns "eval_steps: 0.5 (from args) != 3 (from trainer_state.json)": it compares
    the recipe's ratio of ``max_steps`` with the step count the checkpoint stored for it. A ratio that resolves to the
    stored count is the same setting, so that line is dropped (and the warning, when nothing else differs)."""
    target = logging.getLogger("transformers.trainer_utils")
    for earlier in [f for f in target.filters if isinstance(f, _RatioStepsAreNoMismatch)]:
        target.removeFilter(earlier)  # one per process: the latest run's max_steps
    target.addFilter(_RatioStepsAreNoMismatch(max_steps))


# --- the step lines: what the console shows ---

# (label, log key, format): the line's fields, in order. Missing keys are skipped.
STEP_FIELDS: tuple[tuple[str, str, str], ...] = (
    ("reward", "episode/outcome_reward", "{:.3f}"),
    ("std", "reward_std", "{:.3f}"),
    ("process", "episode/process_reward", "{:+.3f}"),
    ("trunc", "episode/truncation_rate", "{:.2f}"),
    ("sat", "episode/group_saturation", "{:.2f}"),
    ("turns", "episode/turns", "{:.1f}"),
    ("tool calls", "episode/tool_calls", "{:.1f}"),
    ("user calls", "episode/user_tool_calls", "{:.1f}"),  # a domain whose user holds tools: its own calls
    ("loss", "loss", "{:.4g}"),
)


DOMAIN_REWARD = re.compile(r"^domain/(?P<domain>[^/]+)/outcome_reward$")
"""A run over several domains logs each domain's outcome reward as ``domain/<name>/outcome_reward``."""


def domain_rewards(logs: dict[str, Any]) -> dict[str, float]:
    """Each domain's outcome reward in one log dict (empty for a run over one domain)."""
    found = {}
    for key, value in logs.items():
        match = DOMAIN_REWARD.match(key)
        if match and isinstance(value, int | float) and not math.isnan(value):
            found[match["domain"]] = float(value)
    return dict(sorted(found.items()))


def format_step_line(
    step: int, max_steps: int, logs: dict[str, Any], seconds: float | None, extras: list[tuple[str, float]] = ()
) -> str:
    """``step 3/20 | reward 0.250 | std 0.433 | ... | loss 0.0123 | 21.4 s`` from one log dict; ``extras`` are
    (what, seconds) that the time includes besides the step itself (``184.0 s incl. step 16's eval 150.2 s + save
    3.1 s``)."""
    parts = [f"step {step}/{max_steps}" if max_steps > 0 else f"step {step}"]
    for label, key, fmt in STEP_FIELDS:
        value = logs.get(key)
        if isinstance(value, int | float) and not (isinstance(value, float) and math.isnan(value)):
            parts.append(f"{label} {fmt.format(value)}")
    domains = domain_rewards(logs)
    if domains:  # a run over several domains: each one's outcome reward this step (those it played)
        parts.insert(2, " · ".join(f"{domain} {value:.3f}" for domain, value in domains.items()))
    judged = {term: logs[f"reward_term/{term}"] for term in ("ACTION", "ENV_ASSERTION", "NL_ASSERTION")
              if isinstance(logs.get(f"reward_term/{term}"), int | float)}  # fmt: skip
    if judged:  # a basis beyond DB and COMMUNICATE: the share of episodes meeting each of its terms
        terms = {t: logs[f"reward_term/{t}"] for t in ("DB", "COMMUNICATE")
                 if isinstance(logs.get(f"reward_term/{t}"), int | float)}  # fmt: skip
        parts.append("terms " + " · ".join(f"{t} {v:.2f}" for t, v in {**terms, **judged}.items()))
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


def named_steps(extras: list[tuple[str, int, float]]) -> list[tuple[str, float]]:
    """(what, step, seconds) → (label, seconds), the step named once before its first item: ``step 16's eval``,
    ``save``."""
    labelled: list[tuple[str, float]] = []
    previous = None
    for what, step, seconds in extras:
        labelled.append((what if step == previous else f"step {step}'s {what}", seconds))
        previous = step
    return labelled


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
    resumed_from: int | None = None,
) -> str:
    """The run's last line: its length, ``metric`` (label, log key; GRPO: the outcome reward, SFT: the loss) first →
    last quarter of the steps, ``user_errors`` (episodes that failed in the user simulator, episodes played) when
    there were any, and where the last checkpoint, the hub revision, the TensorBoard events and (with ``picture``)
    the learning-curve picture are. ``steps_done`` (the trainer's ``global_step``) is the length; without it, the last
    logged step (which undercounts when ``logging_steps`` does not divide the run). ``resumed_from``: the step this
    process resumed at; ``seconds`` then covers only the steps after it, and the line says so."""
    from transformers.trainer_utils import get_last_checkpoint

    label, key = metric
    steps = [e for e in log_history if "loss" in e and "step" in e]
    done = steps_done if steps_done is not None else (steps[-1]["step"] if steps else 0)
    if resumed_from:
        took = f": the last {done - resumed_from} in {_duration(seconds)}" if seconds else ""
        parts = [f"done: {done} steps (resumed at step {resumed_from}{took})"]
    else:
        parts = [f"done: {done} steps" + (f" in {_duration(seconds)}" if seconds else "")]
    untrained = sum(1 for e in steps if e.get("train/user_error_skip", 0) >= 1)
    if untrained:
        parts[0] += (f" ({untrained} without update: every episode a user error; each counts in --max_steps and "
                     "in the LR schedule)")  # fmt: skip
    values = [float(e[key]) for e in steps if isinstance(e.get(key), int | float)]
    if values:
        first, last, gain = quarter_gain(values)
        per_domain = {}  # a run over several domains: each one's gain over the steps that played it
        for domain in sorted({d for e in steps for d in domain_rewards(e)}):
            mine = [domain_rewards(e)[domain] for e in steps if domain in domain_rewards(e)]
            per_domain[domain] = quarter_gain(mine)[2]
        each = "".join(f"; {domain} {domain_gain:+.3f}" for domain, domain_gain in per_domain.items())
        parts.append(f"{label} {first:.3f} → {last:.3f} ({gain:+.3f}, first → last quarter{each})")
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
        self._extras: list[tuple[str, int, float]] = []  # (what, after step, seconds) since the last step line
        self.started: float | None = None
        self.first_step = 0  # the step training began at in this process (a resumed checkpoint's)
        self.tensorboard_dir: str | None = None

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._last = self._mark = self.started = time.perf_counter()
        self.first_step = state.global_step  # the Trainer loads a resumed checkpoint's state before on_train_begin
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
        extras, self._extras = named_steps(self._extras), []
        print(format_step_line(state.global_step, state.max_steps, logs, seconds, extras), flush=True)

    def _timed(self, what: str, step: int) -> None:
        """An evaluation or a save of ``step`` just ended: the next step line's time includes it, and names it with
        its step. (The Trainer evaluates and saves after logging a step, so their time lands in the next step's
        interval: step 17's line read ``incl. eval 5.4 s`` for the evaluation at step 16.)"""
        now = time.perf_counter()
        if self._mark is not None:
            self._extras.append((what, step, now - self._mark))
        self._mark = now

    def on_evaluate(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._timed("eval", state.global_step)

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._timed("save", state.global_step)

    def summary(
        self, state: Any, output_dir: str, hub_revision: str | None, user_errors: tuple[int, int] | None = None
    ) -> str:
        """The end-of-run line (``summary_line``) for this run."""
        seconds = None if self.started is None else time.perf_counter() - self.started
        return summary_line(
            state.log_history, output_dir, hub_revision, self.tensorboard_dir, seconds, user_errors=user_errors,
            steps_done=state.global_step, resumed_from=self.first_step or None,
        )  # fmt: skip


def use_step_lines(trainer: Any, hub_dir: str | None = None) -> StepLineCallback:
    """Replaces the trainer's dict printer (and progress bar) with ``StepLineCallback``; returns it."""
    trainer.remove_callback(PrinterCallback)
    trainer.remove_callback(ProgressCallback)
    callback = StepLineCallback(hub_dir, trainer.callback_handler)
    trainer.add_callback(callback)
    return callback
