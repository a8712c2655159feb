"""Will the optimiser's updates survive the precision the weights are kept in? Checked before training starts.

An optimiser adds its update to the tensor that holds the weights. When that tensor is bf16 (8 significant bits), an
update below half a unit in the last place (ulp) of the weight rounds back to the same value: AdamW's steps are about
``learning_rate`` in size, and at ``learning_rate: 1e-6`` that loses the update of every weight larger than ~5e-4 in
magnitude, i.e. ~98% of a 7B model's weights (std ~0.02). Loss and rewards can still drift through the few small
weights, so nothing looks broken; the ablation's variants would then differ by noise.

Where the updates accumulate:

* DeepSpeed (any ZeRO stage, bf16 or fp16): in fp32 master weights held by its optimiser (on the CPU with
  ``accelerate_configs/zero2_offload.yaml``); the model's bf16 weights are rounded copies of them;
* FSDP through accelerate with ``mixed_precision`` bf16/fp16: accelerate upcasts the trainable parameters to fp32
  before sharding them, and computes in bf16 (``MixedPrecisionPolicy``);
* otherwise (one process, ``single_gpu.yaml``, DDP): in the parameters themselves, in the dtype they were loaded in
  (``--dtype``). LoRA adapters are created in fp32 by PEFT even over a bf16 base.

``check_update_precision`` measures, on a fixed strided sample of every trainable tensor, the fraction of weights
whose ``learning_rate``-sized update rounds away in that dtype, and refuses (one line, naming the fix) when it is
most of them, unless ``--allow_rounded_updates true``. ``run.update_monitor`` then watches it during training.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

import torch

logger = logging.getLogger(__name__)

# Refuse when more than this fraction of the trainable weights would not move ("most updates round away").
REFUSE_ABOVE = 0.5
# Elements sampled per tensor (strided over the whole tensor): enough for a fraction to ~1%, cheap on 7.6B weights.
SAMPLE_PER_TENSOR = 4096

FIX = (
    "launch with --config_file accelerate_configs/zero2_offload.yaml (fp32 master weights; docs/reproducing.md), "
    "or train fp32 LoRA adapters (--use_peft true), or load --dtype float32"
)


def strided_sample(tensor: torch.Tensor, size: int = SAMPLE_PER_TENSOR) -> torch.Tensor:
    """A fixed, evenly spaced subset of a tensor's elements (the same ones every call), as a flat copy."""
    flat = tensor.detach().reshape(-1)
    if flat.numel() == 0:
        return flat.clone()
    stride = max(1, flat.numel() // size)
    return flat[::stride][:size].clone()


def rounded_away(values: torch.Tensor, step: float, dtype: torch.dtype) -> torch.Tensor:
    """Which of ``values`` (held in ``dtype``) stay the same after adding ``step``, in ``dtype`` arithmetic.

    Adds in float64 and rounds once to ``dtype``, as a fused optimiser does; both signs are tried, since at a power of
    two the ulp below is half the one above, and an update counts as lost only if it is lost either way.
    """
    held = values.to(dtype)
    wide = held.to(torch.float64)
    up = (wide + step).to(dtype) == held
    down = (wide - step).to(dtype) == held
    return up & down


def fp32_master_weights(trainer: Any) -> bool:
    """Whether the trainer's launch keeps fp32 master weights that the optimiser updates (see the module docstring)."""
    args = trainer.args
    if getattr(trainer, "is_deepspeed_enabled", False):
        return True
    return bool(getattr(trainer, "is_fsdp_enabled", False) and (args.bf16 or args.fp16))


def update_dtype(param: torch.Tensor, fp32_master: bool) -> torch.dtype:
    """The dtype the optimiser's update is added in for this parameter."""
    if fp32_master and param.dtype in (torch.bfloat16, torch.float16):
        return torch.float32
    return param.dtype


def lost_update_fraction(
    params: Iterable[torch.Tensor], learning_rate: float, fp32_master: bool = False, sample: int = SAMPLE_PER_TENSOR
) -> float:
    """Fraction of the trainable weights (by count) whose ``learning_rate``-sized update rounds away.

    Each tensor is estimated from a strided sample and weighted by its size. AdamW's update is about the learning rate
    for every weight (the ratio of the moments is ~1 in magnitude), so this is what most steps lose. For optimisers
    whose step is smaller than the learning rate (SGD: lr × gradient) the estimate is lenient, never strict.
    """
    lost = total = 0.0
    for param in params:
        if param.numel() == 0:
            continue
        values = strided_sample(param, sample)
        fraction = rounded_away(values, learning_rate, update_dtype(param, fp32_master)).double().mean().item()
        lost += fraction * param.numel()
        total += param.numel()
    return lost / total if total else 0.0


def check_update_precision(trainer: Any, allow: bool) -> float:
    """Refuses to train when most updates would round away (one line naming the fix), unless ``allow``.

    Call after the trainer is built (LoRA adapters exist then) and before ``train()``. Uses the peak learning rate:
    warm-up and decay only make the steps smaller. Returns the fraction lost.
    """
    args = trainer.args
    master = fp32_master_weights(trainer)
    trainable = [p for p in trainer.model.parameters() if p.requires_grad]
    lost = lost_update_fraction(trainable, args.learning_rate, master)
    dtypes = sorted({str(update_dtype(p, master)).removeprefix("torch.") for p in trainable})
    where = "fp32 master weights" if master else f"{'/'.join(dtypes)} parameters"
    if not master and dtypes != ["float32"]:
        where += " (no fp32 master copy)"
    if lost <= REFUSE_ABOVE:
        logger.info("update precision: updates go to %s; %.1f%% of lr=%g steps round away", where, 100 * lost,
                    args.learning_rate)  # fmt: skip
        return lost
    message = (
        f"{100 * lost:.0f}% of the trainable weights would never change: learning_rate={args.learning_rate:g} steps "
        f"round away in {where}; {FIX}, or pass --allow_rounded_updates true to train anyway"
    )
    if not allow:
        raise SystemExit(f"error: {message}")
    logger.warning("--allow_rounded_updates true: %s", message)
    return lost
