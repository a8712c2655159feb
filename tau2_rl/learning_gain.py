"""How much a run learned, in one number: the mean of its last quarter of steps minus the mean of its first quarter.

The run's summary line (``run/console.py``), its learning-curve picture (``evaluation/learning_curve.py``), the
benchmarks and the README all quote it, so it lives here, below all of them, with the picture's file name.
"""

from __future__ import annotations

from collections.abc import Sequence

CURVE_FILE = "learning_curve.png"
"""The learning-curve picture's name, in the run's ``output_dir``."""


def quarter_gain(values: Sequence[float]) -> tuple[float, float, float]:
    """(mean of the first quarter, mean of the last quarter, last − first); a quarter is at least one value."""
    if not values:
        raise ValueError("no values: the run logged no step")
    quarter = max(1, len(values) // 4)
    first = sum(values[:quarter]) / quarter
    last = sum(values[-quarter:]) / quarter
    return first, last, last - first
