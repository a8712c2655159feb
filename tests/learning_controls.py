"""Negative controls shared by the learning tests: the same trainer with its advantages negated, or with every policy
token masked, must not learn (a learning test without them cannot tell learning from drift)."""

from __future__ import annotations

from typing import Any


def apply_control(trainer: Any, control: str | None) -> None:
    """``flip_sign``: advantages negated after scoring; ``mask_policy``: no completion token counts as the policy's."""
    if control == "flip_sign":
        score = trainer._generate_and_score_completions

        def flipped(inputs):
            output = score(inputs)
            output["advantages"] = -output["advantages"]
            return output

        trainer._generate_and_score_completions = flipped
    elif control == "mask_policy":
        generate = trainer._generate

        def masked(prompts):
            result = list(generate(prompts))
            result[2] = [[0] * len(mask) for mask in result[2]]  # tool_mask: no token counts as the policy's
            return tuple(result)

        trainer._generate = masked
    elif control is not None:
        raise ValueError(f"unknown control {control!r}: flip_sign or mask_policy")
