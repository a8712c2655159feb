"""Each variant's per-token weights and advantages against its formula, on hand-made tensors."""

import math

import pytest
import torch

from tau2_rl.configs import VARIANTS, MultiTurnGRPOConfig
from tau2_rl.trainers.variants import (
    bound_turn_credit,
    token_advantages,
    token_weights,
    turn_discount_factors,
)

# Two trajectories: row 0 has 2 turns (2 + 3 policy tokens, environment tokens between), row 1 one turn of 2 tokens.
POLICY_MASK = torch.tensor([[0, 1, 1, 0, 1, 1, 1, 0], [1, 1, 0, 0, 0, 0, 0, 0]])
TURN_INDEX = torch.tensor([[-1, 0, 0, -1, 1, 1, 1, -1], [0, 0, -1, -1, -1, -1, -1, -1]])
GROUP_ADV = torch.tensor([1.5, -0.5])


def test_vanilla_is_inverse_length():
    w = token_weights("vanilla", POLICY_MASK, TURN_INDEX)
    assert torch.allclose(w[0], POLICY_MASK[0] / 5.0)
    assert torch.allclose(w[1], POLICY_MASK[1] / 2.0)
    assert torch.allclose(w.sum(1), torch.ones(2))  # Σ_t w = 1: the per-sequence mean


def test_lata_is_inverse_sqrt_length():
    w = token_weights("lata", POLICY_MASK, TURN_INDEX)
    assert torch.allclose(w[0][POLICY_MASK[0].bool()], torch.full((5,), 1 / math.sqrt(5)))
    assert torch.allclose(w[1][POLICY_MASK[1].bool()], torch.full((2,), 1 / math.sqrt(2)))


def test_length_reference_is_a_constant_scale_that_matches_vanilla_at_l_ref():
    plain = token_weights("lata", POLICY_MASK, TURN_INDEX)
    scaled = token_weights("lata", POLICY_MASK, TURN_INDEX, length_reference=256.0)
    assert torch.allclose(scaled, plain / 16.0)  # √256: the shape is unchanged, only the step size
    mask = torch.ones(1, 256, dtype=torch.long)  # a trajectory of exactly L_ref policy tokens
    index = torch.zeros(1, 256, dtype=torch.long)
    assert torch.allclose(token_weights("lata", mask, index, length_reference=256.0).sum(), torch.tensor(1.0))
    assert torch.allclose(token_weights("vanilla", mask, index).sum(), torch.tensor(1.0))
    with pytest.raises(ValueError, match="length_reference"):
        token_weights("lata", POLICY_MASK, TURN_INDEX, length_reference=0.0)


def test_turn_credit_is_bounded_by_the_clip_and_keeps_signs():
    farmer = torch.tensor([[0.3, 0.4, 0.5], [0.1, -0.05, 0.0], [-0.4, -0.4, 0.2]])
    credit = bound_turn_credit(farmer, clip=0.5)
    assert torch.allclose(credit[0], farmer[0] * 0.5 / 1.2)  # raw sum 1.2 → scaled to the clip
    assert torch.allclose(credit[1], farmer[1])  # inside the bound: unchanged
    assert torch.allclose(credit[2].abs().sum(), torch.tensor(0.5))
    assert torch.equal(torch.sign(credit), torch.sign(farmer))
    generator = torch.Generator().manual_seed(0)
    for _ in range(50):
        raw = torch.randn(4, 7, generator=generator)
        bounded = bound_turn_credit(raw, clip=0.5)
        assert (bounded.abs().sum(dim=1) <= 0.5 + 1e-6).all()
        assert (bounded.sum(dim=1).abs() <= 0.5 + 1e-6).all()  # never more than the clipped process score allows
    assert torch.equal(bound_turn_credit(torch.zeros(2, 3), clip=0.0), torch.zeros(2, 3))


def test_joint_credit_is_zero_for_user_error_and_truncated_episodes():
    scores = torch.tensor([[0.4, 0.4], [0.3, 0.0]])
    eligible = torch.tensor([False, True])  # row 0: user simulator failed or token budget cut the episode
    joint = token_advantages("joint", GROUP_ADV, POLICY_MASK, TURN_INDEX, scores, turn_credit_coef=0.3,
                             prm_clip=0.5, credit_eligible=eligible)  # fmt: skip
    assert torch.allclose(joint[0], GROUP_ADV[0] * POLICY_MASK[0] / math.sqrt(5))  # the mask is still 1: no credit
    user_error = token_advantages("joint", torch.zeros(2), POLICY_MASK, TURN_INDEX, scores, turn_credit_coef=0.3,
                                  prm_clip=0.5, credit_eligible=torch.tensor([False, False]))  # fmt: skip
    assert torch.equal(user_error, torch.zeros_like(user_error))  # advantage 0 and no credit: exactly zero
    assert torch.allclose(joint[1, :2], torch.full((2,), (-0.5 + 0.3 * 0.3) / math.sqrt(2)))
    bounded = token_advantages("joint", torch.zeros(2), POLICY_MASK, TURN_INDEX, torch.tensor([[2.0, 2.0], [0, 0]]),
                               turn_credit_coef=1.0, prm_clip=0.5)  # fmt: skip
    per_token = bounded[0][POLICY_MASK[0].bool()] * math.sqrt(5)  # undo the 1/√L weight: the credit itself
    assert torch.allclose(per_token, torch.full((5,), 0.25))  # each of the two turns gets 0.5 / 2


