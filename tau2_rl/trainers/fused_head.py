"""TRL's fused LM head on CPU: score the labelled positions only, as TRL does on GPUs.

``trl.trainer.utils.add_fused_lm_head`` (GRPOTrainer's per-token log-probs, SFTTrainer's loss) projects the hidden
states through the LM head in vocabulary tiles. On Triton devices it projects only the positions whose label is not
-100; elsewhere every position (a fixed tile shape, for compilers that would recompile per batch), the choice read
from ``trl.trainer.utils._use_triton``. On CPU "every position" is the prompt and the padding of a GRPO batch of
whole episodes, and everything outside the assistant tokens of an SFT row, each pushed through a ~151k-token head
forward and backward: ~30% of a quick-start GRPO step (fa6d1b5: 6 steps in 37.3 s → 25.8 s).

The labelled positions get the same log-probabilities (and entropies) either way: each row's head product is its
own. The head's weight gradient is a sum over rows; summing fewer zero rows can change its last bit (6e-8 after 6
quick-start steps), so a run is not bit-identical to one made before this switch (tests/test_trl_hooks.py).
"""

from __future__ import annotations

import torch
import trl.trainer.utils as trl_utils


def score_labelled_positions_on_cpu() -> None:
    """Makes TRL's fused head take its labelled-rows branch on CPU too; idempotent; other devices keep TRL's
    choice. Called by the GRPO and SFT trainers before they build their models' heads' forwards."""
    if getattr(trl_utils._use_triton, "_tau2_rl_cpu", False):
        return
    triton = trl_utils._use_triton

    def labelled_rows(device: torch.device) -> bool:
        return device.type == "cpu" or triton(device)

    labelled_rows._tau2_rl_cpu = True  # type: ignore[attr-defined]
    labelled_rows.trl_choice = triton  # type: ignore[attr-defined]
    trl_utils._use_triton = labelled_rows
