"""The README's quick start with generation ahead of training (``--max_staleness k``, issue 38): it learns as the
synchronous one does (tests/test_readme_numbers.py), and its staleness stays within k.

A module of its own (it was in tests/test_readme_numbers.py, beside the synchronous quick start): the two
32-step runs share nothing, so under ``pytest -n 2 --dist loadfile`` they start on different workers (dd2178f).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from test_readme_numbers import assert_it_learns, run_quick_start

CASES = [
    (1, 4),  # CI: the staleness bound over 4 steps (the learning of the quick start: tests/test_readme_numbers.py)
    pytest.param(1, 32, marks=pytest.mark.exhaustive),  # the 32-step run learns at k = 1 too
    pytest.param(2, 32, marks=pytest.mark.exhaustive),  # and at k = 2
]
"""(k, steps): CI runs 4 steps at k = 1 (CI's time: the 32-step run took ~170 s of stage 2); the whole runs, which
repeat test_readme_numbers.py's learning claim at k = 1 and 2, are ``exhaustive``."""


@pytest.mark.slow  # two processes, not serial: the staleness pattern follows the batch boundaries, not timing
@pytest.mark.parametrize(("k", "steps"), CASES, ids=["1-4steps", "1", "2"])
def test_the_quick_start_learns_with_generation_ahead(
    tmp_path: Path, default_policy_cache: Path, k: int, steps: int
) -> None:
    """The quick start at ``--max_staleness k`` (issue 38; the rollout worker has the one thread the trainer has):
    over the whole run, the same learning claims as the synchronous quick start; over any run, the logged staleness
    reaches k on some step and exceeds it on none.

    The staleness bound: the first batch is played on the weights it trains (staleness 0, behaviour weight 1: the
    proximal policy is the behaviour policy), the next ones on weights one step older, never more than k; the run
    says so at its start."""
    logged, console = run_quick_start(tmp_path, default_policy_cache, "--max_staleness", str(k), steps=steps)
    if steps == 32:
        assert_it_learns(logged)
    else:
        assert all(e["loss"] != 0 for e in logged), [e["loss"] for e in logged]
    staleness = [e["async/staleness_max"] for e in logged]
    assert max(staleness) == k and all(s <= k for s in staleness), staleness
    if k == 1:  # (at k = 2 the third batch may start before or after step 1's weights arrive)
        assert staleness[:3] == [0.0, 1.0, 1.0], staleness
    assert logged[0]["async/behaviour_weight"] == pytest.approx(1.0, abs=1e-4)
    assert f"generation runs ahead of training by at most {k} step(s)" in console
