"""Did the last optimiser step change the weights? Logged as ``update/changed_fraction`` on every logging step.

``tau2_rl.run.precision`` refuses configurations that round most updates away before training; this watches the run
itself (a mis-set launch, an optimiser whose state went to zero, a learning rate decayed below the weights'
resolution). It compares a fixed sample of a fixed subset of tensors across each optimiser step: at most
``MAX_TENSORS`` trainable tensors evenly spread over the model (embeddings left out: rows of tokens absent from a
batch get no gradient) and ``SAMPLE_PER_TENSOR`` strided elements of each, so a step costs a few small copies.

It reads the values the optimiser updates: DeepSpeed's fp32 master weights (through ``safe_get_full_fp32_param``)
when DeepSpeed runs, the parameters otherwise. The model's bf16 copy of fp32 master weights only changes once the
accumulated steps pass half an ulp, so it would read low while the run is healthy.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from transformers import TrainerCallback

from tau2_rl.run.precision import strided_sample

logger = logging.getLogger(__name__)

METRIC = "update/changed_fraction"
MAX_TENSORS = 8
WARN_BELOW = 0.5
WARN_EVERY = 50  # steps between repeated warnings while the fraction stays low
NEAR_ZERO = 1e-6  # |loss| or grad norm below this: the step had (almost) nothing to learn from


def _pick(named: list[tuple[str, torch.nn.Parameter]], count: int) -> list[tuple[str, torch.nn.Parameter]]:
    """``count`` trainable tensors evenly spread over the model, embeddings left out unless nothing else trains."""
    trainable = [(n, p) for n, p in named if p.requires_grad]
    candidates = [(n, p) for n, p in trainable if "embed" not in n] or trainable
    if len(candidates) <= count or count < 2:
        return candidates[: max(count, 0)] if count < 2 else candidates
    last = len(candidates) - 1
    return [candidates[round(i * last / (count - 1))] for i in range(count)]


class UpdateFractionCallback(TrainerCallback):
    """Measures the fraction of sampled weights changed by each optimiser step; warns when it stays low.

    Bracketing ``on_step_begin``/``on_step_end`` (not the optimiser hooks) matters: under DeepSpeed the real step runs
    inside the last micro-batch's backward, before ``on_pre_optimizer_step``. Insert it before the reporting callbacks
    (``add_update_monitor``) so that its ``on_log`` adds the metric before TensorBoard writes the logs.
    """

    def __init__(self, trainer: Any, warn_below: float = WARN_BELOW, max_tensors: int = MAX_TENSORS) -> None:
        self.trainer = trainer
        self.warn_below = warn_below
        self.max_tensors = max_tensors
        self.tensors: list[tuple[str, torch.nn.Parameter]] | None = None
        self.before: list[torch.Tensor] | None = None
        self.fraction: float | None = None
        self.low_streak = 0
        self.last_warning_step: int | None = None
        self.master_unavailable = False
        self.logged_step: int | None = None

    def _master(self, param: torch.nn.Parameter) -> torch.Tensor | None:
        if getattr(self.trainer, "is_deepspeed_enabled", False):
            from deepspeed.utils import safe_get_full_fp32_param

            return safe_get_full_fp32_param(param)
        return param.to_local() if hasattr(param, "to_local") else param  # FSDP2 DTensor: this rank's shard

    def _sample(self) -> list[torch.Tensor] | None:
        if self.tensors is None:
            self.tensors = _pick(list(self.trainer.model.named_parameters()), self.max_tensors)
        samples = []
        for _, param in self.tensors:
            master = self._master(param)
            if master is None:  # DeepSpeed without an fp32 master mapping for this parameter
                if not self.master_unavailable:
                    logger.info("%s: DeepSpeed exposes no fp32 master weights here; not measured", METRIC)
                self.master_unavailable = True
                return None
            samples.append(strided_sample(master).float().cpu())
        return samples

    def _learning_rate(self) -> float:
        scheduler = getattr(self.trainer, "lr_scheduler", None)
        if scheduler is None:
            return float(self.trainer.args.learning_rate)
        return float(scheduler.get_last_lr()[0])

    def on_step_begin(self, args, state, control, **kwargs):
        # a zero learning rate (the first step of a warm-up from 0) changes nothing by design: skip that step
        self.before = None if self.master_unavailable or self._learning_rate() == 0 else self._sample()

    def on_step_end(self, args, state, control, **kwargs):
        if self.before is None:
            return
        after = self._sample()
        if after is None:
            return
        changed = sum(int((a != b).sum()) for a, b in zip(after, self.before, strict=True))
        total = sum(a.numel() for a in after)
        self.fraction = changed / total if total else None
        self.before = None

    def on_log(self, args, state, control, logs=None, **kwargs):
        # once per measured step: not again in the end-of-training summary or an evaluation's logs
        if self.fraction is None or logs is None or self.logged_step == state.global_step:
            return
        self.logged_step = state.global_step
        logs[METRIC] = self.fraction
        if state.log_history and state.log_history[-1].get("step") == state.global_step:
            state.log_history[-1][METRIC] = self.fraction  # Trainer.log stored its copy before calling us
        # a zero gradient (GRPO: every group's rewards equal) leaves the weights alone by design, not by rounding;
        # so does a (near) zero-loss step: Adam turns a 1e-9 gradient into tiny updates that leave most weights as
        # they were (the README's SFT → GRPO chain, every group saturated). Two low steps in a row: LoRA's A matrices
        # get no gradient in the first step (B starts at zero).
        low = self.fraction < self.warn_below and logs.get("grad_norm") != 0
        near_zero = low and _near_zero(logs)
        self.low_streak = self.low_streak + 1 if low else 0
        due = self.last_warning_step is None or state.global_step - self.last_warning_step >= WARN_EVERY
        if self.low_streak >= 2 and due:
            self.last_warning_step = state.global_step
            if near_zero:
                saturated = logs.get("frac_reward_zero_std")
                why = (
                    f"; every group's rewards were equal (frac_reward_zero_std {saturated:.2f})"
                    if isinstance(saturated, int | float) and saturated >= 1.0
                    else ""
                )
                logger.warning(
                    "step %d: the optimiser step changed only %.1f%% of the sampled weights, but the step had "
                    "(near) zero loss (loss %.3g, grad_norm %.3g%s): nothing to learn from, not a precision problem",
                    state.global_step, 100 * self.fraction, float(logs.get("loss", 0.0)),
                    float(logs.get("grad_norm", 0.0)), why,
                )  # fmt: skip
                return
            logger.warning(
                "step %d: the optimiser step changed only %.1f%% of the sampled weights (%s); updates are "
                "rounded away or the learning rate is below the weights' precision (tau2_rl/run/precision.py)",
                state.global_step, 100 * self.fraction, ", ".join(n for n, _ in self.tensors or []),
            )  # fmt: skip


def _near_zero(logs: dict) -> bool:
    """Whether the logged step had (almost) nothing to learn from: |loss| or its gradient norm below ``NEAR_ZERO``,
    or (GRPO) every group's rewards equal."""
    loss, grad = logs.get("loss"), logs.get("grad_norm")
    if isinstance(logs.get("frac_reward_zero_std"), int | float) and logs["frac_reward_zero_std"] >= 1.0:
        return True
    return any(isinstance(v, int | float) and abs(v) < NEAR_ZERO for v in (loss, grad))


def add_update_monitor(trainer: Any, warn_below: float = WARN_BELOW) -> UpdateFractionCallback:
    """Adds the callback ahead of the reporting callbacks (TensorBoard...), so its metric reaches them."""
    callback = UpdateFractionCallback(trainer, warn_below)
    trainer.callback_handler.callbacks.insert(0, callback)
    return callback
