"""What the training console shows: our INFO lines, not per-step noise and not warnings that do not apply to us."""

from __future__ import annotations

import logging
import math
import re
from typing import Any

from transformers import TrainerCallback

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