def test_turn_discount_matches_formula_and_has_mean_one():
    alpha = 1.05
    d = turn_discount_factors(POLICY_MASK, TURN_INDEX, alpha)
    raw = [alpha ** (2 - 1 - 0)] * 2 + [alpha ** (2 - 1 - 1)] * 3  # α^(T−1−k), T=2
    mean = sum(raw) / len(raw)
    expected = torch.tensor([0, raw[0] / mean, raw[1] / mean, 0, raw[2] / mean, raw[3] / mean, raw[4] / mean, 0])
    assert torch.allclose(d[0], expected.float(), atol=1e-6)
    assert torch.allclose(d[0][POLICY_MASK[0].bool()].mean(), torch.tensor(1.0))
    assert torch.allclose(d[1][:2], torch.ones(2))  # a single turn: α^0 everywhere
    w = token_weights("turn_discount", POLICY_MASK, TURN_INDEX, alpha=alpha)
    assert torch.allclose(w[0], d[0] / 5.0)
    assert d[0, 1] > d[0, 4]  # α > 1: earlier turns weigh more


def test_turn_discount_is_stable_for_many_turns():
    turns = 2000
    mask = torch.ones(1, turns, dtype=torch.long)
    index = torch.arange(turns).unsqueeze(0)
    d = turn_discount_factors(mask, index, 1.05)  # 1.05^1999 overflows float32 without log space
    assert torch.isfinite(d).all()
    assert torch.allclose(d.mean(), torch.tensor(1.0), atol=1e-4)


def test_prm_lite_uses_vanilla_weights_and_joint_adds_turn_credit():
    plain = token_advantages("prm_lite", GROUP_ADV, POLICY_MASK, TURN_INDEX)
    assert torch.allclose(plain, GROUP_ADV.unsqueeze(1) * POLICY_MASK / POLICY_MASK.sum(1, keepdim=True))
    scores = torch.tensor([[0.1, -0.2], [0.05, 0.0]])
    joint = token_advantages("joint", GROUP_ADV, POLICY_MASK, TURN_INDEX, scores, turn_credit_coef=0.3)
    expected_row0 = torch.tensor([0, 1.5 + 0.03, 1.5 + 0.03, 0, 1.5 - 0.06, 1.5 - 0.06, 1.5 - 0.06, 0]) / math.sqrt(5)
    assert torch.allclose(joint[0], expected_row0, atol=1e-6)
    assert torch.allclose(joint[1, :2], torch.full((2,), (-0.5 + 0.015) / math.sqrt(2)), atol=1e-6)
    assert torch.all(joint[1, 2:] == 0)


def test_trajectory_without_policy_tokens_gets_zero_weight():
    mask = torch.zeros(1, 4, dtype=torch.long)
    for variant in VARIANTS:
        w = token_weights(variant, mask, torch.full((1, 4), -1), alpha=1.05)
        assert torch.all(w == 0), variant


@pytest.mark.parametrize(
    "variant,field",
    [
        ("vanilla", "prm_coef"),
        ("lata", "turn_discount_alpha"),
        ("prm_lite", "turn_credit_coef"),
        ("joint", "turn_discount_alpha"),
    ],
)
def test_variant_specific_field_under_another_variant_is_an_error(variant, field, tmp_path):
    with pytest.raises(ValueError, match=f"--{field} belongs to"):
        MultiTurnGRPOConfig(output_dir=str(tmp_path), variant=variant, bf16=False, **{field: 0.5})


def test_variant_defaults_are_filled_and_loss_type_is_luspo(tmp_path):
    config = MultiTurnGRPOConfig(output_dir=str(tmp_path), variant="joint", bf16=False)
    assert (config.prm_coef, config.prm_clip, config.turn_credit_coef) == (0.3, 0.5, 0.3)
    assert config.turn_discount_alpha is None
    assert config.length_reference == 256.0
    assert MultiTurnGRPOConfig(output_dir=str(tmp_path), variant="vanilla", bf16=False).length_reference is None
    assert config.loss_type == "luspo"
    assert (
        MultiTurnGRPOConfig(output_dir=str(tmp_path), variant="turn_discount", bf16=False).turn_discount_alpha == 1.05
    )


def test_unknown_variant_fails_clearly_and_use_vllm_is_only_recorded(tmp_path, hide_vllm):
    with pytest.raises(ValueError, match="valid variants"):
        MultiTurnGRPOConfig(output_dir=str(tmp_path), variant="bogus", bf16=False)
    # without vLLM a use_vllm config still parses and runs its own checks; the run refuses (test_trainer.py)
    assert MultiTurnGRPOConfig(output_dir=str(tmp_path), use_vllm=True, bf16=False).use_vllm
