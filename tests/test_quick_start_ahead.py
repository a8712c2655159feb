"""The README's quick start with generation ahead of training (``--max_staleness k``, issue 38): it learns as the
synchronous one does (tests/test_readme_numbers.py), and its staleness stays within k.

A module of its own (it was in tests/test_readme_numbers.py, beside the synchronous quick start): the two
32-step runs share nothing, so under ``pytest -n 2 --dist loadfile`` they start on different workers (dd2178f).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from test_readme_numbers import assert_it_learns, run_quick_start


@pytest.mark.slow  # two processes, not serial: the staleness pattern follows the batch boundaries, not timing
@pytest.mark.parametrize("k", [1, pytest.param(2, marks=pytest.mark.exhaustive)])  # k = 2 repeats k = 1 (CI's time)
def test_the_quick_start_learns_with_generation_ahead(tmp_path: Path, default_policy_cache: Path, k: int) -> None:
    """The quick start at ``--max_staleness k`` (issue 38; the rollout worker has the one thread the trainer has):
    the same claims, and the logged staleness reaches k on some step and exceeds it on none.

    The staleness bound, checked on this run (it was a 3-step run of its own before): the first batch is played on
    the weights it trains (staleness 0, behaviour weight 1: the proximal policy is the behaviour policy), the next
    ones on weights one step older, never more than k; the run says so at its start."""
    steps, console = run_quick_start(tmp_path, default_policy_cache, "--max_staleness", str(k))
    assert_it_learns(steps)
    staleness = [e["async/staleness_max"] for e in steps]
    assert max(staleness) == k and all(s <= k for s in staleness), staleness
    if k == 1:  # (at k = 2 the third batch may start before or after step 1's weights arrive)
        assert staleness[:3] == [0.0, 1.0, 1.0], staleness
    assert steps[0]["async/behaviour_weight"] == pytest.approx(1.0, abs=1e-4)
    assert f"generation runs ahead of training by at most {k} step(s)" in console
