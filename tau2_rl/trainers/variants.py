"""The five loss variants as per-token advantages (formulas and rationale in docs/variants.md; the variant table,
``VARIANTS``, lives beside the configs that check it: ``tau2_rl.configs``).

Notation: L_i = number of policy tokens of trajectory i, A_i its group advantage (TRL's), ℓ_it TRL's clipped
surrogate at token t. Every variant is a batch loss  mean_i Σ_t w_it ℓ_it  with non-negative weights w_it.

How it is implemented on top of TRL: with ``loss_type="luspo"`` TRL aggregates ``mean_i Σ_t ℓ_it`` (per micro-batch,
divided by the gradient-accumulation steps; DDP averages over processes), and because for w ≥ 0
``-min(r A w, clip(r) A w) = -w min(r A, clip(r) A)``, multiplying the advantage by w_it gives exactly Σ_t w_it ℓ_it.
So a variant is nothing but the per-token advantage tensor it hands to TRL's unchanged ``_compute_loss``:

- vanilla:        A_i / L_i                                   (= TRL's ``loss_type="grpo"``)
- turn_discount:  A_i · d_it / L_i, d_it = α^(T_i−1−k) / mean over the trajectory's policy tokens of α^(T_i−1−k)
- lata:           A_i / √(L_i · L_ref)
- prm_lite:       A_i / L_i, with A_i computed from outcome + prm_coef · process score (reward side, not here)
- joint:          (A_i + turn_credit_coef · c_ik) / √(L_i · L_ref), c_ik the bounded PRM-Lite credit of the turn k
                  that token t is in (``bound_turn_credit``)

L_ref (``length_reference``) is a constant: lata/joint give a trajectory of L_ref policy tokens the same total weight
as vanilla, so the ablation compares the shapes of the weightings rather than their step sizes.
"""

from __future__ import annotations

import math

import torch

from tau2_rl.configs import get_variant


def policy_token_counts(policy_mask: torch.Tensor) -> torch.Tensor:
    """L_i as float, [B]."""
    return policy_mask.sum(dim=1).to(torch.float32)


def turn_discount_factors(policy_mask: torch.Tensor, turn_index: torch.Tensor, alpha: float) -> torch.Tensor:
    """d_it = α^(T_i−1−k) rescaled to mean 1 over each trajectory's policy tokens, computed in log space, [B, C].

    ``turn_index[i, t]`` is the assistant turn k of token t (−1 for non-policy tokens) and T_i = 1 + max_k. With
    α > 1 a turn's weight grows with the number of turns that follow it: early turns (identification, the reads
    every later action depends on) get more weight than the closing ones. Log space keeps α^(T−1) finite for
    hundreds of turns; the rescaling keeps the trajectory's total weight equal to vanilla's (mean d = 1).
    """
    mask = policy_mask.bool() & (turn_index >= 0)
    num_turns = torch.where(mask, turn_index, torch.full_like(turn_index, -1)).amax(dim=1, keepdim=True) + 1
    log_d = (num_turns - 1 - turn_index).to(torch.float64) * math.log(alpha)
    log_d = torch.where(mask, log_d, torch.full_like(log_d, -math.inf))
    counts = mask.sum(dim=1, keepdim=True).clamp(min=1).to(torch.float64)
    log_mean = torch.logsumexp(log_d, dim=1, keepdim=True) - counts.log()
    log_mean = torch.where(torch.isfinite(log_mean), log_mean, torch.zeros_like(log_mean))
    d = torch.exp(log_d - log_mean)
    return torch.where(mask, d, torch.zeros_like(d)).to(torch.float32)


