"""OpenMP's wait policy for generation ahead (tau2_rl/run/omp_wait.py): read from the command line and the recipe
before torch loads, set only for --max_staleness >= 1, never over a value the user exported."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tau2_rl.run import omp_wait

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(
    ("argv", "recipe", "expected"),
    [
        ([], None, 0),
        (["--max_staleness", "2"], None, 2),
        (["--max_staleness=1"], None, 1),
        (["--max_staleness", "1", "--max_staleness", "0"], None, 0),  # the last one wins, as in argparse
        (["--config", "{recipe}"], "max_staleness: 1\n", 1),
        (["--config", "{recipe}", "--max_staleness", "0"], "max_staleness: 2\n", 0),  # a flag beats the recipe
        (["--config", "{recipe}"], "variant: joint\n", 0),
        (["--config", "{recipe}"], "max_staleness: [1\n", 0),  # unreadable: the real parser says so later
        (["--config", "missing.yaml"], None, 0),
        (["--max_staleness", "two"], None, 0),
    ],
)
def test_the_staleness_is_read_from_the_flags_then_the_recipe(tmp_path, argv, recipe, expected):
    path = tmp_path / "recipe.yaml"
    if recipe is not None:
        path.write_text(recipe)
    assert omp_wait.requested_staleness([a.replace("{recipe}", str(path)) for a in argv]) == expected


def _policy_in_a_fresh_interpreter(argv: list[str], exported: str | None) -> str:
    """What ``train_grpo.py``'s first lines leave in the environment of a fresh interpreter (torch not loaded)."""
    env = {k: v for k, v in os.environ.items() if k != omp_wait.VARIABLE}
    if exported is not None:
        env[omp_wait.VARIABLE] = exported
    code = (
        "import os, sys; from tau2_rl.run.omp_wait import passive_waits_for_generation_ahead as p; "
        f"p({argv!r}); import torch; print(os.environ.get('OMP_WAIT_POLICY', 'unset'))"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, check=True)
    return done.stdout.strip()


def test_passive_only_when_generating_ahead_and_never_over_an_exported_value():
    assert _policy_in_a_fresh_interpreter(["--max_staleness", "1"], None) == "PASSIVE"
    assert _policy_in_a_fresh_interpreter(["--max_staleness", "0"], None) == "unset"  # the synchronous run as before
    assert _policy_in_a_fresh_interpreter(["--max_staleness", "1"], "ACTIVE") == "ACTIVE"


def test_nothing_is_set_once_torch_is_loaded(monkeypatch):
    """Here torch is loaded already: setting the variable now would claim an effect it cannot have."""
    import torch  # noqa: F401

    monkeypatch.delenv(omp_wait.VARIABLE, raising=False)
    assert omp_wait.passive_waits_for_generation_ahead(["--max_staleness", "1"]) is False
    assert omp_wait.VARIABLE not in os.environ
    assert "spin" in omp_wait.wait_policy_note()
    monkeypatch.setenv(omp_wait.VARIABLE, "passive")
    assert omp_wait.wait_policy_note() is None


def test_train_grpo_sets_it_before_anything_imports_torch():
    """The call sits above train_grpo.py's first import that loads torch (trl)."""
    source = (ROOT / "train_grpo.py").read_text().splitlines()
    call = next(i for i, line in enumerate(source) if line.startswith("passive_waits_for_generation_ahead()"))
    first_heavy = next(
        i for i, line in enumerate(source) if line.startswith(("from trl", "import torch", "from tau2_rl.c"))
    )
    assert call < first_heavy
