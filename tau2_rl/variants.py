"""The GRPO variants: their names, in the order every table, recipe list and driver uses, and what each one does.

A module of plain data below everything else, so the trainer's configs and the ablation driver (which must start
without importing TRL) read one table instead of keeping two lists in step.
"""

from __future__ import annotations

VARIANTS: dict[str, dict[str, object]] = {
    "vanilla": {"weights": "inverse_length", "uses_prm": False, "turn_credit": False},
    "turn_discount": {"weights": "turn_discounted", "uses_prm": False, "turn_credit": False},
    "prm_lite": {"weights": "inverse_length", "uses_prm": True, "turn_credit": False},
    "lata": {"weights": "inverse_sqrt_length", "uses_prm": False, "turn_credit": False},
    "joint": {"weights": "inverse_sqrt_length", "uses_prm": True, "turn_credit": True},
}
"""Variant table: how tokens are weighted, whether the trajectory reward includes the PRM-Lite process score, and
whether tokens get per-turn credit. Configs, docs and the trainer all read this table."""

# Which config fields each variant reads (a field set under another variant is a configuration error).
VARIANT_FIELDS: dict[str, tuple[str, ...]] = {
    "turn_discount_alpha": ("turn_discount",),
    "prm_coef": ("prm_lite", "joint"),
    "prm_clip": ("prm_lite", "joint"),
    "turn_credit_coef": ("joint",),
    "length_reference": ("lata", "joint"),
}


def get_variant(name: str) -> dict[str, object]:
    if name not in VARIANTS:
        raise ValueError(f"unknown variant {name!r} (--variant); valid variants: {list(VARIANTS)}")
    return VARIANTS[name]