def token_weights(
    variant: str,
    policy_mask: torch.Tensor,
    turn_index: torch.Tensor,
    alpha: float | None = None,
    length_reference: float | None = None,
) -> torch.Tensor:
    """w_it for ``variant``, [B, C]; zero outside policy tokens and for trajectories without policy tokens.

    ``length_reference`` (L_ref, 1 when None) divides the 1/√L weights by √L_ref."""
    kind = get_variant(variant)["weights"]
    lengths = policy_token_counts(policy_mask).unsqueeze(1)
    safe = lengths.clamp(min=1.0)
    mask = policy_mask.to(torch.float32)
    if kind == "inverse_length":
        weights = mask / safe
    elif kind == "inverse_sqrt_length":
        if length_reference is not None and not length_reference > 0:
            raise ValueError(f"length_reference must be > 0, got {length_reference}")
        weights = mask / (safe * (length_reference or 1.0)).sqrt()
    elif kind == "turn_discounted":
        if alpha is None:
            raise ValueError("turn_discount needs alpha (turn_discount_alpha)")
        weights = turn_discount_factors(policy_mask, turn_index, alpha) / safe
    else:  # pragma: no cover - the table only holds the kinds above
        raise AssertionError(kind)
    return torch.where(lengths > 0, weights, torch.zeros_like(weights))


def bound_turn_credit(
    turn_scores: torch.Tensor, clip: float | None = None, eligible: torch.Tensor | None = None
) -> torch.Tensor:
    """c_ik = s_ik · min(1, clip / Σ_k |s_ik|), and 0 for every turn of an ineligible trajectory, [B, K].

    The raw turn scores are unbounded (a farmer's sum can reach several times the clip), but the trajectory reward
    only ever sees the clipped process score. Scaling a trajectory's turn scores down until their absolute sum is at
    most ``clip`` keeps each turn's sign and relative share, and guarantees |Σ_k c_ik| ≤ Σ_k |c_ik| ≤ clip: the
    per-turn credit never exceeds what the clipped score allows. ``eligible[i]`` False (the user simulator failed, or
    the episode was truncated) zeroes its credit whatever its loss mask says: such an episode has advantage 0 or no
    loss, and must not get a gradient through the credit alone.
    """
    scores = turn_scores.to(torch.float32)
    if clip is not None:
        if clip < 0:
            raise ValueError(f"clip must be >= 0, got {clip}")
        total = scores.abs().sum(dim=1, keepdim=True)
        scale = torch.where(total > clip, clip / total.clamp(min=1e-12), torch.ones_like(total))
        scores = scores * scale
    if eligible is not None:
        scores = scores * eligible.to(device=scores.device, dtype=scores.dtype).reshape(-1, 1)
    return scores


def token_advantages(
    variant: str,
    group_advantages: torch.Tensor,
    policy_mask: torch.Tensor,
    turn_index: torch.Tensor,
    turn_scores: torch.Tensor | None = None,
    alpha: float | None = None,
    turn_credit_coef: float | None = None,
    length_reference: float | None = None,
    prm_clip: float | None = None,
    credit_eligible: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-token advantages [B, C] whose TRL ``luspo`` aggregation is the variant's loss.

    ``turn_scores[i, k]`` is the PRM-Lite score of turn k of trajectory i (needed for per-turn credit); it is bounded
    by ``prm_clip`` and zeroed where ``credit_eligible`` is False (``bound_turn_credit``).
    """
    weights = token_weights(variant, policy_mask, turn_index, alpha, length_reference)
    advantages = group_advantages.to(torch.float32).unsqueeze(1).expand_as(weights)
    if get_variant(variant)["turn_credit"]:
        if turn_scores is None or turn_credit_coef is None:
            raise ValueError(f"variant {variant!r} needs turn_scores and turn_credit_coef")
        credit = bound_turn_credit(turn_scores, prm_clip, credit_eligible)
        index = turn_index.clamp(min=0).clamp(max=max(credit.shape[1] - 1, 0))
        per_token_credit = torch.gather(credit, 1, index) if credit.numel() else 0.0
        advantages = advantages + turn_credit_coef * per_token_credit * (turn_index >= 0)
    return advantages * weights
